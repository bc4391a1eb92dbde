"""
The scheduler: hands each request a member with free capacity, or queues it.
A member never has more requests in flight than its reported capacity: the
only way to get one is a L{Lease}, and leases are counted against capacity.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, fail, succeed

from kcoral.errors import NotEnoughDevices, ServerBusy
from kcoral.router.pool import Member, Pool
from kcoral.router.queue import QueueFull, QueueTimeout, WaitQueue


class Lease:
    """One request's hold on one member's capacity; release it exactly once."""

    __slots__ = ("_scheduler", "member")

    def __init__(self, member: Member, scheduler: Scheduler):
        self.member = member
        self._scheduler: Scheduler | None = scheduler
        member.active += 1

    def release(self) -> None:
        if self._scheduler is not None:
            scheduler, self._scheduler = self._scheduler, None
            self.member.active -= 1
            scheduler.dispatch()


class Scheduler:
    def __init__(self, pool: Pool, queue: WaitQueue):
        self.pool = pool
        self.queue = queue
        self.draining = False
        self._refusing = False
        self._idle: list[Deferred] = []
        pool.on_change = self.dispatch

    def acquire(self, program: str | None = None, devices: int = 1) -> Deferred:
        """A Deferred L{Lease} on a member that owns at least C{devices}
        devices; fails with L{ServerBusy} (503) and its reason, or with
        L{NotEnoughDevices} (422) at once when no ready member owns as many.
        C{program}, a program digest, breaks ties between free members
        (L{Pool.pick})."""
        if self._refusing:
            return _busy("the router is draining", "draining")
        refusal = self._too_few(devices)
        if refusal is not None:
            return fail(refusal)
        if not len(self.queue):
            member = self.pool.pick(program, devices)
            if member is not None:
                return succeed(Lease(member, self))
        return self.queue.wait(devices).addErrback(self._refused)

    def _too_few(self, devices: int) -> NotEnoughDevices | None:
        """Why no member will run a program exported for C{devices} devices,
        or None when one may (a pool with no ready member may yet get one)."""
        most = self.pool.most_devices() if devices > 1 else None
        if most is None or devices <= most:
            return None
        return NotEnoughDevices(f"the program was exported for {devices} devices; no ready "
                                f"member owns more than {most}")

    def _refused(self, failure):
        self._check_idle()
        if failure.check(QueueFull):
            raise ServerBusy("too many requests are already waiting for capacity", reason="queue_full")
        if failure.check(QueueTimeout):
            if not self.pool.ready_nodes():
                raise ServerBusy("no node was ready while the request waited", reason="no_ready_node")
            raise ServerBusy("no capacity freed up within the queue wait timeout", reason="queue_timeout")
        return failure

    def dispatch(self) -> None:
        """Give free capacity to waiting requests, oldest first."""
        while len(self.queue):
            devices = self.queue.oldest_need()
            refusal = self._too_few(devices)
            if refusal is not None:
                # The members that owned as many are gone: waiting longer
                # would hold up every run behind this one.
                self.queue.fail_next(refusal)
                continue
            member = self.pool.pick(None, devices)
            if member is None:
                break
            self.queue.grant_next(Lease(member, self))
        self._check_idle()

    def drain(self, refuse: bool = True) -> Deferred:
        """
        Fires once no request waits or runs. With C{refuse} (a gateway, whose
        port stays open while it drains) new requests get 503 C{draining}.
        Without it (the Router, which closes its port first) a request that
        still arrives on a connection already open is served: the client sent
        it before the Router stopped accepting, and a 503 for it would be a
        5xx from a graceful stop.
        """
        self.draining = True
        self._refusing = self._refusing or refuse
        d: Deferred[None] = Deferred()
        self._idle.append(d)
        self._check_idle()
        return d

    def _check_idle(self) -> None:
        if self._idle and not len(self.queue) and self.pool.active() == 0:
            idle, self._idle = self._idle, []
            for d in idle:
                d.callback(None)


def _busy(message: str, reason: str) -> Deferred:
    d: Deferred = Deferred()
    d.errback(ServerBusy(message, reason=reason))
    return d
