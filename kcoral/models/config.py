"""
A model's configuration given with its load, as Triton takes it: its
C{ModelConfig} message in JSON form (integers quoted or not), which replaces
what the model's folder says. KCoral honours C{max_batch_size},
C{version_policy}, C{dynamic_batching}'s C{max_queue_delay_microseconds}
and, for a sequence model, C{sequence_batching}'s strategy (C{direct} or
C{oldest}) and C{max_sequence_idle_microseconds};
C{name}, C{platform} (or C{backend}), C{input}, C{output} and
C{model_transaction_policy} may be given when they are the model's own, as
C{GET .../config} shows them, so that a configuration read, changed and
sent back loads. Any other field is refused, naming it: a load that
silently ignored it would serve another model than the client asked for.
"""

from __future__ import annotations

import json

import attrs
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from kcoral.models.manifest import (
    MAX_BATCH_SIZE,
    MAX_IDLE_SECONDS,
    STRATEGIES,
    ModelManifest,
    SequenceSpec,
    TensorSpec,
)
from kcoral.models.versions import (
    CONFIG,
    VersionError,
    VersionPolicy,
    parse_policy,
    read_config_json,
)
from kcoral.protocol.tensors import config_type

#: The model platform that configurations name.
PLATFORM = "jax"
#: The most bytes of a configuration given with a load.
MAX_CONFIG_BYTES = 64 * 1024
#: The fields KCoral reads of a configuration; the others are refused.
_HONOURED = frozenset({"name", "platform", "backend", "max_batch_size", "version_policy",
                       "dynamic_batching", "sequence_batching", "input", "output",
                       "model_transaction_policy"})
_IDLE = "max_sequence_idle_microseconds"
#: Triton's kind of each control.
_CONTROL_KINDS = {"START": "CONTROL_SEQUENCE_START", "END": "CONTROL_SEQUENCE_END",
                  "READY": "CONTROL_SEQUENCE_READY", "CORRID": "CONTROL_SEQUENCE_CORRID"}
_DELAY = "max_queue_delay_microseconds"
#: The most a batch waits for more rows (an hour: past it, a typo).
MAX_DELAY_MICROSECONDS = 3600 * 10**6


class ConfigError(ValueError):
    """A configuration that cannot be honoured; the message says why."""


@attrs.frozen
class ModelConfig:
    """
    What a load's configuration sets (None: what the bundle and its folder
    say): the most rows of a batch, the versions served, and how long a
    short batch waits for more rows; C{inputs} and C{outputs}, when given,
    each C{(name, data_type, dims)}, must be the model's own.
    """

    max_batch_size: int | None = None
    policy: VersionPolicy | None = None
    batch_delay_microseconds: int | None = None
    inputs: tuple[tuple[str, str, tuple[int, ...]], ...] | None = None
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...] | None = None
    name: str = ""
    #: A sequence model's strategy (C{direct}, C{oldest}) and idle bound.
    sequence_batching: str | None = None
    sequence_idle_microseconds: int | None = None
    #: Each control as C{(name, Triton's kind)}, when given: the model's own.
    sequence_controls: tuple[tuple[str, str], ...] | None = None
    #: Whether the model is decoupled, when given: the model's own.
    decoupled: bool | None = None

    def check(self, manifest: ModelManifest) -> None:
        """ConfigError unless the model of C{manifest}, configured so, is
        the one this configuration describes."""
        if self.name and self.name != manifest.name:
            raise ConfigError(f"name {self.name[:64]!r} is not the model's, {manifest.name!r}")
        if self.decoupled is not None and self.decoupled != manifest.decoupled:
            raise ConfigError(f"model_transaction_policy.decoupled must be the model's own, "
                              f"{str(manifest.decoupled).lower()}: a model is decoupled as it "
                              "was exported (kcoral.export_bundle(..., decoupled=True))")
        batched = manifest.max_batch_size > 0
        if self.batch_delay_microseconds is not None and not batched:
            raise ConfigError("dynamic_batching needs a max_batch_size of 1 or more")
        sequenced = (self.sequence_batching, self.sequence_idle_microseconds,
                     self.sequence_controls) != (None, None, None)
        if sequenced and manifest.sequence is None:
            raise ConfigError("sequence_batching is a sequence model's: export the model with "
                              "its state (kcoral.export_bundle(..., state=...))")
        if self.batch_delay_microseconds is not None and manifest.sequence is not None:
            raise ConfigError("dynamic_batching: a sequence model's steps are batched by its "
                              "sequence_batching")
        if manifest.sequence is not None and self.sequence_controls is not None:
            controls = _controls(manifest.sequence)
            if self.sequence_controls != controls:
                raise ConfigError("sequence_batching.control_input must be the model's own: "
                                  + ", ".join(f"{n} {k}" for n, k in controls))
        for what, given, specs in (("input", self.inputs, manifest.inputs),
                                   ("output", self.outputs, manifest.outputs)):
            own = tuple(_tensor(spec, batched) for spec in specs)
            if given is not None and given != own:
                raise ConfigError(f"{what} must be the model's own: "
                                  + ", ".join(f"{n} {t} {list(d)}" for n, t, d in own))

    def overridden(self, by: ModelConfig) -> ModelConfig:
        """This configuration with every field that C{by} sets set as C{by}
        sets it: a load's configuration over its folder's."""
        return ModelConfig(**{field.name: getattr(self, field.name) if getattr(by, field.name) in (
            None, "") else getattr(by, field.name) for field in attrs.fields(ModelConfig)})


#: A load without a configuration: the model as its bundle and folder say.
NO_CONFIG = ModelConfig()


def _tensor(spec: TensorSpec, batched: bool) -> tuple[str, str, tuple[int, ...]]:
    # Triton's dims leave out the batch dimension of a batched model.
    return spec.name, config_type(spec.datatype), spec.shape[1:] if batched else spec.shape


def tensor_config(spec: TensorSpec, batched: bool) -> dict:
    """A tensor as Triton's configuration lists it."""
    name, data_type, dims = _tensor(spec, batched)
    return {"name": name, "data_type": data_type, "dims": list(dims)}


def _controls(sequence: SequenceSpec) -> tuple[tuple[str, str], ...]:
    return tuple((spec.name, _CONTROL_KINDS[spec.name]) for spec in sequence.controls)


def sequence_config(sequence: SequenceSpec) -> dict:
    """A sequence model's C{sequence_batching}, as Triton's configuration has it."""
    controls = []
    for spec in sequence.controls:
        control: dict = {"kind": _CONTROL_KINDS[spec.name]}
        if spec.name == "CORRID":
            control["data_type"] = config_type(spec.datatype)
        else:
            control["int32_false_true"] = [0, 1]
        controls.append({"name": spec.name, "control": [control]})
    return {_IDLE: round(sequence.max_idle_seconds * 1e6), "control_input": controls,
            sequence.batching: {}}


def config_of(manifest: ModelManifest, config: ModelConfig = NO_CONFIG) -> dict:
    """
    A model's configuration as Triton's tools read it (perf_analyzer needs
    C{max_batch_size}, C{input} and C{output}), with what its load's
    C{config} set; every key is a field of Triton's C{ModelConfig} message,
    so the gRPC front sends the same.
    """
    batched = manifest.max_batch_size > 0
    value: dict = {"name": manifest.name, "platform": PLATFORM,
                   "max_batch_size": manifest.max_batch_size,
                   "input": [tensor_config(t, batched) for t in manifest.inputs],
                   "output": [tensor_config(t, batched) for t in manifest.outputs]}
    if config.policy is not None:
        value["version_policy"] = config.policy.to_json()
    if manifest.decoupled:
        value["model_transaction_policy"] = {"decoupled": True}
    if manifest.sequence is not None:
        value["sequence_batching"] = sequence_config(manifest.sequence)
    elif batched:
        # Workers batch concurrent inferences of a batched model.
        value["dynamic_batching"] = {} if config.batch_delay_microseconds is None else {
            _DELAY: config.batch_delay_microseconds}
    return value


def parse_config(text: str) -> ModelConfig:
    """The configuration in C{text}, Triton's ModelConfig as JSON;
    ConfigError says why it cannot be honoured."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"the configuration is over {MAX_CONFIG_BYTES} bytes")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"the configuration is not JSON: {str(e)[:200]}") from None
    if not isinstance(value, dict):
        raise ConfigError("the configuration must be a JSON object, Triton's ModelConfig")
    if {"dynamic_batching", "dynamicBatching"} & set(value) and {
            "sequence_batching", "sequenceBatching"} & set(value):
        raise ConfigError("dynamic_batching and sequence_batching exclude each other")
    try:
        message = json_format.ParseDict(value, model_config_pb2.ModelConfig())
    except (json_format.ParseError, RecursionError) as e:
        raise ConfigError(f"the configuration is not a ModelConfig: {str(e)[:300]}") from None
    present = {field.name for field, _ in message.ListFields()}
    refused = sorted(present - _HONOURED)
    if refused:
        raise ConfigError(f"{refused[0]} is not served: a configuration may set only "
                          + ", ".join(sorted(_HONOURED)))
    for field in ("platform", "backend"):
        if getattr(message, field) not in ("", PLATFORM):
            raise ConfigError(f"{field} {getattr(message, field)[:64]!r} is not {PLATFORM!r}")
    # A scalar's absence and its zero read the same in a message: the JSON
    # says whether max_batch_size was given.
    given = "max_batch_size" in value or "maxBatchSize" in value
    if not 0 <= message.max_batch_size <= MAX_BATCH_SIZE:
        raise ConfigError(f"max_batch_size must be from 0 to {MAX_BATCH_SIZE}")
    strategy, idle, controls = (_sequence(message, value) if "sequence_batching" in present
                                else (None, None, None))
    return ModelConfig(
        sequence_batching=strategy, sequence_idle_microseconds=idle, sequence_controls=controls,
        max_batch_size=message.max_batch_size if given else None,
        policy=_policy(message) if "version_policy" in present else None,
        batch_delay_microseconds=_delay(message, value) if "dynamic_batching" in present else None,
        inputs=_tensors(message.input) if "input" in present else None,
        outputs=_tensors(message.output) if "output" in present else None,
        name=message.name,
        decoupled=(message.model_transaction_policy.decoupled
                   if "model_transaction_policy" in present else None))


def read_config(folder: str) -> ModelConfig:
    """
    What the C{config.json} of the model folder C{folder} sets, in the
    form a load's configuration takes (NO_CONFIG: it has none); ConfigError
    names the file and why. It reads the disk: call it off the reactor.
    """
    try:
        value = read_config_json(folder)
    except VersionError as e:
        raise ConfigError(str(e)) from None
    if value is None:
        return NO_CONFIG
    try:
        return parse_config(json.dumps(value))
    except ConfigError as e:
        raise ConfigError(f"{CONFIG}: {e}") from None


def _policy(message: model_config_pb2.ModelConfig) -> VersionPolicy:
    policy = message.version_policy
    kind = policy.WhichOneof("policy_choice")
    setting: dict = {}
    if kind == "latest" and policy.latest.num_versions:
        setting = {"num_versions": policy.latest.num_versions}
    elif kind == "specific":
        setting = {"versions": list(policy.specific.versions)}
    try:
        return parse_policy({"version_policy": {kind: setting}}, "the configuration")
    except VersionError as e:
        raise ConfigError(str(e)) from None


def _delay(message: model_config_pb2.ModelConfig, value: dict) -> int | None:
    """The delay that C{dynamic_batching} sets (None: it sets none)."""
    batching = message.dynamic_batching
    refused = sorted(field.name for field, _ in batching.ListFields() if field.name != _DELAY)
    if refused:
        raise ConfigError(f"dynamic_batching.{refused[0]} is not served: KCoral's batches "
                          f"take {_DELAY} alone")
    given = value.get("dynamic_batching", value.get("dynamicBatching"))
    if not isinstance(given, dict) or not {_DELAY, "maxQueueDelayMicroseconds"} & set(given):
        return None  # as a scalar's zero, its absence reads 0 in the message
    if batching.max_queue_delay_microseconds > MAX_DELAY_MICROSECONDS:
        raise ConfigError(f"dynamic_batching.{_DELAY} is over {MAX_DELAY_MICROSECONDS}")
    return batching.max_queue_delay_microseconds


def _sequence(message: model_config_pb2.ModelConfig, value: dict
              ) -> tuple[str | None, int | None, tuple[tuple[str, str], ...] | None]:
    """The strategy, idle bound and controls that C{sequence_batching} sets
    (each None: it sets none)."""
    batching = message.sequence_batching
    fields = {field.name for field, _ in batching.ListFields()}
    given = value.get("sequence_batching", value.get("sequenceBatching"))
    if isinstance(given, dict):
        # An empty strategy ({"oldest": {}}) is no field of the message.
        fields |= {name for name in STRATEGIES if name in given}
    refused = sorted(fields - {_IDLE, "control_input", *STRATEGIES})
    if refused:
        raise ConfigError(f"sequence_batching.{refused[0]} is not served: KCoral's sequence "
                          f"batching takes {', '.join(STRATEGIES)}, {_IDLE} and control_input")
    strategy = None
    for name in STRATEGIES:
        if name in fields:
            inner = sorted(field.name for field, _ in getattr(batching, name).ListFields())
            if inner:
                raise ConfigError(f"sequence_batching.{name}.{inner[0]} is not served")
            strategy = name
    idle = None
    if _IDLE in fields:
        idle = batching.max_sequence_idle_microseconds
        if not 0 < idle <= MAX_IDLE_SECONDS * 1e6:
            raise ConfigError(f"sequence_batching.{_IDLE} must be over 0, at most "
                              f"{MAX_IDLE_SECONDS * 1e6:.0f}")
    controls = None
    if "control_input" in fields:
        listed = []
        for control in batching.control_input:
            kinds = [model_config_pb2.ModelSequenceBatching.Control.Kind.Name(c.kind)
                     for c in control.control]
            if len(kinds) != 1:
                raise ConfigError(f"sequence_batching.control_input {control.name[:64]!r}: one "
                                  f"control an input")
            listed.append((control.name, kinds[0]))
        controls = tuple(listed)
    return strategy, idle, controls


def _tensors(tensors) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple((t.name, model_config_pb2.DataType.Name(t.data_type), tuple(t.dims))
                 for t in tensors)
