"""
The failure rows of the status-code table, with real processes on loopback and
real JAX: a Router with a one-place queue in front of two CPU nodes of
capacity 1 (shared by this module): 503 C{queue_full} and C{queue_timeout},
a queued client that leaves frees its place;
a worker that stops answering (SIGSTOP) is replaced, TERM then KILL; a worker
killed with SIGKILL mid-request is a 502 and the supervisor restores it; a
node stopped with SIGTERM under load loses no request and exits 0; a Router
stopped with SIGTERM finishes its in-flight request, exits 0, and after a
restart on the same port the nodes come back by themselves.

The tests run in file order and share the deployment; the last one restarts
its Router.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import deferLater
from twisted.web.client import HTTPConnectionPool

from kcoral import AsyncClient, NodeFailure, ServerBusy
from kcoral.protocol.wire import REQUEST_CONTENT_TYPE
from tests.harness import until
from tests.httputil import post_run, request
from tests.test_routed import (
    Deployment,
    pool_nodes,
    quick_program,
    router_health,
    spin_seconds,
    start_node,
    start_router,
    until_ready,
)
from tests.test_server import metrics, run_frame, sample
from tests.test_server_lifecycle import check_spun

pytestmark = pytest.mark.integration

jax = pytest.importorskip("jax")

#: The Router's wait for capacity (the queue_timeout row).
QUEUE_WAIT = 1.0
#: Failed probes before a restart, and the grace of a fresh worker: long
#: enough for a worker to import JAX on a busy machine.
FAILURE_THRESHOLD = 3
STARTUP_GRACE = 10.0
TERMINATION_GRACE = 0.5
NODE_OPTIONS = ("--capacity", "1", "--failure-threshold", str(FAILURE_THRESHOLD),
                "--startup-grace-seconds", str(STARTUP_GRACE),
                "--termination-grace-seconds", str(TERMINATION_GRACE))


@pytest_twisted.async_fixture(scope="module")
async def deployment(module_processes):
    router = await start_router(module_processes, "--max-queued-requests", "1",
                                "--queue-wait-timeout-seconds", str(QUEUE_WAIT),
                                name="f-router")
    a, b = await gatherResults([
        Deferred.fromCoroutine(start_node(module_processes, router.url, node_id, *NODE_OPTIONS))
        for node_id in ("f-a", "f-b")], consumeErrors=True)
    await until_ready(router, "f-a", "f-b")
    return Deployment(router, {"f-a": a, "f-b": b})


async def run_codes(router) -> dict:
    """The Router's /v1/run answers so far, by status code."""
    samples = await metrics(router)
    return {code: sample(samples, "kcoral_http_requests_total", route="/v1/run", code=code)
            for code in ("200", "500", "502", "503")}


async def worker_active(url: str) -> int:
    answer = await request("GET", url + "/health", timeout=10)
    return answer.json["active"]


async def served_by(url: str) -> float:
    return sample(await metrics_at(url), "kcoral_http_requests_total", route="/v1/run", code="200")


async def metrics_at(url: str) -> dict:
    from tests.harness import RunningService

    return await metrics(RunningService(None, url, int(url.rsplit(":", 1)[1])))


async def both_nodes_serve(deployment, spin, tag: str) -> None:
    """Two runs at once, each taking long enough that both are in flight
    together: with capacity 1 per node, each node serves one."""
    program, rate, x = spin
    urls = {n: node.worker_url for n, node in deployment.nodes.items()}
    before = {n: await served_by(u) for n, u in urls.items()}
    client = AsyncClient(deployment.router.url, busy_timeout=30)
    try:
        results = await gatherResults([
            client.run(program, spin_seconds(rate, 0.5), x, request_id=f"{tag}-{i}")
            for i in range(2)], consumeErrors=True)
    finally:
        await client.close()
    for result in results:
        check_spun(result, x)
    after = {n: await served_by(u) for n, u in urls.items()}
    assert all(after[n] - before[n] == 1 for n in urls), (before, after)


# -- the queue ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_queue_full_and_queue_timeout(deployment, spin):
    """A full queue answers 503 queue_full, a queued wait ends as queue_timeout, a leaver frees its place."""
    program, rate, x = spin
    router = deployment.router
    quick = quick_program()
    client = AsyncClient(router.url, busy_timeout=0)
    try:
        # Both nodes (capacity 1 each) run a slow program...
        slow = [client.run(program, spin_seconds(rate, 4), x, request_id=f"fill-{i}") for i in range(2)]
        await until(lambda: _health_at_least(router, "active", 2), "two runs in flight")
        # ...one more request takes the one place in the Router's queue...
        waiting = client.run(quick, np.float32(1), request_id="waits-1")
        outcome = []
        waiting.addBoth(outcome.append)
        await until(lambda: _health_at_least(router, "queued", 1), "one run queued")
        started = reactor.seconds()

        # ...so the next is refused at once: 503 queue_full, with Retry-After.
        answer = await post_run(router.url, run_frame(quick, [np.float32(1)]), request_id="full-1")
        assert answer.code == 503 and answer.header("Retry-After") is not None
        info = answer.error()
        assert info["type"] == "server_busy" and info["reason"] == "queue_full"
        with pytest.raises(ServerBusy) as refused:
            await client.run(quick, np.float32(1), request_id="full-2")
        assert refused.value.reason == "queue_full" and refused.value.request_id == "full-2"
        assert not outcome, "the queued request ended early"

        # The queued request's wait for capacity expires: 503 queue_timeout.
        await until(lambda: outcome, "the queued request's answer", QUEUE_WAIT + 10)
        [error] = outcome
        assert isinstance(error.value, ServerBusy), error
        assert error.value.reason == "queue_timeout" and error.value.request_id == "waits-1"
        assert reactor.seconds() - started < QUEUE_WAIT + 5

        # A queued request whose client goes away frees its place at once.
        gone = await leave_once(router, run_frame(quick, [np.float32(1)]), "leaves-1",
                                lambda: _health_at_least(router, "queued", 1), "queued")
        assert len(gone) == 1 and (await router_health(router))["queued"] == 0
        assert not any(d.called for d in slow), "the slow programs ended too soon"

        # The running programs are not affected.
        for result in await gatherResults(slow, consumeErrors=True):
            check_spun(result, x)
    finally:
        await client.close()
    for rid, reason in (("full-1", "queue_full"), ("full-2", "queue_full"), ("waits-1", "queue_timeout")):
        await router.process.wait_for_line(rf"{rid} answered 503 {reason}", 10)
    # None of the refused requests reached a node.
    for node in deployment.nodes.values():
        assert not node.process.matching(r"(full-\d|waits-1|leaves-1)")
    health = await router_health(router)
    assert health["active"] == 0 and health["queued"] == 0


@pytest_twisted.ensureDeferred
async def test_a_client_that_leaves_mid_run_cancels_the_forwarded_request(deployment, spin):
    """A client that leaves mid-run frees its lease at once, and the worker drops the answer."""
    program, rate, x = spin
    router = deployment.router
    marks = {n: node.process.mark() for n, node in deployment.nodes.items()}
    router_mark = router.process.mark()

    async def running():
        # Not the Router's count: it counts a run active once it holds a
        # lease, before the worker has read it (and a worker says nothing of
        # a request whose body never came).
        return any([await worker_active(node.worker_url) for node in deployment.nodes.values()])

    gone = await leave_once(router, run_frame(program, [spin_seconds(rate, 2), x]), "leaves-2",
                            running, "running on a worker")
    # Its lease is released at once...
    assert len(gone) == 1 and (await router_health(router))["active"] == 0
    # ...and the Router closed its request to the node: the worker finishes
    # the run (a device cannot be interrupted) and drops the answer.
    dropped = r"\[worker0\] .*leaves-2 answer dropped: the client went away"

    async def ran_on():
        return [n for n, node in deployment.nodes.items()
                if node.process.matching(dropped, since=marks[n])]

    assert len(await until(ran_on, "the worker's dropped answer", 15)) == 1
    assert not router.process.matching(r"leaves-2 (answered|failed on)", since=router_mark)


async def leave_once(router, frame: bytes, rid: str, where, what: str) -> list:
    """Send a run on a connection of its own, wait until C{where()} says it
    is C{what}, then go away, and wait for the Router to log that; the
    failures the client saw (one)."""
    mark = router.process.mark()
    leaving = treq.post(router.url + "/v1/run", data=frame,
                        headers={"Content-Type": REQUEST_CONTENT_TYPE, "X-Request-ID": rid},
                        pool=HTTPConnectionPool(reactor, persistent=False))
    gone: list = []
    leaving.addErrback(gone.append)
    await until(where, f"{rid} {what}")
    leaving.cancel()
    await router.process.wait_for_line(rf"{rid} cancelled: the client went away", 10, since=mark)
    return gone


async def _health_at_least(router, what: str, count: int):
    return (await router_health(router))[what] >= count


# -- supervisor recovery -----------------------------------------------------------------------

@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_unresponsive_worker_is_replaced(deployment, spin):
    """A worker stopped with SIGSTOP fails its probes, is killed after the grace and restarted."""
    node = deployment.nodes["f-a"]
    router = deployment.router
    supervisor = node.process
    # Probes only count once the worker is past its startup grace.
    past_grace = node.worker_started_at() + STARTUP_GRACE + 1.5
    await deferLater(reactor, max(0.0, past_grace - time.time()), lambda: None)

    pid, old_url = node.worker_pid, node.worker_url
    mark, router_mark = supervisor.mark(), router.process.mark()
    os.kill(pid, signal.SIGSTOP)
    exited = rf"worker0 exited with signal {int(signal.SIGKILL)}"
    try:
        await supervisor.wait_for_line(
            rf"worker0 is being restarted: {FAILURE_THRESHOLD} failed health probes in a row", 30,
            since=mark)
        # SIGTERM cannot reach a stopped process: SIGKILL follows the grace.
        await supervisor.wait_for_line(rf"worker0 did not stop within {TERMINATION_GRACE}s: SIGKILL",
                                       10, since=mark)
        await supervisor.wait_for_line(exited, 10, since=mark)
    finally:
        if not supervisor.matching(exited, since=mark):
            os.kill(pid, signal.SIGCONT)  # not reaped yet: the pid is still ours
    await supervisor.wait_for_line(r"worker0 started \(pid \d+\)", 30, since=mark)
    await supervisor.wait_for_line(r"worker0 is ready at", 60, since=mark)
    assert node.worker_pid != pid
    # One restart, logged once with its reason.
    assert len(supervisor.matching(r"worker0 is being restarted", since=mark)) == 1
    # The Router took the node out while it had no healthy worker...
    await router.process.wait_for_line(r"node f-a: ready -> unhealthy", 10, since=router_mark)
    # ...and service resumes, on both nodes.
    nodes = await until_ready(router, "f-a", "f-b")
    assert nodes["f-a"]["workers"][0]["url"] == node.worker_url
    await both_nodes_serve(deployment, spin, "after-stop")
    assert supervisor.running and old_url  # the supervisor itself went on


@pytest_twisted.ensureDeferred
async def test_sigkill_mid_request_is_a_502_then_the_node_recovers(deployment, spin):
    """A worker killed mid-request is a 502, never retried; the supervisor restarts it and runs succeed."""
    program, rate, x = spin
    router = deployment.router
    codes = await run_codes(router)
    client = AsyncClient(router.url, busy_timeout=30)
    try:
        running = client.run(program, spin_seconds(rate, 5), x, request_id="killed-1")
        outcome = []
        running.addBoth(outcome.append)

        # Find the node that runs it, and wait until its worker is running it.
        async def victim():
            for node_id, info in (await pool_nodes(router)).items():
                if info["active"]:
                    return deployment.nodes[node_id]

        node = await until(victim, "the node running killed-1")
        await until(lambda: worker_active(node.worker_url), "killed-1 running on the worker")
        pid = node.worker_pid
        mark, router_mark = node.process.mark(), router.process.mark()
        os.kill(pid, signal.SIGKILL)

        await until(lambda: outcome, "the answer to killed-1", 30)
        [error] = outcome
        assert isinstance(error.value, NodeFailure), error
        assert error.value.status == 502 and error.value.request_id == "killed-1"
        await router.process.wait_for_line(rf"killed-1 failed on {node.node_id}/worker0", 10,
                                           since=router_mark)
        # Restored by the supervisor...
        await node.process.wait_for_line(
            rf"worker0 exited with signal {int(signal.SIGKILL)}; restarting in", 10, since=mark)
        await node.process.wait_for_line(r"worker0 is ready at", 60, since=mark)
        assert node.worker_pid != pid
        await until_ready(router, "f-a", "f-b")
        # ...and the next request succeeds.
        check_spun(await client.run(program, spin_seconds(rate, 0.1), x, request_id="after-kill"), x)
    finally:
        await client.close()
    await both_nodes_serve(deployment, spin, "after-kill")
    # Never retried, by the Router or by the client.
    assert len(router.process.matching(r"killed-1 ")) == 1
    after = await run_codes(router)
    assert after["502"] - codes["502"] == 1 and after["500"] == codes["500"]


# -- a node stopped under load ---------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_node_stopped_under_load_loses_no_request(deployment, module_processes, spin):
    """A node stopped with SIGTERM under load drains, exits 0 and fails no request."""
    program, rate, x = spin
    router = deployment.router
    node = await start_node(module_processes, router.url, "f-c", *NODE_OPTIONS)
    await until_ready(router, "f-a", "f-b", "f-c")
    codes = await run_codes(router)
    clients = [AsyncClient(router.url, busy_timeout=60) for _ in range(3)]
    n = spin_seconds(rate, 0.6)
    done = []

    async def load(client, index):
        for i in range(4):
            result = await client.run(program, n, x, request_id=f"load-{index}-{i}")
            check_spun(result, x)
            done.append(result)

    try:
        loads = gatherResults([Deferred.fromCoroutine(load(c, i)) for i, c in enumerate(clients)],
                              consumeErrors=True)
        # Stop the node while its worker runs a program.
        await until(lambda: worker_active(node.worker_url), "f-c running a program")
        mark, router_mark = node.process.mark(), router.process.mark()
        node.process.signal("TERM")
        assert await node.process.exited(60) == 0
        await loads
    finally:
        for client in clients:
            await client.close()
    assert len(done) == 12
    # It drained: the run in flight was answered, then it left.
    await node.process.wait_for_line(r"\[worker0\] .*draining: 1 running", 1, since=mark)
    assert node.process.matching(r"kcoral node stopped", since=mark)
    assert router.process.matching(r"node f-c: ready -> draining", since=router_mark)
    # No request failed: a 503 (a wait in the Router's queue that expired
    # while the pool was one node short) is retried by the client.
    assert not router.process.matching(r"load-\d-\d (failed on|answered 50[0-2])")
    after = await run_codes(router)
    assert after["200"] - codes["200"] >= 12
    assert after["500"] == codes["500"] and after["502"] == codes["502"]
    nodes = await pool_nodes(router)
    assert nodes["f-c"]["state"] == "gone" and nodes["f-c"]["active"] == 0


# -- a Router restart ------------------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_router_restart(deployment, module_processes, spin):
    """A Router stopped with SIGTERM answers its run in flight and exits 0; the nodes rejoin its successor."""
    program, rate, x = spin
    old = deployment.router
    client = AsyncClient(old.url, busy_timeout=0)
    try:
        running = client.run(program, spin_seconds(rate, 3), x, request_id="in-flight")
        await until(lambda: _health_at_least(old, "active", 1), "a run in flight")
        mark = old.process.mark()
        marks = {n: node.process.mark() for n, node in deployment.nodes.items()}
        old.process.signal("TERM")
        await old.process.wait_for_line(r"draining: 1 running", 10, since=mark)
        # It takes no new work: a new connection is refused, or answered 503
        # draining (the request never reaches a node).
        try:
            answer = await post_run(old.url, run_frame(quick_program(), [np.float32(1)]),
                                    request_id="too-late")
        except ConnectionRefusedError:
            pass
        else:
            assert answer.code == 503 and answer.error()["reason"] == "draining", answer
        assert not running.called, "the in-flight program ended too soon"
        # The in-flight request is answered, then the Router exits 0.
        check_spun(await running, x)
        assert await old.process.exited(30) == 0
    finally:
        await client.close()
    assert old.process.matching(r"kcoral router stopped")
    assert not any(node.process.matching("too-late") for node in deployment.nodes.values())

    # The nodes notice, and keep trying.
    for node_id, node in deployment.nodes.items():
        await node.process.wait_for_line(r"the Router is unreachable", 10, since=marks[node_id])

    new = await start_router(module_processes, "--max-queued-requests", "1",
                             "--queue-wait-timeout-seconds", str(QUEUE_WAIT),
                             name="f-router-2", port=old.port)
    deployment.router = new
    assert new.url == old.url
    # Nobody touches the nodes: they register again by themselves.
    for node_id, node in deployment.nodes.items():
        await node.process.wait_for_line(rf"registered with the Router as {node_id} ", 30,
                                         since=marks[node_id])
        await new.process.wait_for_line(rf"node {node_id}: joining -> ready", 30)
    await until_ready(new, *deployment.nodes)
    await both_nodes_serve(deployment, spin, "after-restart")
