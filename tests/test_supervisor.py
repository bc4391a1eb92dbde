"""
The supervisor's service tree in process, on a fake process reactor: the
order in which its children start, and the order in which they stop (the
gateway drains before the workers get SIGTERM; the Router hears of the drain
first and of the departure last).
"""

from __future__ import annotations

import sys

from kcoral.common.announce import URL_FD
from kcoral.common.serverconfig import ServerConfig
from kcoral.node.config import NodeConfig
from kcoral.node.devices import WorkerSpec
from kcoral.node.supervisor import SupervisorService, worker_argv
from tests.fakes import FakeOutgoing, ProcessReactor

ROUTER = "http://127.0.0.1:9000"
NODE_URL = ROUTER + "/v1/nodes/gpu-a"
HEALTHY = {"status": "ok", "capacity": 2, "active": 0, "gpu_target": "cpu", "runtime": {}}
SPECS = [WorkerSpec("worker0", 0, None), WorkerSpec("worker1", 1, None)]


def supervisor(**settings):
    reactor, outgoing = ProcessReactor(), FakeOutgoing()
    node = SupervisorService(NodeConfig(cpu_workers=2, **settings),
                             ServerConfig(port=0, gpus="none"), reactor, SPECS, [0, 0],
                             "2 CPU worker(s)", outgoing=outgoing)
    return node, reactor, outgoing.servers, outgoing


UNDER_A_ROUTER = {"router": ROUTER, "node_id": "gpu-a"}


def serve(node, reactor, servers):
    """Start the node; each worker announces its URL and answers healthy."""
    node.privilegedStartService()
    node.startService()
    for i, process in enumerate(reactor.processes):
        url = f"http://127.0.0.1:{8001 + i}"
        process.write_to(URL_FD, url.encode() + b"\n")
        servers.answer(url + "/health", 200, HEALTHY)
    reactor.advance(2)


def test_children_start_reporter_or_workers_then_gateway():
    """Standalone the children are the workers then the gateway; under a Router, reporter then
    workers; either way the heap settles last, once the gateway's objects exist."""
    node, _, _, _ = supervisor()
    assert [type(c).__name__ for c in node] == ["MultiService", "Gateway", "SettledHeap"]
    node, _, _, _ = supervisor(**UNDER_A_ROUTER)
    assert [type(c).__name__ for c in node] == ["Reporters", "MultiService", "SettledHeap"]


def test_the_gateway_serves_the_healthy_workers():
    """Once the workers answer, the gateway's pool holds both, ready."""
    node, reactor, servers, _ = supervisor()
    serve(node, reactor, servers)
    assert node.gateway.app.pool.capacity() == 4


def test_the_workers_get_sigterm_only_after_the_gateway_drained():
    """A run in flight through the gateway holds the workers' SIGTERM until it ends."""
    node, reactor, servers, outgoing = supervisor()
    serve(node, reactor, servers)
    leases = []
    node.gateway.app.scheduler.acquire().addCallback(leases.append)
    stopped = []
    node.stopService().addCallback(stopped.append)
    assert all(p.signals == [] for p in reactor.processes)
    leases[0].release()
    assert [p.signals for p in reactor.processes] == [["TERM"], ["TERM"]]
    assert not stopped and not outgoing.closed
    for process in reactor.processes:
        process.end(status=0)
    assert stopped and outgoing.closed


def test_under_a_router_draining_is_said_first_and_leaving_last():
    """The Router hears 'draining' before any SIGTERM and the DELETE after the workers exit."""
    node, reactor, servers, _ = supervisor(**UNDER_A_ROUTER)
    servers.answer(NODE_URL, 200, {"state": "ready"})
    serve(node, reactor, servers)
    node.stopService()
    puts = servers.client.sent("PUT")
    assert puts[-1]["draining"] is True
    assert all(p.signals == ["TERM"] for p in reactor.processes)
    assert "DELETE" not in servers.client.methods()
    reactor.processes[0].end(status=0)
    assert "DELETE" not in servers.client.methods()
    reactor.processes[1].end(status=0)
    assert servers.client.methods()[-1] == "DELETE"
    assert all(body["draining"] for body in servers.client.sent("PUT")[len(puts) - 1:])


def test_a_worker_change_is_reported_without_waiting_for_the_heartbeat():
    """A worker that turns healthy is reported to the Router at once."""
    node, reactor, servers, _ = supervisor(**UNDER_A_ROUTER)
    servers.answer(NODE_URL, 200, {"state": "joining"})
    serve(node, reactor, servers)
    healthy = [sum(w["healthy"] for w in body["workers"]) for body in servers.client.sent("PUT")]
    # Heartbeats alone would have sent two by now (at 0 and 2 s).
    assert healthy[-1] == 2 and len(healthy) > 2


def test_a_worker_runs_with_the_node_server_settings():
    """A worker's command line carries the node's server settings and a cache directory of its own."""
    server = ServerConfig(host="10.0.0.5", capacity=3, cache_dir="/var/cache/kcoral",
                          tls_cert="cert.pem")
    argv = worker_argv(server, SPECS[1], 8002)
    assert argv[:4] == [sys.executable, "-m", "kcoral", "server"]
    pairs = dict(zip(argv[4::2], argv[5::2], strict=True))
    assert pairs["--host"] == "10.0.0.5" and pairs["--port"] == "8002"
    assert pairs["--gpus"] == "none" and pairs["--capacity"] == "3"
    assert pairs["--cache-dir"] == "/var/cache/kcoral/worker1"
    assert pairs["--tls-cert"] == "cert.pem" and "--tls-key" not in pairs
