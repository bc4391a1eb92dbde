"""
The wait queue: one FIFO of requests waiting for capacity, bounded in length
(full: refused at once) and in waiting time (expired: refused). A waiter that
is cancelled, because its client went away, leaves the queue at once.

The Router, the embedded gateway and each server's admission all queue here.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Any

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
