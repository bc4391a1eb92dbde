"""
L{Program}: a JAX computation exported with C{jax.export}, ready to send.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kcoral.errors import ProgramExportError
from kcoral.protocol.wire import sha256

DEFAULT_PLATFORMS = ("cpu", "cuda")


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
        the example arguments (arrays or C{jax.ShapeDtypeStruct}s).
        """
        import jax
        from jax import export

        try:
            exported = export.export(jax.jit(function), platforms=tuple(platforms))(
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
        from jax import export

        serialized = bytes(serialized)
        try:
            exported = export.deserialize(bytearray(serialized))
        except Exception as e:
            raise ProgramExportError(f"not a serialized jax.export program: {e}") from e
        return cls(serialized, exported, sha256(serialized))

    @property
    def platforms(self) -> tuple[str, ...]:
        return tuple(self.exported.platforms)

    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[np.ndarray]:
        """
        The flat input arrays, checked against the program's signature so that a
        mistake is reported here and not by the server.
        """
        import jax

        leaves, tree = jax.tree.flatten((tuple(args), dict(kwargs)))
        if tree != self.exported.in_tree:
            raise ValueError(
                f"arguments have structure {tree}, the program expects {self.exported.in_tree}")
        arrays = []
        for i, (leaf, aval) in enumerate(zip(leaves, self.exported.in_avals)):
            array = np.asarray(leaf)
            if array.dtype != aval.dtype:
                raise ValueError(f"input {i} has dtype {array.dtype}, the program expects {aval.dtype}")
            expected = aval.shape
            if len(array.shape) != len(expected) or any(
                    isinstance(d, int) and d != s for d, s in zip(expected, array.shape)):
                raise ValueError(f"input {i} has shape {array.shape}, the program expects {expected}")
            arrays.append(array)
        return arrays

    def unflatten_outputs(self, outputs: list[np.ndarray]):
        import jax

        return jax.tree.unflatten(self.exported.out_tree, outputs)


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
