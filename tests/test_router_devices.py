"""
Programs for several devices in a pool (the Router's and a gateway's, the
same code): a run goes only to a member that owns at least as many devices
as its program was exported for (the C{X-KCoral-Devices} header), waits in
the one FIFO queue like any other, and is refused at once with 422
C{not_enough_devices} when no ready member owns as many.
"""

from __future__ import annotations

import pytest

from kcoral.common.report import InvalidReport, parse_report
from kcoral.errors import NotEnoughDevices
from tests.fakes import node_report
from tests.test_router_app import Router, assert_error
from tests.test_router_scheduler import Outcome, World


def report(*devices: int, host: str = "10.0.0.1") -> dict:
    """A node report of one-slot workers owning C{devices} devices each."""
    body = node_report(capacities=(1,) * len(devices), host=host)
    for worker, count in zip(body["workers"], devices):
        worker["devices"] = count
    return body


class Pooled(World):
    def node(self, node_id, *devices, host="10.0.0.1"):
        self.pool.report(node_id, parse_report(report(*devices, host=host)))
        self.pool.observe()
        return self.pool.nodes[node_id]

    def acquire(self, devices=1):
        return Outcome(self.scheduler.acquire(None, devices))


def refusal(outcome: Outcome) -> NotEnoughDevices:
    assert outcome.fired and outcome.failure is not None, outcome.value
    error = outcome.failure.value
    assert isinstance(error, NotEnoughDevices), outcome.failure
    assert error.status == 422 and error.reason == "not_enough_devices"
    return error


def test_a_run_goes_only_to_a_member_with_enough_devices():
    """A two-device run is leased the two-device member, whichever member the placement prefers."""
    world = Pooled()
    world.node("a", 1, 1, 2, 4)
    picked = world.acquire(2).lease.member
    assert (picked.name, picked.devices) == ("worker2", 2)
    assert world.acquire(2).lease.member.name == "worker3"


def test_a_one_device_run_goes_anywhere():
    """A run without the header (one device) may take any member, however many devices it owns."""
    world = Pooled()
    world.node("a", 2, 2)
    assert {world.acquire().lease.member.name for _ in range(2)} == {"worker0", "worker1"}


def test_no_ready_member_with_enough_devices_is_a_422_at_once():
    """With no ready member owning enough devices the run is refused at once, never queued."""
    world = Pooled()
    world.node("a", 1, 1)
    error = refusal(world.acquire(2))
    assert "2 devices" in error.message and "more than 1" in error.message
    assert len(world.queue) == 0


def test_a_busy_member_with_enough_devices_is_waited_for():
    """The run waits while the member owning enough is busy; a one-device member freed does not take it."""
    world = Pooled()
    world.node("a", 1, 2)
    small, big = world.acquire().lease, world.acquire().lease
    assert big.member.devices == 2
    waiting = world.acquire(2)
    assert not waiting.fired and len(world.queue) == 1
    small.release()
    assert not waiting.fired
    big.release()
    assert waiting.lease.member is big.member


def test_the_queue_stays_first_in_first_out():
    """A run behind a waiting two-device run waits too, though a one-device member is free."""
    world = Pooled()
    world.node("a", 1, 2)
    held = [world.acquire().lease, world.acquire().lease]
    first, second = world.acquire(2), world.acquire()
    held[0].release()
    assert not first.fired and not second.fired
    held[1].release()
    assert first.lease.member.devices == 2 and second.lease.member.devices == 1


def test_a_waiting_run_is_refused_when_the_members_with_enough_devices_leave():
    """A queued two-device run is refused (422) once no ready member owns two; the runs behind it go on."""
    world = Pooled()
    world.node("a", 1)
    world.node("b", 2, host="10.0.0.2")
    held = [world.acquire().lease, world.acquire(2).lease]
    waiting, behind = world.acquire(2), world.acquire()
    world.pool.leave("b", "s1")
    world.pool.observe()
    refusal(waiting)
    held[0].release()
    assert behind.lease.member.node.node_id == "a"


def test_without_a_ready_member_the_run_waits_for_one():
    """A pool with no ready member queues a two-device run, and the first member with enough takes it."""
    world = Pooled()
    waiting = world.acquire(2)
    assert not waiting.fired
    world.node("a", 2)
    assert waiting.lease.member.devices == 2


@pytest.mark.parametrize("devices", [0, -1, 1025, "2", True])
def test_a_report_with_a_bad_device_count_is_refused(devices):
    """A worker's device count is an integer from 1 to 1024."""
    with pytest.raises(InvalidReport, match="devices"):
        parse_report(report(devices))


def test_a_report_without_a_device_count_means_one():
    """An older supervisor's report (no device count) is of one-device workers."""
    body = node_report()
    assert "devices" not in body["workers"][0]
    assert parse_report(body).workers[0].devices == 1


# -- over HTTP ---------------------------------------------------------------------

def test_the_node_list_gives_each_workers_devices():
    """GET /v1/nodes gives each worker's device count."""
    router = Router()
    router.ready("a", report(1, 2))
    _, body = router.json("GET", "/v1/nodes")
    assert [w["devices"] for w in body["nodes"][0]["workers"]] == [1, 2]


def test_a_run_for_more_devices_than_any_member_owns_is_answered_422():
    """POST /v1/run with X-KCoral-Devices above every ready member's count: a JSON 422 not_enough_devices."""
    router = Router()
    router.ready("a", report(1, 1))
    response, body = router.json("POST", "/v1/run", body=b"frame",
                                 headers={"X-KCoral-Devices": "2"})
    info = assert_error(response, body, 422, "program_rejected")
    assert info["reason"] == "not_enough_devices"


@pytest.mark.parametrize("header", ["0", "two", "+2", "1025", ""])
def test_a_bad_device_header_is_answered_400(header):
    """X-KCoral-Devices must be a count from 1 to 1024."""
    router = Router()
    router.ready("a", report(2))
    response, body = router.json("POST", "/v1/run", body=b"frame",
                                 headers={"X-KCoral-Devices": header})
    assert "X-KCoral-Devices" in assert_error(response, body, 400)["message"]
