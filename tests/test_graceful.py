"""
Graceful paths lose nothing, with real processes on
loopback and the chaos run's load generator (C{bench.chaos}): a node
stopped with SIGTERM under load, and a Router stopped with SIGTERM under load,
produce no 5xx and no connection closed without an answer; neither does a
supervisor killed outright (its worker drains and goes by itself).

 - The node reports that it is draining, its worker finishes the runs it
   holds, and the rest of the load goes to the other node: every request
   gets its correct 200.
 - The Router closes its port at once (a new connection is refused: the
   client raises C{ServerBusy} with reason C{unreachable} itself, no answer
   was sent), serves what it holds and what still arrives on open
   connections, each answer closing its connection, and exits 0. Every
   request sent before the SIGTERM gets its correct 200.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import signal
import time

import pytest

from bench import chaos
from bench.support.child import until
from tests.httputil import connect, fake_site

pytest.importorskip("jax")


@pytest.fixture(scope="module")
def workload():
    """Mostly long runs (0.5 and 1 s), so that a SIGTERM finds work in flight."""
    return chaos.Workload((0.5, 1.0), mix=(0.4, 0.1, 0.5))


@pytest.fixture
def deployment(tmp_path):
    """One Router and two CPU nodes at full capacity; stopped after the test.
    The Router's queue wait is long: on a busy 2-core machine, half the
    capacity with eight clients of long runs must not time out (a 503
    queue_timeout would be a 5xx, if not one due to the stop)."""
    settings = chaos.Settings(nodes=2, routers=1, clients=8, busy_timeout=30.0,
                              queue_timeout=120.0, log_dir=str(tmp_path))
    d = chaos.Deployment(settings, tmp_path)
    try:
        d.start()
        yield d
    finally:
        d.stop_all()


#: The Router's own 5xx answer to a client ("<request id> answered 503
#: <reason>"), not a node's 503 that it logged while sending the request on.
ROUTER_5XX = re.compile(r"\[kcoral\.router\.app\] \S+ answered 5\d\d")


def only_router(d: chaos.Deployment):
    """The deployment's one Router."""
    return d.router[d.names[0]]


def logs(d: chaos.Deployment) -> str:
    return "\n".join(child.tail(40) for child in d.children())


def load_on_first_node(d: chaos.Deployment, workload, requests: int):
    """Start C{requests} runs of C{workload}; once the first node runs one of
    them, the load and that node's id."""
    load = chaos.Load(d, workload, d.settings, chaos.Pacer(requests))
    load.start()
    target = d.node_ids[0]
    until(lambda: d.pool_nodes().get(target, {}).get("active", 0) >= 1, f"{target} running a program")
    return load, target


def outcomes(records) -> collections.Counter:
    return collections.Counter(r.outcome if r.outcome != "503" else f"503 {r.detail}"
                               for r in records)


@pytest.mark.slow
@pytest.mark.integration
def test_node_sigterm_under_load_loses_nothing(deployment, workload):
    """A node stopped with SIGTERM under load drains and exits 0, and every request gets its 200."""
    d = deployment
    load, target = load_on_first_node(d, workload, 60)
    node = d.node(target)
    node.signal(signal.SIGTERM)
    assert node.wait(60) == 0, logs(d)
    assert load.join(180), "the load did not finish"

    records = load.records
    assert outcomes(records) == {"ok": 60}, \
        [dataclasses.astuple(r) for r in records if r.outcome != "ok"][:10]
    # It drained with work in flight, and the Router failed nothing.
    assert node.find(re.compile(r"\[worker0\] .*draining: [1-9]\d* running")), logs(d)
    assert node.find(re.compile(r"kcoral node stopped"))
    assert not only_router(d).find(chaos.ROUTER_FAILED)
    assert not only_router(d).find(ROUTER_5XX), [m.string for _, m in only_router(d).find(ROUTER_5XX)]
    # A run the Router had already sent when the node began to drain was
    # turned away by its worker, and went on to the other node.
    turned_away = only_router(d).find(re.compile(r"turned it away with 503 (\S+)"))
    assert all(m.group(1) == "draining" for _, m in turned_away), [m.string for _, m in turned_away]
    # It deregistered (and may be forgotten already: 30 s of retention).
    assert d.pool_nodes().get(target, {"state": "gone"})["state"] == "gone"


@pytest.mark.integration
def test_router_sigterm_under_load_answers_what_it_was_sent(deployment, workload):
    """A Router stopped with SIGTERM under load answers what was sent before with 200, and no 5xx."""
    d = deployment
    # No retries: once the Router is gone, a request is refused at once.
    settings = dataclasses.replace(d.settings, busy_timeout=0.0)
    load = chaos.Load(d, workload, settings, chaos.Pacer(80))
    load.start()
    until(lambda: (d.health()[d.names[0]] or {}).get("active", 0) >= 3, "three runs in flight")
    router = only_router(d)
    terminated = time.monotonic()
    router.signal(signal.SIGTERM)
    assert router.wait(60) == 0, logs(d)
    assert load.join(180), "the load did not finish"

    records = load.records
    counts = outcomes(records)
    # No 5xx answer, nothing dropped: a 200, or (after the SIGTERM) a
    # refused connection, which the client reports as unreachable.
    assert set(counts) <= {"ok", "503 unreachable"}, \
        [dataclasses.astuple(r) for r in records if r.outcome != "ok"][:10]
    sent_before = [r for r in records if r.start < terminated]
    assert len(sent_before) >= 3
    assert all(r.outcome == "ok" for r in sent_before), \
        [dataclasses.astuple(r) for r in sent_before if r.outcome != "ok"]
    # The ones the Router held when it got the SIGTERM were answered 200
    # before it exited, and later ones were refused, not answered 503.
    drained = router.find(re.compile(r"draining: (\d+) running, (\d+) waiting"))
    assert drained and int(drained[0][1].group(1)) >= 1, logs(d)
    assert counts["503 unreachable"] >= 1
    assert not router.find(chaos.ROUTER_FAILED)
    assert not router.find(ROUTER_5XX), [m.string for _, m in router.find(ROUTER_5XX)]
    assert router.find(re.compile(r"kcoral router stopped"))


@pytest.mark.slow
@pytest.mark.integration
def test_a_worker_outlives_no_supervisor_and_finishes_its_runs(deployment, workload):
    """A worker whose supervisor is killed finishes its runs and exits; the node restarts to full capacity."""
    # A supervisor killed outright (SIGKILL, the OOM killer) cannot stop its
    # worker: the worker drains by itself (the kernel's SIGTERM on its
    # parent's death), answering what it runs, and goes; an orphan would keep
    # its port and device from the supervisor that is started again.
    d = deployment
    load, target = load_on_first_node(d, workload, 30)
    worker = d.worker_pid(target)
    d.node(target).signal(signal.SIGKILL)
    until(lambda: not chaos.pid_alive(worker), "the orphaned worker gone", timeout=30)
    assert load.join(180), "the load did not finish"
    assert outcomes(load.records) == {"ok": 30}, \
        [dataclasses.astuple(r) for r in load.records if r.outcome != "ok"][:10]
    # Started again, the node takes its id back once the old reports are stale.
    d.start_node(target)
    assert d.wait_full(60), d.health()


# -- the Router's keep-alive stop, on a fake transport ---------------------------------------

def test_stop_keep_alive_closes_each_connection_after_its_next_answer():
    """After stop_keep_alive, each connection's next answer says Connection: close and closes it."""
    from twisted.internet.task import Clock

    site = fake_site(Clock())
    idle, idle_transport = connect(site)
    idle.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert idle_transport.value().endswith(b"hello") and not idle_transport.disconnecting
    idle_transport.clear()
    arriving, arriving_transport = connect(site)
    arriving.dataReceived(b"POST /v1/run HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nabc")

    site.stop_keep_alive()
    # A request already arriving is answered, and says the connection closes.
    arriving.dataReceived(b"def")
    answer = arriving_transport.value()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"got 6")
    assert b"\r\nConnection: close\r\n" in answer and arriving_transport.disconnecting
    # So is one that comes later on an idle keep-alive connection.
    assert not idle_transport.disconnecting
    idle.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = idle_transport.value()
    assert answer.endswith(b"hello") and b"\r\nConnection: close\r\n" in answer
    assert idle_transport.disconnecting


# -- a drained server's quiet period, on a fake clock ------------------------------------------

def test_a_drained_server_closes_only_once_runs_stop_arriving():
    """A draining server finishes only once runs have stopped arriving for DRAIN_QUIET_SECONDS."""
    # A Router that has not heard of the drain sends the next run as soon as
    # the last answer frees a slot: the port stays open (answering 503
    # draining) until runs have stopped arriving for DRAIN_QUIET_SECONDS.
    from twisted.internet.task import Clock

    from kcoral.common.serverconfig import ServerConfig
    from kcoral.server.service import DRAIN_QUIET_SECONDS, ServerService

    clock = Clock()
    svc = ServerService(ServerConfig(port=0, gpus="none"), clock)
    admission = svc.app.admission
    admission.acquire()
    drained = []
    svc._drain().addCallback(drained.append)
    clock.advance(10)
    assert not drained  # a run is still running
    admission.release()
    clock.advance(DRAIN_QUIET_SECONDS * 0.8)
    assert not drained
    svc.app.last_run_at = clock.seconds()  # a late run arrives (and gets 503)
    clock.advance(DRAIN_QUIET_SECONDS * 0.8)
    assert not drained
    clock.advance(DRAIN_QUIET_SECONDS * 0.3)
    assert drained
