"""
Several Routers and no shared store. The clients' failover from one URL to
the next (a scripted peer on loopback); then real processes on loopback and
real JAX: two Routers, two CPU nodes of capacity 1 that each report to both
(C{--router A,B}); runs through either Router and through a client given
both; a worker never runs more than its capacity, whichever Router sent the
runs; a worker SIGKILLed mid-run, with and without re-dispatch; and a Router
SIGKILLed under load, with clients that know both.

The integration tests share the deployment and run in file order; the last
one kills a Router.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import pytest_twisted
from twisted.internet.defer import Deferred, gatherResults

from kcoral import AsyncClient, Client, NodeFailure
from kcoral.client.exchange import Response
from kcoral.client.failover import Failover, moves_on, urls_of
from kcoral.protocol.wire import REDISPATCH_HEADER
from tests.harness import until
from tests.test_client_connection import Peer, ok
from tests.test_routed import (
    pool_nodes,
    quick_program,
    router_health,
    spin_seconds,
    start_node,
    start_router,
    until_ready,
)
from tests.test_routed_failures import worker_active
from tests.test_server_lifecycle import check_spun

_DRAINING_BODY = b'{"error": {"type": "server_busy", "message": "x", "reason": "draining"}}'
DRAINING = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(_DRAINING_BODY) + _DRAINING_BODY)


def closed_port() -> int:
    """A loopback port nothing listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_urls_of_takes_one_a_list_or_a_comma_list():
    """A client's URLs: one, a list, or a comma list as the environment has them; none is an error."""
    assert urls_of("http://a:1/") == ["http://a:1"]
    assert urls_of(["http://a:1", "http://b:2"]) == urls_of("http://a:1, http://b:2")
    with pytest.raises(ValueError):
        urls_of([])


def test_a_round_starts_with_the_current_one_and_keeps_where_it_stopped():
    """A failover round gives the current endpoint, then each other once; the last one given stays current."""
    failover = Failover(["a", "b", "c"])
    round_ = failover.round()
    assert next(round_) == "a" and next(round_) == "b"
    assert failover.current == "b"
    assert list(failover.round()) == ["b", "c", "a"]


def test_only_unreachable_or_draining_moves_on():
    """No connection and a 503 draining send the client on; a full queue or an error answer do not."""
    assert moves_on(Response(None, problem="refused"))
    assert moves_on(Response(503, _DRAINING_BODY))
    assert not moves_on(Response(503, b'{"error": {"type": "server_busy", "message": "x", '
                                      b'"reason": "queue_full"}}'))
    assert not moves_on(Response(500, b'{"error": {"type": "internal", "message": "x"}}'))


def test_the_client_goes_on_past_a_dead_url_and_a_draining_one():
    """A Client given three URLs, the first closed and the second draining, is answered by the third."""
    draining = Peer([DRAINING])
    healthy = Peer([ok(b'{"status": "ok"}', b"Content-Type: application/json")])
    urls = [f"http://127.0.0.1:{closed_port()}", f"http://127.0.0.1:{draining.port}",
            f"http://127.0.0.1:{healthy.port}"]
    with Client(urls, timeout=10) as client:
        assert client.health() == {"status": "ok"}
        assert client.url == urls[2]
    draining.join()
    healthy.join()
    assert len(draining.requests) == 1 and len(healthy.requests) == 1


def test_a_node_takes_a_comma_list_of_routers():
    """--router takes a comma list, one reporter each; one that names no URL is a usage error."""
    from twisted.python import usage

    from kcoral.taps.node import NodeOptions

    options = NodeOptions()
    options.parseOptions(["--router", "http://a:9000, http://b:9000", "--node-id", "n"])
    assert options.node_config().routers == ("http://a:9000", "http://b:9000")
    with pytest.raises(usage.UsageError, match="names no Router URL"):
        NodeOptions().parseOptions(["--router", ",", "--node-id", "n"])


def test_redispatch_is_a_header_of_each_run():
    """With redispatch=True each run carries X-KCoral-Redispatch: true; without it, no such header."""
    from kcoral.client.exchange import RunCall

    call = RunCall.prepare(quick_program(), (np.float32(1),), {})
    assert call.send(set(), None, redispatch=True).headers[REDISPATCH_HEADER] == "true"
    assert REDISPATCH_HEADER not in call.send(set(), None).headers


# -- two Routers, two nodes reporting to both -----------------------------------------------------

jax = pytest.importorskip("jax")

NODE_OPTIONS = ("--capacity", "1", "--startup-grace-seconds", "10",
                "--termination-grace-seconds", "0.5")
NODES = ("ha-a", "ha-b")


@pytest_twisted.async_fixture(scope="module")
async def routers(module_processes):
    """Routers A and B, and the nodes, each reporting to both: ([A, B], {node id: Node})."""
    both = [await start_router(module_processes, name=f"ha-router-{n}") for n in "ab"]
    nodes = await gatherResults([
        Deferred.fromCoroutine(start_node(module_processes, ",".join(r.url for r in both),
                                          node_id, *NODE_OPTIONS))
        for node_id in NODES], consumeErrors=True)
    for router in both:
        await until_ready(router, *NODES)
    return both, dict(zip(NODES, nodes, strict=True))


@pytest.mark.slow
@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_node_reports_to_every_router_and_either_runs_programs(routers):
    """Each node registers with both Routers; runs go through A, B, and a client given both."""
    both, nodes = routers
    for node in nodes.values():
        for router in both:
            assert node.process.matching(rf"registered with the Router as {node.node_id} .* at "
                                         rf"{router.url}")
    program = quick_program()
    for urls in ([both[0].url], [both[1].url], [r.url for r in both]):
        client = AsyncClient(urls, busy_timeout=30)
        try:
            assert await client.run(program, np.float32(3)) == np.float32(6)
        finally:
            await client.close()


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_together_the_routers_never_run_more_than_capacity_on_a_worker(routers, spin):
    """Four slow runs, two through each Router, on two workers of capacity 1: never two at once on one."""
    both, nodes = routers
    program, rate, x = spin
    clients = [AsyncClient(r.url, busy_timeout=60) for r in both for _ in range(2)]
    seen: list[int] = []
    try:
        runs = gatherResults([c.run(program, spin_seconds(rate, 1.5), x, request_id=f"cap-{i}")
                              for i, c in enumerate(clients)], consumeErrors=True)
        runs.addBoth(lambda result: seen.append(-1) or result)

        async def sample():
            for node in nodes.values():
                seen.append(await worker_active(node.worker_url))
            return -1 in seen

        await until(sample, "the four runs answered", 60, interval=0.1)
        for result in await runs:
            check_spun(result, x)
    finally:
        for client in clients:
            await client.close()
    assert max(seen) == 1, seen
    # The worker's own report gives each Router the load of both.
    for router in both:
        assert (await router_health(router))["active"] == 0


@pytest.mark.slow
@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_worker_killed_mid_run_is_a_502_unless_the_client_allows_redispatch(routers, spin):
    """Both workers SIGKILLed mid-run: the run without re-dispatch is a 502, the one with it is answered."""
    both, nodes = routers
    router = both[0]
    program, rate, x = spin
    plain = AsyncClient(router.url, busy_timeout=30)
    again = AsyncClient(router.url, busy_timeout=30, redispatch=True)
    try:
        outcomes: dict = {}
        for rid, client in (("plain-1", plain), ("again-1", again)):
            client.run(program, spin_seconds(rate, 4), x, request_id=rid).addBoth(
                lambda result, rid=rid: outcomes.__setitem__(rid, result))

        async def both_running():
            answer = await pool_nodes(router)
            return all(answer[n]["active"] == 1 for n in NODES)

        await until(both_running, "both runs forwarded", 30)
        for node in nodes.values():
            await until(lambda node=node: worker_active(node.worker_url), "the run on the worker")
        marks = {n: node.process.mark() for n, node in nodes.items()}
        router_mark = router.process.mark()
        for node in nodes.values():
            os.kill(node.worker_pid, signal.SIGKILL)
        await until(lambda: len(outcomes) == 2, "both answers", 90)
        assert isinstance(outcomes["plain-1"].value, NodeFailure), outcomes
        assert outcomes["plain-1"].value.status == 502
        check_spun(outcomes["again-1"], x)
    finally:
        await plain.close()
        await again.close()
    assert router.process.matching(r"again-1 re-dispatched \(1 of at most 2\)", since=router_mark)
    assert router.process.matching(r"again-1 attempt 2 -> ", since=router_mark)
    assert not router.process.matching(r"plain-1 re-dispatched", since=router_mark)
    for node_id, node in nodes.items():
        await node.process.wait_for_line(r"worker0 is ready at", 60, since=marks[node_id])
    for r in both:
        await until_ready(r, *NODES)


@pytest.mark.slow
@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_router_killed_under_load_loses_no_run(routers, spin):
    """SIGKILL of one of two Routers under load: every run of clients given both is answered, correctly."""
    both, nodes = routers
    program, rate, x = spin
    # Half the clients start with each Router; all know both.
    clients = [AsyncClient([r.url for r in (both if i % 2 else both[::-1])], busy_timeout=60,
                           redispatch=True) for i in range(4)]
    done: list = []

    async def load(client, index):
        for i in range(5):
            check_spun(await client.run(program, spin_seconds(rate, 0.3), x,
                                        request_id=f"ha-load-{index}-{i}"), x)
            done.append(i)

    try:
        loads = gatherResults([Deferred.fromCoroutine(load(c, i)) for i, c in enumerate(clients)],
                              consumeErrors=True)
        await until(lambda: len(done) >= 4, "the load under way", 60)
        both[0].process.signal("KILL")
        await loads
    finally:
        for client in clients:
            await client.close()
    assert len(done) == 20
    assert (await router_health(both[1]))["nodes"]["ready"] == 2
