"""
KCoral's HTTP/1.1 connection: a deadline on each request head, a refusal
that is answered before the connection closes, and a graceful close.
"""

from __future__ import annotations

from typing import cast

from twisted.internet.interfaces import IConsumer, IDelayedCall, ISSLTransport, ITCPTransport
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web import http
from zope.interface import Attribute, Interface

from kcoral.errors import BadRequest
from kcoral.web.requestid import request_id_from
from kcoral.web.responses import raw_error_response
from kcoral.web.seams import close_after_requests, drop_input, requests_of

#: After refusing a body, how long to keep reading (and discarding) it so the
#: client sees our answer instead of a connection reset.
LINGER_SECONDS = 2.0


class IKCoralSite(Interface):
    """The site that builds a connection (C{KCoralSite}): its settings and
    shared state, as the connection and its requests read them."""

    bounds = Attribute("The body's bounds (kcoral.web.bounds.BodyBounds).")
    spool = Attribute("Where large bodies go (kcoral.web.spool.Spool), or None.")
    streams = Attribute("Whether a request (method, path) whose body is spooled is processed "
                        "while its body arrives.")
    client_guard = Attribute("The client tokens guarded paths need (IGuard), or None.")
    clock = Attribute("The reactor's clock (IReactorTime).")
    logger = Attribute("The service's twisted.logger Logger.")
    metrics = Attribute("The service's HTTP metrics (kcoral.metrics.HttpMetrics).")
    header_timeout = Attribute("Seconds each request head may take.")
    keepalive = Attribute("How the kernel probes each connection for a silent peer "
                          "(kcoral.common.keepalive.Keepalive).")
    connections = Attribute("The open connections (kcoral.web.connections.Connections).")
    closing = Attribute("True once every answer closes its connection.")


class KCoralChannel(http.HTTPChannel):
    """
    A connection that must send each request head within its site's
    C{header_timeout} seconds (from its opening, then from each answer), so
    a byte-a-second client cannot hold it forever.
    """

    #: Set by the site that built it, as for every Twisted protocol.
    site: IKCoralSite
    transport: ITCPTransport | None
    _headerDeadline: IDelayedCall | None = None
    _lingering: IDelayedCall | None = None
    #: What arrives is dropped, and closing lingers (L{discard_input}).
    _discarding = False
    #: The first line of the request whose head is being read, until it is whole.
    _request_line = b""

    def connectionMade(self):
        super().connectionMade()
        self.site.connections.add(self)
        # A client whose link went silent while its run was in flight
        # (Twisted's idle timeout sleeps meanwhile) is then noticed, and its
        # run cancelled, as one that closed its connection.
        self.site.keepalive.apply_to(self.transport)
        self._armHeaderDeadline()

    def close_when_idle(self) -> None:
        """Close this connection gracefully: now if no request is in progress,
        else once its response has been sent (never cutting it short)."""
        if requests_of(self):
            close_after_requests(self)
        elif self.transport is not None:
            self._close()

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
        self._close()

    def _close(self) -> None:
        """
        Close gracefully (what is buffered is sent first), as Twisted's own
        close does: the transport no longer drives this channel first. A TLS
        transport sends its close alert only once no producer is registered
        on it: closed while this channel still was one, it sent nothing and
        read nothing more, and a client that sent its next request on the
        connection meanwhile waited for the idle timeout (60 s) to learn it
        was closed.
        """
        super().loseConnection()

    def lineReceived(self, line):
        # Kept so that a request can be refused from its head alone, before
        # Twisted hands it its method and path with the whole body.
        if not self._request_line:  # an empty line before a request is skipped
            self._request_line = line
        super().lineReceived(line)

    def lineLengthExceeded(self, line):
        # Twisted's line reader closes the connection without a word on a
        # head line past MAX_LENGTH: the client, or a proxy in front, would
        # see a reset and never why.
        self.site.metrics.observe(b"other", 400, 0.0)
        self.refuse(raw_error_response(
            BadRequest(f"a line of the request head is over {self.MAX_LENGTH} bytes"),
            request_id_from(None)))

    def headers_complete(self) -> tuple[bytes, bytes, bytes]:
        """The head of the request in progress is whole: its deadline is met.
        Its method, URI and version, as its request line gave them."""
        if self._headerDeadline is not None:
            self._headerDeadline.cancel()
            self._headerDeadline = None
        line, self._request_line = self._request_line, b""
        method, _, rest = line.partition(b" ")
        uri, _, version = rest.partition(b" ")
        return method, uri, version

    def requestDone(self, request):
        super().requestDone(request)
        if self.persistent and self.transport is not None:
            self._armHeaderDeadline()

    def discard_input(self) -> None:
        """Read and drop whatever else arrives: the request in progress was
        answered before its body ended, and nothing after it can be parsed.
        The connection then closes as L{refuse} closes it."""
        close_after_requests(self)
        self._discarding = True
        drop_input(self)

    def refuse(self, response: bytes) -> None:
        """Answer C{response} now, then discard whatever else arrives."""
        self.discard_input()
        assert self.transport is not None  # called from the connection's own dataReceived
        self.transport.write(response)
        self._linger()

    def loseConnection(self):
        if not self._discarding:
            super().loseConnection()
            return
        assert self.transport is not None  # a request is done on an open connection
        # As Twisted's own close does: the transport no longer drives this channel.
        cast(IConsumer, self.transport).unregisterProducer()
        self._linger()

    def _linger(self) -> None:
        """Close once the answer is sent, while still reading (and dropping)
        what the client sends, up to L{LINGER_SECONDS}: a socket closed with
        unread data sends a reset, which can destroy the answer before the
        client reads it, and fails a client still sending its body."""
        transport = self.transport
        assert transport is not None
        if self._lingering is not None:
            return
        # TLS has no half-close: a TLS transport's loseWriteConnection would be
        # its TCP connection's (a protocol wrapper passes unknown names on),
        # closing the socket under TLS's own records.
        tls = ISSLTransport.providedBy(transport)
        loseWrite = None if tls else getattr(transport, "loseWriteConnection", None)
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
        self.site.connections.discard(self)
