"""
L{Program}: a JAX computation exported with C{jax.export}, ready to send.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kcoral.errors import ProgramExportError
from kcoral.protocol.wire import sha256

DEFAULT_PLATFORMS = ("cpu", "cuda")


@attrs.frozen
class Inputs:
    """
    The flat inputs of one call as they travel: host arrays and, beside each,
    None or, for typed PRNG keys sent as their key data, their key type (the
    name of their implementation, e.g. C{"threefry2x32"}).
    """

    arrays: list[np.ndarray]
    key_types: list[str | None]


@attrs.frozen
class Program:
    """
    A serialized C{jax.export.Exported} plus what a client needs to call it:
    the input and output tree structures and the input avals.

    Build one with L{from_function}, L{from_exported} or L{from_bytes}.
    """

    serialized: bytes = attrs.field(repr=False)
    exported: Any = attrs.field(repr=False, eq=False)
    digest: str

    @classmethod
    def from_function(cls, function: Callable, *example_args,
                      platforms: Sequence[str] = DEFAULT_PLATFORMS, **example_kwargs) -> Program:
        """
        Export C{function} for C{platforms}, traced at the shapes and dtypes of
        the example arguments (arrays or C{jax.ShapeDtypeStruct}s). A
        function already under C{jax.jit} is exported as it is, with its
        C{in_shardings} and C{out_shardings}: a program for several devices.
        """
        import jax
        from jax import export

        # Wrapped again, a jitted function's shardings would be its inner
        # call's, and the program's inputs would have none.
        jitted = function if isinstance(function, jax.stages.Wrapped) else jax.jit(function)
        try:
            exported = export.export(jitted, platforms=tuple(platforms))(
                *example_args, **example_kwargs)
        except Exception as e:
            name = getattr(function, "__name__", function)
            callbacks = _host_callbacks(function, example_args, example_kwargs)
            if callbacks:
                raise ProgramExportError(
                    f"{name!r} uses host callbacks ({', '.join(callbacks)}), which jax.export "
                    "cannot serialize, so no server could run it; remove jax.debug.print, "
                    "jax.pure_callback and the like from the program") from e
            raise ProgramExportError(
                f"jax.export could not export {name!r}: {type(e).__name__}: {e}") from e
        return cls.from_exported(exported)

    @classmethod
    def from_exported(cls, exported) -> Program:
        """The program of a C{jax.export.Exported} made by the caller."""
        try:
            serialized = bytes(exported.serialize())
        except Exception as e:
            raise ProgramExportError(
                "this program cannot be serialized, so no server could run it "
                f"({type(e).__name__}: {e}); host callbacks such as jax.debug.print "
                "and custom calls without a stable export are not supported") from e
        return cls(serialized, exported, sha256(serialized))

    @classmethod
    def from_bytes(cls, serialized: bytes) -> Program:
        """The program of C{serialized}, the bytes of an earlier one's C{serialized}."""
        from jax import export

        serialized = bytes(serialized)
        try:
            exported = export.deserialize(bytearray(serialized))
        except Exception as e:
            raise ProgramExportError(f"not a serialized jax.export program: {e}") from e
        return cls(serialized, exported, sha256(serialized))

    @property
    def platforms(self) -> tuple[str, ...]:
        """The platforms it was exported for (C{"cpu"}, C{"cuda"} ...)."""
        return tuple(self.exported.platforms)

    @property
    def nr_devices(self) -> int:
        """The devices it was exported for; it runs on a worker that owns as many."""
        return int(self.exported.nr_devices)

    def flatten_inputs(self, args: tuple, kwargs: dict) -> Inputs:
        """
        The flat inputs, converted as the program's C{Exported.call}
        converts its arguments in this process (whose C{jax_enable_x64} decides
        how 64-bit values and Python scalars canonicalize) and refused where it
        refuses them, so that a mistake is reported here and not by the server.
        """
        import jax

        return self.inputs_of(*jax.tree.flatten((tuple(args), dict(kwargs))))

    def inputs_of(self, leaves: list, tree) -> Inputs:
        """L{flatten_inputs} of arguments flattened already: C{leaves} of the structure C{tree}."""
        if tree != self.exported.in_tree:
            raise ValueError(
                f"arguments have structure {tree}, the program expects {self.exported.in_tree}")
        avals = self.exported.in_avals
        converted = [_input(i, leaf, aval) for i, (leaf, aval) in enumerate(zip(leaves, avals))]
        arrays = [array for array, _ in converted]
        if any(not isinstance(d, int) for aval in avals for d in aval.shape):
            # A key's data has trailing dimensions of its own: the key's
            # shape leads.
            problem = _dimension_problem(self, tuple(a.shape[:len(v.shape)] for a, v in zip(arrays, avals)))
            if problem:
                raise ValueError(problem)
        return Inputs(arrays, [key for _, key in converted])

    def unflatten_outputs(self, outputs: list, key_types: Sequence[str | None] = ()):
        """The outputs (arrays, or what stands for them) in the program's
        structure; those with a key type (in C{key_types}, one entry per
        output) are typed PRNG keys again."""
        import jax

        if any(key_types):
            outputs = [o if k is None else jax.random.wrap_key_data(jax.numpy.asarray(o), impl=k)
                       for o, k in zip(outputs, key_types)]
        return jax.tree.unflatten(self.exported.out_tree, outputs)


def _input(index: int, leaf, expected) -> tuple[np.ndarray, str | None]:
    """One argument as the host array the program takes, with its key type
    if it is typed PRNG keys, or a ValueError."""
    import jax

    key_type = None
    if isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype == expected.dtype:
        # Already of the program's type: sent as it is, even a 64-bit array
        # from a process without x64, which could not make it a jax.Array.
        array = np.asarray(leaf)
        shape = array.shape
    else:
        try:
            # JAX's own reading of an argument: its dtype canonicalized for
            # this process's x64 setting, Python scalars weakly typed, an
            # OverflowError for a Python int that does not fit.
            aval = jax.typeof(leaf)
        except (TypeError, OverflowError) as e:
            raise ValueError(f"input {index}: {e}") from None
        dtype, shape = aval.dtype, aval.shape
        if dtype != expected.dtype:
            hint = ""
            if (isinstance(expected.dtype, np.dtype)
                    and jax.dtypes.canonicalize_dtype(expected.dtype) != expected.dtype):
                hint = (" (this process has jax_enable_x64 off: pass a numpy array "
                        f"of dtype {expected.dtype}, or enable x64)")
            raise ValueError(
                f"input {index} has dtype {dtype}, the program expects {expected.dtype}{hint}")
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            # NumPy has no key type: the keys travel as their raw key data
            # and are wrapped again, with the same implementation, by the server.
            array = np.asarray(jax.random.key_data(leaf))
            key_type = str(jax.random.key_impl(leaf))
        else:
            # The same conversion as JAX's transfer to a device: a 64-bit
            # numpy array without x64 wraps around to 32 bits; a CPU jax.Array
            # is viewed, not copied.
            array = np.asarray(leaf, dtype)
    if len(shape) != len(expected.shape) or any(
            isinstance(d, int) and d != s for d, s in zip(expected.shape, shape)):
        raise ValueError(f"input {index} has shape {shape}, the program expects {expected.shape}")
    return array, key_type


# Programs are hashed by their content, whose hash CPython keeps: a hit
# costs a lookup, where JAX's check traces the call (about a millisecond).
@functools.lru_cache(maxsize=64)
def _dimension_problem(program: Program, shapes: tuple[tuple[int, ...], ...]) -> str | None:
    """What C{Exported.call} says of a shape-polymorphic program called at
    these concrete shapes (a dimension variable below 1, two sizes for one
    variable, a constraint not met), or None when it takes them."""
    import jax

    exported = program.exported
    specs = [jax.ShapeDtypeStruct(shape, aval.dtype) for shape, aval in zip(shapes, exported.in_avals)]
    args, kwargs = jax.tree.unflatten(exported.in_tree, specs)
    # The specs have the program's own dtypes, which only x64 leaves as
    # they are.
    with jax.enable_x64(True):
        try:
            jax.eval_shape(exported.call, *args, **kwargs)
        except ValueError as e:
            return str(e)
    return None


def _host_callbacks(function: Callable, args: tuple, kwargs: dict) -> list[str]:
    """The host-callback primitives C{function} uses (for a clear message when
    C{jax.export} fails on one), or [] when it cannot be traced either."""
    import jax

    try:
        closed = jax.make_jaxpr(function)(*args, **kwargs)
    except Exception:
        return []
    found: list[str] = []

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if ("callback" in name or name == "debug_print") and name not in found:
                found.append(name)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    return found
