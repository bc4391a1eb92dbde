"""
The Router's scheduler and its wait queue: capacity accounting under bursts,
FIFO hand-over, the 503 reasons (queue_full, queue_timeout, no_ready_node,
draining), cancellation and draining, on a fake clock.
"""

from __future__ import annotations

import pytest
from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock

from kcoral.common.queue import WaitQueue
from kcoral.common.report import parse_report
from kcoral.errors import ServerBusy
from kcoral.router.pool import Pool
from kcoral.router.scheduler import Scheduler
from tests.fakes import node_report


def report(*capacities, host="10.0.0.1"):
    return parse_report(node_report(capacities=capacities, host=host))


class Outcome:
    """What a Deferred fired with; None while it has not."""

    def __init__(self, d):
        self.value = None
        self.failure = None
        self.fired = False
        d.addCallbacks(self._ok, self._failed)

    def _ok(self, value):
        self.fired, self.value = True, value

    def _failed(self, failure):
        self.fired, self.failure = True, failure

    @property
    def lease(self):
        assert self.fired and self.failure is None, self.failure
        return self.value

    @property
    def reason(self):
        assert self.fired and self.failure is not None, self.value
        error = self.failure.value
        assert isinstance(error, ServerBusy), self.failure
        assert error.status == 503
        assert error.message
        return error.reason


class World:
    def __init__(self, *, max_queued=1024, timeout=30.0, recovery_threshold=1):
        self.clock = Clock()
        self.pool = Pool(self.clock, recovery_threshold=recovery_threshold)
        self.queue = WaitQueue(self.clock, max_queued, timeout)
        self.scheduler = Scheduler(self.pool, self.queue)

    def node(self, node_id, *capacities, host="10.0.0.1"):
        self.pool.report(node_id, report(*capacities, host=host))
        self.pool.observe()
        assert self.pool.nodes[node_id].state == "ready"
        return self.pool.nodes[node_id]

    def acquire(self):
        return Outcome(self.scheduler.acquire())

    def in_flight(self):
        return {(m.node.node_id, m.name): m.active
                for n in self.pool.nodes.values() for m in n.members.values()}

    def check_capacity(self):
        for n in self.pool.nodes.values():
            for m in n.members.values():
                assert 0 <= m.active <= m.capacity, (n.node_id, m.name, m.active, m.capacity)


# -- capacity ------------------------------------------------------------------------

def test_a_burst_of_2000_never_exceeds_capacity():
    """A burst leases 4, queues 1024 and refuses the rest (queue_full); releases serve every waiter."""
    world = World(max_queued=1024)
    world.node("gpu-a", 4)
    outcomes = [world.acquire() for _ in range(2000)]
    leased = [o for o in outcomes if o.fired and o.failure is None]
    refused = [o for o in outcomes if o.fired and o.failure is not None]
    waiting = [o for o in outcomes if not o.fired]
    assert len(leased) == 4
    assert len(waiting) == 1024 == len(world.queue)
    assert len(refused) == 2000 - 4 - 1024
    assert {o.reason for o in refused} == {"queue_full"}
    assert world.pool.active() == 4
    world.check_capacity()
    # Every release hands the slot to exactly one waiter; capacity holds throughout.
    served = 0
    running = [o.lease for o in leased]
    while running:
        running.pop(0).release()
        world.check_capacity()
        assert world.pool.active() <= 4
        newly = [o for o in waiting if o.fired]
        waiting = [o for o in waiting if not o.fired]
        running.extend(o.lease for o in newly)
        served += len(newly)
    assert served == 1024
    assert world.pool.active() == 0 and len(world.queue) == 0


def test_a_burst_is_spread_over_nodes_and_members_within_capacity():
    """A burst fills every member of every ready node to its capacity and queues the rest."""
    world = World()
    world.node("gpu-a", 2, 3)
    world.node("gpu-b", 1, host="10.0.0.2")
    outcomes = [world.acquire() for _ in range(500)]
    assert sum(1 for o in outcomes if o.fired) == 6
    assert world.in_flight() == {("gpu-a", "worker0"): 2, ("gpu-a", "worker1"): 3,
                                 ("gpu-b", "worker0"): 1}
    assert len(world.queue) == 494


def test_capacity_freed_by_a_report_goes_to_waiters():
    """Capacity added by a node's report goes at once to the requests waiting."""
    world = World()
    world.node("gpu-a", 1)
    first, second, third = world.acquire(), world.acquire(), world.acquire()
    assert first.fired and not second.fired
    world.pool.report("gpu-a", report(3))  # the node now reports more capacity
    assert second.fired and third.fired
    assert world.in_flight() == {("gpu-a", "worker0"): 3}


def test_capacity_that_shrinks_below_the_load_is_not_refilled():
    """A member whose capacity shrank under its load gets no lease until its load is below it."""
    world = World()
    world.node("gpu-a", 4)
    leases = [world.acquire().lease for _ in range(3)]
    world.pool.report("gpu-a", report(1))  # e.g. the worker restarted with less room
    waiter = world.acquire()
    assert not waiter.fired
    leases.pop().release()
    leases.pop().release()
    assert not waiter.fired  # one still runs: the member is at its new capacity
    leases.pop().release()
    assert waiter.fired
    world.check_capacity()


def test_a_node_that_becomes_ready_serves_the_queue():
    """Waiters are served by a node as soon as it becomes ready, not while it joins."""
    world = World(recovery_threshold=2)
    waiting = [world.acquire() for _ in range(3)]
    world.pool.report("gpu-a", report(2))
    world.pool.observe()
    assert not any(o.fired for o in waiting)
    world.pool.observe()
    assert [o.fired for o in waiting] == [True, True, False]


def test_a_release_is_counted_once():
    """Releasing a lease twice frees one slot, not two."""
    world = World()
    world.node("gpu-a", 1)
    lease = world.acquire().lease
    waiter = world.acquire()
    lease.release()
    lease.release()
    assert waiter.fired
    assert world.pool.active() == 1


# -- FIFO -------------------------------------------------------------------------------

def test_waiters_are_served_in_arrival_order():
    """Waiters get freed slots one at a time, in the order they arrived."""
    world = World()
    world.node("gpu-a", 1)
    lease = world.acquire().lease
    waiting = [world.acquire() for _ in range(5)]
    order = []
    for i, o in enumerate(waiting):
        o.index = i
    while True:
        lease.release()
        newly = [o for o in waiting if o.fired and o.index not in order]
        if not newly:
            break
        assert len(newly) == 1
        order.append(newly[0].index)
        lease = newly[0].lease
    assert order == [0, 1, 2, 3, 4]


def test_a_newcomer_does_not_overtake_the_queue():
    """New capacity goes to a waiter first; a newcomer then waits for the next slot."""
    world = World()
    world.node("gpu-a", 1)
    lease = world.acquire().lease
    waiter = world.acquire()
    # Capacity appears while someone waits: the waiter gets it, not a newcomer.
    world.node("gpu-b", 1, host="10.0.0.2")
    assert waiter.fired
    newcomer = world.acquire()
    assert not newcomer.fired
    lease.release()
    assert newcomer.fired


# -- refusals -----------------------------------------------------------------------------

def test_queue_full_is_refused_at_once():
    """A request beyond the queue's length is refused at once (queue_full), the waiters untouched."""
    world = World(max_queued=2)
    world.node("gpu-a", 1)
    world.acquire()
    waiting = [world.acquire(), world.acquire()]
    refused = world.acquire()
    assert refused.reason == "queue_full"
    assert not any(o.fired for o in waiting)


def test_no_queue_at_all():
    """With no queue, a request beyond capacity is refused at once (queue_full)."""
    world = World(max_queued=0)
    world.node("gpu-a", 1)
    assert world.acquire().lease
    assert world.acquire().reason == "queue_full"


def test_queue_timeout_when_nodes_are_ready_but_busy():
    """A waiter with ready but busy nodes is refused queue_timeout at the timeout, not before."""
    world = World(timeout=30)
    world.node("gpu-a", 1)
    world.acquire()
    waiter = world.acquire()
    world.clock.advance(29.9)
    assert not waiter.fired
    world.clock.advance(0.1)
    assert waiter.reason == "queue_timeout"
    assert len(world.queue) == 0


def test_no_ready_node_after_the_wait():
    """A waiter with no ready node is refused no_ready_node at the timeout, leaving no timer."""
    world = World(timeout=30)
    waiter = world.acquire()
    assert not waiter.fired
    world.clock.advance(30)
    assert waiter.reason == "no_ready_node"
    assert world.clock.getDelayedCalls() == []


def test_no_ready_node_when_the_only_node_left_during_the_wait():
    """A waiter whose only node left while it waited is refused no_ready_node."""
    world = World(timeout=30)
    world.node("gpu-a", 1)
    world.acquire()
    waiter = world.acquire()
    world.pool.leave("gpu-a", "s1")
    world.clock.advance(30)
    assert waiter.reason == "no_ready_node"


def test_a_timed_out_slot_is_free_for_the_next_request():
    """The queue place of a waiter that timed out takes the next request, which a release serves."""
    world = World(max_queued=1, timeout=10)
    world.node("gpu-a", 1)
    lease = world.acquire().lease
    world.acquire()
    assert world.acquire().reason == "queue_full"
    world.clock.advance(10)
    late = world.acquire()
    assert not late.fired
    lease.release()
    assert late.lease.member.active == 1


# -- cancellation -------------------------------------------------------------------------

def test_cancellation_frees_the_queue_slot():
    """A cancelled waiter fails with CancelledError, frees its queue place and leaves no timer."""
    world = World(max_queued=2)
    world.node("gpu-a", 1)
    lease = world.acquire().lease
    d = world.scheduler.acquire()
    gone = Outcome(d)
    second = world.acquire()
    assert world.acquire().reason == "queue_full"
    d.cancel()
    assert gone.failure.check(CancelledError)
    assert len(world.queue) == 1
    third = world.acquire()
    assert not third.fired
    lease.release()
    assert second.fired and not third.fired
    second.lease.release()
    assert third.fired
    # No timer is left behind: not the cancelled waiter's, not the served ones'.
    assert world.clock.getDelayedCalls() == []


def test_a_cancelled_waiter_never_gets_a_lease():
    """A slot freed after a waiter was cancelled is not leased to it."""
    world = World()
    world.node("gpu-a", 1)
    lease = world.acquire().lease
    d = world.scheduler.acquire()
    d.cancel()
    d.addErrback(lambda f: f.trap(CancelledError))
    lease.release()
    assert world.pool.active() == 0


# -- draining ---------------------------------------------------------------------------------

def test_drain_fires_at_once_when_idle():
    """drain() fires at once when nothing runs or waits."""
    world = World()
    world.node("gpu-a", 1)
    drained = Outcome(world.scheduler.drain())
    assert drained.fired and drained.failure is None


def test_drain_waits_for_running_and_queued_requests():
    """drain() fires only once the running and the queued requests are done."""
    world = World()
    world.node("gpu-a", 1)
    lease = world.acquire().lease
    waiter = world.acquire()
    drained = Outcome(world.scheduler.drain())
    assert not drained.fired
    lease.release()  # the waiter gets the slot: still not idle
    assert waiter.fired and not drained.fired
    waiter.lease.release()
    assert drained.fired


def test_drain_fires_when_the_last_waiter_times_out():
    """drain() fires when its last waiter times out."""
    world = World(timeout=5)
    waiter = world.acquire()
    drained = Outcome(world.scheduler.drain())
    assert not drained.fired
    world.clock.advance(5)
    assert waiter.reason == "no_ready_node"
    assert drained.fired


def test_drain_fires_when_the_last_waiter_is_cancelled():
    """drain() fires when its last waiter is cancelled."""
    world = World()
    d = world.scheduler.acquire()
    d.addErrback(lambda f: f.trap(CancelledError))
    drained = Outcome(world.scheduler.drain())
    assert not drained.fired
    d.cancel()
    assert drained.fired


def test_draining_refuses_new_work():
    """While draining, a new request is refused (draining) and running leases are kept."""
    world = World()
    world.node("gpu-a", 4)
    lease = world.acquire().lease
    world.scheduler.drain()
    refused = world.acquire()
    assert refused.reason == "draining"
    assert world.pool.active() == 1
    lease.release()


def test_a_router_drain_serves_what_still_arrives():
    # The Router closes its port before it drains: a request that arrives on
    # a connection already open was sent before it stopped accepting.
    """drain(refuse=False) queues and serves late requests, and fires once they are done."""
    world = World()
    world.node("gpu-a", 1)
    lease = world.acquire().lease
    drained = Outcome(world.scheduler.drain(refuse=False))
    late = world.acquire()
    assert not late.fired  # queued behind the running one, not refused
    lease.release()
    assert not drained.fired
    late.lease.release()
    assert drained.fired
    assert world.scheduler.draining


@pytest.mark.parametrize("count", [1, 3])
def test_every_drain_caller_is_told(count):
    """Every caller of drain() is told when the scheduler is idle."""
    world = World()
    world.node("gpu-a", 1)
    lease = world.acquire().lease
    drains = [Outcome(world.scheduler.drain()) for _ in range(count)]
    assert not any(d.fired for d in drains)
    lease.release()
    assert all(d.fired for d in drains)
