"""
The Router's pool: the node state machine (joining, ready, unhealthy,
draining, incompatible, gone), retention, session conflicts and the choice of
a member, on a fake clock.
"""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from kcoral.common.queue import WaitQueue
from kcoral.common.report import parse_report
from kcoral.router.pool import (
    DRAINING,
    GONE,
    INCOMPATIBLE,
    JOINING,
    READY,
    UNHEALTHY,
    Pool,
    PoolFull,
    SessionConflict,
)
from kcoral.router.scheduler import Lease, Scheduler
from tests.fakes import RUNTIME, node_report


def report(*args, **kw):
    """A node report (L{node_report}'s arguments) parsed as the Router parses it."""
    return parse_report(node_report(*args, **kw))


class World:
    """A pool on a fake clock, with the Router's defaults unless told."""

    def __init__(self, **settings):
        self.clock = Clock()
        defaults = {"max_status_age_seconds": 5.0, "unhealthy_threshold": 3, "recovery_threshold": 2,
                    "node_retention_seconds": 600.0}
        defaults.update(settings)
        self.pool = Pool(self.clock, **defaults)

    def tick(self, seconds=1.0, *, reports=()):
        """One status-check interval: time passes, reports arrive, the pool observes."""
        self.clock.advance(seconds)
        for node_id, r in reports:
            self.pool.report(node_id, r)
        self.pool.observe()

    def ready(self, node_id="gpu-a", r=None):
        r = r or report()
        self.pool.report(node_id, r)
        for _ in range(self.pool.recovery_threshold):
            self.tick(reports=[(node_id, r)])
        node = self.pool.nodes[node_id]
        assert node.state == READY
        return node


@pytest.fixture
def world():
    return World()


# -- joining and ready ----------------------------------------------------------

def test_a_new_node_joins(world):
    """A first report makes a joining node, not yet a ready one."""
    node = world.pool.report("gpu-a", report())
    assert node.state == JOINING
    assert world.pool.ready_nodes() == []
    assert world.pool.pick() is None
    assert world.pool.capacity() == 0


@pytest.mark.parametrize("threshold", [1, 2, 4])
def test_ready_after_recovery_threshold_good_observations(threshold):
    """A node becomes ready after exactly the recovery threshold of good observations."""
    world = World(recovery_threshold=threshold)
    r = report()
    world.pool.report("gpu-a", r)
    for _ in range(threshold - 1):
        world.tick(reports=[("gpu-a", r)])
        assert world.pool.nodes["gpu-a"].state == JOINING
    world.tick(reports=[("gpu-a", r)])
    node = world.pool.nodes["gpu-a"]
    assert node.state == READY
    assert world.pool.capacity() == 2
    assert world.pool.target == ("sm_90", tuple(sorted(RUNTIME.items())))


def test_a_bad_observation_restarts_the_count(world):
    """A bad observation starts the count of good ones over."""
    world.pool.report("gpu-a", report())
    world.tick(reports=[("gpu-a", report())])
    world.tick(reports=[("gpu-a", report(healthy=False))])
    world.tick(reports=[("gpu-a", report())])
    assert world.pool.nodes["gpu-a"].state == JOINING
    world.tick(reports=[("gpu-a", report())])
    assert world.pool.nodes["gpu-a"].state == READY


def test_a_node_without_a_healthy_worker_does_not_become_ready(world):
    """A node with no healthy worker never becomes ready."""
    for _ in range(5):
        world.tick(reports=[("gpu-a", report(healthy=False))])
    assert world.pool.nodes["gpu-a"].state == JOINING
    assert world.pool.pick() is None


# -- ready -> unhealthy -> ready ---------------------------------------------------

@pytest.mark.parametrize("threshold", [1, 3])
def test_unhealthy_after_threshold_stale_observations(threshold):
    """A ready node turns unhealthy after the threshold of stale observations."""
    world = World(unhealthy_threshold=threshold)
    world.ready()
    # Reports stop: observations within max_status_age are still good.
    for _ in range(5):
        world.tick()
    assert world.pool.nodes["gpu-a"].state == READY
    for _ in range(threshold - 1):
        world.tick()
        assert world.pool.nodes["gpu-a"].state == READY
    world.tick()
    node = world.pool.nodes["gpu-a"]
    assert node.state == UNHEALTHY
    assert "stale" in node.reason
    assert world.pool.pick() is None
    assert world.pool.capacity() == 0


def test_unhealthy_after_threshold_reports_without_a_healthy_worker(world):
    """A ready node turns unhealthy after the threshold of reports without a healthy worker."""
    world.ready()
    sick = report(healthy=False)
    world.tick(reports=[("gpu-a", sick)])
    world.tick(reports=[("gpu-a", sick)])
    assert world.pool.nodes["gpu-a"].state == READY
    world.tick(reports=[("gpu-a", sick)])
    node = world.pool.nodes["gpu-a"]
    assert node.state == UNHEALTHY
    assert "no healthy worker" in node.reason


def test_an_unhealthy_node_recovers_after_recovery_threshold(world):
    """An unhealthy node is ready again after the recovery threshold."""
    world.ready()
    for _ in range(10):
        world.tick()
    assert world.pool.nodes["gpu-a"].state == UNHEALTHY
    world.tick(reports=[("gpu-a", report())])
    assert world.pool.nodes["gpu-a"].state == UNHEALTHY
    world.tick(reports=[("gpu-a", report())])
    assert world.pool.nodes["gpu-a"].state == READY
    assert world.pool.pick() is not None


def test_stale_means_older_than_max_status_age():
    """A report is stale once older than the maximum status age."""
    world = World(max_status_age_seconds=2.5, unhealthy_threshold=1)
    world.ready()
    world.tick(2.5)
    assert world.pool.nodes["gpu-a"].state == READY
    world.tick(0.01)
    assert world.pool.nodes["gpu-a"].state == UNHEALTHY


# -- draining and leaving ------------------------------------------------------------

def test_a_draining_report_takes_the_node_out_at_once(world):
    """A draining report takes the node out of scheduling at once."""
    world.ready()
    node = world.pool.report("gpu-a", report(draining=True))
    assert node.state == DRAINING
    assert world.pool.pick() is None
    assert world.pool.capacity() == 0
    for _ in range(3):
        world.tick(reports=[("gpu-a", report(draining=True))])
        assert node.state == DRAINING
        assert world.pool.pick() is None


def test_a_node_that_stops_draining_joins_again(world):
    """A node that stops draining joins again."""
    world.ready()
    world.pool.report("gpu-a", report(draining=True))
    world.tick(reports=[("gpu-a", report())])
    assert world.pool.nodes["gpu-a"].state == JOINING
    world.tick(reports=[("gpu-a", report())])
    world.tick(reports=[("gpu-a", report())])
    assert world.pool.nodes["gpu-a"].state == READY


def test_leave_makes_the_node_gone(world):
    """Deregistration makes the node gone and its members unhealthy."""
    world.ready()
    assert not world.pool.leave("gpu-a", "another session")
    assert world.pool.nodes["gpu-a"].state == READY
    assert not world.pool.leave("nobody", "s1")
    assert world.pool.leave("gpu-a", "s1")
    node = world.pool.nodes["gpu-a"]
    assert node.state == GONE
    assert world.pool.pick() is None
    world.tick()
    assert node.state == GONE


# -- retention -------------------------------------------------------------------------

def test_a_gone_node_is_forgotten_after_retention():
    """A gone node is forgotten after the retention time."""
    world = World(node_retention_seconds=60)
    world.ready()
    world.pool.leave("gpu-a", "s1")
    world.tick(59)
    assert "gpu-a" in world.pool.nodes
    world.tick(1)
    assert "gpu-a" not in world.pool.nodes


def test_the_pool_refuses_node_ids_beyond_its_bound_until_one_is_forgotten():
    """New node ids beyond the pool's bound are refused until one is forgotten."""
    world = World(node_retention_seconds=60, max_nodes=2)
    world.ready("gpu-a")
    world.pool.report("gpu-b", report("s2"))
    with pytest.raises(PoolFull, match="tracks 2 nodes"):
        world.pool.report("gpu-c", report("s3"))
    # Known ids still report, also with a new session (a restarted supervisor).
    world.pool.report("gpu-a", report())
    world.pool.leave("gpu-b", "s2")
    world.pool.report("gpu-b", report("s4"))
    world.pool.leave("gpu-b", "s4")
    world.tick(60, reports=[("gpu-a", report())])
    assert sorted(world.pool.nodes) == ["gpu-a"]
    assert world.pool.report("gpu-c", report("s3")).state == JOINING


def test_a_silent_node_is_forgotten_retention_after_its_last_report():
    """A silent node is forgotten the retention time after its last report."""
    world = World(node_retention_seconds=60)
    world.ready()
    last_report = world.clock.seconds()
    while world.clock.seconds() - last_report < 59:
        world.tick()
    assert world.pool.nodes["gpu-a"].state == UNHEALTHY
    world.tick()
    assert "gpu-a" not in world.pool.nodes
    assert world.pool.counts() == dict.fromkeys(world.pool.counts(), 0)


def test_a_node_with_requests_in_flight_is_kept_past_retention():
    """A silent node with requests in flight outlives the retention time."""
    world = World(node_retention_seconds=60)
    scheduler = Scheduler(world.pool, WaitQueue(world.clock, 10, 1800))
    world.ready()
    lease = _lease(scheduler)
    for _ in range(120):
        world.tick()
    assert world.pool.nodes["gpu-a"].state == UNHEALTHY
    assert world.pool.nodes["gpu-a"].active == 1
    lease.release()
    world.tick()
    assert "gpu-a" not in world.pool.nodes


def test_a_gone_node_with_requests_in_flight_is_kept_until_they_end():
    """A gone node with requests in flight is kept until they end."""
    world = World(node_retention_seconds=60)
    scheduler = Scheduler(world.pool, WaitQueue(world.clock, 10, 1800))
    world.ready()
    lease = _lease(scheduler)
    world.pool.leave("gpu-a", "s1")
    world.tick(600)
    assert world.pool.nodes["gpu-a"].state == GONE
    lease.release()
    world.tick()
    assert "gpu-a" not in world.pool.nodes


# -- compatibility ----------------------------------------------------------------------

def test_a_node_with_another_gpu_target_is_incompatible(world):
    """A node with another GPU target than the pool's is incompatible."""
    world.ready("gpu-a")
    other = report(gpu_target="sm_80", host="10.0.0.2")
    world.pool.report("gpu-b", other)
    world.tick(reports=[("gpu-a", report()), ("gpu-b", other)])
    world.tick(reports=[("gpu-a", report()), ("gpu-b", other)])
    node = world.pool.nodes["gpu-b"]
    assert node.state == INCOMPATIBLE
    assert "sm_80" in node.reason and "sm_90" in node.reason
    assert world.pool.capacity() == 2
    picked = {_take(world.pool).node.node_id for _ in range(2)}
    assert picked == {"gpu-a"}
    assert world.pool.pick() is None  # gpu-a is full and gpu-b never takes work
    assert world.pool.counts()[INCOMPATIBLE] == 1


def test_a_node_with_another_runtime_is_incompatible(world):
    """A node with another runtime than the pool's is incompatible."""
    world.ready("gpu-a")
    other = report(runtime=dict(RUNTIME, jax="0.4.31"), host="10.0.0.2")
    world.pool.report("gpu-b", other)
    world.tick(reports=[("gpu-a", report()), ("gpu-b", other)])
    world.tick(reports=[("gpu-a", report()), ("gpu-b", other)])
    node = world.pool.nodes["gpu-b"]
    assert node.state == INCOMPATIBLE
    assert "runtime" in node.reason and "0.4.31" in node.reason


def test_a_compatible_second_node_becomes_ready(world):
    """A second node that matches the pool becomes ready."""
    world.ready("gpu-a")
    world.ready("gpu-b", report(host="10.0.0.2"))
    assert world.pool.capacity() == 4
    assert len(world.pool.ready_nodes()) == 2


def test_the_pool_target_comes_from_the_first_ready_node(world):
    """The pool's target is its first ready node's, and resets when none is left."""
    first = report(gpu_target="sm_80", host="10.0.0.2")
    world.ready("gpu-b", first)
    assert world.pool.target[0] == "sm_80"
    second = report()
    world.pool.report("gpu-a", second)
    world.tick(reports=[("gpu-a", second), ("gpu-b", first)])
    world.tick(reports=[("gpu-a", second), ("gpu-b", first)])
    assert world.pool.nodes["gpu-a"].state == INCOMPATIBLE


# -- sessions -----------------------------------------------------------------------------

def test_a_second_live_session_with_the_same_node_id_is_refused(world):
    """A second live session for a node id is refused."""
    world.ready()
    with pytest.raises(SessionConflict):
        world.pool.report("gpu-a", report(session="s2"))
    node = world.pool.nodes["gpu-a"]
    assert node.session == "s1" and node.state == READY


def test_a_stale_session_can_be_taken_over(world):
    """A stale session's node id can be taken over."""
    world.ready()
    world.clock.advance(5.01)
    node = world.pool.report("gpu-a", report(session="s2", host="10.0.0.9"))
    assert node.session == "s2"
    assert node.state == JOINING
    assert [m.url for m in node.members.values()] == ["http://10.0.0.9:8000"]


def test_a_gone_session_can_be_taken_over_at_once(world):
    """A gone session's node id can be taken over at once."""
    world.ready()
    world.pool.leave("gpu-a", "s1")
    node = world.pool.report("gpu-a", report(session="s2"))
    assert node.session == "s2" and node.state == JOINING


def test_a_takeover_keeps_the_accounting_of_requests_in_flight(world):
    """A takeover keeps the accounting of the requests in flight."""
    scheduler = Scheduler(world.pool, WaitQueue(world.clock, 10, 1800))
    world.ready()
    lease = _lease(scheduler)
    world.clock.advance(6)
    node = world.pool.report("gpu-a", report(session="s2"))
    assert node.state == JOINING and node.active == 1
    lease.release()
    assert node.active == 0


# -- picking --------------------------------------------------------------------------------

def test_pick_is_least_loaded_and_never_beyond_capacity(world):
    """pick() takes the least loaded member and never goes beyond capacity."""
    world.ready("gpu-a", report(capacities=(2, 4)))
    for _ in range(6):
        member = _take(world.pool)
        assert member.active <= member.capacity
    members = world.pool.nodes["gpu-a"].members
    assert members["worker0"].active == 2 and members["worker1"].active == 4
    assert world.pool.pick() is None


def test_pick_prefers_the_member_with_the_lowest_load(world):
    """pick() prefers the member with the lowest load relative to its capacity."""
    world.ready("gpu-a", report(capacities=(4, 4)))
    members = world.pool.nodes["gpu-a"].members
    members["worker0"].active = 3
    members["worker1"].active = 1
    assert world.pool.pick() is members["worker1"]
    members["worker1"].active = 3
    members["worker0"].active = 2
    assert world.pool.pick() is members["worker0"]


def test_pick_spreads_ties(world):
    """pick() spreads ties among equally loaded members."""
    world.ready("gpu-a")
    world.ready("gpu-b", report(host="10.0.0.2"))
    first, second = world.pool.pick(), world.pool.pick()
    assert {first.node.node_id, second.node.node_id} == {"gpu-a", "gpu-b"}


def test_pick_skips_suspect_and_unhealthy_members(world):
    """pick() skips suspect and unhealthy members."""
    world.ready("gpu-a", report(capacities=(2, 2, 2), healthy=(True, True, False)))
    members = world.pool.nodes["gpu-a"].members
    members["worker0"].suspect = True
    for _ in range(5):
        assert world.pool.pick() is members["worker1"]
    # The next report clears the suspicion.
    world.pool.report("gpu-a", report(capacities=(2, 2, 2), healthy=(True, True, False)))
    assert not members["worker0"].suspect
    assert world.pool.pick() is members["worker0"]


def test_pick_skips_nodes_that_are_not_ready(world):
    """pick() skips members of nodes that are not ready."""
    world.ready("gpu-a")
    world.pool.report("gpu-b", report(host="10.0.0.2"))  # joining
    world.pool.report("gpu-a", report(draining=True))
    assert world.pool.pick() is None


def test_a_member_with_zero_capacity_gets_no_work(world):
    """A member with zero capacity gets no work."""
    world.ready("gpu-a", report(capacities=(0, 1)))
    assert _take(world.pool).name == "worker1"
    assert world.pool.pick() is None


# -- members come and go ----------------------------------------------------------------------

def test_a_worker_that_disappears_from_the_report_is_dropped(world):
    """A worker missing from a report is dropped."""
    world.ready("gpu-a", report(capacities=(2, 2)))
    world.pool.report("gpu-a", report())
    assert list(world.pool.nodes["gpu-a"].members) == ["worker0"]


def test_a_departed_worker_with_requests_in_flight_keeps_its_accounting(world):
    """A departed worker with requests in flight keeps their accounting."""
    scheduler = Scheduler(world.pool, WaitQueue(world.clock, 10, 1800))
    world.ready("gpu-a", report(capacities=(1, 1)))
    leases = [_lease(scheduler), _lease(scheduler)]
    world.pool.report("gpu-a", report(capacities=(1,)))
    node = world.pool.nodes["gpu-a"]
    assert node.active == 2
    assert not node.members["worker1"].healthy
    for lease in leases:
        lease.release()
    assert node.active == 0


def test_a_worker_that_moves_to_another_url_keeps_its_accounting(world):
    """A restarted worker may listen on another port: the requests still in
    flight on its old address must still be counted, and their release must
    free the capacity again."""
    scheduler = Scheduler(world.pool, WaitQueue(world.clock, 10, 1800))
    world.ready("gpu-a", report(capacities=(1,)))
    lease = _lease(scheduler)
    node = world.pool.report("gpu-a", report(capacities=(1,), port=8100))
    assert node.members["worker0"].url == "http://10.0.0.1:8100"
    assert node.active == 1
    assert world.pool.pick() is None  # still full
    lease.release()
    assert node.active == 0
    assert world.pool.pick() is node.members["worker0"]


def _take(pool):
    """Pick a member and count one request on it, as a Lease does."""
    member = pool.pick()
    assert member is not None, "no capacity was free"
    member.active += 1
    return member


def _lease(scheduler) -> Lease:
    leases = []
    scheduler.acquire().addCallback(leases.append)
    assert len(leases) == 1, "no capacity was free"
    return leases[0]


def test_static_members_are_never_stale_and_have_no_session(world):
    """Members set first hand are ready without reports, never stale, never taken over."""
    node = world.pool.set_static("local", report().workers, gpu_target="sm_90", runtime={})
    assert node.static and node.session is None and node.report is None
    for _ in range(world.pool.recovery_threshold):
        world.clock.advance(3600)
        world.pool.observe()
    assert node.state == READY and world.pool.capacity() == 2
    with pytest.raises(SessionConflict):
        world.pool.report("local", report("s1"))
