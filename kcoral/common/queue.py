"""
The queues of requests that wait.

The wait queue: one FIFO of requests waiting for capacity, bounded in length
(full: refused at once) and in waiting time (expired: refused). A waiter that
is cancelled, because its client went away, leaves the queue at once. The
Router, the embedded gateway and each server's admission all queue here.

The batch queue: the inferences of one batched model waiting in arrival
order to go as one batch, which both batchers (a worker's, and a Router's or
gateway's at the front) take from it. A batch is the queue's head as far as
its requests share the oldest's kind (the dimensions past the first, and
what else must match to merge) and fit the model's rows: a request is never
split, none is taken past one that does not fit, so no client's requests are
reordered.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import islice
from typing import Any, Generic, Protocol, TypeVar

from twisted.internet.base import DelayedCall
from twisted.internet.defer import Deferred, fail


class QueueFull(Exception):
    """The queue already holds its maximum number of waiters."""


class QueueTimeout(Exception):
    """The waiter did not get capacity within the queue's timeout."""


class _Waiter:
    __slots__ = ("deferred", "need", "since", "timer")
    deferred: Deferred
    timer: DelayedCall
    #: What the waiter needs of a grant (L{WaitQueue.wait}), and since when it waits.
    need: Any
    since: float


class WaitQueue:
    def __init__(self, clock, max_waiting: int, timeout_seconds: float):
        self.clock = clock
        self.max_waiting = max_waiting
        self.timeout_seconds = timeout_seconds
        self._waiters: deque[_Waiter] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    def wait(self, need: Any = None) -> Deferred:
        """
        A Deferred that fires with what L{grant_next} or L{grant} hands over,
        or fails with L{QueueFull} (at once) or L{QueueTimeout}. C{need}, what
        the waiter needs of a grant (for the Router: what its run needs), is
        what L{oldest_need} says while it waits longest, and L{oldest} shows.
        """
        if len(self._waiters) >= self.max_waiting:
            return fail(QueueFull())
        waiter = _Waiter()
        waiter.need, waiter.since = need, self.clock.seconds()
        waiter.deferred = Deferred(lambda d: self._leave(waiter))
        waiter.timer = self.clock.callLater(self.timeout_seconds, self._expire, waiter)
        self._waiters.append(waiter)
        return waiter.deferred

    def _leave(self, waiter: _Waiter) -> None:
        self._waiters.remove(waiter)
        if waiter.timer.active():
            waiter.timer.cancel()

    def _expire(self, waiter: _Waiter) -> None:
        self._waiters.remove(waiter)
        waiter.deferred.errback(QueueTimeout())

    def oldest(self, count: int) -> list[_Waiter]:
        """The C{count} oldest waiters, oldest first, each with what it
        C{need}s and C{since} when."""
        return list(islice(self._waiters, count))

    def grant(self, waiter: _Waiter, grant: Any) -> None:
        """Hand C{grant} to C{waiter}, one of L{oldest}, still waiting."""
        self._waiters.remove(waiter)
        waiter.timer.cancel()
        waiter.deferred.callback(grant)
    def oldest_need(self) -> Any:
        """The C{need} of the oldest waiter; the queue must not be empty."""
        return self._waiters[0].need

    def fail_next(self, error: Exception) -> None:
        """Fail the oldest waiter with C{error}; the queue must not be empty."""
        waiter = self._waiters.popleft()
        waiter.timer.cancel()
        waiter.deferred.errback(error)

    def grant_next(self, grant: Any) -> bool:
        """Hand C{grant} to the oldest waiter; False when nobody waits."""
        if not self._waiters:
            return False
        waiter = self._waiters.popleft()
        waiter.timer.cancel()
        waiter.deferred.callback(grant)
        return True

    def fail_all(self, error: Exception) -> None:
        while self._waiters:
            self.fail_next(error)


class Batchable(Protocol):
    """A request a L{BatchQueue} holds: its rows, and what another must
    share with it to go in one batch (None: it goes alone)."""

    @property
    def kind(self) -> tuple | None: ...

    @property
    def rows(self) -> int: ...


B = TypeVar("B", bound=Batchable)


class BatchQueue(Generic[B]):
    """The requests of one batched model waiting, oldest first, at most
    C{most_waiting} of them."""

    def __init__(self, most_waiting: int):
        self.most_waiting = most_waiting
        self._waiting: deque[B] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[B]:
        return iter(self._waiting)

    @property
    def full(self) -> bool:
        return len(self._waiting) >= self.most_waiting

    @property
    def oldest(self) -> B:
        """The request that waits longest; the queue must not be empty."""
        return self._waiting[0]

    def append(self, request: B) -> None:
        self._waiting.append(request)

    def remove(self, request: B) -> bool:
        """Take C{request} out (its client left); False when it no longer waits."""
        try:
            self._waiting.remove(request)
        except ValueError:
            return False
        return True

    def head(self, most_rows: int) -> list[B]:
        """The requests of the next batch of at most C{most_rows} rows: the
        oldest, and those behind it that share its kind and fit."""
        first = self._waiting[0]
        batch, rows = [first], first.rows
        if first.kind is None:
            return batch
        for request in islice(self._waiting, 1, None):
            if request.kind != first.kind or rows + request.rows > most_rows:
                break
            batch.append(request)
            rows += request.rows
        return batch

    def take(self, most_rows: int) -> list[B]:
        """The next batch (L{head}), out of the queue."""
        batch = self.head(most_rows)
        for _ in batch:
            self._waiting.popleft()
        return batch

    def drain(self) -> list[B]:
        """Every request waiting, out of the queue: what all of them meet."""
        waiting = list(self._waiting)
        self._waiting.clear()
        return waiting
