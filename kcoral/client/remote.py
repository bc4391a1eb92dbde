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
        zero = np.zeros((), self.dtype)
        if self.key_type is None:
            return np.broadcast_to(zero, self.shape)
        import jax

        return jax.random.wrap_key_data(jax.numpy.zeros(self.shape, self.dtype), impl=self.key_type)


def fetched(body: bytes):
    """The array a fetch's result frame holds (typed PRNG keys again, where it held their data)."""
    (array,), (key_type,) = decode_outputs(body)
    if key_type is None:
        return array
    import jax

    return jax.random.wrap_key_data(jax.numpy.asarray(array), impl=key_type)


@functools.lru_cache(maxsize=64)
def identity(shape: tuple[int, ...], dtype: np.dtype):
    """The program that returns its one input, of this shape and dtype: a
    run of it that keeps its output uploads an array to keep."""
    import jax

    from kcoral.program import Program

    return Program.from_function(lambda x: x, jax.ShapeDtypeStruct(shape, dtype))


def path_of(array: RemoteArray) -> str:
    """The route of C{array} on the service that holds it."""
    return ARRAY.path(kept=array.id)
