"""The client's memory of its large inputs' digests (L{kcoral.client.digests})."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kcoral.client.digests import InputDigests
from kcoral.protocol.wire import sha256

jax = pytest.importorskip("jax")


class CountingDigests(InputDigests):
    """Counts the arrays it actually hashes (with the real sha256)."""

    def __init__(self, maxsize: int = 1024):
        super().__init__(maxsize, hasher=self._count)
        self.hashed = 0

    def _count(self, array):
        self.hashed += 1
        return sha256(array)


def test_a_jax_array_is_hashed_once():
    digests = CountingDigests()
    weights = jax.numpy.arange(1 << 16, dtype=np.float32)
    first = digests.digest(weights, np.asarray(weights))
    assert digests.digest(weights, np.asarray(weights)) == first == sha256(np.asarray(weights))
    assert digests.hashed == 1


def test_a_numpy_array_is_hashed_every_time_as_it_may_have_changed():
    digests = CountingDigests()
    weights = np.zeros(1 << 16, np.float32)
    before = digests.digest(weights, weights)
    weights[0] = 1
    after = digests.digest(weights, weights)
    assert before != after == sha256(weights)
    assert digests.hashed == 2


def test_an_array_that_took_a_collected_arrays_id_is_hashed_again():
    digests = CountingDigests()
    old = jax.numpy.zeros(1 << 14, np.float32)
    old_id = id(old)
    digests.digest(old, np.asarray(old))
    del old
    gc.collect()
    # Whatever array now has that id (or none does), the memo must not
    # hand out the old digest for a different array.
    for _ in range(200):
        new = jax.numpy.ones(1 << 14, np.float32)
        if id(new) == old_id:
            break
    assert digests.digest(new, np.asarray(new)) == sha256(np.asarray(new))
    assert digests.hashed == 2


def test_the_memo_is_bounded():
    digests = CountingDigests(maxsize=2)
    arrays = [jax.numpy.full(16, i, np.float32) for i in range(3)]
    for a in arrays:
        digests.digest(a, np.asarray(a))
    assert len(digests._memo) == 2
    digests.digest(arrays[0], np.asarray(arrays[0]))  # evicted: hashed again
    assert digests.hashed == 4
