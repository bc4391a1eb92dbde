"""
L{kcoral.server.models.ModelRepository}: a worker's models loaded from
bundles with real JAX on the CPU, the broken ones listed with their reasons.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kcoral  # noqa: E402
from kcoral.models.bundle import PARAMS, PROGRAM, BundleError, read_bundle  # noqa: E402
from kcoral.models.config import parse_config  # noqa: E402
from kcoral.models.manifest import MANIFEST  # noqa: E402
from kcoral.protocol.tensors import InvalidInput  # noqa: E402
from kcoral.server.invariant import deterministic_flags  # noqa: E402
from kcoral.server.models import (  # noqa: E402
    NOT_LOADED,
    READY,
    UNAVAILABLE,
    ModelRepository,
    ModelStatus,
    ModelUnavailable,
    RepositoryError,
    UnknownModel,
)
from tests.rowcheck import ROUNDING_ULPS, assert_within_rounding, runs  # noqa: E402
from tests.test_bundle import export_mlp, mlp, mlp_params  # noqa: E402


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """A repository of a good MLP beside three broken models, loaded; and the
    seconds of each compile of the load."""
    path = tmp_path_factory.mktemp("models")
    export_mlp(path / "mlp")
    export_mlp(path / "broken", name="broken")
    (path / "broken" / MANIFEST).write_text('{"format": 1, "name": "broken"')
    export_mlp(path / "cuda_only", name="cuda_only", platforms=("cuda",))
    export_mlp(path / "corrupt", name="corrupt")
    (path / "corrupt" / PARAMS).write_bytes(b"\0" * 16)
    (path / "not_a_model").mkdir()
    compiles: list[float] = []
    models = ModelRepository(path, observe_compile=compiles.append)
    models.load(jax.local_devices()[0])
    return models, compiles


def rows(count: int, seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, 16)).astype(np.float32)


def test_index(repository):
    """The index lists every model folder in name order: the good one READY, the others UNAVAILABLE."""
    models, _ = repository
    assert [(s.name, s.version, s.state) for s in models.index()] == [
        ("broken", 1, UNAVAILABLE), ("corrupt", 1, UNAVAILABLE), ("cuda_only", 1, UNAVAILABLE),
        ("mlp", 1, READY)]
    assert models.index()[-1] == ModelStatus("mlp", 1, READY, "")


def test_reasons(repository):
    """An unavailable model's reason names the file and the problem."""
    models, _ = repository
    reasons = {s.name: s.reason for s in models.index()}
    assert reasons["broken"].startswith(f"{MANIFEST}: {MANIFEST} is not JSON")
    assert reasons["corrupt"].startswith(f"{PARAMS}: its SHA-256 is")
    assert reasons["cuda_only"] == "exported for cuda, this worker runs cpu: export it for cpu too"


def test_misnamed_and_mismatched(tmp_path):
    """A folder whose model.json names another model, or whose params misfit the program, is UNAVAILABLE."""
    export_mlp(tmp_path / "renamed", name="other")
    export_mlp(tmp_path / "resized", name="resized")
    leaves = jax.tree.leaves(mlp_params())
    leaves[0] = leaves[0][:4]
    data = safetensors.numpy.save({f"param_{i}": leaf for i, leaf in enumerate(leaves)})
    (tmp_path / "resized" / PARAMS).write_bytes(data)
    manifest = json.loads((tmp_path / "resized" / MANIFEST).read_bytes())
    manifest["params"]["sha256"] = hashlib.sha256(data).hexdigest()
    (tmp_path / "resized" / MANIFEST).write_text(json.dumps(manifest))
    models = ModelRepository(tmp_path)
    models.load(jax.local_devices()[0])
    reasons = {s.name: s.reason for s in models.index()}
    assert reasons == {
        "renamed": f"{MANIFEST} names the model 'other': a model's folder has its name",
        "resized": "program.jax takes float32[32], float32[8], float32[16, 32], float32[32, 8], "
                   "float32[-1, 16]; the params and model.json say float32[4], float32[8], "
                   "float32[16, 32], float32[32, 8], float32[-1, 16]"}


def test_a_folder_linked_from_outside_the_repository_is_refused(tmp_path):
    """A model folder that is a link out of the repository is UNAVAILABLE with the reason;
    a link to a folder inside it is served under its own name."""
    outside, repository = tmp_path / "outside", tmp_path / "repository"
    export_mlp(outside / "mlp", name="mlp")
    export_mlp(repository / "real", name="inside")
    repository.joinpath("mlp").symlink_to(outside / "mlp", target_is_directory=True)
    repository.joinpath("inside").symlink_to("real", target_is_directory=True)
    models = ModelRepository(repository)
    models.load(jax.local_devices()[0])
    states = {s.name: (s.state, s.reason) for s in models.index()}
    assert states["mlp"][0] == UNAVAILABLE and "leads out of the model repository" in states["mlp"][1]
    assert states["inside"] == (READY, "")
    with pytest.raises(ModelUnavailable):
        models.get("mlp")


def test_a_folder_read_by_path_outside_its_repository_is_refused(tmp_path):
    """read_bundle with the repository refuses a folder that resolves outside it, through
    any link on its path, and reads the same folder where it lies inside."""
    export_mlp(tmp_path / "outside" / "mlp", name="mlp")
    (tmp_path / "repository").mkdir()
    (tmp_path / "repository" / "up").symlink_to(tmp_path / "outside", target_is_directory=True)
    for path in (tmp_path / "repository" / "up" / "mlp", tmp_path / "repository" / ".." / "outside" / "mlp"):
        with pytest.raises(BundleError, match="leads out of the model repository"):
            read_bundle(path, within=tmp_path / "repository")
    assert read_bundle(tmp_path / "outside" / "mlp", within=tmp_path / "outside").manifest.name == "mlp"


def test_not_a_program(tmp_path):
    """A program file that jax.export cannot read makes its model UNAVAILABLE, naming the file."""
    export_mlp(tmp_path / "mlp")
    garbage = b"not a program"
    (tmp_path / "mlp" / PROGRAM).write_bytes(garbage)
    manifest = json.loads((tmp_path / "mlp" / MANIFEST).read_bytes())
    manifest["programs"][0]["sha256"] = hashlib.sha256(garbage).hexdigest()
    (tmp_path / "mlp" / MANIFEST).write_text(json.dumps(manifest))
    models = ModelRepository(tmp_path)
    models.load(jax.local_devices()[0])
    (status,) = models.index()
    assert status.state == UNAVAILABLE and status.reason.startswith(f"{PROGRAM}: not a jax.export program")


def test_not_batched(tmp_path):
    """A bundle written by hand as doc/bundles.rst says, with max_batch_size 0, runs at its fixed shapes."""
    def affine(w, x):
        return (w @ x, x.sum())

    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    exported = jax.export.export(jax.jit(affine), platforms=("cpu",))(w, np.zeros(3, np.float32))
    program = bytes(exported.serialize())
    params = safetensors.numpy.save({"param_0": w})
    (tmp_path / "affine").mkdir()
    (tmp_path / "affine" / "p.jax").write_bytes(program)
    (tmp_path / "affine" / "w.safetensors").write_bytes(params)
    (tmp_path / "affine" / MANIFEST).write_text(json.dumps({
        "format": 1, "name": "affine", "version": 3, "platforms": ["cpu"],
        "max_batch_size": 0, "batch_sizes": [],
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [3]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]},
                    {"name": "total", "datatype": "FP32", "shape": []}],
        "programs": [{"file": "p.jax", "sha256": hashlib.sha256(program).hexdigest(), "batch_sizes": []}],
        "params": {"file": "w.safetensors", "sha256": hashlib.sha256(params).hexdigest(), "count": 1}}))
    compiles: list[float] = []
    models = ModelRepository(tmp_path, observe_compile=compiles.append)
    models.load(jax.local_devices()[0])
    assert models.index() == [ModelStatus("affine", 3, READY)] and len(compiles) == 1
    x = np.array([1, 2, 3], np.float32)
    outputs = models.get("affine", 3).infer({"x": x})
    assert list(outputs) == ["y", "total"]
    np.testing.assert_array_equal(outputs["y"], w @ x)
    assert outputs["total"].shape == () and outputs["total"] == 6


def test_missing_repository(tmp_path):
    """A repository folder that does not exist fails the load, naming it."""
    with pytest.raises(RepositoryError, match=f"model repository {tmp_path}/none: No such file"):
        ModelRepository(tmp_path / "none").load(jax.local_devices()[0])


def test_the_index_read_now_lists_every_model_folder(tmp_path):
    """Read now, the index lists every model folder, loaded or not: one never loaded with
    the versions a load would serve (numbered folders by their policy, a bundle by its
    manifest), "not loaded"; a folder moved in after the start; a folder gone leaves it
    unless its model is served (an unloaded one leaves it too)."""
    export_mlp(tmp_path / "mlp")
    for version in (1, 2):
        (tmp_path / "numbered" / str(version)).mkdir(parents=True)
        (tmp_path / "numbered" / str(version) / MANIFEST).write_text("{}")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / MANIFEST).write_text('{"version": 3}')
    models = ModelRepository(tmp_path)
    models.load(jax.local_devices()[0], only={"mlp"})
    at_start = [ModelStatus("mlp", 1, READY), ModelStatus("numbered", 2, UNAVAILABLE, NOT_LOADED),
                ModelStatus("plain", 3, UNAVAILABLE, NOT_LOADED)]
    assert models.index() == models.listing() == at_start

    (tmp_path / "late").mkdir()
    (tmp_path / "late" / MANIFEST).write_text("{not json")
    shutil.rmtree(tmp_path / "plain")
    shutil.rmtree(tmp_path / "mlp")
    assert models.listing() == [ModelStatus("late", 1, UNAVAILABLE, NOT_LOADED), *at_start[:2]]
    assert models.index() == at_start  # what it serves: no disk read
    models.unload_model("mlp")
    assert [s.name for s in models.listing()] == ["late", "numbered"]


@pytest.mark.parametrize("count", [1, 3, 8])
def test_infer(repository, count):
    """Inference on 1, 3 (padded to 8) and 8 rows answers what the function answers in process."""
    models, _ = repository
    x = rows(count)
    outputs = models.get("mlp").infer({"input": x})
    assert list(outputs) == ["output"]
    assert outputs["output"].shape == (count, 8) and outputs["output"].dtype == np.float32
    np.testing.assert_allclose(outputs["output"], jax.jit(mlp)(mlp_params(), x), rtol=1e-6)


def test_rows_independent(repository):
    """A row's outputs alone, padded, or among other rows of a batch are equal within the
    model's rounding (ROUNDING_ULPS of the row's largest output)."""
    model = repository[0].get("mlp")
    batch = rows(8)
    whole = model.infer({"input": batch})["output"]
    for start, count in [(0, 1), (0, 3), (5, 3), (2, 6)]:
        part = model.infer({"input": batch[start:start + count]})["output"]
        assert_within_rounding(whole[start:start + count], part)


@pytest.mark.parametrize(("inputs", "message"), [
    ({"pixels": rows(1)}, "model mlp has no input 'pixels'"),
    ({"input": rows(1)[:, :15]}, r"input 'input' has shape \[1, 15\], the model takes \[-1, 16\]"),
    ({"input": rows(1).astype(np.float64)}, "input 'input' has datatype FP64, the model takes FP32"),
    ({"input": rows(9)}, "a batch of 9 rows: model mlp takes 1 to 8"),
])
def test_invalid_input(repository, inputs, message):
    """Inputs of a wrong name, shape or datatype, or too many rows, raise InvalidInput."""
    with pytest.raises(InvalidInput, match=message):
        repository[0].get("mlp").infer(inputs)


def test_compiled_once_per_batch_size(repository):
    """The load compiled the good model once per batch size; inference compiles nothing."""
    models, compiles = repository
    assert len(compiles) == 2 and all(seconds > 0 for seconds in compiles)
    models.get("mlp").infer({"input": rows(5)})
    assert len(compiles) == 2


def test_get(repository):
    """get() raises UnknownModel for a model or version not there, ModelUnavailable for a broken one."""
    models, _ = repository
    assert models.get("mlp", 1).manifest.name == "mlp"
    with pytest.raises(UnknownModel, match="no model 'nothing'"):
        models.get("nothing")
    with pytest.raises(UnknownModel, match="no version 2 of model 'mlp'"):
        models.get("mlp", 2)
    with pytest.raises(ModelUnavailable, match="model 'cuda_only' is unavailable: exported for cuda") as e:
        models.get("cuda_only")
    assert e.value.reason.startswith("exported for cuda")


# -- a load's configuration ----------------------------------------------------------------

def test_a_larger_max_batch_size_is_compiled_where_the_batch_is_symbolic(tmp_path):
    """A configuration's max_batch_size over the bundle's is compiled for a program of a
    symbolic batch (its sizes: those below it, and it); the model runs 16 rows; and the
    version_policy and batching delay it sets are the model's."""
    export_mlp(tmp_path / "mlp")
    models = ModelRepository(tmp_path)
    config = parse_config('{"max_batch_size": "16", "dynamic_batching": '
                          '{"max_queue_delay_microseconds": 250}}')
    [state] = models.load_model("mlp", jax.local_devices()[0], config)
    assert state == ModelStatus("mlp", 1, READY)
    model = models.get("mlp")
    assert (model.manifest.max_batch_size, model.manifest.batch_sizes) == (16, (1, 8, 16))
    assert model.config == config and model.config.batch_delay_microseconds == 250
    x = rows(16)
    assert_within_rounding(model.infer({"input": x})["output"],
                           np.asarray(jax.jit(mlp)(mlp_params(), x)))
    [state] = models.load_model("mlp", jax.local_devices()[0], parse_config('{"max_batch_size": 4}'))
    assert models.get("mlp").manifest.batch_sizes == (1, 4)


def test_a_configuration_a_bundle_cannot_honour_leaves_the_served_model(tmp_path):
    """A max_batch_size over what programs exported per batch size run, or a configuration
    of another model, fails the load with the reason; the model served is served still, and
    a smaller max_batch_size among the programs' sizes is honoured."""
    w = np.random.default_rng(5).standard_normal((16, 16)).astype(np.float32)
    kcoral.export_bundle(layer, w, rows(1), dir=tmp_path / "layer", name="layer", batch_sizes=[2, 8])
    models = ModelRepository(tmp_path)
    device = jax.local_devices()[0]
    models.load(device)
    served = models.get("layer")
    for text, reason in (
            ('{"max_batch_size": 16}', ("max_batch_size 16: the bundle's programs run at batch "
                                       "sizes [2, 8] alone (exported without a symbolic batch "
                                       "dimension): export it for 16")),
            ('{"max_batch_size": 0}', ("max_batch_size 0: the model was exported batched "
                                      "(max_batch_size 8): export it again")),
            ('{"name": "other"}', "name 'other' is not the model's, 'layer'"),
            ('{"input": [{"name": "input", "data_type": "TYPE_FP32", "dims": ["15"]}]}',
             "input must be the model's own: input TYPE_FP32 [16]")):
        [state] = models.load_model("layer", device, parse_config(text))
        assert (state.state, state.reason) == (UNAVAILABLE, reason)
        assert models.get("layer") is served
    models.load_model("layer", device, parse_config(
        '{"max_batch_size": 2, "input": [{"name": "input", "data_type": "TYPE_FP32", "dims": [16]}]}'))
    assert models.get("layer").manifest.batch_sizes == (2,)


def test_config_json_sets_what_a_loads_configuration_sets(tmp_path):
    """config.json in a model's folder may set max_batch_size (compiled where the batch is
    symbolic), dynamic_batching and version_policy, as a load's configuration does; a
    load's configuration overrides it field by field; a field it cannot honour leaves the
    model unavailable, the reason naming config.json."""
    export_mlp(tmp_path / "mlp")
    (tmp_path / "mlp" / "config.json").write_text(json.dumps(
        {"max_batch_size": 16, "dynamic_batching": {"max_queue_delay_microseconds": 250}}))
    models = ModelRepository(tmp_path)
    device = jax.local_devices()[0]
    models.load(device)
    model = models.get("mlp")
    assert (model.manifest.max_batch_size, model.config.batch_delay_microseconds) == (16, 250)
    x = rows(16)
    assert_within_rounding(model.infer({"input": x})["output"],
                           np.asarray(jax.jit(mlp)(mlp_params(), x)))
    models.load_model("mlp", device, parse_config('{"max_batch_size": 4}'))
    model = models.get("mlp")
    assert (model.manifest.max_batch_size, model.config.batch_delay_microseconds) == (4, 250)
    (tmp_path / "mlp" / "config.json").write_text('{"instance_group": [{"count": 2}]}')
    [state] = models.load_model("mlp", device)
    assert state.state == UNAVAILABLE and state.reason.startswith(
        "config.json: instance_group is not served"), state
    assert models.get("mlp") is model


# -- batch invariant ------------------------------------------------------------------------

#: The XLA CPU configurations rowcheck runs under (XLA_FLAGS, on one core): the
#: default; one core without Eigen's threads; the widest vectors off (x86 only).
XLA_CONFIGURATIONS = [("", False), ("--xla_cpu_multi_thread_eigen=false", True)] + (
    [("--xla_cpu_max_isa=SSE4_2", False), ("--xla_cpu_max_isa=AVX2", False)]
    if platform.machine() in ("x86_64", "AMD64") else [])
ROOT = Path(__file__).resolve().parent.parent


def layer(w, x):
    # A Python branch on the batch size: JAX exports one program per size.
    return jnp.tanh(x @ w) if x.shape[0] > 1 else jnp.tanh(x @ w)


def two_ways(w, a, b):
    return a @ w, b * 3


@pytest.fixture(scope="module")
def invariant(tmp_path_factory):
    """A batch-invariant repository, loaded: the MLP (one program of a symbolic batch), a
    layer exported once per batch size (2, 4 and 8: none of one row) and a model of two
    inputs and two outputs; and the seconds of each compile of the load."""
    path = tmp_path_factory.mktemp("invariant")
    export_mlp(path / "mlp")
    w = np.random.default_rng(5).standard_normal((16, 16)).astype(np.float32)
    kcoral.export_bundle(layer, w, rows(1), dir=path / "layer", name="layer", batch_sizes=[2, 4, 8])
    kcoral.export_bundle(two_ways, w, rows(1), np.zeros((1, 3), np.int32), dir=path / "two",
                         name="two", batch_sizes=[1, 4])
    compiles: list[float] = []
    models = ModelRepository(path, observe_compile=compiles.append, batch_invariant=True)
    models.load(jax.local_devices()[0])
    return models, compiles, w


def assert_invariant(model, inputs: dict) -> dict:
    """Every run of consecutive rows of the batch C{inputs} sent alone gets the bytes the
    same rows get in the whole batch; the whole batch's outputs."""
    whole = model.infer(inputs)
    for start, count in runs(len(next(iter(inputs.values())))):
        part = model.infer({name: x[start:start + count] for name, x in inputs.items()})
        for name, output in part.items():
            assert output.tobytes() == whole[name][start:start + count].tobytes(), (name, start,
                                                                                   count)
    return whole


@settings(max_examples=25, deadline=None)
@given(batch=arrays(np.float32, st.tuples(st.integers(1, 8), st.just(16)),
                    elements=st.floats(-100, 100, width=32)))
def test_batch_invariant_rows_are_the_same_bytes_alone_or_batched(invariant, batch):
    """Batch invariant, every run of rows of any batch gets the same bytes alone as in the
    batch, wherever it sits; and they equal the MLP's within its rounding."""
    whole = assert_invariant(invariant[0].get("mlp"), {"input": batch})
    assert_within_rounding(whole["output"], np.asarray(jax.jit(mlp)(mlp_params(), batch)))


def test_batch_invariant_with_a_program_per_batch_size(invariant):
    """Batch invariant, a model exported once per batch size, none of them one row, gives a
    row the same bytes alone or batched (computed in its smallest program beside zeros)."""
    models, _, w = invariant
    batch = rows(8)
    whole = assert_invariant(models.get("layer"), {"input": batch})
    assert_within_rounding(whole["output"], np.tanh(batch @ w))


def test_batch_invariant_with_several_inputs_and_outputs(invariant):
    """Batch invariant, each output of a model of several inputs and outputs (one of them
    integers) is the same bytes for a row alone or batched."""
    models, _, w = invariant
    a, b = rows(4), np.arange(12, dtype=np.int32).reshape(4, 3)
    whole = assert_invariant(models.get("two"), {"input0": a, "input1": b})
    np.testing.assert_array_equal(whole["output1"], b * 3)
    assert_within_rounding(whole["output0"], a @ w)


def test_batch_invariant_compiles_once_per_model(invariant):
    """Batch invariant, the load compiles each batched model once, whatever its batch
    sizes, and says so in its models; inference compiles nothing."""
    models, compiles, _ = invariant
    assert len(compiles) == 3
    assert all(models.get(name).batch_invariant for name in ("mlp", "layer", "two"))
    models.get("mlp").infer({"input": rows(5)})
    assert len(compiles) == 3


@pytest.mark.parametrize(("flags", "made"), [
    ("", "--xla_gpu_deterministic_ops=true"),
    ("--xla_cpu_max_isa=AVX2", "--xla_cpu_max_isa=AVX2 --xla_gpu_deterministic_ops=true"),
    ("--xla_gpu_deterministic_ops=false", "--xla_gpu_deterministic_ops=false"),
])
def test_batch_invariant_makes_gpu_executions_deterministic(flags, made):
    """A batch-invariant worker's XLA_FLAGS make GPU executions deterministic, unless they
    already name that flag."""
    assert deterministic_flags(flags) == made


@pytest.mark.slow
def test_rows_under_several_xla_configurations(tmp_path):
    """Under XLA CPU configurations that change the kernels and the threads, the default's
    batched rows stay within ROUNDING_ULPS of the same rows alone, and on this CPU some are
    not their bytes (a promise of bytes would fail here); batch invariant, all are."""
    export_mlp(tmp_path / "mlp")
    found = []
    for flags, one_core in XLA_CONFIGURATIONS:
        done = subprocess.run(
            [sys.executable, "-m", "tests.rowcheck", str(tmp_path), *["--one-core"] * one_core],
            env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, cwd=ROOT,
            capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (flags, done.stderr[-3000:])
        found.append(json.loads(done.stdout.splitlines()[-1]))
    assert [(f["xla_flags"], f["cores"] == 1) for f in found] == XLA_CONFIGURATIONS, found
    assert all(f["ulps"] <= ROUNDING_ULPS for f in found), found
    assert all(f["invariant_differing"] == 0 for f in found), found
    assert any(f["differing"] for f in found), found
