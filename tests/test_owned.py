"""
A client's bookkeeping of the kept arrays it made (L{kcoral.client.owned}):
those referenced, where its next puts go; those whose last reference went,
queued by their finalizers and freed by the client's next request to their
worker, or given back when that request failed.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kcoral.client.owned import STOP, Owned
from kcoral.client.remote import RemoteArray
from kcoral.errors import ArrayLost
from kcoral.protocol.wire import Reference

A, B = "0123456789abcdef", "fedcba9876543210"


def made(owned: Owned, holder: str, n: int) -> RemoteArray:
    array = RemoteArray(Reference(f"{holder}-{n:016x}", np.dtype(np.float32), ()), owned)
    owned.adopt(array)
    return array


def test_the_nearest_array_is_the_live_one_made_last():
    """nearest() is the most recently made array still referenced; None once none is."""
    owned = Owned()
    first = made(owned, A, 1)
    second = made(owned, B, 2)
    assert owned.nearest() is second
    del second
    gc.collect()
    assert owned.nearest() is first
    del first
    gc.collect()
    assert owned.nearest() is None


def test_an_array_whose_last_reference_went_is_an_orphan_of_its_worker():
    """Orphans are taken by worker, once; those explicitly freed or released never are."""
    owned = Owned()
    arrays = [made(owned, A, 1), made(owned, B, 2), made(owned, A, 3), made(owned, A, 4)]
    owned.released([arrays[3].id])
    ids = [a.id for a in arrays]
    del arrays
    gc.collect()
    assert owned.orphans(B) == (ids[1],)
    assert sorted(owned.orphans(A)) == [ids[0], ids[2]]
    assert owned.orphans() == ()


def test_orphans_a_failed_run_took_along_are_freed_later_unless_lost():
    """A failed run gives its orphans back, but for those its ArrayLost says are gone."""
    owned = Owned()
    ids = [made(owned, A, n).id for n in range(3)]
    gc.collect()

    class Call:
        orphans = owned.orphans(A)
        free = ()

    assert sorted(Call.orphans) == ids
    owned.failed(Call, ArrayLost("gone", details={"lost": [ids[0]]}))
    assert sorted(owned.orphans(A)) == ids[1:]


@pytest.mark.slow
@given(st.lists(st.tuples(st.sampled_from([A, B]), st.booleans()), max_size=30))
def test_every_array_is_freed_once_whether_dropped_or_deleted(arrays):
    """Whatever is dropped or deleted, each array is freed once: as an orphan, by delete or at close."""
    owned = Owned()
    made_ = [made(owned, holder, n) for n, (holder, _) in enumerate(arrays)]
    deleted = [a.id for a, (_, delete) in zip(made_, arrays) if delete]
    owned.released(deleted)
    kept = [a for a, (_, delete) in zip(made_, arrays) if not delete][::2]
    del made_
    gc.collect()
    freed = [*owned.orphans(A, most=None), *owned.orphans(B, most=None), *owned.everything()]
    assert sorted(freed + deleted) == sorted(f"{h}-{n:016x}" for n, (h, _) in enumerate(arrays))
    assert len(set(freed)) == len(freed)
    del kept


def orphaned(owned: Owned, holder: str) -> str:
    """The id of an array of C{owned}, on C{holder}, whose last reference went."""
    array = made(owned, holder, 1)
    kept = array.id
    del array
    gc.collect()
    return kept


def test_the_freeing_thread_stops_on_the_mark():
    """wait() is True once an array is orphaned, False on STOP, which a drain leaves for it."""
    owned = Owned()
    kept = orphaned(owned, A)
    owned.orphaned.put(STOP)
    assert owned.wait() is True
    assert owned.orphans() == (kept,)
    made(owned, A, 2)
    gc.collect()
    owned.orphans()  # drains the queue, the mark put back
    assert owned.wait() is False


def test_orphans_a_run_left_wake_the_freer():
    """Orphans of another worker, drained by a run that took none of them, still wake the freeing thread."""
    owned = Owned()
    kept = orphaned(owned, B)
    assert owned.orphans(A) == ()  # a run on another worker drained the queue
    assert not owned.orphaned.empty()
    assert owned.wait() is True
    assert owned.orphans() == (kept,)
