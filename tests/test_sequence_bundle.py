"""
Sequence models' bundles (L{kcoral.export_bundle} with a state): what
model.json records, what a worker's repository makes of good and bad ones,
and the configuration Triton's clients read and send.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kcoral
from kcoral.models.config import ConfigError, ModelConfig, config_of, parse_config
from kcoral.models.manifest import MANIFEST, ModelManifest
from kcoral.server.models import READY, UNAVAILABLE, ModelRepository

X = np.zeros((1, 1), np.int32)


def accumulate(state, start, end, corrid, x):
    """The running sum of a sequence's inputs; its last step adds its id."""
    total = state + x
    return total, total + end * corrid.astype(jnp.int32)


def export(folder, name="acc", fn=accumulate, **sequence):
    sequence.setdefault("state", np.zeros((1, 1), np.int32))
    sequence.setdefault("controls", ("START", "END", "CORRID"))
    return kcoral.export_bundle(fn, None, X, dir=os.path.join(folder, name), name=name,
                                batch_sizes=[1, 4], input_names=["INPUT"],
                                output_names=["OUTPUT"], **sequence)


def test_model_json_records_the_sequence(tmp_path):
    """model.json holds the strategy, idle bound, controls (in order, CORRID
    of the width JAX exported), state and initial state, and reads back."""
    manifest = export(tmp_path, sequence_batching="oldest", max_sequence_idle_seconds=2.5)
    written = json.loads((tmp_path / "acc" / MANIFEST).read_bytes())["sequence"]
    assert written["batching"] == "oldest"
    assert written["max_idle_seconds"] == 2.5
    corrid = "UINT64" if jax.config.jax_enable_x64 else "UINT32"
    assert [(c["name"], c["datatype"], c["shape"]) for c in written["controls"]] == [
        ("START", "INT32", [-1, 1]), ("END", "INT32", [-1, 1]), ("CORRID", corrid, [-1, 1])]
    assert written["state"] == [{"name": "state0", "datatype": "INT32", "shape": [-1, 1]}]
    assert ModelManifest.loads((tmp_path / "acc" / MANIFEST).read_bytes()) == manifest
    assert [t.name for t in manifest.inputs] == ["INPUT"]
    assert [t.name for t in manifest.outputs] == ["OUTPUT"]


def test_config_shows_sequence_batching(tmp_path):
    """config shows Triton's sequence_batching (and no dynamic_batching)."""
    config = config_of(export(tmp_path, sequence_batching="oldest"))
    assert "dynamic_batching" not in config
    corrid = "TYPE_UINT64" if jax.config.jax_enable_x64 else "TYPE_UINT32"
    assert config["sequence_batching"] == {
        "max_sequence_idle_microseconds": 1000000, "oldest": {},
        "control_input": [
            {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START",
                                           "int32_false_true": [0, 1]}]},
            {"name": "END", "control": [{"kind": "CONTROL_SEQUENCE_END",
                                         "int32_false_true": [0, 1]}]},
            {"name": "CORRID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID",
                                            "data_type": corrid}]}]}
    # What config shows, sent back, loads as it is.
    parse_config(json.dumps(config)).check(export(tmp_path, sequence_batching="oldest"))


@pytest.mark.parametrize("bad, why", [
    ({"state": np.zeros((2, 1), np.int32)}, "with a batch dimension of 1"),
    ({"controls": ("START", "STOP")}, "'STOP' is not a control"),
    ({"controls": ("START", "START")}, "controls name a control twice"),
    ({"sequence_batching": "newest"}, "sequence_batching 'newest'"),
    ({"fn": lambda state, start, end, corrid, x: (state.astype(jnp.float32), x)},
     "the new state does not round-trip"),
])
def test_bad_exports_refused(tmp_path, bad, why):
    """A state, controls or strategy no worker could serve is refused at export."""
    with pytest.raises(ValueError, match=why):
        export(tmp_path, **bad)


@pytest.mark.parametrize("change, why", [
    (lambda s: s["controls"].append({"name": "STOP", "datatype": "INT32", "shape": [-1, 1]}),
     "'STOP' is not a control"),
    (lambda s: s["controls"].append(dict(s["controls"][0])), "controls name a control twice"),
    (lambda s: s["state"][0].update(datatype="FP32"), "state0 is int32[1, 1], one row of FP32"),
    (lambda s: s.update(batching="newest"), "batching 'newest'"),
])
def test_bad_bundles_unavailable(tmp_path, change, why):
    """A bundle whose sequence no worker can serve is UNAVAILABLE with the
    reason, the repository's other models served."""
    export(tmp_path, name="good")
    export(tmp_path)
    path = tmp_path / "acc" / MANIFEST
    manifest = json.loads(path.read_bytes())
    change(manifest["sequence"])
    path.write_text(json.dumps(manifest))
    repository = ModelRepository(tmp_path)
    repository.load(jax.devices()[0])
    states = {s.name: s for s in repository.index()}
    assert states["good"].state == READY
    assert states["acc"].state == UNAVAILABLE
    assert why in states["acc"].reason


def test_configuration_sets_strategy_and_idle(tmp_path):
    """A load's configuration (or config.json) sets the strategy and the
    idle bound of a sequence model; on another model, or beside
    dynamic_batching, it is refused in words."""
    export(tmp_path, sequence_batching="direct")
    config = parse_config(json.dumps({"sequence_batching": {
        "oldest": {}, "max_sequence_idle_microseconds": "250000"}}))
    assert config == ModelConfig(sequence_batching="oldest", sequence_idle_microseconds=250000)
    repository = ModelRepository(tmp_path)
    repository.load_model("acc", jax.devices()[0], config)
    sequence = repository.get("acc").manifest.sequence
    assert (sequence.batching, sequence.max_idle_seconds) == ("oldest", 0.25)
    with pytest.raises(ConfigError, match="exclude each other"):
        parse_config('{"sequence_batching": {}, "dynamic_batching": {}}')
    with pytest.raises(ConfigError, match="sequence_batching.oldest.max_candidate_sequences"):
        parse_config('{"sequence_batching": {"oldest": {"max_candidate_sequences": 4}}}')
    plain = kcoral.export_bundle(lambda x: x, None, X, dir=tmp_path / "plain", name="plain")
    with pytest.raises(ConfigError, match="export the model with its state"):
        ModelConfig(sequence_batching="oldest").check(plain)
