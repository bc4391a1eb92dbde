"""
KCoral's request: the adapter that feeds Twisted's calls on a request
(C{gotLength}, C{handleContentChunk}, C{requestReceived}, C{finish},
C{connectionLost}) to its body's intake (L{kcoral.web.intake}); a request id
on every answer, and every answer counted in the service's metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twisted.web import http, server

from kcoral.web.body import IBody, MemoryBody
from kcoral.web.errors import method_not_allowed
from kcoral.web.intake import Intake
from kcoral.web.requestid import HEADER, request_id_from
from kcoral.web.seams import close_after_requests
from kcoral.web.sendnow import together

if TYPE_CHECKING:
    from kcoral.web.body import RequestBody
    from kcoral.web.channel import KCoralChannel


class KCoralRequest(server.Request):
    """
    A request whose body is bounded while it arrives, kept in memory,
    spooled or streamed, or refused from its head (L{kcoral.web.intake});
    L{body} is what its handler reads.
    """

    channel: KCoralChannel
    content: RequestBody | None
    _request_id: str | None = None

    def __init__(self, channel, *args, **kw):
        super().__init__(channel, *args, **kw)
        self._intake = Intake(self, channel)

    @property
    def request_id(self) -> str:
        rid = self._request_id
        if rid is None:
            rid = self._request_id = request_id_from(self.requestHeaders.getRawHeaders(HEADER, [None])[0])
        return rid

    @property
    def body(self) -> IBody:
        """The whole body, once the request is processed: spooled, streamed,
        or its content, taken without a copy (L{MemoryBody})."""
        body = self._intake.body()
        if body is not None:
            return body
        assert self.content is not None  # a processed request has one
        return MemoryBody(self.content)

    def gotLength(self, length):
        method, uri, version = self.channel.headers_complete()
        if self._intake.head(self, length, method, uri):
            super().requestReceived(method, self._intake.target, version)

    def handleContentChunk(self, data):
        self._intake.chunk(data)

    def requestReceived(self, command, path, version):
        # Twisted's channel hands on the target as its request line spelled
        # it: each request is processed with its canonical one (gotLength).
        self._intake.whole().addCallback(self._processed, command, version)

    def _processed(self, now: bool, command: bytes, version: bytes) -> None:
        if now:
            super().requestReceived(command, self._intake.target, version)

    def connectionLost(self, reason):
        self._intake.lost()
        super().connectionLost(reason)

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

    def write(self, data):
        # The first write sends the head too: both in one send.
        with together():
            super().write(data)

    def close_after_response(self) -> None:
        """Answer with C{Connection: close} and close the connection after
        this response: the service is stopping, and a client must not send
        another request on a connection that is about to close."""
        if not self.startedWriting:
            self.setHeader(b"Connection", b"close")
        if self.channel is not None:
            close_after_requests(self.channel)

    def finish(self):
        self._intake.answered()
        site = self.channel.site if self.channel is not None else None
        started = self._intake.started
        if site is not None and not self.finished and started is not None:
            site.metrics.observe(self.path, self.code, site.clock.seconds() - started)
        return super().finish()
