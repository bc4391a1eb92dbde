"""
Kept arrays: outputs of runs that stay in this worker's device memory, as
device arrays, until deleted, idle for too long, or the worker ends.

Each kept array's id starts with this worker instance's own id, drawn at
random when the worker starts: a Router sends the runs that use it here by
that part alone, and an id from an instance that is gone (a restart) names
nothing here, so it is reported lost rather than mistaken for another array.

A run that keeps its outputs reserves their bytes before it runs, so that
concurrent runs never pass C{--kept-bytes} together. The store is used from
the server's run threads and from the reactor, under one lock.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Gauge

from kcoral.errors import ArrayLost, KeptMemoryFull
from kcoral.protocol.wire import Reference, holder_of_all

#: Defaults of C{--kept-bytes} and C{--kept-idle-seconds}.
KEPT_BYTES = 1 << 30
KEPT_IDLE_SECONDS = 3600.0
#: The longest between two looks for idle arrays.
MOST_SWEEP_SECONDS = 60.0


@attrs.define(eq=False)
class Kept:
    """One kept array: the device array, the key type of key data, its
    bytes, and when a run or a fetch last used it."""

    array: Any
    key_type: str | None
    nbytes: int
    used_at: float

    def reference(self, kept: str) -> Reference:
        return Reference(kept, self.array.dtype, tuple(self.array.shape), self.key_type)


@attrs.frozen
class Reservation:
    """Bytes a run that keeps its outputs holds while it runs."""

    nbytes: int


class KeptStore:
    """
    This worker's kept arrays, at most C{limit_bytes} of them, each freed
    once unused for C{idle_seconds} (by L{expire}, which the server calls
    every L{sweep_seconds}); C{now} is the clock both are read on.
    """

    def __init__(self, limit_bytes: int = KEPT_BYTES, idle_seconds: float = KEPT_IDLE_SECONDS,
                 now: Callable[[], float] = time.monotonic):
        #: This worker instance's id, which every kept array's id starts with.
        self.instance = secrets.token_hex(8)
        self.limit_bytes = limit_bytes
        self.idle_seconds = idle_seconds
        self._now = now
        self._arrays: dict[str, Kept] = {}
        self._bytes = 0
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def sweep_seconds(self) -> float:
        """How often L{expire} should run: an idle array lives at most this
        much past C{idle_seconds}."""
        return min(self.idle_seconds, MOST_SWEEP_SECONDS)

    @property
    def count(self) -> int:
        return len(self._arrays)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def reserve(self, nbytes: int) -> Reservation:
        """Room for C{nbytes} of outputs to keep; L{KeptMemoryFull} when
        they would pass the bound, with what is kept and reserved now."""
        with self._lock:
            held = self._bytes + self._reserved
            if held + nbytes > self.limit_bytes:
                raise KeptMemoryFull(
                    f"keeping {nbytes} bytes of outputs would pass this worker's "
                    f"--kept-bytes {self.limit_bytes} ({held} kept or reserved): the run did not "
                    f"run; delete kept arrays or fetch the outputs instead")
            self._reserved += nbytes
        return Reservation(nbytes)

    def release(self, reservation: Reservation) -> None:
        """The run that reserved C{reservation} failed: nothing to keep."""
        with self._lock:
            self._reserved -= reservation.nbytes

    def keep(self, reservation: Reservation, arrays: Sequence[Any],
             key_types: Sequence[str | None]) -> list[Reference]:
        """Keep C{arrays}, the outputs the run that made C{reservation} made."""
        now = self._now()
        references = []
        with self._lock:
            self._reserved -= reservation.nbytes
            for array, key_type in zip(arrays, key_types, strict=True):
                kept = f"{self.instance}-{secrets.token_hex(8)}"
                entry = self._arrays[kept] = Kept(array, key_type, array.nbytes, now)
                self._bytes += entry.nbytes
                references.append(entry.reference(kept))
        return references

    def take(self, ids: Iterable[str]) -> dict[str, Kept]:
        """The arrays of C{ids}, marked used; L{ArraysApart} when they name
        several workers, L{ArrayLost} naming every one this worker does not
        hold."""
        ids = together(ids)
        now = self._now()
        with self._lock:
            found = {kept: self._arrays[kept] for kept in ids if kept in self._arrays}
            for entry in found.values():
                entry.used_at = now
        lost = [kept for kept in ids if kept not in found]
        if lost:
            raise lost_error(lost)
        return found

    def delete(self, ids: Iterable[str]) -> list[str]:
        """Free the arrays of C{ids} it holds; the ids of those it does not
        hold. L{ArraysApart}, freeing none, when they name several workers."""
        lost = []
        ids = together(ids)
        with self._lock:
            for kept in ids:
                entry = self._arrays.pop(kept, None)
                if entry is None:
                    lost.append(kept)
                else:
                    self._bytes -= entry.nbytes
        return lost

    def expire(self) -> int:
        """Free the arrays no run or fetch used for C{idle_seconds}; how many."""
        since = self._now() - self.idle_seconds
        with self._lock:
            idle = [kept for kept, entry in self._arrays.items() if entry.used_at <= since]
            for kept in idle:
                self._bytes -= self._arrays.pop(kept).nbytes
        return len(idle)


def together(ids: Iterable[str]) -> list[str]:
    """C{ids} without repeats; L{ArraysApart} when they name several
    workers, which no one request reaches together."""
    ids = list(dict.fromkeys(ids))
    holder_of_all(ids)
    return ids


def lost_error(lost: list[str]) -> ArrayLost:
    return ArrayLost(f"this worker does not hold kept array(s) {', '.join(lost[:8])} "
                     f"(deleted, expired, or its worker restarted)", details={"lost": lost})


def kept_metrics(store: KeptStore, registry: CollectorRegistry) -> None:
    """The store's gauges in C{registry}, read at scrape time."""
    Gauge("kcoral_kept_arrays", "Arrays kept on this worker's devices between runs",
          registry=registry).set_function(lambda: store.count)
    Gauge("kcoral_kept_bytes", "Bytes of the arrays kept on this worker's devices",
          registry=registry).set_function(lambda: store.nbytes)
