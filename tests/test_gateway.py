"""
The embedded gateway in process, on a memory reactor: its workers are the
static members of its pool, never stale, and its port closes when it stops.
"""

from __future__ import annotations

import pytest
from twisted.internet.testing import MemoryReactorClock

from kcoral.common.report import NodeReport, WorkerReport
from kcoral.node.gateway import NODE, Gateway
from kcoral.router.pool import READY, SessionConflict
from kcoral.router.service import RouterConfig

WORKERS = (WorkerReport("worker0", "http://127.0.0.1:8001", True, 2, 0),
           WorkerReport("worker1", "http://127.0.0.1:8002", True, 2, 0))


def gateway():
    reactor = MemoryReactorClock()
    return Gateway(RouterConfig(port=0, unhealthy_threshold=1, recovery_threshold=1), reactor), reactor


def test_healthy_workers_are_ready_members_at_once():
    """An update with healthy workers makes them ready members with their capacity."""
    g, _ = gateway()
    g.update(WORKERS, gpu_target="cpu", runtime={"kcoral": "1"})
    node = g.app.pool.nodes[NODE]
    assert node.state == READY and node.static and node.report is None
    assert sorted(node.members) == ["worker0", "worker1"]
    assert g.app.pool.capacity() == 4 and node.gpu_target == "cpu"


def test_static_members_are_never_stale():
    """Without reports, the gateway's members stay ready past any status age."""
    g, reactor = gateway()
    g.update(WORKERS, gpu_target="cpu", runtime={})
    reactor.advance(3600)
    g.app.pool.observe()
    assert g.app.pool.nodes[NODE].state == READY


def test_a_worker_that_turns_unhealthy_leaves_the_capacity():
    """An update that says a worker is unhealthy takes its capacity away."""
    g, _ = gateway()
    g.update(WORKERS, gpu_target="cpu", runtime={})
    g.update((WORKERS[0], WorkerReport("worker1", WORKERS[1].url, False, 0, 0)),
             gpu_target="cpu", runtime={})
    assert g.app.pool.capacity() == 2


def test_no_supervisor_can_claim_the_gateway_node():
    """A report over HTTP for the gateway's own node id is a conflict."""
    g, _ = gateway()
    g.update(WORKERS, gpu_target="cpu", runtime={})
    with pytest.raises(SessionConflict):
        g.app.pool.report(NODE, NodeReport("intruder", WORKERS, "cpu", {}))


def test_the_gateway_listens_at_privileged_start_and_closes_on_stop():
    """The port is bound before the reactor runs, and a stopped gateway has drained."""
    g, reactor = gateway()
    g.privilegedStartService()
    assert len(reactor.tcpServers) == 1 and g.listener.url.startswith("http://")
    g.startService()
    stopped = []
    g.stopService().addCallback(stopped.append)
    assert stopped and not g.running
