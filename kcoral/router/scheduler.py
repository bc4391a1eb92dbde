"""
The scheduler: hands each request a member with free capacity, or queues it.
A member never has more requests in flight than its reported capacity: the
only way to get one is a L{Lease}, and leases are counted against capacity.

Waiting requests get freed capacity oldest first, as the placement rule
places them: one that would rather wait for a warmer member than take the
free one (L{kcoral.router.placement.Wait}) lets a younger request have it,
and is considered again when that wait is over.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, fail, succeed

from kcoral.common.queue import QueueFull, QueueTimeout, WaitQueue
from kcoral.errors import (
    ArrayLost,
    KCoralError,
    MissingContent,
    NotEnoughDevices,
    SequenceLost,
    ServerBusy,
)
from kcoral.router.placement import Wait
from kcoral.router.pool import Member, Pool
from kcoral.router.residency import Demand

#: Waiters, oldest first, that one dispatch offers free capacity to: a bound
#: on its work whatever the queue's length.
DISPATCH_WINDOW = 16


class Lease:
    """One request's hold on one member's capacity; release it exactly once.
    C{warm}: the member was believed to hold all the run needs. Several
    requests may hold one slot (L{share}): it is free once each has let go."""

    __slots__ = ("_holds", "_scheduler", "member", "warm")

    def __init__(self, member: Member, scheduler: Scheduler, warm: bool = False,
                 holds: list[int] | None = None):
        self.member = member
        self.warm = warm
        self._scheduler: Scheduler | None = scheduler
        if holds is None:
            holds = [0]
            member.active += 1
        holds[0] += 1
        #: The holds on its slot, this one's among them (shared with its shares).
        self._holds = holds

    def share(self) -> Lease:
        """Another hold on this one's slot, released on its own."""
        assert self._scheduler is not None, "a released lease has no slot to share"
        return Lease(self.member, self._scheduler, self.warm, self._holds)

    def release(self) -> None:
        if self._scheduler is not None:
            scheduler, self._scheduler = self._scheduler, None
            self._holds[0] -= 1
            if not self._holds[0]:
                self.member.active -= 1
                scheduler.dispatch()


class Scheduler:
    def __init__(self, pool: Pool, queue: WaitQueue):
        self.pool = pool
        self.queue = queue
        self._clock = queue.clock
        self.draining = False
        self._refusing = False
        self._idle: list[Deferred] = []
        #: The next look at waiters that chose to wait for a warmer member.
        self._recheck = None
        #: Since when a member has stood free while runs waited for warmer
        #: ones and no member has taken a run (None: not now). That time is
        #: what waiting costs beyond what the placement expected, and what
        #: it weighs against a cold placement: a run's wait while every
        #: member was busy cost nothing a cold placement would have saved,
        #: and one while warm members take runs is the wait it expected.
        self._declined_since: float | None = None
        pool.on_change = self.dispatch

    def acquire(self, demand: Demand | None = None, devices: int = 1) -> Deferred:
        """A Deferred L{Lease} on a member that owns at least C{devices}
        devices; fails with L{ServerBusy} (503) and its reason, or with
        L{NotEnoughDevices} (422) at once when no ready member owns as many.
        C{demand}, the content the run needs, decides where it goes
        (L{Pool.choose})."""
        if self._refusing:
            return _busy("draining: this service is stopping", "draining")
        refusal = self._refusal(demand, devices)
        if refusal is not None:
            return fail(refusal)
        if not len(self.queue):
            choice = self.pool.choose(((demand, devices, 0.0),))
            if isinstance(choice, tuple):
                return succeed(self._lease(choice[1], demand))
            waiting = self.queue.wait((demand, devices)).addErrback(self._refused)
            if isinstance(choice, Wait):
                self._declined(choice)
            return waiting
        waiting = self.queue.wait((demand, devices)).addErrback(self._refused)
        # Those ahead may be waiting for warmer members than a free one.
        self.dispatch()
        return waiting

    def _lease(self, member: Member, demand: Demand | None) -> Lease:
        return Lease(member, self, self.pool.residency.placed(member.held, demand))

    def _refusal(self, demand: Demand | None, devices: int) -> KCoralError | None:
        """Why no member will take a run of C{demand} exported for C{devices}
        devices (L{_too_few}), that uses arrays no member holds (L{_lost}),
        that requires content no usable member holds (a 409, so that its
        client sends it), or an inference of a model no usable member has
        ready; None when one may."""
        if demand is not None and demand.model is not None and not self.pool.serves(demand.model):
            return ServerBusy(f"no member has model {demand.model!r} ready", reason="no_ready_node")
        if demand is not None and demand.required and not self.pool.holds(demand.required):
            return MissingContent(f"no worker of this pool holds {len(demand.required)} "
                                  f"referenced upload(s)", details={"missing": list(demand.required)})
        return self._too_few(devices) or self._lost(demand)

    def _too_few(self, devices: int) -> NotEnoughDevices | None:
        """Why no member will run a program exported for C{devices} devices,
        or None when one may (a pool with no ready member may yet get one)."""
        most = self.pool.most_devices() if devices > 1 else None
        if most is None or devices <= most:
            return None
        return NotEnoughDevices(f"the program was exported for {devices} devices; no ready "
                                f"member owns more than {most}")

    def _lost(self, demand: Demand | None) -> ArrayLost | SequenceLost | None:
        """Why a run of C{demand} will never find its kept arrays or its
        sequence's state (no member reports the instance that holds them: it
        restarted, or this Router never heard of it), or None."""
        if demand is None or demand.kept is None or self.pool.holder(demand.kept) is not None:
            return None
        if demand.sequence is not None:
            return SequenceLost(f"{demand.sequence} was placed on worker instance {demand.kept}, "
                                f"which is gone")
        return ArrayLost(f"no worker of this pool holds the kept arrays of instance "
                         f"{demand.kept} (it restarted, or is gone)",
                         details={"lost": list(demand.arrays)})

    def _refused(self, failure):
        self._check_idle()
        if failure.check(QueueFull):
            raise ServerBusy("too many requests are already waiting for capacity", reason="queue_full")
        if failure.check(QueueTimeout):
            raise self.timed_out()
        return failure

    def timed_out(self) -> ServerBusy:
        """The refusal of a request that waited the queue's wait timeout."""
        if not self.pool.ready_nodes():
            return ServerBusy("no node was ready while the request waited", reason="no_ready_node")
        return ServerBusy("no capacity freed up within the queue wait timeout", reason="queue_timeout")

    def dispatch(self) -> None:
        """Give free capacity to waiting requests, as the placement rule
        chooses among the oldest."""
        while len(self.queue):
            demand, devices = self.queue.oldest_need()
            refusal = self._refusal(demand, devices)
            if refusal is not None:
                # The members that owned as many, or its kept arrays, are
                # gone: waiting longer would hold up every run behind this one.
                self.queue.fail_next(refusal)
                continue
            now = self._clock.seconds()
            idle = 0.0 if self._declined_since is None else now - self._declined_since
            waiters = self.queue.oldest(DISPATCH_WINDOW)
            choice = self.pool.choose((*w.need, idle) for w in waiters)
            if isinstance(choice, Wait):
                self._declined(choice)
                break
            if choice is None:
                self._declined_since = None
                break
            index, member = choice
            self.queue.grant(waiters[index], self._lease(member, waiters[index].need[0]))
            if self._declined_since is not None:
                self._declined_since = now
        if not len(self.queue):
            self._declined_since = None
        self._check_idle()

    def _declined(self, wait: Wait) -> None:
        """A free member was left for a warmer one: dispatch again when the
        first waiting run's patience is spent, or sooner if already due."""
        now = self._clock.seconds()
        if self._declined_since is None:
            self._declined_since = now
        due = now + wait.seconds
        if self._recheck is not None and self._recheck.active():
            if self._recheck.getTime() <= due:
                return
            self._recheck.cancel()
        self._recheck = self._clock.callLater(wait.seconds, self.dispatch)

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
