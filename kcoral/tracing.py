"""
Traces of runs: a span for each step a run takes (a Router's wait for
capacity and its forward to a worker; a server's wait for a slot, its compile
and its execution), in the trace of the client's W3C C{traceparent} header,
which the Router hands on to the worker as the traceparent of its forward.

With C{--tracing none}, the default, every span is L{NO_SPAN}, whose methods
do nothing: OpenTelemetry is never imported and a run pays a few empty calls.
C{console} and C{otlp} record spans with the OpenTelemetry SDK (the optional
extra C{kcoral[otel]}): C{console} logs each one as it ends (so C{--log-format
json} makes them JSON lines too), C{otlp} exports them in batches over OTLP/HTTP,
configured by OpenTelemetry's own environment variables
(C{OTEL_EXPORTER_OTLP_ENDPOINT}, C{OTEL_SERVICE_NAME}...).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from zope.interface import Interface, implementer

from kcoral._version import __version__

log = Logger()

#: The values of C{--tracing}.
TRACING_MODES = ("none", "console", "otlp")
TRACEPARENT = b"traceparent"


class ISpan(Interface):
    """
    One step of a run, timed from its start to its end. Keyword attributes
    are recorded as C{kcoral.NAME}. A span is a context manager: leaving the
    block ends it, recording the exception that left it, if any.
    """

    def child(name: str, **attributes: Any) -> ISpan:
        """A span starting now within this one."""

    def traceparent() -> bytes | None:
        """The C{traceparent} header naming this span as the parent of a
        request it sends; None when nothing is recorded."""

    def failed(error: BaseException) -> None:
        """Record that the step failed with C{error}."""

    def end() -> None:
        """End the span (once)."""

    def ended(result: Any) -> Any:
        """End the span as a Deferred's callback: C{result}, passed on, is
        recorded as the span's failure when it is one."""

    def __enter__() -> ISpan:
        """The span itself."""

    def __exit__(kind, error, traceback) -> None:
        """End the span, failed with C{error} if there is one."""


class ITracing(Interface):
    def start(name: str, headers: Headers, **attributes: Any) -> ISpan:
        """The span of a run that arrived with the request headers C{headers}:
        within the caller's trace if they carry a valid C{traceparent}."""


@implementer(ISpan)
class _NoSpan:
    __slots__ = ()

    def child(self, name: str, **attributes: Any) -> ISpan:
        return self

    def traceparent(self) -> bytes | None:
        return None

    def failed(self, error: BaseException) -> None:
        pass

    def end(self) -> None:
        pass

    def ended(self, result: Any) -> Any:
        return result

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        pass


NO_SPAN = _NoSpan()


@implementer(ITracing)
class _NoTracing:
    def start(self, name: str, headers: Headers, **attributes: Any) -> ISpan:
        return NO_SPAN


#: C{--tracing none}.
NO_TRACING: ITracing = _NoTracing()


def _attributes(given: dict[str, Any]) -> dict[str, Any]:
    # OpenTelemetry refuses None values (with a warning each time).
    return {f"kcoral.{name}": value for name, value in given.items() if value is not None}


@implementer(ISpan)
class _Span:
    __slots__ = ("_span", "_tracing")

    def __init__(self, tracing: OpenTelemetry, span):
        self._tracing = tracing
        self._span = span

    def child(self, name: str, **attributes: Any) -> ISpan:
        return self._tracing.span(name, self._span, attributes)

    def traceparent(self) -> bytes | None:
        return self._tracing.traceparent_of(self._span)

    def failed(self, error: BaseException) -> None:
        self._tracing.fail(self._span, error)

    def end(self) -> None:
        self._span.end()

    def ended(self, result: Any) -> Any:
        if isinstance(result, Failure) and result.value is not None:
            self.failed(result.value)
        self.end()
        return result

    def __enter__(self) -> _Span:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None:
            self.failed(error)
        self.end()


@implementer(ITracing)
class OpenTelemetry:
    """Spans recorded by the OpenTelemetry C{provider} (an SDK TracerProvider)."""

    def __init__(self, provider):
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = provider.get_tracer("kcoral", __version__)
        self._propagator = TraceContextTextMapPropagator()
        self._in_context = trace.set_span_in_context
        self._server = trace.SpanKind.SERVER
        self._error = trace.StatusCode.ERROR
        self._status = trace.Status

    def start(self, name: str, headers: Headers, **attributes: Any) -> ISpan:
        header = headers.getRawHeaders(TRACEPARENT)
        context = (self._propagator.extract({"traceparent": header[0].decode("latin-1")})
                   if header else None)
        return _Span(self, self._tracer.start_span(name, context, kind=self._server,
                                                   attributes=_attributes(attributes)))

    def span(self, name: str, parent, attributes: dict[str, Any]) -> ISpan:
        """A span within C{parent} (an OpenTelemetry span)."""
        return _Span(self, self._tracer.start_span(name, self._in_context(parent),
                                                   attributes=_attributes(attributes)))

    def traceparent_of(self, span) -> bytes:
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, self._in_context(span))
        return carrier["traceparent"].encode("ascii")

    def fail(self, span, error: BaseException) -> None:
        span.record_exception(error)
        span.set_status(self._status(self._error, str(error) or type(error).__name__))


class _LogExporter:
    """C{--tracing console}: each span, as it ends, is a line of the service's log."""

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        for span in spans:
            context, parent = span.get_span_context(), span.parent
            log.info("span {span} {duration_ms:.3f} ms trace {trace_id} span {span_id} "
                     "parent {parent_id}", span=span.name,
                     duration_ms=((span.end_time or 0) - (span.start_time or 0)) / 1e6,
                     trace_id=f"{context.trace_id:032x}", span_id=f"{context.span_id:016x}",
                     parent_id=f"{parent.span_id:016x}" if parent else None,
                     request_id=span.attributes.get("kcoral.request_id"),
                     status=span.status.status_code.name)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def current_traceparent() -> str | None:
    """
    The C{traceparent} of the caller's active OpenTelemetry span (a client
    in a traced notebook or service), or None. Imports nothing: without
    OpenTelemetry already imported there is no such span.
    """
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


def tracing_for(mode: str, service: str) -> ITracing:
    """
    The tracing of C{--tracing mode} in the service named C{service} (its
    OpenTelemetry C{service.name} unless C{OTEL_SERVICE_NAME} says otherwise).
    A ValueError when OpenTelemetry is not installed.
    """
    return tracing_maker(mode, service)()


def tracing_maker(mode: str, service: str) -> Callable[[], ITracing]:
    """
    What makes L{tracing_for}'s tracing, checked now (a ValueError when
    OpenTelemetry is not installed), made when called: C{otlp}'s exporter
    starts a thread, which a process that confines itself starts after
    (L{kcoral.sandbox.confinement}).
    """
    if mode == "none":
        return lambda: NO_TRACING
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise ValueError(f"--tracing {mode} needs OpenTelemetry: pip install 'kcoral[otel]'") from None
    if mode == "console":
        def processor():
            return SimpleSpanProcessor(_LogExporter())  # type: ignore[arg-type]
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError("--tracing otlp needs OpenTelemetry's OTLP exporter: "
                             "pip install 'kcoral[otel]'") from None

        def processor():
            return BatchSpanProcessor(OTLPSpanExporter())

    def make() -> ITracing:
        named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
        provider = TracerProvider(resource=Resource.create(named))
        provider.add_span_processor(processor())
        return OpenTelemetry(provider)

    return make
