"""
A model's configuration given with its load, as Triton's clients send it
(L{kcoral.models.config}), and a load request's parameters
(L{kcoral.inference.front.load_config}): what is honoured, what is refused
and why, whatever a client sends.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kcoral.errors import LoadFailed
from kcoral.inference.front import load_config
from kcoral.models.config import (
    MAX_CONFIG_BYTES,
    NO_CONFIG,
    ConfigError,
    ModelConfig,
    config_of,
    parse_config,
    read_config,
)
from kcoral.models.manifest import ModelManifest, ProgramFile, TensorSpec
from kcoral.models.versions import VersionPolicy

MANIFEST = ModelManifest(
    name="simple", inputs=(TensorSpec("INPUT0", "INT32", (-1, 16)),),
    outputs=(TensorSpec("OUTPUT0", "INT32", (-1, 16)),), max_batch_size=8, batch_sizes=(1, 8),
    programs=(ProgramFile("program.jax", "0" * 64, (1, 8)),), params=None, platforms=("cpu",))


@pytest.mark.parametrize("text, config", [
    ("{}", NO_CONFIG),
    ('{"max_batch_size": "16"}', ModelConfig(max_batch_size=16)),
    ('{"maxBatchSize": 4}', ModelConfig(max_batch_size=4)),
    ('{"max_batch_size": 0}', ModelConfig(max_batch_size=0)),
    ('{"version_policy": {"all": {}}}', ModelConfig(policy=VersionPolicy("all"))),
    ('{"version_policy": {"latest": {"num_versions": "2"}}}',
     ModelConfig(policy=VersionPolicy("latest", 2))),
    ('{"version_policy": {"specific": {"versions": ["1", 3]}}}',
     ModelConfig(policy=VersionPolicy("specific", versions=frozenset({1, 3})))),
    ('{"dynamic_batching": {}}', NO_CONFIG),
    ('{"dynamic_batching": {"max_queue_delay_microseconds": "0"}}',
     ModelConfig(batch_delay_microseconds=0)),
    ('{"name": "simple", "platform": "jax", "backend": ""}', ModelConfig(name="simple")),
    ('{"input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": ["16"]}]}',
     ModelConfig(inputs=(("INPUT0", "TYPE_INT32", (16,)),))),
])
def test_what_a_configuration_sets(text, config):
    """Triton's ModelConfig JSON, integers quoted or not, in either spelling of its names."""
    assert parse_config(text) == config


@pytest.mark.parametrize("text, reason", [
    ('"parameters": {"config": {{"max_batch_size": "16"}}}', "the configuration is not JSON"),
    ("[1]", "the configuration must be a JSON object"),
    ('{"max_batch_size": 1.5}', "the configuration is not a ModelConfig"),
    ('{"no_such_field": 1}', "the configuration is not a ModelConfig"),
    ('{"max_batch_size": -1}', "max_batch_size must be from 0 to 65536"),
    ('{"max_batch_size": 70000}', "max_batch_size must be from 0 to 65536"),
    ('{"instance_group": [{"count": 2}]}', "instance_group is not served"),
    ('{"sequence_batching": {"oldest": {"max_candidate_sequences": 4}}}',
     "sequence_batching.oldest.max_candidate_sequences is not served"),
    ('{"sequence_batching": {}, "dynamic_batching": {}}',
     "dynamic_batching and sequence_batching exclude each other"),
    ('{"platform": "onnxruntime_onnx"}', "platform 'onnxruntime_onnx' is not 'jax'"),
    ('{"dynamic_batching": {"preferred_batch_size": [4]}}',
     "dynamic_batching.preferred_batch_size is not served"),
    ('{"version_policy": {"specific": {}}}', "version_policy must be"),
    ('{"version_policy": {"latest": {"num_versions": 0}}}', None),
])
def test_what_cannot_be_honoured_says_why(text, reason):
    """Invalid JSON, another message, a field KCoral does not honour: refused, naming why."""
    if reason is None:  # Triton's latest 0 is its default, 1
        assert parse_config(text).policy == VersionPolicy("latest", 1)
        return
    with pytest.raises(ConfigError) as refused:
        parse_config(text)
    assert reason in str(refused.value)


def test_a_configuration_over_its_bound_is_refused():
    """A configuration is bounded before it is parsed."""
    with pytest.raises(ConfigError, match="over"):
        parse_config('{"name": "' + "a" * MAX_CONFIG_BYTES + '"}')


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["max_batch_size", "version_policy", "dynamic_batching", "input", "name",
                         "latest", "all", "specific", "versions", "num_versions", "dims",
                         "max_queue_delay_microseconds", "data_type", "x"]), inner, max_size=4),
    max_leaves=12)


@given(st.one_of(st.text(max_size=64), json_values.map(json.dumps)))
def test_any_text_is_a_configuration_or_a_reason(text):
    """Whatever a client sends, it parses to a configuration or is refused with a reason."""
    try:
        parse_config(text)
    except ConfigError as e:
        assert str(e)


def test_the_configuration_shown_is_the_one_loaded():
    """GET config shows the model's batch sizes, and the policy and delay its load set."""
    shown = config_of(MANIFEST, ModelConfig(policy=VersionPolicy("all"), batch_delay_microseconds=9))
    assert shown["max_batch_size"] == 8 and shown["version_policy"] == {"all": {}}
    assert shown["dynamic_batching"] == {"max_queue_delay_microseconds": 9}
    assert shown["input"] == [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]}]
    assert config_of(MANIFEST)["dynamic_batching"] == {}
    # What GET config shows, sent back, is the model's own.
    parse_config(json.dumps(shown)).check(MANIFEST)


@pytest.mark.parametrize("parameters, reason", [
    ({"other": "x"}, "parameter 'other' is not served"),
    ({"config": b"{}"}, "config must be text"),
    ({"config": 3}, "config must be text"),
])
def test_a_load_takes_a_configuration_and_files_alone(parameters, reason):
    """Any parameter but config and files, or a config that is not text, fails the load
    naming it."""
    with pytest.raises(LoadFailed) as refused:
        load_config("simple", parameters)
    assert refused.value.message.startswith("failed to load 'simple': " + reason)


def test_a_loads_configuration_overrides_the_folders_field_by_field():
    """What a load's configuration sets wins; what it leaves unset, the folder's config.json
    sets."""
    folder = ModelConfig(max_batch_size=16, policy=VersionPolicy("all"),
                         batch_delay_microseconds=250)
    assert folder.overridden(ModelConfig(max_batch_size=0, name="simple")) == ModelConfig(
        max_batch_size=0, policy=VersionPolicy("all"), batch_delay_microseconds=250,
        name="simple")
    assert folder.overridden(NO_CONFIG) == folder and NO_CONFIG.overridden(folder) == folder


@pytest.mark.parametrize("text, read", [
    (None, NO_CONFIG),
    ('{"version_policy": {"latest": {"num_versions": 2}}, "max_batch_size": 4}',
     ModelConfig(max_batch_size=4, policy=VersionPolicy("latest", 2))),
    ("{not json", "config.json is not JSON"),
    ('{"instance_group": [{"count": 2}]}', "config.json: instance_group is not served"),
    ('{"max_batch_size": -1}', "config.json: max_batch_size must be from 0 to"),
])
def test_config_json_reads_as_a_loads_configuration(tmp_path, text, read):
    """config.json is read as a load's configuration is: its fields, or why it cannot be
    honoured, naming the file."""
    if text is not None:
        (tmp_path / "config.json").write_text(text)
    if isinstance(read, ModelConfig):
        assert read_config(str(tmp_path)) == read
    else:
        with pytest.raises(ConfigError) as refused:
            read_config(str(tmp_path))
        assert str(refused.value).startswith(read), refused.value


def test_a_load_without_parameters_has_no_configuration():
    """No parameters (or config unset): the model as its folder says."""
    assert load_config("simple", {}) is None and load_config("simple", {"config": None}) is None
    assert load_config("simple", {"config": "{}"}) == "{}"
