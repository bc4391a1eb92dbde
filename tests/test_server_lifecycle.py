"""
Integration tests that start their own C{kcoral server} processes: restarts
(the client resends what the new process lacks), the disk cache across a
restart, a server with capacity 1, a queue of 1 and a small body limit (413,
503 queue_full, dropping a queued request whose client left, health while a
program runs), draining on SIGTERM, a run past --max-run-seconds (504,
the requests the server held cut, then exit status 3), and the command's
exit statuses.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.web.client import HTTPConnectionPool

from kcoral import (
    AsyncClient,
    BadRequest,
    Client,
    KCoralError,
    NodeFailure,
    Program,
    RunTimeout,
    ServerBusy,
)
from kcoral.protocol.wire import REQUEST_CONTENT_TYPE
from tests import programs
from tests.conftest import server_args, server_env
from tests.harness import SERVER_READY, kcoral_argv, until
from tests.httputil import parse_raw, raw_exchange, request
from tests.test_server import assert_tree_close, metrics, run_frame, sample

pytestmark = pytest.mark.integration

jax = pytest.importorskip("jax")

#: How long the slow program runs: long enough to act while it runs.
SLOW_SECONDS = 3.0
#: The small server's body limit.
SMALL_LIMIT = 200_000


@pytest.fixture(scope="module")
def affine():
    return programs.affine_program()


@pytest.fixture(scope="module")
def spin():
    program, _, x = programs.spin_program()
    return program, np.int32(programs.spin_iterations(SLOW_SECONDS)), x


@pytest_twisted.async_fixture(scope="module")
async def small_server(module_processes):
    args = server_args("--capacity", "1", "--max-queued-requests", "1",
                       "--max-request-bytes", str(SMALL_LIMIT))
    return await module_processes.start_service(args, name="small-server", ready=SERVER_READY,
                                                env=server_env())


async def health(server) -> tuple[dict, float]:
    started = reactor.seconds()
    answer = await request("GET", server.url + "/health", timeout=10)
    return answer.json, reactor.seconds() - started


async def until_health(server, what: str, count: int, timeout: float = 60.0) -> dict:
    """Poll /health (a real process: there is no event to wait on) until its
    C{what} ("active" or "queued") reaches C{count}."""
    async def reached():
        body, _ = await health(server)
        return body if body[what] >= count else None
    return await until(reached, f"/health's {what} reaching {count}", timeout, interval=0.02)


def outcome(d):
    """A Deferred of the result of C{d}, or of the KCoralError it failed with."""

    def error(failure):
        failure.trap(KCoralError)
        return failure.value

    return d.addErrback(error)


def check_spun(result, x):
    # sin(v)/2 + v/2 shrinks every positive value toward 0.
    assert result.shape == x.shape and result.dtype == np.float32
    assert np.all((result > 0) & (result < x)) and np.all(result == result[0])


# -- restarts ----------------------------------------------------------------------

@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_client_resends_after_a_server_restart(start_server, affine):
    """After a server restart (memory cache gone) the client resends the content once and succeeds."""
    program, (w, x, b), expected = affine
    first = await start_server(name="server-1")
    client = Client(first.url)
    try:
        await deferToThread(client.run, program, w, x, b)
        sent_first = client.bytes_sent

        # Ctrl+C (SIGINT) stops an idle server with exit status 0, like SIGTERM.
        first.process.signal("INT")
        assert await first.process.exited(30) == 0
        assert first.process.matching("kcoral server stopped")

        second = await start_server("--port", str(first.port), name="server-2")
        assert second.url == first.url
        result = await deferToThread(client.run, program, w, x, b, request_id="after-restart")
    finally:
        client.close()
    assert_tree_close(result, expected(w, x, b))
    # The new process lacked the program and the weights: one 409, then
    # everything again inline.
    await second.process.wait_for_line(r"after-restart answered 409 missing_content", 30)
    assert client.bytes_sent - sent_first > sent_first
    samples = await metrics(second)
    assert sample(samples, "kcoral_http_requests_total", route="/v1/run", code="409") == 1
    assert sample(samples, "kcoral_http_requests_total", route="/v1/run", code="200") == 1


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_async_client_rides_out_a_server_crash(start_server, affine):
    """The async client retries through a server crash and restart."""
    program, (w, x, b), expected = affine
    first = await start_server(name="server-1")
    client = AsyncClient(first.url, busy_timeout=120)
    impatient = AsyncClient(first.url, busy_timeout=0)
    try:
        await client.run(program, w, x, b)
        # A crash this time: SIGKILL, no draining.
        first.process.signal("KILL")
        assert await first.process.exited(30) is None
        assert first.process.output.exit_signal == 9

        with pytest.raises(ServerBusy) as down:
            await impatient.run(program, w, x, b)
        assert down.value.reason == "unreachable"
        # A client with time to wait retries until a server is back, and then
        # resends what the new process lacks.
        pending = client.run(program, w, x, b, request_id="after-crash")
        second = await start_server("--port", str(first.port), name="server-2")
        result = await pending
    finally:
        await client.close()
        await impatient.close()
    assert_tree_close(result, expected(w, x, b))
    await second.process.wait_for_line(r"after-crash answered 409", 30)


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_disk_cache_survives_a_restart(start_server, affine, tmp_path):
    """The disk upload cache still holds the content after a restart."""
    program, (w, x, b), expected = affine
    cache = str(tmp_path / "uploads")
    first = await start_server("--cache-dir", cache, name="server-1")
    client = Client(first.url)
    try:
        await deferToThread(client.run, program, w, x, b)
        sent_first = client.bytes_sent
        assert await first.stop() == 0
        second = await start_server("--port", str(first.port), "--cache-dir", cache, name="server-2")
        result = await deferToThread(client.run, program, w, x, b)
    finally:
        client.close()
    assert_tree_close(result, expected(w, x, b))
    # References only: the new process found the content on disk.
    assert client.bytes_sent - sent_first < 1024
    samples = await metrics(second)
    assert sample(samples, "kcoral_http_requests_total", route="/v1/run", code="409") == 0
    assert sample(samples, "kcoral_cache_hits_total", cache="upload", tier="disk") == 2



@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_persistent_compilation_cache_is_written_and_reused(start_server, affine, tmp_path):
    """JAX's persistent compilation cache is written, then reused by a new server."""
    program, (w, x, b), expected = affine
    xla = tmp_path / "xla"
    first = await start_server("--compilation-cache-dir", str(xla), name="server-1")
    client = Client(first.url)
    try:
        await deferToThread(client.run, program, w, x, b)
        assert await first.stop() == 0
        written = sorted(p.name for p in xla.iterdir())
        assert written, "the server wrote nothing to --compilation-cache-dir"
        second = await start_server("--port", str(first.port), "--compilation-cache-dir", str(xla),
                                    name="server-2")
        result = await deferToThread(client.run, program, w, x, b)
    finally:
        client.close()
    # A new process over the same directory still computes the right answer
    # (JAX checks its cache entries' keys; a stale one is recompiled).
    assert_tree_close(result, expected(w, x, b))
    await second.stop()


# -- a small server: capacity 1, one place in the queue, 200 kB bodies -------------------------------

@pytest_twisted.ensureDeferred
async def test_413_as_soon_as_a_chunked_body_passes_the_limit(small_server):
    """A chunked body gets 413 as soon as it passes the limit."""
    head = (b"POST /v1/run HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/x-kcoral-run\r\n"
            b"Transfer-Encoding: chunked\r\n"
            b"X-Request-ID: chunky-1\r\n\r\n")
    chunk = b"%x\r\n" % 65536 + b"\0" * 65536 + b"\r\n"
    # Up to 100 times the limit: the answer must come long before the end.
    raw = await deferToThread(raw_exchange, small_server.port, head,
                              [chunk] * (100 * SMALL_LIMIT // 65536), timeout=30)
    status, headers, body = parse_raw(raw)
    assert status == 413
    assert headers["x-request-id"] == "chunky-1"
    info = json.loads(body)["error"]
    assert info["type"] == "payload_too_large" and info["request_id"] == "chunky-1"
    await small_server.process.wait_for_line(r"chunky-1 refused: request body exceeds", 30)
    body, _ = await health(small_server)
    assert body["status"] == "ok"


@pytest_twisted.ensureDeferred
async def test_client_gets_bad_request_for_a_body_over_the_limit(small_server):
    """A body over the limit raises BadRequest in the client."""
    big = np.ones(4 * SMALL_LIMIT // 4, np.float32)
    program = Program.from_function(lambda v: v.sum(), big)

    def work():
        with Client(small_server.url, busy_timeout=0) as client:
            try:
                return client.run(program, big, request_id="client-413")
            except BadRequest as e:
                return e

    error = await deferToThread(work)
    assert isinstance(error, BadRequest), error
    assert error.status == 413 and error.request_id == "client-413"
    body, _ = await health(small_server)
    assert body["status"] == "ok"


@pytest_twisted.ensureDeferred
async def test_queue_full_retries_and_fast_health_while_a_program_runs(small_server, spin):
    """A full queue refuses at once, a patient client gets in later, a left run is dropped, health is fast."""
    program, n, x = spin
    quick = Program.from_function(lambda v: v * 2, np.float32(1))
    slow_client = AsyncClient(small_server.url, busy_timeout=0)
    busy_client = AsyncClient(small_server.url, busy_timeout=0)
    patient_client = AsyncClient(small_server.url, busy_timeout=60)
    try:
        slow = slow_client.run(program, n, x, request_id="slow-1")
        busy = await until_health(small_server, "active", 1)
        assert busy["capacity"] == 1 and busy["queued"] == 0

        # The reactor answers health checks while JAX runs on a worker thread.
        latencies = []
        for _ in range(10):
            body, seconds = await health(small_server)
            assert body["active"] == 1
            latencies.append(seconds)
        assert sorted(latencies)[5] < 0.1 and max(latencies) < 1.0, latencies

        # A second run takes the one place in the queue...
        waiting = treq.post(small_server.url + "/v1/run", data=run_frame(quick, [np.float32(1)]),
                            headers={"Content-Type": REQUEST_CONTENT_TYPE, "X-Request-ID": "queued-1"},
                            pool=HTTPConnectionPool(reactor, persistent=False))
        gone = []
        waiting.addErrback(gone.append)  # cancelled below
        await until_health(small_server, "queued", 1)

        # ...so a third is refused at once.
        with pytest.raises(ServerBusy) as refused:
            await busy_client.run(quick, np.float32(1), request_id="refused-1")
        assert refused.value.reason == "queue_full"
        assert refused.value.request_id == "refused-1"
        # A patient client keeps retrying (honouring Retry-After) instead.
        patient = patient_client.run(quick, np.float32(5), request_id="patient-1")
        await small_server.process.wait_for_line(r"patient-1 answered 503 server_busy", 30)

        # The queued run's client goes away: the server drops it unrun.
        mark = small_server.process.mark()
        waiting.cancel()
        await small_server.process.wait_for_line(
            r"queued-1 dropped: the client went away before it ran", 30, since=mark)
        assert len(gone) == 1
        body, _ = await health(small_server)
        assert body["queued"] == 0 and body["active"] == 1
        assert not slow.called, "the slow program ended before the checks: raise SLOW_SECONDS"

        check_spun(await slow, x)
        # The patient client got in once there was room, within its deadline.
        assert await patient == 10
        # The slot is free again.
        assert await busy_client.run(quick, np.float32(21)) == 42
        assert not small_server.process.matching(r"queued-1 (compiled|answered)")
    finally:
        for client in (slow_client, busy_client, patient_client):
            await client.close()


# -- draining --------------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_sigterm_drains_and_exits_zero(start_server, spin):
    """SIGTERM drains the running program, refuses new ones, and exits 0."""
    program, n, x = spin
    quick = Program.from_function(lambda v: v * 2, np.float32(1))
    server = await start_server()
    slow_client = AsyncClient(server.url, busy_timeout=0)
    late_client = AsyncClient(server.url, busy_timeout=0)
    try:
        slow = slow_client.run(program, n, x, request_id="in-flight")
        await until_health(server, "active", 1)

        mark = server.process.mark()
        server.process.signal("TERM")
        await server.process.wait_for_line(r"draining: 1 running", 30, since=mark)

        ready = await request("GET", server.url + "/readyz")
        assert ready.code == 503 and ready.json["status"] == "draining"
        answer = await request("GET", server.url + "/health")
        assert answer.code == 503 and answer.json["status"] == "draining"
        assert answer.json["active"] == 1
        with pytest.raises(ServerBusy) as refused:
            await late_client.run(quick, np.float32(1), request_id="too-late")
        assert refused.value.reason == "draining"
        assert refused.value.request_id == "too-late"
        assert server.process.running
        assert not slow.called, "the slow program ended before the checks: raise SLOW_SECONDS"

        # The request in flight is still answered, and then the process exits 0.
        check_spun(await slow, x)
        assert await server.process.exited(60) == 0
    finally:
        await slow_client.close()
        await late_client.close()
    assert server.process.matching(r"too-late answered 503 server_busy")
    assert server.process.matching(r"kcoral server stopped")
    assert not server.process.matching(r"Traceback")


# -- the run limit -----------------------------------------------------------------------

#: The largest count the spin program takes: a minute of running here, far
#: past a limit of a second.
FOREVER = np.int32(2**31 - 1)


@pytest_twisted.ensureDeferred
async def test_a_run_past_the_limit_is_504_and_the_server_exits_3(start_server, spin):
    """With --max-run-seconds 1, a run that would take a minute is answered 504 run_timeout
    with its request id about a second after it started; then the server exits with status 3."""
    program, _, x = spin
    server = await start_server("--max-run-seconds", "1")
    client = AsyncClient(server.url, busy_timeout=0)
    try:
        sent = reactor.seconds()
        with pytest.raises(RunTimeout) as timed_out:
            await client.run(program, FOREVER, x, request_id="forever-1")
        waited = reactor.seconds() - sent
    finally:
        await client.close()
    assert (timed_out.value.reason, timed_out.value.request_id) == ("run_timeout", "forever-1")
    assert 1.0 <= waited < 5.0, waited
    assert await server.process.exited(30) == 3
    assert server.process.matching(r"forever-1 was still running 1 s after it started "
                                   r"\(--max-run-seconds\)")
    assert not server.process.matching(r"Traceback")


@pytest_twisted.ensureDeferred
async def test_a_run_that_keeps_its_outputs_is_timed_until_they_are_computed(start_server):
    """A run that keeps its outputs on the server, of a program the device runs after the
    call that starts it returns, is answered once they are computed: one that never ends is
    answered 504 run_timeout and the server exits 3. (It was answered 200 at once, a kept
    array of a computation running for ever, and the run limit struck the next run instead.)"""
    program, _, x = programs.spin_program(costly=True)
    server = await start_server("--max-run-seconds", "1")
    client = AsyncClient(server.url, busy_timeout=0)
    try:
        with pytest.raises(RunTimeout) as timed_out:
            await client.run(program, FOREVER, x, keep=True, request_id="kept-forever-1")
    finally:
        await client.close()
    assert timed_out.value.request_id == "kept-forever-1"
    assert await server.process.exited(30) == 3


@pytest_twisted.ensureDeferred
async def test_the_requests_an_ending_server_held_fail_as_on_a_lost_node(start_server, spin):
    """A run waiting for the slot of a run past the limit is cut when the server ends: the
    client's NodeFailure (502), as for any lost node, while the run past the limit gets its 504."""
    program, _, x = spin
    # Two seconds: time enough to queue the second run behind the first.
    server = await start_server("--max-run-seconds", "2", "--capacity", "1")
    clients = [AsyncClient(server.url, busy_timeout=0) for _ in range(2)]
    try:
        forever = outcome(clients[0].run(program, FOREVER, x, request_id="forever-1"))
        await until_health(server, "active", 1)
        held = outcome(clients[1].run(program, np.int32(1), x, request_id="held-1"))
        await until_health(server, "queued", 1)
        assert isinstance(await forever, RunTimeout)
        lost = await held
    finally:
        for client in clients:
            await client.close()
    assert isinstance(lost, NodeFailure) and lost.status == 502, lost
    assert await server.process.exited(30) == 3


# -- the command -------------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_port_in_use_is_a_one_line_error(processes, small_server):
    """A port in use is a one-line error and exit status 1."""
    child = processes.spawn(kcoral_argv("server", "--port", str(small_server.port), "--gpus", "none"),
                            name="second")
    assert await child.exited(60) == 1
    errors = [line for line in child.output.lines if line.startswith("kcoral: error")]
    assert len(errors) == 1 and str(small_server.port) in errors[0]
    assert not child.matching("Traceback")


@pytest.mark.parametrize("args, message", [
    (["--no-such-flag"], "no-such-flag"),
    (["--port", "-5"], "port"),
    (["--capacity", "0"], "must be positive, got 0"),
    (["--router", "http://127.0.0.1:9"], "--node-id"),
])
@pytest_twisted.ensureDeferred
async def test_bad_options_exit_2(processes, args, message):
    """Bad server options exit 2 with a one-line error."""
    child = processes.spawn(kcoral_argv("server", *args), name="bad-options")
    assert await child.exited(60) == 2
    assert child.matching(message)
    assert not child.matching("Traceback")
