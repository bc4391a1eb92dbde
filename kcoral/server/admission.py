"""
Admission: at most C{capacity} runs at once on this server, the rest waiting in
a bounded L{WaitQueue}.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, succeed

from kcoral.common.queue import WaitQueue


class Admission:
    def __init__(self, capacity: int, queue: WaitQueue):
        self.capacity = capacity
        self.queue = queue
        self.active = 0
        self._idle: list[Deferred] = []

    def acquire(self) -> Deferred:
        if self.active < self.capacity and not len(self.queue):
            self.active += 1
            return succeed(None)
        return self.queue.wait()

    def release(self) -> None:
        # A waiter inherits the slot; only when nobody waits does it free up.
        if not self.queue.grant_next(None):
            self.active -= 1
            if self.active == 0:
                idle, self._idle = self._idle, []
                for d in idle:
                    d.callback(None)

    def idle(self) -> Deferred:
        """Fires once nothing runs and nothing waits."""
        if self.active == 0 and not len(self.queue):
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._idle.append(d)
        return d
