"""
Model bundles: the folder that L{export_bundle} writes and a worker reads
with L{read_bundle}. Its layout is described in C{doc/bundles.rst}.

A bundle holds C{model.json}, the serialized program(s) and the params in a
safetensors file. Everything here blocks (JAX, hashing, disk): a server calls
L{read_bundle} from a worker thread, never from the reactor.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kcoral.errors import ProgramExportError
from kcoral.models.manifest import (
    CONTROLS,
    DIRECT,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    STRATEGIES,
    InvalidManifest,
    ModelManifest,
    ParamsFile,
    ProgramFile,
    SequenceSpec,
    TensorSpec,
)
from kcoral.program import DEFAULT_PLATFORMS
from kcoral.protocol.strings import DATA, LENGTHS, MAX_LENGTH, Strings
from kcoral.protocol.tensors import BYTES, DATATYPES, datatype_of

PARAMS = "params.safetensors"
#: A sequence model's initial state, tensors named as the params'.
INITIAL_STATE = "state.safetensors"
#: The program exported with a symbolic batch dimension, serving every size.
PROGRAM = "program.jax"
#: The program for one batch size, when the symbolic export is not possible.
SIZED_PROGRAM = "program_{size}.jax"
MAX_PROGRAM_BYTES = 1 << 30
MAX_PARAMS_BYTES = 64 << 30
#: The batch dimension's name in a symbolically exported program.
BATCH = "batch"
_CHUNK = 1 << 20

#: safetensors' names of the dtypes a bundle's params may have: the inference
#: protocol's, shortened (UINT8 is U8, INT8 I8, FP32 F32; BOOL and BF16 alike).
#: Its own numpy loader knows no bfloat16, so params are read with its
#: format-level deserializer and typed by this table.
_SAFETENSORS_DTYPES = {name.replace("UINT", "U").replace("INT", "I").replace("FP", "F"): dtype
                       for name, dtype in DATATYPES.items()}


class BundleError(ValueError):
    """A bundle that cannot be served; the message names the file and what is wrong."""


@attrs.frozen
class Bundle:
    """A bundle read whole and checked: its manifest, its programs' bytes by
    file name, its params in C{param_0} ... order, and a sequence model's
    initial state in its state's order."""

    manifest: ModelManifest
    programs: dict[str, bytes] = attrs.field(repr=False)
    params: list[np.ndarray] = attrs.field(repr=False)
    initial: list[np.ndarray] = attrs.field(repr=False, factory=list)


def export_bundle(fn: Callable, params, *example_inputs, dir: str | os.PathLike, name: str,
                  batch_sizes: Sequence[int] = (1,), input_names: Sequence[str] | None = None,
                  output_names: Sequence[str] | None = None,
                  platforms: Sequence[str] = DEFAULT_PLATFORMS, state=None,
                  controls: Sequence[str] = (), sequence_batching: str = DIRECT,
                  max_sequence_idle_seconds: float = 1.0, decoupled: bool = False) -> ModelManifest:
    """
    Write the model C{fn(params, *inputs)} (C{fn(*inputs)} when C{params} is
    None) to the bundle folder C{dir}, created if missing, and return its
    manifest.

    With C{state} (a pytree of arrays, one sequence's initial state, each
    with a batch dimension of 1), it is a sequence model:
    C{fn([params,] state, *controls, *inputs) -> (new_state, *outputs)},
    where C{controls} names any of START, END, READY (int32 0/1) and CORRID
    (uint64 with JAX's 64-bit types, else uint32), each of shape (batch, 1),
    in the order given. A worker keeps each live sequence's state on its
    device between requests; C{sequence_batching} C{"direct"} runs one step
    an execution, C{"oldest"} the steps of different waiting sequences in
    one execution, each row with its own state; a sequence idle
    C{max_sequence_idle_seconds} is freed.

    With C{decoupled}, it is a decoupled model, as Triton's: a request gets
    several answers (none, one, or more), on gRPC's ModelStreamInfer.
    C{fn} returns each output with a first dimension of answers, the same
    for every output, and answer i holds row i of each. It is not batched:
    each request runs alone, its inputs of the example inputs' shapes,
    whole (C{batch_sizes} is not used).

    C{params} is any pytree of arrays; the first dimension of every example
    input and of every output is the batch dimension, and only the example
    inputs' other dimensions and dtypes matter. A BYTES input's example is a
    L{Strings} (its elements' bytes at their most length, and their
    lengths), and C{fn} is given it as one; a BYTES output is a L{Strings}
    that C{fn} returns, its max_length the last dimension of its bytes
    (L{kcoral.protocol.strings}). The program is exported once
    with a symbolic batch dimension when JAX can trace C{fn} so, else once
    for each of C{batch_sizes}. C{model.json} is written last, so a reader
    never sees a manifest whose files are not all there.
    """
    import jax

    sizes = tuple(sorted(set(batch_sizes)))
    if not sizes or sizes[0] < 1:
        raise ValueError("batch_sizes must list one or more sizes of at least 1")
    if not example_inputs:
        raise ValueError("a model takes one or more inputs: pass an example of each")
    leaves, tree = jax.tree.flatten(params)
    leaves = [_host(leaf, f"param {i}") for i, leaf in enumerate(leaves)]
    strings = [isinstance(x, Strings) for x in example_inputs]
    examples = [array for i, x in enumerate(example_inputs) for array in _example(x, f"input {i}")]
    #: Which outputs are BYTES, as the last trace of fn returned them.
    returned: list[bool] = []
    stateful = state is not None
    initial, state_tree = jax.tree.flatten(state)
    initial = [_host(leaf, f"state {i}") for i, leaf in enumerate(initial)]
    if stateful:
        _check_sequence(initial, controls, sequence_batching)
    elif controls:
        raise ValueError("controls are a sequence model's: export it with its state")
    if decoupled and stateful:
        raise ValueError("a decoupled model is not a sequence model: export it without a state")
    # The program takes the state and controls as it takes inputs, each
    # with the batch as its first dimension: one row a sequence.
    examples = [*initial, *(_control(name) for name in controls), *examples]
    carried = len(initial) + len(controls)
    bound = params is not None

    def flat(*arrays):
        # The program takes and returns flat arrays, so that the server (and
        # a writer in another language) needs no pytree of the caller's.
        args = _grouped(arrays[len(leaves):], strings)
        if stateful:
            args = (jax.tree.unflatten(state_tree, args[:len(initial)]), *args[len(initial):])
        if bound:
            args = (jax.tree.unflatten(tree, arrays[:len(leaves)]), *args)
        if not stateful:
            return _returned(fn(*args), returned)
        new_state, *outputs = fn(*args)
        if str(jax.tree.structure(new_state)) != str(state_tree):
            raise ValueError(f"the new state is {jax.tree.structure(new_state)}, the state "
                             f"{state_tree}: a step returns a state of the state's structure")
        return (*jax.tree.leaves(new_state), *_returned(outputs, returned))

    jitted = jax.jit(flat)
    fixed = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]

    def export(batch):
        return jax.export.export(jitted, platforms=tuple(platforms))(
            *fixed, *[jax.ShapeDtypeStruct((batch, *x.shape[1:]), x.dtype) for x in examples])

    symbolic = None if decoupled else _export_symbolic(export, sizes, len(fixed))
    exported: dict[str, tuple[Any, tuple[int, ...]]]
    if decoupled:
        exported = {PROGRAM: (_export_decoupled(jitted, platforms, fixed, examples), ())}
    elif symbolic is not None:
        exported = {PROGRAM: (symbolic, sizes)}
    else:
        sized = [_export_sized(export, size) for size in sizes]
        for program, size in zip(sized, sizes):
            _check_batched(program, size, sized[0])
        exported = {SIZED_PROGRAM.format(size=size): (program, (size,))
                    for program, size in zip(sized, sizes)}
    first = next(iter(exported.values()))[0]
    inputs = _specs(first.in_avals[len(fixed) + carried:], input_names, "input", strings,
                    dims=tuple if decoupled else _batched)
    outputs = _specs(first.out_avals[len(initial):], output_names, "output", returned,
                     dims=_answer if decoupled else _batched)
    sequence = None
    if stateful:
        state_specs = _specs(first.in_avals[len(fixed):len(fixed) + len(initial)],
                             [f"state{i}" for i in range(len(initial))], "state")
        stepped = _specs(first.out_avals[:len(initial)],
                         [f"state{i}" for i in range(len(initial))], "state")
        if stepped != state_specs:
            raise ValueError("the new state does not round-trip: a step returns "
                             + ", ".join(f"{t.datatype}{list(t.shape)}" for t in stepped)
                             + " for the state's "
                             + ", ".join(f"{t.datatype}{list(t.shape)}" for t in state_specs))
        control_specs = _specs(first.in_avals[len(fixed) + len(initial):len(fixed) + carried],
                               list(controls), "control")

    files = {file: bytes(program.serialize()) for file, (program, _) in exported.items()}
    programs = tuple(ProgramFile(file, _sha256(files[file]), covered)
                     for file, (_, covered) in exported.items())
    params_file = None
    if bound:
        import safetensors.numpy

        files[PARAMS] = safetensors.numpy.save({f"param_{i}": leaf for i, leaf in enumerate(leaves)})
        params_file = ParamsFile(PARAMS, _sha256(files[PARAMS]), len(leaves))
    if stateful:
        import safetensors.numpy

        files[INITIAL_STATE] = safetensors.numpy.save(
            {f"param_{i}": leaf for i, leaf in enumerate(initial)})
        sequence = SequenceSpec(
            sequence_batching, float(max_sequence_idle_seconds), control_specs, state_specs,
            ParamsFile(INITIAL_STATE, _sha256(files[INITIAL_STATE]), len(initial)))
    manifest = ModelManifest(name=name, inputs=inputs, outputs=outputs,
                             max_batch_size=0 if decoupled else sizes[-1],
                             batch_sizes=() if decoupled else sizes, programs=programs,
                             params=params_file, platforms=tuple(platforms), sequence=sequence,
                             decoupled=decoupled)
    # What is written is what a worker will accept.
    try:
        ModelManifest.loads(manifest.dumps())
    except InvalidManifest as e:
        raise ValueError(f"the model cannot be bundled: {e}") from None
    os.makedirs(dir, exist_ok=True)
    for file, data in files.items():
        _write(dir, file, data)
    _write(dir, MANIFEST, manifest.dumps())
    return manifest


def _check_sequence(initial: list[np.ndarray], controls: Sequence[str], batching: str) -> None:
    """Refuse, before any tracing, a sequence model's state and controls
    that no worker could serve."""
    if not initial:
        raise ValueError("a sequence model's state holds one or more arrays")
    for i, leaf in enumerate(initial):
        if leaf.shape[:1] != (1,):
            raise ValueError(f"state {i} has shape {list(leaf.shape)}: the initial state is one "
                             "sequence's, with a batch dimension of 1")
    unknown = [name for name in controls if name not in CONTROLS]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a control: they are {', '.join(CONTROLS)}")
    if len(set(controls)) != len(controls):
        raise ValueError("controls name a control twice")
    if batching not in STRATEGIES:
        raise ValueError(f"sequence_batching {batching!r} is not one of {', '.join(STRATEGIES)}")


def _control(name: str) -> np.ndarray:
    """An example of control C{name}: int32 flags, and CORRID as uint64,
    narrowed to uint32 unless JAX runs 64-bit."""
    return _host(np.zeros((1, 1), np.uint64 if name == "CORRID" else np.int32), name)


def _example(value, what: str) -> list[np.ndarray]:
    """The host arrays of one example input: itself, or a BYTES input's
    bytes and lengths."""
    if not isinstance(value, Strings):
        array = _host(value, what)
        if array.ndim == 0:
            raise ValueError(f"{what} is a scalar: its first dimension must be the batch")
        return [array]
    data, lengths = np.asarray(value.data), np.asarray(value.lengths)
    if data.dtype != DATA or lengths.dtype != LENGTHS or data.ndim < 2 or (
            data.shape[:-1] != lengths.shape) or not 1 <= data.shape[-1] <= MAX_LENGTH:
        raise ValueError(f"{what}: a BYTES input's example is a Strings of uint8 bytes, of its "
                         f"shape (the batch first) and its max_length (1 to {MAX_LENGTH}), and "
                         f"int32 lengths of its shape; given {data.dtype}{list(data.shape)} and "
                         f"{lengths.dtype}{list(lengths.shape)}")
    return [data, lengths]


def _grouped(arrays: Sequence, strings: Sequence[bool]) -> tuple:
    """The arguments of a model's function from the arrays its program
    takes, the inputs' last (two for a BYTES input, given as a L{Strings}):
    the arrays before the inputs', then each input."""
    count = len(strings) + sum(strings)
    head, given = arrays[:len(arrays) - count], iter(arrays[len(arrays) - count:])
    return (*head, *(Strings(next(given), next(given)) if is_strings else next(given)
                     for is_strings in strings))


def _returned(results, returned: list[bool]) -> tuple:
    """The arrays a program returns for a model's function's C{results}
    (two for each L{Strings}, a BYTES output's), noting in C{returned}
    which outputs are BYTES."""
    import jax

    leaves = jax.tree.leaves(results, is_leaf=lambda x: isinstance(x, Strings))
    returned[:] = [isinstance(leaf, Strings) for leaf in leaves]
    return tuple(array for leaf in leaves
                 for array in ((leaf.data, leaf.lengths) if isinstance(leaf, Strings) else (leaf,)))


def _host(value, what: str) -> np.ndarray:
    """C{value} as a host array of the dtype JAX will trace it with (64-bit
    types narrowed unless JAX runs 64-bit), which must be a served datatype."""
    import jax

    array = np.asarray(value)
    array = array.astype(jax.dtypes.canonicalize_dtype(array.dtype), copy=False)
    try:
        datatype_of(array.dtype)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return array


def _export_symbolic(export, sizes: tuple[int, ...], fixed: int):
    """The program exported with a symbolic batch dimension, when JAX can
    export C{fn} so and the program then runs at every one of C{sizes}; else
    None."""
    import jax

    (batch,) = jax.export.symbolic_shape(BATCH)
    try:
        program = export(batch)
    except Exception:
        return None
    # Dimension 0 of every output the batch, the others fixed: what a
    # manifest can describe.
    if not all(a.shape and a.shape[0] == batch and all(isinstance(d, int) for d in a.shape[1:])
               for a in program.out_avals):
        return None
    try:
        for size in sizes:
            # Tracing a call at each size checks the shapes that the symbolic
            # export could only assume (a reshape by two needs an even batch).
            shapes = jax.eval_shape(program.call, *[
                jax.ShapeDtypeStruct((size, *a.shape[1:]) if i >= fixed else a.shape, a.dtype)
                for i, a in enumerate(program.in_avals)])
            if not all(s.shape[:1] == (size,) for s in shapes):
                return None
    except Exception:
        return None
    return program


def _export_decoupled(jitted, platforms: Sequence[str], fixed: list, examples: list[np.ndarray]):
    """A decoupled model's program, of its example inputs' shapes, whole;
    every output with a first dimension of answers, the same for all."""
    import jax

    try:
        program = jax.export.export(jitted, platforms=tuple(platforms))(
            *fixed, *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in examples])
    except Exception as e:
        raise ProgramExportError(f"jax.export could not export the model: "
                                 f"{type(e).__name__}: {e}") from e
    answers = {aval.shape[0] if aval.shape else None for aval in program.out_avals}
    if len(answers) != 1 or None in answers:
        raise ValueError("a decoupled model's outputs have one row for each answer, the same "
                         "number in every output: it returns "
                         + ", ".join(f"{a.dtype}{list(a.shape)}" for a in program.out_avals))
    return program


def _export_sized(export, size: int):
    try:
        return export(size)
    except Exception as e:
        raise ProgramExportError(f"jax.export could not export the model at batch size "
                                 f"{size}: {type(e).__name__}: {e}") from e


def _check_batched(program, size: int, first) -> None:
    """Check that the program exported at batch size C{size} has the batch as
    dimension 0 of every output, and the other dimensions of C{first}'s."""
    for i, aval in enumerate(program.out_avals):
        if aval.shape[:1] != (size,):
            raise ValueError(f"output {i} has shape {list(aval.shape)} at batch size {size}: "
                             "the first dimension of every output must be the batch")
        if aval.shape[1:] != first.out_avals[i].shape[1:]:
            raise ValueError(f"output {i} has shape {list(aval.shape)} at batch size {size}, "
                             f"{list(first.out_avals[i].shape)} at {first.out_avals[i].shape[0]}: "
                             "only its first dimension, the batch, may change with the batch")


def _batched(shape: tuple) -> tuple[int, ...]:
    """A batched tensor's shape as its spec has it: -1 for the batch."""
    return (-1, *shape[1:])


def _answer(shape: tuple) -> tuple[int, ...]:
    """A decoupled model's output's shape in one answer: a row of it."""
    return tuple(shape[1:])


def _specs(avals, names: Sequence[str] | None, kind: str,
           strings: Sequence[bool] | None = None,
           dims: Callable[[tuple], tuple[int, ...]] = _batched) -> tuple[TensorSpec, ...]:
    """The specs of the program's C{avals}, in which a BYTES tensor (where
    C{strings} says; None: none is) is two: its bytes, then its lengths;
    C{dims} makes a spec's shape of its program's."""
    if strings is None:
        strings = [False] * len(avals)
    if names is None:
        names = [kind] if len(strings) == 1 else [f"{kind}{i}" for i in range(len(strings))]
    elif len(names) != len(strings):
        raise ValueError(f"{len(names)} {kind} names for {len(strings)} {kind}s")
    specs, given = [], iter(avals)
    for i, (name, is_strings) in enumerate(zip(names, strings)):
        aval = next(given)
        if not is_strings:
            try:
                specs.append(TensorSpec(name, datatype_of(aval.dtype), dims(aval.shape)))
            except ValueError as e:
                raise ValueError(f"{kind} {i}: {e}") from None
            continue
        lengths = next(given)
        if aval.dtype != DATA or lengths.dtype != LENGTHS or len(aval.shape) < 2 or (
                aval.shape[:-1] != lengths.shape):
            raise ValueError(f"{kind} {i}: a BYTES {kind} is a Strings of uint8 bytes, of its "
                             "shape and its max_length, and int32 lengths of its shape")
        specs.append(TensorSpec(name, BYTES, dims(lengths.shape), aval.shape[-1]))
    return tuple(specs)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(dir: str | os.PathLike, file: str, data: bytes) -> None:
    """
    Write C{data} to C{file} in C{dir} by renaming a complete copy over it.
    The copy gets the mode of any file its user creates (0666 less the
    umask), not a temporary file's 0600: a bundle is exported by one user
    and served by another, such as a service account in the same group.
    """
    partial = os.path.join(os.fspath(dir), f".{file}.{secrets.token_hex(8)}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        os.unlink(partial)
        raise
    os.replace(partial, os.path.join(dir, file))


def read_bundle(path: str | os.PathLike, within: str | os.PathLike | None = None) -> Bundle:
    """
    The bundle in the folder C{path}, every file checked against its manifest
    (a plain file in the folder, not a link; bounded; its SHA-256), and its
    params against their count and the datatypes served. With C{within} (a
    model repository), the folder must be in it once links are resolved. A
    BundleError says which file is wrong and how.
    """
    try:
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise BundleError(f"{path}: cannot open the bundle folder: {e.strerror}") from None
    try:
        if within is not None:
            _inside(path, folder, within)
        data, _ = _read(folder, MANIFEST, MAX_MANIFEST_BYTES)
        try:
            manifest = ModelManifest.loads(data)
        except InvalidManifest as e:
            raise BundleError(f"{MANIFEST}: {e}") from None
        programs = {}
        for program in manifest.programs:
            programs[program.file] = _verified(folder, program.file, program.sha256, MAX_PROGRAM_BYTES)
        params: list[np.ndarray] = []
        if manifest.params is not None:
            params = _params(_verified(folder, manifest.params.file, manifest.params.sha256,
                                       MAX_PARAMS_BYTES), manifest.params)
        initial: list[np.ndarray] = []
        if manifest.sequence is not None:
            described = manifest.sequence.initial
            initial = _params(_verified(folder, described.file, described.sha256,
                                        MAX_PARAMS_BYTES), described)
            for spec, leaf in zip(manifest.sequence.state, initial):
                if leaf.dtype != spec.dtype or leaf.shape != (1, *spec.shape[1:]):
                    raise BundleError(f"{described.file}: {spec.name} is {leaf.dtype}"
                                      f"{list(leaf.shape)}, one row of {spec.datatype}"
                                      f"{list(spec.shape)} in {MANIFEST}")
    finally:
        os.close(folder)
    return Bundle(manifest, programs, params, initial)


def _inside(path: str | os.PathLike, folder: int, root: str | os.PathLike) -> None:
    """Refuse the opened C{folder} unless C{path}, links resolved, is a folder
    inside C{root}: a link may rename a model within its repository, never
    lead out of it to what the operator did not put there. The folder
    opened must be the one resolved, or a link swapped meanwhile would pass."""
    resolved, top = os.path.realpath(path), os.path.realpath(root)
    if resolved == top or os.path.commonpath([resolved, top]) != top:
        raise BundleError("the model's folder is a link that leads out of the model "
                          "repository: a model's folder and files must be in it")
    try:
        named = os.stat(resolved)
    except OSError as e:
        raise BundleError(f"cannot look at the model's folder: {e.strerror}") from None
    opened = os.fstat(folder)
    if (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino):
        raise BundleError("the model's folder changed while it was read: load it again")


def _verified(folder: int, file: str, digest: str, most: int) -> bytes:
    data, actual = _read(folder, file, most)
    if actual != digest:
        raise BundleError(f"{file}: its SHA-256 is {actual}, {MANIFEST} says {digest} "
                          "(a corrupt or partly copied file: export the bundle again)")
    return data


def _read(folder: int, file: str, most: int) -> tuple[bytes, str]:
    """The bytes of the regular file C{file} directly in C{folder}, and their
    SHA-256; never a link's target, never more than C{most} bytes."""
    try:
        # O_NONBLOCK: a FIFO planted in the folder must not hang the worker.
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BundleError(f"{file}: a link; a bundle's files are plain files in its folder") from None
        raise BundleError(f"{file}: cannot open it: {e.strerror}") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BundleError(f"{file}: not a regular file")
        if info.st_size > most:
            raise BundleError(f"{file}: {info.st_size} bytes, over the {most} a bundle may hold")
        digest = hashlib.sha256()
        data = bytearray()
        while len(data) <= most:
            try:
                chunk = f.read(_CHUNK)
            except OSError as e:
                raise BundleError(f"{file}: cannot read it: {e.strerror}") from None
            if not chunk:
                break
            digest.update(chunk)
            data += chunk
        if len(data) > most:
            raise BundleError(f"{file}: grew over the {most} bytes a bundle may hold while read")
    return bytes(data), digest.hexdigest()


def _params(data: bytes, described: ParamsFile) -> list[np.ndarray]:
    import safetensors

    try:
        tensors = dict(safetensors.deserialize(data))
    except Exception as e:
        raise BundleError(f"{described.file}: not a safetensors file: {e}") from None
    names = [f"param_{i}" for i in range(described.count)]
    if set(tensors) != set(names):
        raise BundleError(f"{described.file}: holds {len(tensors)} tensors, {MANIFEST} says "
                          f"{described.count}, named param_0 to param_{described.count - 1}")
    params = []
    for name in names:
        tensor = tensors[name]
        dtype = _SAFETENSORS_DTYPES.get(tensor["dtype"])
        if dtype is None:
            raise BundleError(f"{described.file}: tensor {name} has dtype {tensor['dtype']}, "
                              "which no served datatype has")
        params.append(np.frombuffer(tensor["data"], dtype).reshape(tensor["shape"]))
    return params
