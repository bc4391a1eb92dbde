"""
Traces of runs (L{kcoral.tracing}), recorded with the OpenTelemetry SDK's
in-memory exporter: a Router's app and a server's app in process on the
real reactor (the server's runs on its worker thread, with JAX on the CPU),
the Router's forwards reaching the server through C{treq.testing.StubTreq},
so that only the C{traceparent} header joins their spans.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import types

import numpy as np
import pytest
import pytest_twisted
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry
from treq.testing import StubTreq
from twisted.logger import globalLogPublisher
from twisted.python.threadpool import ThreadPool
from twisted.web.http_headers import Headers

from kcoral.client.exchange import RunCall
from kcoral.common.queue import WaitQueue
from kcoral.common.report import parse_report
from kcoral.router.app import RouterApp
from kcoral.router.pool import Pool
from kcoral.router.scheduler import Scheduler
from kcoral.server.app import OK
from kcoral.tracing import NO_SPAN, NO_TRACING, OpenTelemetry, tracing_for
from tests.fakes import FakeClient, node_report
from tests.harness import until
from tests.httputil import AsKCoralSite
from tests.test_http import Harness

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


def recording(exporter: InMemorySpanExporter) -> OpenTelemetry:
    """Tracing whose spans, as they end, go to C{exporter}."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return OpenTelemetry(provider)


class Deployment:
    """A Router app whose one member is a server app, each with its own tracing."""

    def __init__(self, reactor, threadpool, exporter, *, router_tracing=None):
        self.server = Harness(reactor=reactor, threadpool=threadpool)
        self.server.app.tracing = recording(exporter)
        self.server.app.executor.load()
        self.server.app.status = OK
        pool = Pool(reactor, max_status_age_seconds=60.0, unhealthy_threshold=3,
                    recovery_threshold=1, node_retention_seconds=600.0)
        pool.report("node-t", parse_report(node_report(host="10.0.0.7", capacities=(2,))))
        pool.observe()
        self.forwards = FakeClient(self.server.treq)
        self.router = RouterApp(pool=pool, scheduler=Scheduler(pool, WaitQueue(reactor, 8, 30.0)),
                                outgoing=types.SimpleNamespace(client=self.forwards),
                                reactor=reactor, registry=CollectorRegistry(),
                                tracing=router_tracing or recording(exporter))
        self.treq = StubTreq(AsKCoralSite(self.router.resource()))

    async def run(self, body: bytes, headers: dict):
        """The Router's answer (status, body) to C{body}, once both apps are done."""
        done: list = []
        d = self.treq.post("http://router.test/v1/run", data=body, headers=headers)
        d.addCallback(lambda r: self.treq.content(r).addCallback(lambda b: (r.code, b)))
        d.addBoth(done.append)

        def settled():
            self.treq.flush()
            self.forwards.flush()
            return done

        await until(settled, "the Router's answer", 30)
        if not isinstance(done[0], tuple):
            done[0].raiseException()
        return done[0]


@functools.cache
def small_program():
    import jax.numpy as jnp

    from kcoral import Program

    return Program.from_function(lambda v: jnp.sin(v) * 2, np.float32(1))


def run_request(value: float = 1.0, *, traceparent: str | None = TRACEPARENT):
    """The body and headers of a client's run of a small program."""
    send = RunCall.prepare(small_program(), (np.float32(value),), {}).send(set(), "run-1")
    headers = dict(send.headers)
    if traceparent is not None:
        headers["traceparent"] = traceparent
    return b"".join(bytes(p) for p in send.parts), headers


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


@pytest.fixture
def threadpool():
    pool = ThreadPool(minthreads=1, maxthreads=1, name="test-run")
    pool.start()
    yield pool
    pool.stop()


def by_name(exporter) -> dict:
    """The finished spans, by name (each name once, but the two queue waits)."""
    spans: dict = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    return spans


def parent_of(span) -> int | None:
    return span.parent.span_id if span.parent is not None else None


@pytest_twisted.ensureDeferred
async def test_a_run_s_spans_join_the_client_s_trace_from_router_to_worker(
        reactor, threadpool, exporter):
    """The client's traceparent parents the Router's run; its forward parents the worker's run and steps."""
    deployment = Deployment(reactor, threadpool, exporter)
    code, _ = await deployment.run(*run_request())
    assert code == 200
    spans = by_name(exporter)
    assert {span.context.trace_id for group in spans.values() for span in group} == {int(TRACE_ID, 16)}

    (router_run,), (forward,) = spans["kcoral.router.run"], spans["kcoral.forward"]
    assert parent_of(router_run) == int(CLIENT_SPAN, 16)
    assert router_run.attributes["kcoral.request_id"] == "run-1"
    assert parent_of(forward) == router_run.context.span_id
    assert forward.attributes["kcoral.node_id"] == "node-t"
    assert forward.attributes["kcoral.worker"] == "worker0"
    # The worker's run is the forward's child: only the forwarded header says so.
    (server_run,) = spans["kcoral.server.run"]
    assert parent_of(server_run) == forward.context.span_id
    for name in ("kcoral.compile", "kcoral.execute"):
        (step,) = spans[name]
        assert parent_of(step) == server_run.context.span_id
    waits = {parent_of(span) for span in spans["kcoral.queue_wait"]}
    assert waits == {router_run.context.span_id, server_run.context.span_id}
    assert all(span.status.status_code != StatusCode.ERROR
               for group in spans.values() for span in group)
    # Steps lie within their runs.
    assert router_run.start_time <= forward.start_time <= server_run.start_time
    assert server_run.end_time <= forward.end_time <= router_run.end_time

    # Compiled once: the next run of the program has no compile span.
    exporter.clear()
    code, _ = await deployment.run(*run_request(2.0))
    assert code == 200 and "kcoral.compile" not in by_name(exporter)
    assert "kcoral.execute" in by_name(exporter)


@pytest_twisted.ensureDeferred
async def test_without_a_traceparent_a_run_starts_a_trace(reactor, threadpool, exporter):
    """A client that sends no (or a malformed) traceparent gets a new trace, still Router -> worker."""
    deployment = Deployment(reactor, threadpool, exporter)
    code, _ = await deployment.run(*run_request(traceparent="00-not-a-trace"))
    assert code == 200
    spans = by_name(exporter)
    (router_run,), (server_run,) = spans["kcoral.router.run"], spans["kcoral.server.run"]
    assert router_run.parent is None
    assert server_run.context.trace_id == router_run.context.trace_id != int(TRACE_ID, 16)


@pytest_twisted.ensureDeferred
async def test_a_router_without_tracing_passes_the_traceparent_on(reactor, threadpool, exporter):
    """With --tracing none on the Router, the worker's run is the child of the client's span."""
    deployment = Deployment(reactor, threadpool, exporter, router_tracing=NO_TRACING)
    code, _ = await deployment.run(*run_request())
    assert code == 200
    spans = by_name(exporter)
    assert "kcoral.router.run" not in spans
    (server_run,) = spans["kcoral.server.run"]
    assert parent_of(server_run) == int(CLIENT_SPAN, 16)


@pytest_twisted.ensureDeferred
async def test_a_failed_run_is_an_error_span(reactor, threadpool, exporter):
    """A run the worker refuses (a broken frame) ends its run span with an error status."""
    deployment = Deployment(reactor, threadpool, exporter)
    body, headers = run_request()
    code, _ = await deployment.run(body[:-3], headers)
    assert code == 400
    (server_run,) = by_name(exporter)["kcoral.server.run"]
    assert server_run.status.status_code == StatusCode.ERROR
    assert server_run.events[0].name == "exception"


def test_console_tracing_logs_each_span():
    """--tracing console writes each ended span as a log event with its ids and request id."""
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        tracing = tracing_for("console", "kcoral-test")
        headers = Headers({b"traceparent": [TRACEPARENT.encode()]})
        with tracing.start("kcoral.router.run", headers, request_id="r-9") as run:
            run.child("kcoral.queue_wait").end()
    finally:
        globalLogPublisher.removeObserver(events.append)
    logged = {e["span"]: e for e in events if "span" in e}
    assert set(logged) == {"kcoral.router.run", "kcoral.queue_wait"}
    assert logged["kcoral.router.run"]["request_id"] == "r-9"
    assert logged["kcoral.router.run"]["parent_id"] == CLIENT_SPAN
    assert logged["kcoral.queue_wait"]["parent_id"] == logged["kcoral.router.run"]["span_id"]
    assert {e["trace_id"] for e in logged.values()} == {TRACE_ID}


def test_no_tracing_does_nothing():
    """--tracing none: every span is the one empty span, naming no parent to anyone."""
    span = NO_TRACING.start("kcoral.router.run", Headers({b"traceparent": [TRACEPARENT.encode()]}))
    assert span is NO_SPAN and span.child("kcoral.forward") is NO_SPAN
    assert span.traceparent() is None
    with span.child("kcoral.execute"):
        pass
    assert span.ended("result") == "result"
    assert tracing_for("none", "kcoral-router") is NO_TRACING


@pytest.mark.integration
def test_no_tracing_imports_nothing_of_opentelemetry():
    """The services, built with --tracing none, never import OpenTelemetry."""
    code = ("import sys\n"
            "from twisted.internet import reactor\n"
            "from kcoral import cli\n"
            "from kcoral.router.service import RouterConfig, RouterService\n"
            "from kcoral.common.serverconfig import ServerConfig\n"
            "from kcoral.server.service import ServerService\n"
            "RouterService(RouterConfig(port=0), reactor)\n"
            "ServerService(ServerConfig(port=0, gpus='none'), reactor)\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_a_client_in_a_traced_span_sends_its_traceparent():
    """A client called inside an active OpenTelemetry span sends that span as the run's traceparent."""
    tracer = TracerProvider().get_tracer("notebook")
    assert "traceparent" not in run_request(traceparent=None)[1]
    with tracer.start_as_current_span("cell") as cell:
        _, headers = run_request(traceparent=None)
    context = cell.get_span_context()
    assert headers["traceparent"] == (f"00-{context.trace_id:032x}-{context.span_id:016x}"
                                      f"-{context.trace_flags:02x}")
