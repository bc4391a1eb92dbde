"""
The server's HTTP resource, in process, through C{treq.testing.StubTreq}:
health and readiness, metrics, JSON errors with request ids, admission
refusals. Runs that reach JAX are tested against a real server process in
L{tests.test_server}.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import pytest_twisted
from prometheus_client import CollectorRegistry
from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock, deferLater
from twisted.python.threadpool import ThreadPool

from kcoral.common.queue import WaitQueue
from kcoral.errors import RunTimeout
from kcoral.protocol.wire import ALIGN, MAGIC, PREFIX, PROGRAM_HEADER, encode_request, sha256, wire_array
from kcoral.server.admission import Admission
from kcoral.server.app import DRAINING, OK, ServerApp
from kcoral.server.compile_cache import CompileCache
from kcoral.server.device_cache import DeviceCache
from kcoral.server.executor import Executor, ExecutorMetrics
from kcoral.server.runlimit import NO_RUN_LIMIT, RunLimit, RunTimer
from kcoral.server.upload_cache import UploadCache
from tests.httputil import AsKCoralSite

RID = b"X-Request-ID"


class Harness:
    """A ServerApp on a fake clock, served by StubTreq."""

    def __init__(self, *, capacity=2, waiting=4, timeout=30.0, reactor=None, threadpool=None,
                 run_limit=NO_RUN_LIMIT):
        self.clock = reactor if reactor is not None else Clock()
        self.registry = CollectorRegistry()
        metrics = ExecutorMetrics(self.registry)
        self.uploads = UploadCache(1 << 20, metrics.caches)
        # The executor never loads a device here: no request below gets that far.
        executor = Executor(uploads=self.uploads, compiled=CompileCache(4, metrics.caches),
                            placed=DeviceCache(1 << 20, metrics.caches), metrics=metrics, gpus="none")
        self.admission = Admission(capacity, WaitQueue(self.clock, waiting, timeout))
        self.app = ServerApp(executor=executor, admission=self.admission,
                             threadpool=threadpool or ThreadPool(), reactor=self.clock,
                             registry=self.registry, run_limit=run_limit)
        self.resource = AsKCoralSite(self.app.resource())
        self.treq = StubTreq(self.resource)

    def request(self, method, path, *, body=None, headers=None):
        """The response (content read) of a request answered synchronously."""
        done = []
        d = self.treq.request(method, "http://kcoral.test" + path, data=body, headers=headers)
        d.addCallback(lambda response: self.treq.content(response).addCallback(
            lambda content: (response, content)))
        d.addBoth(done.append)
        self.treq.flush()
        assert done, f"{method} {path} was not answered"
        if not isinstance(done[0], tuple):
            done[0].raiseException()
        return done[0]

    def json(self, method, path, **kw):
        response, content = self.request(method, path, **kw)
        assert response.headers.getRawHeaders(b"Content-Type") == [b"application/json"]
        return response, json.loads(content)


def run_body(digest=None, program=b"program bytes", inputs=()):
    """A well-formed run frame."""
    if digest is None:
        digest = sha256(program) if program is not None else "a" * 64
    parts, _ = encode_request(digest, program, [(wire_array(a), d, inline) for a, d, inline in inputs])
    return b"".join(bytes(p) for p in parts)


def assert_error(response, body, status, type_, *, reason=None, request_id=None):
    assert response.code == status
    info = body["error"]
    assert info["type"] == type_
    assert isinstance(info["message"], str) and info["message"]
    header = response.headers.getRawHeaders(RID)
    assert header and info["request_id"] == header[0].decode()
    if request_id is not None:
        assert info["request_id"] == request_id
    if reason is not None:
        assert info["reason"] == reason
    return info


@pytest.fixture
def server():
    harness = Harness()
    harness.app.status = OK
    return harness


# -- health and readiness -----------------------------------------------------

def test_health_while_starting():
    """A starting server answers /health and /readyz with 503, status starting, not ready."""
    harness = Harness()
    response, body = harness.json("GET", "/health")
    assert response.code == 503
    assert body["status"] == "starting"
    response, body = harness.json("GET", "/readyz")
    assert response.code == 503 and body["ready"] is False


def test_health_when_ready(server):
    """A ready server answers /health 200 with its capacity and load, and /readyz 200 ready."""
    response, body = server.json("GET", "/health")
    assert response.code == 200
    assert body["status"] == "ok"
    assert body["capacity"] == 2 and body["active"] == 0 and body["queued"] == 0
    assert {"gpu_target", "runtime", "devices", "version"} <= set(body)
    response, body = server.json("GET", "/readyz")
    assert response.code == 200 and body == {"ready": True, "status": "ok"}


def test_health_counts_active_and_queued_runs():
    """/health counts the runs holding a slot and those waiting for one."""
    harness = Harness(capacity=1)
    harness.app.status = OK
    harness.admission.acquire()
    harness.admission.acquire()
    _, body = harness.json("GET", "/health")
    assert body["active"] == 1 and body["queued"] == 1


def test_health_while_draining(server):
    """A draining server answers /health and /readyz with 503, status draining."""
    server.app.status = DRAINING
    response, body = server.json("GET", "/health")
    assert response.code == 503 and body["status"] == "draining"
    response, _ = server.json("GET", "/readyz")
    assert response.code == 503


def test_metrics_in_prometheus_text_format(server):
    """/metrics is Prometheus text with the run gauges and every metric family."""
    server.admission.acquire()
    response, content = server.request("GET", "/metrics")
    assert response.code == 200
    assert response.headers.getRawHeaders(b"Content-Type")[0].startswith(b"text/plain")
    text = content.decode()
    assert "kcoral_active_runs 1.0" in text
    assert "kcoral_queued_runs 0.0" in text
    for family in ("kcoral_queue_wait_seconds", "kcoral_executions", "kcoral_compile_seconds",
                   "kcoral_execution_seconds", "kcoral_cache_bytes"):
        assert f"# TYPE {family}" in text


# -- request ids and JSON errors ------------------------------------------------

def test_every_response_carries_a_request_id(server):
    """Every response carries an X-Request-ID, a new one per request."""
    seen = set()
    for path in ("/health", "/readyz", "/metrics", "/nowhere"):
        response, _ = server.request("GET", path)
        [rid] = response.headers.getRawHeaders(RID)
        seen.add(rid)
    assert len(seen) == 4


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/run", "/nowhere"])
def test_a_sane_request_id_is_echoed(server, path):
    """A sane client X-Request-ID is echoed on every route, errors included."""
    response, _ = server.request("GET" if path != "/v1/run" else "POST", path,
                                 body=b"junk" if path == "/v1/run" else None,
                                 headers={RID: [b"client-chosen.id:42"]})
    assert response.headers.getRawHeaders(RID) == [b"client-chosen.id:42"]


@pytest.mark.parametrize("bad", [b"has space", b"x" * 500, b"semi;colon", b"\xff"])
def test_an_insane_request_id_is_replaced(server, bad):
    """An unsafe X-Request-ID is replaced by a generated one, also in the error body."""
    response, body = server.json("GET", "/nowhere", headers={RID: [bad]})
    [rid] = response.headers.getRawHeaders(RID)
    assert rid != bad and len(rid) == 32
    assert body["error"]["request_id"] == rid.decode()


def test_unknown_route_is_a_json_404(server):
    """An unknown route is a JSON 404 not_found naming the path, with the request id."""
    # Not under /v2, whose errors are the inference protocol's (the message alone).
    response, body = server.json("GET", "/v3/run", headers={RID: [b"r-404"]})
    info = assert_error(response, body, 404, "not_found", request_id="r-404")
    assert "/v3/run" in info["message"]


def test_under_v2_errors_are_the_inference_protocols(server):
    """Under /v2, an unknown path's 404 is the inference protocol's error, the message alone,
    with the request id in its header."""
    response, body = server.json("GET", "/v2/nope", headers={RID: [b"r-v2"]})
    assert response.code == 404 and isinstance(body["error"], str) and "/v2/nope" in body["error"]
    assert response.headers.getRawHeaders(RID) == [b"r-v2"]


def test_wrong_method_is_a_json_405(server):
    """A method a route does not take is a JSON 405 method_not_allowed, POST /v1/run's included."""
    response, body = server.json("GET", "/v1/run")
    assert_error(response, body, 405, "method_not_allowed")
    response, body = server.json("POST", "/health")
    assert_error(response, body, 405, "method_not_allowed")


@pytest.mark.parametrize("body, message", [
    (b"", "shorter than"),
    (b"not a frame at all", "magic"),
    (PREFIX.pack(MAGIC, 3) + b"{x}", "JSON"),
    (run_body(program=b"p", inputs=[(np.ones(2, np.float32), None, True)])[:-4], "outside the body"),
], ids=["empty", "magic", "json", "truncated"])
def test_malformed_runs_are_400(server, body, message):
    """A malformed run frame is a JSON 400 bad_request saying what is wrong with it."""
    response, info = server.json("POST", "/v1/run", body=body, headers={RID: [b"r-400"]})
    info = assert_error(response, info, 400, "bad_request", request_id="r-400")
    assert message in info["message"]


def test_unknown_dtype_is_400(server):
    """An input of an unknown dtype is a 400 bad_request naming the dtype."""
    text = json.dumps({"program": {"digest": "a" * 64},
                       "inputs": [{"dtype": "float128", "shape": [], "digest": "b" * 64}]}).encode()
    head = PREFIX.pack(MAGIC, len(text)) + text
    response, body = server.json("POST", "/v1/run", body=head + b"\0" * (-len(head) % ALIGN))
    info = assert_error(response, body, 400, "bad_request")
    assert "float128" in info["message"]


def test_program_header_must_match_the_frame(server):
    """An X-KCoral-Program header unlike the frame's program digest is a 400 naming it."""
    response, body = server.json("POST", "/v1/run", body=run_body(),
                                 headers={PROGRAM_HEADER: ["b" * 64]})
    info = assert_error(response, body, 400, "bad_request")
    assert PROGRAM_HEADER in info["message"]


# -- admission ------------------------------------------------------------------

def test_runs_while_starting_are_503(server):
    """A run while starting is a 503 server_busy, reason starting, with Retry-After."""
    server.app.status = "starting"
    response, body = server.json("POST", "/v1/run", body=run_body())
    assert_error(response, body, 503, "server_busy", reason="starting")
    assert response.headers.getRawHeaders(b"Retry-After") == [b"1"]


def test_runs_while_draining_are_503_draining(server):
    """A run while draining is a 503 server_busy, reason draining, with Retry-After."""
    server.app.status = DRAINING
    response, body = server.json("POST", "/v1/run", body=run_body(), headers={RID: [b"r-drain"]})
    assert_error(response, body, 503, "server_busy", reason="draining", request_id="r-drain")
    assert response.headers.getRawHeaders(b"Retry-After") == [b"1"]


def test_full_queue_is_503_queue_full():
    """A run finding every slot taken and no queue room is a 503 queue_full, nothing queued."""
    harness = Harness(capacity=1, waiting=0)
    harness.app.status = OK
    harness.admission.acquire()  # the only slot is taken
    response, body = harness.json("POST", "/v1/run", body=run_body())
    assert_error(response, body, 503, "server_busy", reason="queue_full")
    assert response.headers.getRawHeaders(b"Retry-After") == [b"1"]
    assert harness.admission.active == 1 and len(harness.admission.queue) == 0


def test_expired_wait_is_503_queue_timeout():
    """A run that waits past the queue timeout is a 503 queue_timeout, its wait not observed."""
    harness = Harness(capacity=1, waiting=1, timeout=5.0)
    harness.app.status = OK
    harness.admission.acquire()
    done = []
    d = harness.treq.post("http://kcoral.test/v1/run", data=run_body())
    d.addCallback(lambda r: harness.treq.json_content(r).addCallback(lambda b: (r, b)))
    d.addBoth(done.append)
    harness.treq.flush()
    assert not done and len(harness.admission.queue) == 1
    harness.clock.advance(5.0)
    harness.treq.flush()
    response, body = done[0]
    assert_error(response, body, 503, "server_busy", reason="queue_timeout")
    assert len(harness.admission.queue) == 0
    # The waited time is observed in the queue-wait histogram only for runs
    # that got a slot: this one did not.
    assert harness.registry.get_sample_value("kcoral_queue_wait_seconds_count") == 0


# -- through the executor's worker threads ---------------------------------------

@pytest.fixture
def threaded(reactor):
    pool = ThreadPool(minthreads=1, maxthreads=1, name="test-run")
    pool.start()
    harness = Harness(reactor=reactor, threadpool=pool)
    harness.app.status = OK
    yield harness
    pool.stop()


async def answer(harness, method, path, **kw) -> tuple:
    """The response (JSON read) of a request that a worker thread answers."""
    from twisted.internet import reactor

    done: list = []
    d: Deferred = harness.treq.request(method, "http://kcoral.test" + path, **kw)
    d.addCallback(lambda r: harness.treq.json_content(r).addCallback(lambda b: (r, b)))
    d.addBoth(done.append)
    harness.treq.flush()
    # The response is whole once the worker thread's answer reached the
    # reactor; one more flush hands it to the client.
    await harness.resource.finishing[-1].addTimeout(30, reactor)
    harness.treq.flush()
    assert done, "StubTreq did not deliver the finished response"
    if not isinstance(done[0], tuple):
        done[0].raiseException()
    return done[0]


@pytest_twisted.ensureDeferred
async def test_references_to_unknown_content_are_409_with_the_digests(threaded):
    """A run citing unknown content by digest is a 409 listing the digests, its slot freed."""
    big = np.ones(1000, np.float32)
    digest = sha256(wire_array(big))
    body = run_body(digest="c" * 64, program=None, inputs=[(big, digest, False)])
    response, info = await answer(threaded, "POST", "/v1/run", data=body,
                                  headers={RID: [b"r-409"]})
    info = assert_error(response, info, 409, "missing_content", request_id="r-409")
    assert info["missing"] == ["c" * 64, digest]
    assert threaded.admission.active == 0


@pytest_twisted.ensureDeferred
async def test_content_that_does_not_match_its_digest_is_400(threaded):
    """Content that does not match its digest is a 400, not cached, its slot freed."""
    body = run_body(digest="d" * 64, program=b"program bytes")
    response, info = await answer(threaded, "POST", "/v1/run", data=body)
    info = assert_error(response, info, 400, "bad_request")
    assert "does not match its digest" in info["message"]
    assert "d" * 64 not in threaded.uploads
    assert threaded.admission.active == 0


# -- the run limit, on the one path of runs and inference batches to the device ----

@pytest.fixture
def limited(reactor):
    """A server of one thread whose runs may execute 0.05 s, and the request ids that passed it."""
    pool = ThreadPool(minthreads=1, maxthreads=1, name="test-limited")
    pool.start()
    passed: list[str] = []
    harness = Harness(reactor=reactor, threadpool=pool,
                      run_limit=RunLimit(0.05, reactor, passed.append))
    harness.app.status = OK
    yield harness, passed
    pool.stop()


def run_timers(reactor) -> list:
    return [c for c in reactor.getDelayedCalls() if isinstance(getattr(c.func, "__self__", None),
                                                                RunTimer)]


@pytest_twisted.ensureDeferred
async def test_a_thread_past_the_limit_is_answered_while_it_holds_its_slot(limited, reactor):
    """Work still on its thread past the limit is answered RunTimeout at once; its slot stays held."""
    harness, passed = limited
    stuck = threading.Event()
    await harness.app.admitted("stuck-1")
    answer = harness.app.in_thread("stuck-1", stuck.wait, 30)
    try:
        with pytest.raises(RunTimeout) as timed_out:
            await answer.addTimeout(30, reactor)
        assert timed_out.value.request_id == "stuck-1"
        # The server is told once the answer is out, in the same turn.
        await deferLater(reactor, 0, lambda: None)
        assert passed == ["stuck-1"] and harness.admission.active == 1
    finally:
        stuck.set()
    await harness.admission.idle().addTimeout(30, reactor)


@pytest_twisted.ensureDeferred
async def test_a_thread_done_in_time_leaves_no_timer(limited, reactor):
    """Work done within the limit is answered, and its timer is gone with it."""
    harness, passed = limited
    await harness.app.admitted("quick-1")
    assert await harness.app.in_thread("quick-1", lambda: 42).addTimeout(30, reactor) == 42
    assert run_timers(reactor) == [] and passed == []
