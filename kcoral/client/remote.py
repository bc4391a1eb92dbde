"""
L{RemoteArray}: an array a run kept on the worker that ran it.

A remote array is a reference: passed to a run, it is used where it is and
none of its bytes travel; its shape and dtype are known here, its bytes come
back only when fetched. It belongs to the client that made it, which fetches
and deletes it.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import numpy as np
from zope.interface import Interface

from kcoral.protocol.wire import Reference, decode_outputs
from kcoral.web.family import ARRAY


class IArrayOwner(Interface):
    """The client a remote array fetches and deletes itself with."""

    def fetch(array: RemoteArray) -> Any:
        """The bytes of C{array}, as a numpy array (or typed PRNG keys), or a
        Deferred of them."""

    def delete(*arrays: RemoteArray) -> Any:
        """Free C{arrays} on their worker (or a Deferred that fires once they are)."""

    def forget(*arrays: RemoteArray) -> None:
        """C{arrays} were freed through another client: not this one's to free."""


@attrs.frozen(eq=False)
class RemoteArray:
    """An array kept on a worker: C{reference} names it there."""

    reference: Reference
    owner: IArrayOwner = attrs.field(repr=False)

    @property
    def id(self) -> str:
        return self.reference.kept

    @property
    def shape(self) -> tuple[int, ...]:
        return self.reference.shape

    @property
    def dtype(self) -> np.dtype:
        """Its dtype (the key data's, for typed PRNG keys: see L{key_type})."""
        return self.reference.dtype

    @property
    def key_type(self) -> str | None:
        """The implementation of the typed PRNG keys it holds the data of, or None."""
        return self.reference.key_type

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def fetch(self):
        """Its bytes, copied back from its worker (a Deferred under L{kcoral.AsyncClient})."""
        return self.owner.fetch(self)

    def delete(self):
        """Free it on its worker (a Deferred under L{kcoral.AsyncClient})."""
        return self.owner.delete(self)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        fetched = self.fetch()
        if not isinstance(fetched, np.ndarray):
            raise TypeError("this array's client answers with Deferreds: fetch it with .fetch()")
        return fetched if dtype is None else fetched.astype(dtype)

    def placeholder(self):
        """A stand-in of its type that holds no bytes, for the signature
        check of the run it is passed to."""
        return stand_in(self.shape, self.dtype, self.key_type)


@functools.lru_cache(maxsize=256)
def stand_in(shape: tuple[int, ...], dtype: np.dtype, key_type: str | None):
    """An array of this type that holds no bytes (typed PRNG keys where
    C{key_type} names their implementation): read only, so one serves every
    run of a loop."""
    zero = np.zeros((), dtype)
    if key_type is None:
        return np.broadcast_to(zero, shape)
    import jax

    return jax.random.wrap_key_data(jax.numpy.zeros(shape, dtype), impl=key_type)


def fetched(body: bytes):
    """The array a fetch's result frame holds (typed PRNG keys again, where it held their data)."""
    (array,), (key_type,) = decode_outputs(body)
    if key_type is None:
        return array
    import jax

    return jax.random.wrap_key_data(jax.numpy.asarray(array), impl=key_type)


def keeper(tree, near: RemoteArray | None = None):
    """
    What a put of C{tree} (a pytree of arrays) runs, with C{keep=True}: the
    program that returns its first argument, and its arguments. Beside
    C{near}, the program takes that array too, and ignores it: a run that
    names a kept array goes to its worker, through any Router, so the tree
    is kept there.
    """
    import jax

    leaves, structure = jax.tree.flatten(tree)
    if any(isinstance(leaf, RemoteArray) for leaf in leaves):
        raise TypeError("put takes arrays to upload; a RemoteArray is kept already")
    avals = tuple((tuple(aval.shape), aval.dtype) for aval in map(jax.typeof, leaves))
    if near is None:
        return _keeper(structure, avals, None), (tree,)
    return _keeper(structure, avals, (near.shape, near.dtype, near.key_type)), (tree, near)


@functools.lru_cache(maxsize=64)
def _keeper(structure, avals: tuple, near: tuple | None):
    import jax

    from kcoral.program import Program

    example = jax.tree.unflatten(structure, [jax.ShapeDtypeStruct(*aval) for aval in avals])
    if near is None:
        return Program.from_function(lambda kept: kept, example)
    return Program.from_function(lambda kept, beside: kept, example, stand_in(*near))


def path_of(array: RemoteArray) -> str:
    """The route of C{array} on the service that holds it."""
    return ARRAY.path(kept=array.id)
