"""
KCoral's Twisted C{Site}, composed of the pieces that each bound one thing
C{twisted.web} itself leaves open:

 - L{kcoral.web.request}: a body refused while it arrives, past its
   L{kcoral.web.bounds}, and spooled to a file when large (L{kcoral.web.spool});
   a request id and a metric on every answer;
 - L{kcoral.web.channel}: a deadline on each request head, a refusal that is
   answered before the connection closes;
 - L{kcoral.web.badrequest}: KCoral's JSON 400 for HTTP Twisted cannot parse,
   in the wrapper that sends each write at once (L{kcoral.web.sendnow});
 - L{kcoral.web.connections}: a cap on open connections, and their graceful
   close when the service stops.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet import reactor as _globalReactor
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.protocols import policies
from twisted.web import server
from zope.interface import implementer

from kcoral.common.keepalive import DEFAULT_KEEPALIVE, Keepalive
from kcoral.web.auth import IGuard
from kcoral.web.badrequest import JSONBadRequest
from kcoral.web.bounds import BodyBounds
from kcoral.web.channel import IKCoralSite, KCoralChannel
from kcoral.web.connections import Connections, Refused
from kcoral.web.request import KCoralRequest
from kcoral.web.seams import requests_of
from kcoral.web.spool import Spool


@implementer(IKCoralSite)
class KCoralSite(server.Site):
    # The channel itself, not Twisted's wrapper that would pick HTTP/2 or
    # HTTP/1.1 by TLS negotiation: KCoral speaks HTTP/1.1.
    protocol = KCoralChannel  # type: ignore[assignment]
    requestFactory = KCoralRequest

    def __init__(self, resource, *, metrics, max_request_bytes: int, log: Logger,
                 idle_timeout: float = 60.0, header_timeout: float = 30.0, clock=None,
                 max_connections: int | Callable[[], int] | None = None,
                 spool: Spool | None = None, client_guard: IGuard | None = None,
                 streams: Callable[[bytes, bytes], bool] = lambda method, path: False,
                 keepalive: Keepalive = DEFAULT_KEEPALIVE):
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
        self.bounds = BodyBounds(max_request_bytes)
        #: Where bodies over its threshold go; None: every body in memory.
        self.spool = spool
        #: Whether a request (its method and path) whose body is spooled is
        #: processed while its body arrives (L{kcoral.web.request}).
        self.streams = streams
        #: What a request to a guarded path of an API family must present,
        #: checked as soon as a POST's head is whole, before its body is read
        #: (its resource, L{kcoral.web.front.Front}, checks it again).
        self.client_guard = client_guard
        self.header_timeout = header_timeout
        self.keepalive = keepalive
        self.logger = log
        self.clock = clock if clock is not None else _globalReactor
        self.displayTracebacks = False
        self.noisy = False
        #: Open connections, so that a stopping service can close them only
        #: once their responses are out (the reactor's shutdown would drop
        #: whatever they still have buffered), and at most C{max_connections}
        #: of them (L{kcoral.web.fdlimit}).
        self.connections = Connections(self.clock, log, max_connections)
        #: Keeps the L{JSONBadRequest} wrapper of each open connection.
        self._wrappers: policies.WrappingFactory[JSONBadRequest] = policies.WrappingFactory(self)

    @property
    def channels(self) -> set[KCoralChannel]:
        return self.connections.channels

    def buildProtocol(self, addr):
        # The cap is checked here rather than by a policies wrapper
        # (LimitTotalConnectionsFactory wraps each protocol it builds in a
        # ProtocolWrapper of its own): one wrapper per connection, not two.
        if not self.connections.admit():
            # Not None, which a plain TCP port closes but a TLS wrapper
            # would wrap and then leave open, with no timeout on it.
            return Refused()
        return JSONBadRequest(self._wrappers, super().buildProtocol(addr))

    #: Set by L{stop_keep_alive}: every answer from then on closes its connection.
    closing = False

    def stop_keep_alive(self) -> None:
        """No more requests on open connections: each one closes after the
        response in progress (or the next one, for an idle connection)."""
        self.closing = True
        for channel in list(self.channels):
            for request in requests_of(channel):
                if isinstance(request, KCoralRequest):
                    request.close_after_response()

    def close_connections(self, timeout: float) -> Deferred[None]:
        """
        Close every connection once its response in progress (if any) has
        been written; fires when all are closed. Connections still open after
        C{timeout} seconds (a client that does not read) are aborted.
        """
        return self.connections.close(timeout)

    def log(self, request):
        # No access log: each service logs its own events, with request ids.
        pass
