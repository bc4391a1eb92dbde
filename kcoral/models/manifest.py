"""
A model bundle's manifest (C{model.json}): the one description of a model
that the exporter writes, a worker loads, and the inference protocol
answers metadata and configuration from.

Datatypes are the inference protocol's names (C{FP32}, C{BF16}, ...), shapes
have -1 for the batch dimension, and everything read is checked and
bounded: a repository is an operator's folder, but a broken manifest must
make its model unavailable with a reason, never crash a worker.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping

import attrs
import numpy as np

from kcoral.protocol.strings import DATA, LENGTHS, MAX_LENGTH, OBJECT, longest, pack, unpack
from kcoral.protocol.tensors import BYTES, DATATYPES, MAX_RANK, MAX_TENSORS, InvalidInput, datatype_of

#: A model's or a tensor's name, and a bundle's file names: never a path.
NAME = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")
#: Bounds on what a manifest may describe.
MAX_MANIFEST_BYTES = 1 << 20
MAX_BATCH_SIZES = 16
MAX_BATCH_SIZE = 1 << 16
MANIFEST = "model.json"
FORMAT = 1
_DIGEST = re.compile(r"\A[0-9a-f]{64}\Z")

#: A sequence model's controls, each a tensor of shape (batch, 1): whether
#: the row starts its sequence, ends it, holds a real step (a padding row
#: does not), and the sequence's correlation id.
CONTROLS = ("START", "END", "READY", "CORRID")
#: The datatypes each control may have: CORRID's is UINT64 where the model
#: was exported with JAX's 64-bit types, else UINT32 (the id's low bits).
_CONTROL_DATATYPES = {"START": ("INT32",), "END": ("INT32",), "READY": ("INT32",),
                      "CORRID": ("UINT64", "UINT32")}
#: How a worker runs a sequence model's steps: one step an execution, or
#: the steps of different waiting sequences together, each row its own state.
DIRECT, OLDEST = "direct", "oldest"
STRATEGIES = (DIRECT, OLDEST)
#: The longest a sequence may stay idle before its state is freed (a day:
#: past it, a typo).
MAX_IDLE_SECONDS = 86400.0


class InvalidManifest(ValueError):
    """A manifest that cannot be served; the message says why."""


@attrs.frozen
class TensorSpec:
    """One input or output: its name, datatype and shape (-1: the batch
    dimension, and only there); a BYTES one, the most bytes of one of its
    elements, C{max_length}, by which its program holds it
    (L{kcoral.protocol.strings})."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    max_length: int | None = None

    @property
    def dtype(self) -> np.dtype:
        return OBJECT if self.datatype == BYTES else DATATYPES[self.datatype]

    @property
    def program_tensors(self) -> tuple[tuple[np.dtype, tuple[int, ...]], ...]:
        """The dtype and shape of each array its program takes or returns
        for it: one, or a BYTES tensor's bytes and lengths."""
        if self.max_length is None:
            return ((self.dtype, self.shape),)
        return ((DATA, (*self.shape, self.max_length)), (LENGTHS, self.shape))

    def to_program(self, array: np.ndarray) -> list[np.ndarray]:
        """The arrays its program takes for C{array}, an input checked by
        L{ModelManifest.check}."""
        if self.max_length is None:
            return [array]
        return list(pack(array, self.max_length))

    def from_program(self, arrays: list[np.ndarray]) -> np.ndarray:
        """The output of the arrays its program returned for it; ValueError
        when they are not what it declares."""
        if self.max_length is None:
            return arrays[0]
        return unpack(*arrays)

    def to_json(self) -> dict:
        value: dict = {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}
        if self.max_length is not None:
            value["max_length"] = self.max_length
        return value

    @classmethod
    def from_json(cls, value: object, batched: bool) -> TensorSpec:
        if not isinstance(value, dict):
            raise InvalidManifest("a tensor must be an object")
        name, datatype, shape = value.get("name"), value.get("datatype"), value.get("shape")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidManifest(f"tensor name {str(name)[:64]!r} is not 1-64 of [A-Za-z0-9_.-]")
        if datatype not in DATATYPES and datatype != BYTES:
            raise InvalidManifest(f"tensor {name}: datatype {str(datatype)[:32]!r} is not served")
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(
                type(d) is int and d >= -1 for d in shape):
            raise InvalidManifest(f"tensor {name}: shape must list at most {MAX_RANK} dimensions")
        if batched and (not shape or shape[0] != -1 or -1 in shape[1:]):
            raise InvalidManifest(f"tensor {name}: a batched model's shapes start with -1, "
                                  "the batch dimension, and have no other")
        if not batched and -1 in shape:
            raise InvalidManifest(f"tensor {name}: -1 is the batch dimension of a batched model")
        most = value.get("max_length")
        if datatype == BYTES and (type(most) is not int or not 1 <= most <= MAX_LENGTH):
            raise InvalidManifest(f"tensor {name}: a BYTES tensor's max_length must be the "
                                  f"most bytes of one element, 1 to {MAX_LENGTH}")
        if datatype != BYTES and most is not None:
            raise InvalidManifest(f"tensor {name}: max_length is for BYTES tensors alone")
        return cls(name, datatype, tuple(shape), most)


@attrs.frozen
class ProgramFile:
    """A serialized program of the bundle, for the batch sizes it serves
    (all of them when it was exported with a symbolic batch dimension)."""

    file: str
    sha256: str
    batch_sizes: tuple[int, ...]

    def to_json(self) -> dict:
        return {"file": self.file, "sha256": self.sha256, "batch_sizes": list(self.batch_sizes)}


@attrs.frozen
class ParamsFile:
    """The params' safetensors file: tensors C{param_0} ... C{param_<count-1>},
    the leaves of the params pytree in C{jax.tree.leaves} order."""

    file: str
    sha256: str
    count: int

    def to_json(self) -> dict:
        return {"file": self.file, "sha256": self.sha256, "count": self.count}


@attrs.frozen
class SequenceSpec:
    """
    What makes a model a sequence (stateful) model: its program takes, after
    its params, each state tensor (one row a sequence), then its C{controls}
    in order, then its inputs; and returns each new state tensor, then its
    outputs. C{initial} holds one sequence's starting state (tensors
    C{param_0} ... in the state's order, each of one row); C{batching} is
    L{DIRECT} or L{OLDEST}; a sequence idle C{max_idle_seconds} is freed.
    """

    batching: str
    max_idle_seconds: float
    controls: tuple[TensorSpec, ...]
    state: tuple[TensorSpec, ...]
    initial: ParamsFile

    def to_json(self) -> dict:
        return {"batching": self.batching, "max_idle_seconds": self.max_idle_seconds,
                "controls": [t.to_json() for t in self.controls],
                "state": [t.to_json() for t in self.state], "initial": self.initial.to_json()}

    @classmethod
    def from_json(cls, value: object) -> SequenceSpec:
        if not isinstance(value, dict):
            raise InvalidManifest("sequence must be an object or null")
        batching, idle = value.get("batching"), value.get("max_idle_seconds")
        if batching not in STRATEGIES:
            raise InvalidManifest(f"sequence: batching {str(batching)[:32]!r} is not one of "
                                  + ", ".join(STRATEGIES))
        if not isinstance(idle, (int, float)) or isinstance(idle, bool) or not (
                0 < idle <= MAX_IDLE_SECONDS):
            raise InvalidManifest(f"sequence: max_idle_seconds must be a number of seconds "
                                  f"over 0, at most {MAX_IDLE_SECONDS:g}")
        controls = value.get("controls")
        if not isinstance(controls, list) or len(controls) > len(CONTROLS):
            raise InvalidManifest(f"sequence: controls must list at most {len(CONTROLS)} controls")
        specs = tuple(TensorSpec.from_json(t, batched=True) for t in controls)
        for spec in specs:
            if spec.name not in CONTROLS:
                raise InvalidManifest(f"sequence: {spec.name!r} is not a control: they are "
                                      + ", ".join(CONTROLS))
            if spec.datatype not in _CONTROL_DATATYPES[spec.name] or spec.shape != (-1, 1):
                raise InvalidManifest(f"sequence: control {spec.name} must be "
                                      f"{' or '.join(_CONTROL_DATATYPES[spec.name])} [-1, 1]")
        named = [spec.name for spec in specs]
        if len(set(named)) != len(named):
            raise InvalidManifest("sequence: controls name a control twice")
        state = _tensors(value.get("state"), "sequence: state", batched=True)
        initial = _params(value.get("initial"))
        if initial is None or initial.count != len(state):
            raise InvalidManifest("sequence: initial must be the file of one tensor for each "
                                  "state tensor")
        return cls(batching, float(idle), specs, state, initial)


@attrs.frozen
class ModelManifest:
    """
    What C{model.json} says. C{max_batch_size} 0: the model is not batched
    (its shapes are fixed, C{batch_sizes} is empty); else dimension 0 of
    every input and output is the batch, and a program is compiled for each
    of C{batch_sizes}, the largest of which is C{max_batch_size}.
    """

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    batch_sizes: tuple[int, ...]
    programs: tuple[ProgramFile, ...]
    params: ParamsFile | None
    platforms: tuple[str, ...]
    version: int = 1
    #: None: a model whose every request stands alone.
    sequence: SequenceSpec | None = None
    #: Whether it is decoupled: a request gets one answer for each row of
    #: its program's outputs (their first dimension, the same for all), each
    #: output of an answer of the shape its spec says. Such a model is not
    #: batched.
    decoupled: bool = False

    def as_program(self) -> ModelManifest:
        """The manifest of its program alone: a sequence model's state and
        controls before its inputs, and its new state before its outputs; a
        decoupled model's outputs with their answers' dimension first (-1:
        any number of answers)."""
        if self.decoupled:
            return attrs.evolve(self, outputs=tuple(
                attrs.evolve(t, shape=(-1, *t.shape)) for t in self.outputs), decoupled=False)
        if self.sequence is None:
            return self
        return attrs.evolve(self, inputs=self.sequence.state + self.sequence.controls + self.inputs,
                            outputs=self.sequence.state + self.outputs, sequence=None)

    def to_json(self) -> dict:
        return {
            "format": FORMAT, "name": self.name, "version": self.version,
            "platforms": list(self.platforms),
            "max_batch_size": self.max_batch_size, "batch_sizes": list(self.batch_sizes),
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "programs": [p.to_json() for p in self.programs],
            "params": None if self.params is None else self.params.to_json(),
            "sequence": None if self.sequence is None else self.sequence.to_json(),
            # Written only for a decoupled model: a bundle of any other reads
            # as it did before there were any.
            **({"decoupled": True} if self.decoupled else {}),
        }

    @property
    def signature(self) -> str:
        """The digest of what a client sees of the model: each input's and
        output's name, datatype and shape, in order. Two models of one name
        with different signatures are different models; the same model
        exported for other platforms, or batched otherwise, has the same."""
        tensors = [[t.to_json() for t in self.inputs], [t.to_json() for t in self.outputs]]
        return hashlib.sha256(json.dumps(tensors, separators=(",", ":")).encode()).hexdigest()

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=2).encode() + b"\n"

    @classmethod
    def loads(cls, data: bytes) -> ModelManifest:
        """The manifest in C{data}, checked; InvalidManifest says what is wrong."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise InvalidManifest(f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
        try:
            value = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise InvalidManifest(f"{MANIFEST} is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise InvalidManifest(f"{MANIFEST} must hold an object")
        return cls.from_json(value)

    @classmethod
    def from_json(cls, value: Mapping) -> ModelManifest:
        if value.get("format") != FORMAT:
            raise InvalidManifest(f"format {str(value.get('format'))[:16]!r} is not {FORMAT}")
        name = value.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidManifest(f"model name {str(name)[:64]!r} is not 1-64 of [A-Za-z0-9_.-]")
        version = value.get("version", 1)
        if type(version) is not int or not 1 <= version < 1 << 31:
            raise InvalidManifest("version must be a positive integer")
        most = value.get("max_batch_size")
        if type(most) is not int or not 0 <= most <= MAX_BATCH_SIZE:
            raise InvalidManifest(f"max_batch_size must be an integer from 0 to {MAX_BATCH_SIZE}")
        sizes = value.get("batch_sizes", [])
        if not isinstance(sizes, list) or len(sizes) > MAX_BATCH_SIZES or not all(
                type(s) is int and 1 <= s <= most for s in sizes) or len(set(sizes)) != len(sizes):
            raise InvalidManifest(f"batch_sizes must list at most {MAX_BATCH_SIZES} distinct "
                                  "sizes from 1 to max_batch_size")
        if most and max(sizes, default=0) != most:
            raise InvalidManifest("max_batch_size must be the largest of batch_sizes")
        if not most and sizes:
            raise InvalidManifest("a model with max_batch_size 0 has no batch_sizes")
        batched = most > 0
        inputs = _tensors(value.get("inputs"), "inputs", batched)
        outputs = _tensors(value.get("outputs"), "outputs", batched)
        programs = _programs(value.get("programs"), tuple(sorted(sizes)))
        params = _params(value.get("params"))
        sequence = None if value.get("sequence") is None else SequenceSpec.from_json(
            value["sequence"])
        if sequence is not None and not batched:
            raise InvalidManifest("a sequence model is batched: its controls are (batch, 1)")
        decoupled = value.get("decoupled", False)
        if not isinstance(decoupled, bool):
            raise InvalidManifest("decoupled must be true or false")
        if decoupled and (batched or sequence is not None):
            raise InvalidManifest("a decoupled model is neither batched (max_batch_size 0) nor a "
                                  "sequence model: each request runs alone, its answers one "
                                  "row each of its outputs")
        files = ([p.file for p in programs] + ([] if params is None else [params.file])
                 + ([] if sequence is None else [sequence.initial.file]))
        if len(set(files)) != len(files):
            raise InvalidManifest("programs, params and a sequence's initial state must each "
                                  "have a file of their own")
        platforms = value.get("platforms", [])
        if not isinstance(platforms, list) or not platforms or len(platforms) > 8 or not all(
                isinstance(p, str) and NAME.match(p) for p in platforms):
            raise InvalidManifest("platforms must list the platforms the program was exported for")
        return cls(name=name, version=version, inputs=inputs, outputs=outputs,
                   max_batch_size=most, batch_sizes=tuple(sorted(sizes)), programs=programs,
                   params=params, platforms=tuple(platforms), sequence=sequence,
                   decoupled=decoupled)

    def batch_size_for(self, rows: int) -> int:
        """The smallest compiled batch size that holds C{rows} rows."""
        for size in self.batch_sizes:
            if size >= rows:
                return size
        raise InvalidInput(f"a batch of {rows} is over max_batch_size {self.max_batch_size}")

    def check(self, inputs: Mapping[str, np.ndarray]) -> int:
        """
        The batch's rows (1 for a model that is not batched) when C{inputs}
        are exactly this model's inputs, by name, with their datatypes and
        shapes (a BYTES input's elements within its max_length); else
        InvalidInput, saying which input is wrong and how.
        """
        wanted = {t.name for t in self.inputs}
        unknown = sorted(set(inputs) - wanted)
        if unknown:
            raise InvalidInput(f"model {self.name} has no input {unknown[0]!r} "
                               f"(its inputs: {', '.join(sorted(wanted))})")
        rows = None
        for spec in self.inputs:
            array = inputs.get(spec.name)
            if array is None:
                raise InvalidInput(f"input {spec.name!r} of model {self.name} is missing")
            if array.dtype != spec.dtype:
                raise InvalidInput(f"input {spec.name!r} has datatype "
                                   f"{_datatype_or_dtype(array.dtype)}, the model takes {spec.datatype}")
            shape = tuple(array.shape)
            if len(shape) != len(spec.shape) or any(
                    d != -1 and d != s for d, s in zip(spec.shape, shape)):
                raise InvalidInput(f"input {spec.name!r} has shape {list(shape)}, the model "
                                   f"takes {list(spec.shape)}")
            if spec.max_length is not None:
                length = longest(array)
                if length > spec.max_length:
                    raise InvalidInput(f"input {spec.name!r} has an element of {length} bytes, "
                                       f"over its max_length of {spec.max_length}")
            if self.max_batch_size:
                if rows is not None and shape[0] != rows:
                    raise InvalidInput(f"input {spec.name!r} has {shape[0]} rows, another "
                                       f"input {rows}: a batch's inputs have the same rows")
                rows = shape[0]
        if not self.max_batch_size:
            return 1
        assert rows is not None  # a batched model has an input
        if not 1 <= rows <= self.max_batch_size:
            raise InvalidInput(f"a batch of {rows} rows: model {self.name} takes 1 to "
                               f"{self.max_batch_size} (max_batch_size)")
        return rows


def _datatype_or_dtype(dtype: np.dtype) -> str:
    if dtype == OBJECT:
        return BYTES
    try:
        return datatype_of(dtype)
    except ValueError:
        return str(dtype)


def _tensors(value: object, what: str, batched: bool) -> tuple[TensorSpec, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_TENSORS:
        raise InvalidManifest(f"{what} must list 1 to {MAX_TENSORS} tensors")
    tensors = tuple(TensorSpec.from_json(t, batched) for t in value)
    if len({t.name for t in tensors}) != len(tensors):
        raise InvalidManifest(f"{what} names a tensor twice")
    return tensors


def _file(value: Mapping, what: str) -> tuple[str, str]:
    file, digest = value.get("file"), value.get("sha256")
    if not isinstance(file, str) or not NAME.match(file) or file == MANIFEST:
        raise InvalidManifest(f"{what}: file {str(file)[:64]!r} must be a file name in the bundle")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise InvalidManifest(f"{what}: sha256 must be the file's hex digest")
    return file, digest


def _programs(value: object, sizes: tuple[int, ...]) -> tuple[ProgramFile, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_BATCH_SIZES:
        raise InvalidManifest(f"programs must list 1 to {MAX_BATCH_SIZES} program files")
    programs = []
    for entry in value:
        if not isinstance(entry, dict):
            raise InvalidManifest("a program entry must be an object")
        file, digest = _file(entry, "a program")
        covered = entry.get("batch_sizes", [])
        if not isinstance(covered, list) or not all(type(s) is int for s in covered):
            raise InvalidManifest(f"program {file}: batch_sizes must list batch sizes")
        programs.append(ProgramFile(file, digest, tuple(sorted(covered))))
    listed = sorted(s for p in programs for s in p.batch_sizes)
    if tuple(listed) != sizes or (not sizes and len(programs) != 1):
        raise InvalidManifest("programs must cover each batch size exactly once (a model that "
                              "is not batched: one program, with no batch sizes)")
    return tuple(programs)


def _params(value: object) -> ParamsFile | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidManifest("params must be an object or null")
    file, digest = _file(value, "params")
    count = value.get("count")
    if type(count) is not int or not 0 <= count <= 1 << 16:
        raise InvalidManifest("params: count must be the number of params tensors")
    return ParamsFile(file, digest, count)
