"""
A Twisted C{Site} that enforces KCoral's bounds while the request is still
arriving, which C{twisted.web} itself does not offer:

 - a body larger than C{max_request_bytes} is refused with 413 straight from its
   C{Content-Length}, or as soon as a chunked body passes the limit, without
   reading (or buffering) the rest;
 - bodies are kept in memory (they are bounded), never in a temporary file, so
   no disk I/O happens on the reactor thread;
 - every response carries C{X-Request-ID}, and every request is counted in the
   service's metrics;
 - a client must finish sending its request head within C{header_timeout}
   seconds, so a byte-a-second client cannot hold a connection forever.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable

from twisted.internet import protocol
from twisted.internet import reactor as _globalReactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, ITCPTransport
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.protocols import policies
from twisted.python.failure import Failure
from twisted.web import http, server

from kcoral.errors import BadRequest, KCoralError, PayloadTooLarge, RequestTimeout
from kcoral.web.errors import method_not_allowed
from kcoral.web.requestid import HEADER, request_id_from
from kcoral.web.responses import raw_error_response

#: After refusing a body, how long to keep reading (and discarding) it so the
#: client sees our answer instead of a connection reset.
LINGER_SECONDS = 2.0
#: A body must arrive at this average rate or better, counted from the end of
#: the head once this grace has passed: a client sending a byte every minute
#: (under the idle timeout) would otherwise hold its connection for as long
#: as a 256 MiB body takes at that pace. A slow link (1 Mbit/s) is far above.
MIN_BODY_BYTES_PER_SECOND = 1024
BODY_GRACE_SECONDS = 10.0


class RequestBody(io.BytesIO):
    """A request body that handlers may view without copying (getbuffer):
    closing it would fail while such views exist, and the GC frees it."""

    def close(self):
        pass


class KCoralRequest(server.Request):
    channel: KCoralChannel
    content: RequestBody | None
    _refused = False
    _received = 0
    _started = None

    @property
    def request_id(self) -> str:
        rid = getattr(self, "_request_id", None)
        if rid is None:
            rid = self._request_id = request_id_from(self.requestHeaders.getRawHeaders(HEADER, [None])[0])
        return rid

    def gotLength(self, length):
        self._started = self.channel.site.clock.seconds()
        self.channel.headers_complete()
        limit = self.channel.site.max_request_bytes
        if length is not None and length > limit:
            # Read by the channel once this returns: a client told to go on
            # with a body already refused would send it for nothing.
            self.requestHeaders.removeHeader(b"Expect")
            self._refuse(PayloadTooLarge(f"request body of {length} bytes exceeds the limit of "
                                         f"{limit} bytes"))
            return
        self.content = RequestBody()

    def handleContentChunk(self, data):
        if self._refused:
            return
        self._received += len(data)
        site = self.channel.site
        limit = site.max_request_bytes
        if self._received > limit:
            self._refuse(PayloadTooLarge(f"request body exceeds the limit of {limit} bytes"))
            return
        elapsed = site.clock.seconds() - self._started
        if elapsed > BODY_GRACE_SECONDS and self._received < MIN_BODY_BYTES_PER_SECOND * elapsed:
            self._refuse(RequestTimeout(f"request body arrives at {self._received / elapsed:.0f} "
                                        f"bytes/s, under the least of {MIN_BODY_BYTES_PER_SECOND}"))
            return
        assert self.content is not None  # set by gotLength, which refused if not
        self.content.write(data)

    def _refuse(self, error: KCoralError) -> None:
        self._refused = True
        self.content = RequestBody()
        site = self.channel.site
        site.logger.warn("{request_id} refused: {message}", request_id=self.request_id,
                         message=error.message)
        site.metrics.observe(self.uri or b"other", error.status, 0.0)
        self.channel.refuse(raw_error_response(error, self.request_id))

    def requestReceived(self, command, path, version):
        if not self._refused:
            super().requestReceived(command, path, version)

    def process(self):
        self.setHeader(HEADER, self.request_id.encode())
        if self.channel.site.closing:
            self.close_after_response()
        if self.path == b"*":
            # Twisted would answer it itself, with an empty 405 unless it is
            # OPTIONS: KCoral's errors are JSON with a request id.
            self._answer_star()
            return
        super().process()

    def _answer_star(self) -> None:
        """An empty 200 for C{OPTIONS *} (a probe of the server), else a 405."""
        self.setHeader(b"Date", http.datetimeToString())
        if self.method == b"OPTIONS":
            self.setHeader(b"Content-Length", b"0")
        else:
            self.setHeader(b"Allow", b"OPTIONS")
            self.write(method_not_allowed(self))
        self.finish()

    def render(self, resrc):
        # Twisted's process() names itself and its version in a Server
        # header: nothing a client needs, and something an attacker would.
        self.responseHeaders.removeHeader(b"Server")
        super().render(resrc)

    def close_after_response(self) -> None:
        """Answer with C{Connection: close} and close the connection after
        this response: the service is stopping, and a client must not send
        another request on a connection that is about to close."""
        if not self.startedWriting:
            self.setHeader(b"Connection", b"close")
        if self.channel is not None:
            self.channel.persistent = False

    def finish(self):
        site = self.channel.site if self.channel is not None else None
        if site is not None and not self.finished and self._started is not None:
            site.metrics.observe(self.path, self.code, site.clock.seconds() - self._started)
        return super().finish()


class KCoralChannel(http.HTTPChannel):
    #: Set by the site that built it, as for every Twisted protocol.
    site: KCoralSite
    transport: ITCPTransport | None
    _headerDeadline: IDelayedCall | None = None
    _lingering: IDelayedCall | None = None

    def connectionMade(self):
        super().connectionMade()
        self.site.channels.add(self)
        self._armHeaderDeadline()

    def close_when_idle(self) -> None:
        """Close this connection gracefully: now if no request is in progress,
        else once its response has been sent (never cutting it short)."""
        if self.requests:
            self.persistent = False  # requestDone then loses the connection
        elif self.transport is not None:
            self.transport.loseConnection()  # flushes what is still buffered

    def _armHeaderDeadline(self):
        timeout = self.site.header_timeout
        if timeout and self._headerDeadline is None:
            self._headerDeadline = self.site.clock.callLater(timeout, self._headerTimedOut)

    def _headerTimedOut(self):
        self._headerDeadline = None
        self.site.logger.info("closing a connection that sent no complete request head in time")
        # A graceful close, not an abort: the deadline is re-armed as soon as
        # a response is handed to the transport, and a client still reading a
        # large result must get all of it. Nothing is read after this; a peer
        # that never reads is aborted by Twisted's own idle timeout.
        assert self.transport is not None  # connectionLost cancels the deadline
        self.transport.loseConnection()

    def headers_complete(self):
        if self._headerDeadline is not None:
            self._headerDeadline.cancel()
            self._headerDeadline = None

    def requestDone(self, request):
        super().requestDone(request)
        if self.persistent and self.transport is not None:
            self._armHeaderDeadline()

    def refuse(self, response: bytes) -> None:
        """Answer C{response} now, then discard whatever else arrives."""
        self.rawDataReceived = self.dataReceived = lambda data: None  # type: ignore[method-assign]
        transport = self.transport
        assert transport is not None  # called from the connection's own dataReceived
        transport.write(response)
        loseWrite = getattr(transport, "loseWriteConnection", None)
        if loseWrite is not None:
            loseWrite()
        else:
            transport.loseConnection()
        self._lingering = self.site.clock.callLater(LINGER_SECONDS, transport.abortConnection)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        for call in (self._headerDeadline, self._lingering):
            if call is not None and call.active():
                call.cancel()
        self._headerDeadline = None
        super().connectionLost(reason)
        self.site.channel_lost(self)


#: What Twisted's channel answers to HTTP it cannot parse (request line,
#: header count or size, chunk framing), just before it closes the connection.
TWISTED_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\n\r\n"


class JSONBadRequest(policies.ProtocolWrapper):
    """
    The transport of a L{KCoralChannel}, which answers HTTP that Twisted
    cannot parse with KCoral's JSON 400 and its request id in place of
    Twisted's bare one: KCoral's errors are JSON with a request id, always.
    """

    wrappedProtocol: KCoralChannel

    def write(self, data):
        if data == TWISTED_BAD_REQUEST:
            channel = self.wrappedProtocol
            requests = channel.requests
            request = requests[-1] if requests else None
            rid = request.request_id if isinstance(request, KCoralRequest) else request_id_from(None)
            channel.site.metrics.observe(b"other", 400, 0.0)
            data = raw_error_response(BadRequest("malformed HTTP request"), rid)
        super().write(data)


class _Refused(protocol.Protocol):
    """A connection beyond the cap: closed as soon as it is made."""

    transport: ITCPTransport | None

    def connectionMade(self):
        assert self.transport is not None  # set by makeConnection
        self.transport.abortConnection()


class KCoralSite(server.Site):
    # The channel itself, not Twisted's wrapper that would pick HTTP/2 or
    # HTTP/1.1 by TLS negotiation: KCoral speaks HTTP/1.1.
    protocol = KCoralChannel  # type: ignore[assignment]
    requestFactory = KCoralRequest

    def __init__(self, resource, *, metrics, max_request_bytes: int, log: Logger,
                 idle_timeout: float = 60.0, header_timeout: float = 30.0, clock=None,
                 max_connections: int | Callable[[], int] | None = None):
        try:
            # KCoral reads no HTML form posts; Twisted's form parsing would
            # parse every POST's Content-Type with the email package, which
            # measured at ~15% of the server's CPU per trivial run.
            # The idle timeout runs on C{clock} too (tests drive it with a Clock).
            super().__init__(resource, timeout=idle_timeout, parsePOSTFormSubmission=False,
                             reactor=clock)
        except TypeError:  # a Twisted without that option (and its cost)
            super().__init__(resource, timeout=idle_timeout, reactor=clock)
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        self.header_timeout = header_timeout
        self.logger = log
        self.clock = clock if clock is not None else _globalReactor
        self.displayTracebacks = False
        self.noisy = False
        #: Open connections, so that a stopping service can close them only
        #: once their responses are out (the reactor's shutdown would drop
        #: whatever they still have buffered).
        self.channels: set[KCoralChannel] = set()
        self._closing: list[Deferred] = []
        #: Open connections beyond which new ones are closed at once
        #: (L{kcoral.web.fdlimit}), or a callable that says how many now (a
        #: Router's own connections to its workers grow with its pool);
        #: None: no cap.
        self.max_connections = max_connections
        self._refused = 0
        #: Keeps the L{JSONBadRequest} wrapper of each open connection.
        self._wrappers: policies.WrappingFactory[JSONBadRequest] = policies.WrappingFactory(self)

    def _limit(self) -> int:
        limit = self.max_connections
        if limit is None:
            return sys.maxsize
        return limit() if callable(limit) else limit

    def buildProtocol(self, addr):
        if len(self.channels) >= self._limit():
            if not self._refused:
                self.logger.warn("{open} connections are open, the most this service takes: "
                                 "closing new ones until some close", open=len(self.channels))
            self._refused += 1
            # Not None, which a plain TCP port closes but a TLS wrapper
            # would wrap and then leave open, with no timeout on it.
            return _Refused()
        return JSONBadRequest(self._wrappers, super().buildProtocol(addr))

    #: Set by L{stop_keep_alive}: every answer from then on closes its connection.
    closing = False

    def stop_keep_alive(self) -> None:
        """No more requests on open connections: each one closes after the
        response in progress (or the next one, for an idle connection)."""
        self.closing = True
        for channel in list(self.channels):
            for request in channel.requests:
                if isinstance(request, KCoralRequest):
                    request.close_after_response()

    def channel_lost(self, channel) -> None:
        self.channels.discard(channel)
        if self._refused and len(self.channels) < self._limit():
            self.logger.info("taking connections again; {refused} were closed at the limit",
                             refused=self._refused)
            self._refused = 0
        if not self.channels:
            closing, self._closing = self._closing, []
            for d in closing:
                if not d.called:
                    d.callback(None)

    def close_connections(self, timeout: float) -> Deferred:
        """
        Close every connection once its response in progress (if any) has
        been written; fires when all are closed. Connections still open after
        C{timeout} seconds (a client that does not read) are aborted.
        """
        if not self.channels:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._closing.append(d)
        for channel in list(self.channels):
            channel.close_when_idle()

        def abort():
            for channel in list(self.channels):
                if channel.transport is not None:
                    channel.transport.abortConnection()

        timer = self.clock.callLater(timeout, abort)
        d.addBoth(lambda result: (timer.cancel() if timer.active() else None, result)[1])
        return d

    def log(self, request):
        # No access log: each service logs its own events, with request ids.
        pass
