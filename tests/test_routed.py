"""
Integration tests of routed deployments with real processes on loopback and
real JAX: a C{kcoral router} with two CPU nodes (C{kcoral server --router}),
shared by this module, serving programs; C{kcoral status}; request ids across
the Router's and the workers' logs; 413 from the Router; a second supervisor
with a node id in use (409); an empty Router
(503 C{no_ready_node}); C{twistd -n kcoral-router}; node tokens.

The failure rows of the status-code table (queue full and expired, SIGKILL and
SIGSTOP of a worker, a node stopped under load, a Router restart) are in
L{tests.test_routed_failures}, which reuses the helpers below.
"""

from __future__ import annotations

import calendar
import json
import os
import re
import sys
import time

import attrs
import numpy as np
import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.threads import deferToThread

from kcoral import AsyncClient, BadRequest, Client, Program, ProgramRejected, ServerBusy
from tests import programs
from tests.conftest import TEST_GPUS, server_args, server_env
from tests.harness import LISTENING, START_TIMEOUT, ChildProcess, RunningService, kcoral_argv, until
from tests.httputil import parse_raw, post_run, raw_exchange, request
from tests.test_server import NEW_USER_ARGUMENTS, assert_tree_close, draw, metrics, run_frame, sample

pytestmark = pytest.mark.integration

jax = pytest.importorskip("jax")

#: Router options that make state changes take a fraction of a second.
FAST_ROUTER = ("--status-check-interval-seconds", "0.2", "--max-status-age-seconds", "2",
               "--unhealthy-threshold", "3", "--recovery-threshold", "1")
#: Supervisor options: probes and heartbeats every 0.3 s, quick restarts.
FAST_NODE = ("--health-interval-seconds", "0.3", "--health-timeout-seconds", "1",
             "--restart-min-delay-seconds", "0.1", "--restart-max-delay-seconds", "1",
             "--restart-jitter", "0")
#: The body limit of this module's Router.
ROUTER_LIMIT = 1_000_000

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)")


# -- helpers shared with tests.test_routed_failures ---------------------------------------

@attrs.define
class Node:
    """A running C{kcoral server --router} (the supervisor) and its worker0."""

    process: ChildProcess
    node_id: str

    def _last(self, pattern: str) -> re.Match:
        lines = self.process.matching(pattern)
        assert lines, f"{self.node_id} never logged {pattern!r}"
        return re.search(pattern, lines[-1])

    @property
    def worker_pid(self) -> int:
        """The pid of the current worker0, from the supervisor's start line."""
        return int(self._last(r"worker0 started \(pid (\d+)\)").group(1))

    @property
    def worker_url(self) -> str:
        return self._last(r"worker0 is ready at (\S+)").group(1)

    def worker_started_at(self) -> float:
        """Wall-clock time (whole seconds) of the last worker0 start line."""
        line = self.process.matching(r"worker0 started \(pid")[-1]
        stamp = _STAMP.match(line).group(1)
        return calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))


@attrs.define
class Deployment:
    router: RunningService
    nodes: dict


def router_args(*extra: str, port: int = 0) -> list[str]:
    return ["router", "--port", str(port), *FAST_ROUTER, *extra]


async def start_router(group, *extra: str, name: str = "router", port: int = 0,
                       env: dict | None = None) -> RunningService:
    return await group.start_service(router_args(*extra, port=port), name=name, env=env)


async def start_node(group, router_url: str, node_id: str, *extra: str,
                     name: str | None = None, env: dict | None = None,
                     registered: bool = True) -> Node:
    """Start a node and wait for its worker to be ready and (unless
    C{registered} is false) for the Router to have accepted its report."""
    args = server_args("--router", router_url, "--node-id", node_id, *FAST_NODE, *extra)
    child = group.spawn(kcoral_argv(*args), name=name or node_id,
                        env={**server_env(), **(env or {})})
    try:
        await child.wait_for_line(r"worker0 is ready at", START_TIMEOUT)
        if registered:
            await child.wait_for_line(rf"registered with the Router as {re.escape(node_id)} ",
                                      START_TIMEOUT)
    except Exception:
        await child.stop()
        raise
    return Node(child, node_id)


async def pool_nodes(router) -> dict:
    """The Router's C{/v1/nodes}, by node id."""
    answer = await request("GET", router.url + "/v1/nodes", timeout=10)
    assert answer.code == 200, answer
    return {node["node_id"]: node for node in answer.json["nodes"]}


async def router_health(router) -> dict:
    answer = await request("GET", router.url + "/health", timeout=10)
    return answer.json


async def until_ready(router, *node_ids: str, timeout: float = 60.0) -> dict:
    """Wait until every node in C{node_ids} is ready with a healthy worker."""
    async def check():
        nodes = await pool_nodes(router)
        ok = all(n in nodes and nodes[n]["state"] == "ready"
                 and all(w["healthy"] for w in nodes[n]["workers"]) for n in node_ids)
        return nodes if ok else None

    return await until(check, f"nodes {node_ids} ready", timeout)


def spin_seconds(rate: float, seconds: float) -> np.int32:
    return np.int32(max(1, int(rate * seconds)))


def quick_program():
    return Program.from_function(lambda v: v * 2, np.float32(1))


def twistd_argv(*args: str) -> list[str]:
    """The C{twistd} of this interpreter's environment."""
    script = os.path.join(os.path.dirname(sys.executable), "twistd")
    if os.path.exists(script):
        return [sys.executable, script, *args]
    return [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", *args]


# -- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def affine():
    return programs.affine_program()


@pytest_twisted.async_fixture(scope="module")
async def deployment(module_processes):
    """A Router (1 MB body limit) and two CPU nodes, node-a and node-b."""
    router = await start_router(module_processes, "--max-request-bytes", str(ROUTER_LIMIT))
    a, b = await gatherResults([
        Deferred.fromCoroutine(start_node(module_processes, router.url, node_id))
        for node_id in ("node-a", "node-b")], consumeErrors=True)
    await until_ready(router, "node-a", "node-b")
    return Deployment(router, {"node-a": a, "node-b": b})


# -- a Router with two nodes ------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_two_nodes_serve_programs(deployment, affine):
    """A Router lists two ready nodes, sums their capacity, and spreads concurrent runs over both."""
    program, (w, x, b), expected = affine
    router = deployment.router
    nodes = await pool_nodes(router)
    assert set(nodes) == {"node-a", "node-b"}
    for node_id, node in nodes.items():
        assert node["state"] == "ready" and not node["draining"]
        assert node["capacity"] == 2 and node["active"] == 0
        assert set(node["runtime"]) >= {"kcoral", "jax", "jaxlib"}
        assert 0 <= node["last_report_age_seconds"] < 2
        [worker] = node["workers"]
        assert worker["url"] == deployment.nodes[node_id].worker_url
    if not TEST_GPUS:
        assert {n["gpu_target"] for n in nodes.values()} == {"cpu"}

    health = await router_health(router)
    assert health["status"] == "ok" and health["capacity"] == 4
    assert health["nodes"]["ready"] == 2 and health["gpu_target"] == nodes["node-a"]["gpu_target"]

    urls = {node_id: node.worker_url for node_id, node in deployment.nodes.items()}
    before = {n: sample(await metrics_of(u), "kcoral_http_requests_total", route="/v1/run", code="200")
              for n, u in urls.items()}
    client = AsyncClient(router.url, busy_timeout=30)
    try:
        # Eight at once: four run (two per node), four wait in the Router's queue.
        inputs = [(w, x + i, b) for i in range(8)]
        results = await gatherResults([client.run(program, *args) for args in inputs],
                                      consumeErrors=True)
    finally:
        await client.close()
    for args, result in zip(inputs, results):
        assert_tree_close(result, expected(*args))
    served = {n: sample(await metrics_of(u), "kcoral_http_requests_total", route="/v1/run", code="200")
              - before[n] for n, u in urls.items()}
    assert sum(served.values()) == 8 and all(count >= 1 for count in served.values()), served
    health = await router_health(router)
    assert health["active"] == 0 and health["queued"] == 0


@pytest_twisted.ensureDeferred
async def test_arguments_as_jax_takes_them_through_the_router(deployment):
    """numpy's 64-bit defaults, a Python float and a typed key run through a Router as in process."""
    key = jax.random.key(5)
    cases = [(lambda v: v * 2 + 1, (make(),)) for make in NEW_USER_ARGUMENTS.values()]
    cases.append((draw, (key, 2.0)))
    client = AsyncClient(deployment.router.url, busy_timeout=30)
    try:
        for function, args in cases:
            program = Program.from_function(function, *args)
            expected = jax.tree.leaves(jax.jit(program.exported.call)(*args))
            got = jax.tree.leaves(await client.run(program, *args))
            assert [g.dtype for g in got] == [e.dtype for e in expected]
            for g, e in zip(got, expected):
                if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
                    g, e = jax.random.key_data(g), jax.random.key_data(e)
                np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
    finally:
        await client.close()


async def metrics_of(url: str) -> dict:
    return await metrics(RunningService(None, url, int(url.rsplit(":", 1)[1])))


@pytest_twisted.ensureDeferred
async def test_status_command_prints_a_row_per_node(deployment, processes):
    """kcoral status prints a header, a row per ready node, and the Router's summary line."""
    child = processes.spawn(kcoral_argv("status", "--router", deployment.router.url), name="status")
    assert await child.exited(60) == 0, child.tail()
    lines = child.output.lines
    assert lines[0].split() == ["NODE", "STATE", "TARGET", "CAPACITY", "ACTIVE", "LAST", "REPORT"]
    rows = {line.split()[0]: line.split() for line in lines[1:] if line.startswith("node-")}
    assert set(rows) == {"node-a", "node-b"}
    for row in rows.values():
        assert row[1] == "ready" and row[3] == "2" and row[4] == "0" and row[-1] == "ago"
    assert child.matching(r"^router ok: capacity 4, active 0, queued 0$")


@pytest_twisted.ensureDeferred
async def test_status_json_holds_health_and_nodes(deployment, processes):
    """kcoral status --json prints one JSON object: the Router's /health and its nodes."""
    child = processes.spawn(kcoral_argv("status", "--router", deployment.router.url, "--json"),
                            name="status-json")
    assert await child.exited(60) == 0, child.tail()
    pool = json.loads("\n".join(child.output.lines))
    assert pool["health"]["status"] == "ok" and pool["health"]["capacity"] == 4
    assert sorted(node["node_id"] for node in pool["nodes"]) == ["node-a", "node-b"]
    assert {node["state"] for node in pool["nodes"]} == {"ready"}


@pytest_twisted.ensureDeferred
async def test_status_watch_prints_the_pool_until_interrupted(deployment, processes):
    """kcoral status --watch prints the table again every interval, and Ctrl+C ends it with 0."""
    child = processes.spawn(kcoral_argv("status", "--router", deployment.router.url, "--watch",
                                        "--interval", "0.2"), name="status-watch")
    summary = r"^router ok: capacity 4, active \d+, queued \d+$"
    first = await child.wait_for_line(summary, 60)
    await child.wait_for_line(summary, 30, since=child.output.lines.index(first.string) + 1)
    child.signal("INT")
    assert await child.exited(30) == 0, child.tail()
    assert len(child.matching(r"^NODE\s+STATE")) >= 2


@pytest_twisted.ensureDeferred
async def test_request_id_in_router_and_worker_logs(deployment):
    """A request id is in the worker's log lines and in the Router's line naming the node that answered."""
    router = deployment.router
    supervisors = [node.process for node in deployment.nodes.values()]
    marks = [p.mark() for p in supervisors]
    router_mark = router.process.mark()

    # A program the nodes have never seen: the worker that gets it compiles
    # it, and says so with the request id.
    fresh = Program.from_function(lambda v: jax.numpy.tanh(v) + 3.0, np.ones(5, np.float32))
    answer = await post_run(router.url, run_frame(fresh, [np.ones(5, np.float32)]),
                            program_digest=fresh.digest, request_id="trace-ok-1")
    assert answer.code == 200 and answer.request_id == "trace-ok-1"
    compiled = r"\[worker0\] .*trace-ok-1 compiled program"
    await until(_any_line(supervisors, compiled, marks), "a worker logged trace-ok-1", 10)

    # A program no node can run: the worker refuses it, and the Router names
    # the node that answered, both with the request id.
    wrong = programs.other_platform_program(TEST_GPUS)
    error = await deferToThread(_attempt, router.url, wrong, np.float32(1), request_id="trace-422")
    assert isinstance(error, ProgramRejected) and error.request_id == "trace-422"
    line = await router.process.wait_for_line(
        r"trace-422 answered 422 from (node-[ab])/worker0", 10, since=router_mark)
    node = deployment.nodes[line.group(1)]
    await node.process.wait_for_line(r"\[worker0\] .*trace-422 answered 422", 10,
                                     since=marks[supervisors.index(node.process)])


def _any_line(children, pattern, marks):
    async def check():
        return any(c.matching(pattern, since=m) for c, m in zip(children, marks))

    return check


def _attempt(url, program, *args, request_id=None):
    with Client(url, busy_timeout=0) as client:
        try:
            return client.run(program, *args, request_id=request_id)
        except Exception as e:
            return e


@pytest_twisted.ensureDeferred
async def test_413_through_the_router(deployment):
    """The Router answers 413 to a body over its limit, seen from the head alone; no node sees it."""
    router = deployment.router
    mark = router.process.mark()
    # Only the head is sent: the Router answers from Content-Length.
    head = (b"POST /v1/run HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/x-kcoral-run\r\n"
            b"X-Request-ID: router-413\r\n"
            b"Content-Length: %d\r\n\r\n" % (50 * ROUTER_LIMIT))
    raw = await deferToThread(raw_exchange, router.port, head, timeout=30)
    status, headers, body = parse_raw(raw)
    assert status == 413 and headers["x-request-id"] == "router-413"
    info = json.loads(body)["error"]
    assert info["type"] == "payload_too_large" and info["request_id"] == "router-413"
    await router.process.wait_for_line(r"router-413 refused: ", 10, since=mark)

    # The client sees BadRequest with status 413.
    # Two inputs of 0.8 MB: each under the size that goes by reference first,
    # so that the first request carries them inline.
    half = np.ones(ROUTER_LIMIT // 5, np.float32)
    program = Program.from_function(lambda a, b: a.sum() + b.sum(), half, half)
    error = await deferToThread(_attempt, router.url, program, half, half + 1,
                                request_id="client-413")
    assert isinstance(error, BadRequest) and error.status == 413, error
    assert error.request_id == "client-413"
    await router.process.wait_for_line(r"client-413 refused: request body .*exceeds the limit", 10,
                                       since=mark)
    # Neither node ever saw these requests.
    for node in deployment.nodes.values():
        assert not node.process.matching(r"(router|client)-413")
    health = await router_health(router)
    assert health["status"] == "ok" and health["active"] == 0


@pytest_twisted.ensureDeferred
async def test_a_second_supervisor_with_a_node_id_in_use_is_refused(deployment, processes):
    """A second supervisor with a node id in use is refused with 409 and leaves the live node ready."""
    router = deployment.router
    mark = router.process.mark()
    twin = await start_node(processes, router.url, "node-a", name="twin-a", registered=False)
    await twin.process.wait_for_line(r"the Router refused node node-a with 409", 30)
    await router.process.wait_for_line(r"refused node node-a: node id node-a is in use", 10, since=mark)
    # Stopping it (it deregisters with its own session) leaves the live node alone.
    assert await twin.process.stop() == 0
    nodes = await pool_nodes(router)
    assert nodes["node-a"]["state"] == "ready"
    assert nodes["node-a"]["workers"][0]["url"] == deployment.nodes["node-a"].worker_url
    assert not router.process.matching(r"node node-a: ready ->", since=mark)


# -- a Router without nodes ---------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_no_ready_node(processes):
    """A Router without nodes is unavailable and answers runs 503 no_ready_node with Retry-After."""
    router = await start_router(processes, "--queue-wait-timeout-seconds", "0.3", name="empty-router")
    answer = await request("GET", router.url + "/health")
    assert answer.code == 503 and answer.json["status"] == "unavailable"
    assert answer.json["capacity"] == 0 and answer.json["nodes"]["ready"] == 0
    assert (await request("GET", router.url + "/readyz")).code == 503

    quick = quick_program()
    answer = await post_run(router.url, run_frame(quick, [np.float32(1)]), request_id="nobody-1")
    assert answer.code == 503 and answer.header("Retry-After") is not None
    info = answer.error()
    assert info["type"] == "server_busy" and info["reason"] == "no_ready_node"
    assert info["request_id"] == "nobody-1"

    error = await deferToThread(_attempt, router.url, quick, np.float32(1), request_id="nobody-2")
    assert isinstance(error, ServerBusy) and error.reason == "no_ready_node", error
    assert error.request_id == "nobody-2"
    for rid in ("nobody-1", "nobody-2"):
        await router.process.wait_for_line(rf"{rid} answered 503 no_ready_node", 10)


@pytest_twisted.ensureDeferred
async def test_twistd_kcoral_router(processes):
    """twistd -n kcoral-router serves with its options in effect and drains on SIGTERM."""
    child = processes.spawn(twistd_argv("-n", "kcoral-router", "--port", "0",
                                        "--queue-wait-timeout-seconds", "0.2"), name="twistd-router")
    url = (await child.wait_for_line(LISTENING, START_TIMEOUT)).group("url")
    answer = await request("GET", url + "/health")
    assert answer.code == 503 and answer.json["status"] == "unavailable"
    assert answer.request_id
    # Its options took effect: the wait for a node expires after 0.2 s.
    started = reactor.seconds()
    answer = await post_run(url, run_frame(quick_program(), [np.float32(1)]), request_id="twistd-1")
    assert answer.code == 503 and answer.error()["reason"] == "no_ready_node"
    assert reactor.seconds() - started < 5
    mark = child.mark()
    child.signal("TERM")
    await child.exited(30)
    assert child.matching(r"draining: 0 running, 0 waiting", since=mark)
    assert not child.matching("Traceback")


# -- node tokens -----------------------------------------------------------------------------

SECRET = "s3cret-node-token-4f1d"
WRONG = "not-the-token-9c2e"


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_node_tokens(processes):
    """Only a node with the right token joins; a wrong or missing token gets 401 and is never logged."""
    router = await start_router(processes, "--node-token", SECRET, name="token-router",
                                env={"KCORAL_NODE_TOKEN": None})
    # The right token, from the environment; a wrong one on the command line.
    right, wrong = await gatherResults([
        Deferred.fromCoroutine(start_node(processes, router.url, "tok-right",
                                                 env={"KCORAL_NODE_TOKEN": SECRET})),
        Deferred.fromCoroutine(start_node(processes, router.url, "tok-wrong",
                                                 "--node-token", WRONG, registered=False,
                                                 env={"KCORAL_NODE_TOKEN": None})),
    ], consumeErrors=True)
    await until_ready(router, "tok-right")
    await wrong.process.wait_for_line(r"the Router refused node tok-wrong with 401", 30)
    # It keeps trying (its worker is ready): wait for a few refusals.
    refused = r"refused a control request for node tok-wrong with a wrong token"
    await until(lambda: _count(router.process, refused, 3), "three refusals of tok-wrong", 30)

    # No token at all: registration, heartbeat and deregistration alike.
    report = {"session": "x", "workers": [{"name": "w", "url": "http://127.0.0.1:1",
                                           "healthy": True, "capacity": 1}]}
    answer = await request("PUT", router.url + "/v1/nodes/tok-missing", body=json.dumps(report).encode(),
                           headers={"Content-Type": "application/json"})
    assert answer.code == 401 and answer.header("WWW-Authenticate") == "Bearer"
    assert answer.error()["type"] == "unauthorized"
    answer = await request("DELETE", router.url + "/v1/nodes/tok-right?session=x")
    assert answer.code == 401
    answer = await request("PUT", router.url + "/v1/nodes/tok-missing", body=json.dumps(report).encode(),
                           headers={"Authorization": "Bearer " + WRONG})
    assert answer.code == 401
    await router.process.wait_for_line(r"refused a control request for node tok-missing with no token", 10)

    nodes = await pool_nodes(router)
    assert set(nodes) == {"tok-right"}
    assert not router.process.matching(r"node tok-(wrong|missing)\b.*-> ready")
    assert not router.process.matching(r"node tok-(wrong|missing) joined")
    assert wrong.process.running
    # The right node serves programs.
    result = await deferToThread(_attempt, router.url, quick_program(), np.float32(4))
    assert result == 8
    # No token ever reaches the Router's log.
    text = "\n".join(router.process.output.lines)
    assert SECRET not in text and WRONG not in text


async def _count(child, pattern, count):
    return len(child.matching(pattern)) >= count
