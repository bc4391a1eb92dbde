"""
L{Owned}: the kept arrays a client made. Those it still refers to are where
its next puts go; those no longer referenced are freed on their worker, as
a C{jax.Array} is once nothing refers to it.

The last reference to a L{RemoteArray} may go on any thread and in the
middle of any code (a garbage collection runs finalizers wherever it
happens to run, the client's own request included), so its finalizer does
one thing: it puts the array's id on a C{queue.SimpleQueue}, whose C{put} is
made to be called there. The client frees what the queue holds with its
next run on the same worker (the ids join the run's C{free}), with its next
delete, or, when neither comes soon, with a delete of its own.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kcoral.client.remote import RemoteArray
from kcoral.errors import ArrayLost
from kcoral.protocol.wire import holder_of

if TYPE_CHECKING:
    from kcoral.client.exchange import RunCall

#: What L{Owned.wait} returns False for, once the client closed; and what
#: wakes it with orphans left that no request took: no array's ids either.
STOP = ""
WAKE = "*"

#: The most ids no longer referenced that one run frees in passing.
MOST_FREED_IN_PASSING = 64
#: How long after an array's last reference goes a client waits for a
#: request of its own to free it with before it sends a delete for it.
FREE_AFTER_SECONDS = 0.1


class Owned:
    """
    The kept arrays of one client: live (referenced: L{nearest}) or
    orphaned (L{orphans}, to free). Safe to use from several threads.
    """

    def __init__(self) -> None:
        #: The ids of arrays whose last reference went, put by their finalizers.
        self.orphaned: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._live: dict[str, weakref.finalize] = {}
        self._pending: dict[str, None] = {}
        self._lock = threading.Lock()

    def adopt(self, array: RemoteArray) -> None:
        """C{array} was made for the client: freed once no longer referenced."""
        finalizer = weakref.finalize(array, self.orphaned.put, array.id)
        # At exit the client is gone too: nothing would free it.
        finalizer.atexit = False
        with self._lock:
            self._live[array.id] = finalizer

    def released(self, ids: Iterable[str]) -> None:
        """The arrays of C{ids} are freed, or gone: nothing to free them for."""
        with self._lock:
            for kept in ids:
                finalizer = self._live.pop(kept, None)
                if finalizer is not None:
                    finalizer.detach()
                self._pending.pop(kept, None)

    def nearest(self) -> RemoteArray | None:
        """The live array made last: where the client's arrays are."""
        with self._lock:
            finalizers = list(self._live.values())
        for finalizer in reversed(finalizers):
            found = finalizer.peek()
            if found is not None:
                return found[0]
        return None

    def orphans(self, holder: str | None = None,
                most: int | None = MOST_FREED_IN_PASSING) -> tuple[str, ...]:
        """Up to C{most} (None: all) arrays no longer referenced, of the
        worker C{holder} (None: of any worker), now the caller's to free (or
        to give back with L{unfreed})."""
        self._drain()
        with self._lock:
            taken = tuple(kept for kept in self._pending
                          if holder is None or holder_of(kept) == holder)[:most]
            for kept in taken:
                del self._pending[kept]
            left = bool(self._pending)
        if left:
            # Orphans of other workers, which the caller leaves: its drain
            # may have taken from the queue what would wake the freer.
            self.orphaned.put(WAKE)
        return taken

    def unfreed(self, ids: Iterable[str]) -> None:
        """Orphans that L{orphans} gave out and that were not freed after all."""
        ids = list(ids)
        with self._lock:
            self._pending.update(dict.fromkeys(ids))
        if ids:
            self.orphaned.put(WAKE)

    def everything(self) -> list[str]:
        """Every array the client holds, referenced or not; none are its any more."""
        self._drain()
        with self._lock:
            ids = [*self._live, *self._pending]
            for finalizer in self._live.values():
                finalizer.detach()
            self._live.clear()
            self._pending.clear()
        return ids

    def sending(self, call: RunCall) -> None:
        """C{call} is about to be sent: it frees in passing the orphans of
        the worker it goes to, where it names one; where it names none and
        keeps outputs, it keeps them beside the client's arrays."""
        holder = call.holder
        if holder is not None:
            call.orphans = self.orphans(holder)
        elif any(call.keep):
            nearest = self.nearest()
            call.near = None if nearest is None else nearest.id

    def ran(self, call: RunCall, outputs: Any) -> None:
        """C{call} succeeded with C{outputs}: what it freed is gone, the
        arrays it kept are the client's."""
        import jax

        self.released(call.free + call.orphans)
        for leaf in jax.tree.leaves(outputs):
            if isinstance(leaf, RemoteArray):
                self.adopt(leaf)

    def failed(self, call: RunCall, error: BaseException) -> None:
        """C{call} failed with C{error}: it freed nothing but what is gone."""
        lost = error.lost if isinstance(error, ArrayLost) else []
        self.released(lost)
        self.unfreed(kept for kept in call.orphans if kept not in lost)

    def wait(self) -> bool:
        """Block until an array's last reference goes, or orphans are left
        (True; they are among the L{orphans} now), or L{STOP} is put on the
        queue (False)."""
        kept = self.orphaned.get()
        if kept == STOP:
            return False
        self._orphan([kept])
        return True

    def _drain(self) -> None:
        ids = []
        while True:
            try:
                ids.append(self.orphaned.get_nowait())
            except queue.Empty:
                break
        if STOP in ids:
            self.orphaned.put(STOP)  # for L{wait}, which ends on it
        self._orphan(ids)

    def _orphan(self, ids: list[str]) -> None:
        with self._lock:
            for kept in ids:
                # Not among the live ones: freed or released since.
                if self._live.pop(kept, None) is not None:
                    self._pending[kept] = None


def forgotten(arrays: Any, by: object) -> None:
    """C{arrays} (L{RemoteArray}s, or a structure of them) were freed
    through client C{by}: any other client that made one forgets it, which
    is not its to free any more."""
    import jax

    for array in jax.tree.leaves(arrays):
        if array.owner is not by:
            array.owner.forget(array)
