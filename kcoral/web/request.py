"""
KCoral's request: its body bounded while it arrives (L{kcoral.web.bounds}),
kept in memory or, when large and its site spools, in a temporary file
(L{kcoral.web.spool}); a request id on every answer, and every answer
counted in the service's metrics.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING

from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IPushProducer
from twisted.python.failure import Failure
from twisted.web import http, server

from kcoral.errors import BadRequest, InternalError, KCoralError, RequestTimeout
from kcoral.web.body import PACE_BYTES_PER_SECOND, IBody, MemoryBody
from kcoral.web.errors import method_not_allowed
from kcoral.web.family import guarded, takes_body
from kcoral.web.path import canonical, form_of
from kcoral.web.requestid import HEADER, request_id_from
from kcoral.web.responses import raw_error_response
from kcoral.web.seams import close_after_requests, withhold_continue
from kcoral.web.sendnow import together
from kcoral.web.spool import UNREAD, Holds

if TYPE_CHECKING:
    from kcoral.web.channel import KCoralChannel
    from kcoral.web.spool import Spool, SpoolWriter


#: Chunks of a body forwarded while it arrives smaller than this are joined
#: before it keeps them: each chunk it keeps is then at least this large
#: (but its last), so what objects cost beside their bytes stays negligible.
JOIN_BYTES = 64 << 10


class RequestBody(io.BytesIO):
    """A request body that handlers may view without copying (getbuffer):
    closing it would fail while such views exist, and the GC frees it."""

    def close(self):
        pass


class KCoralRequest(server.Request):
    """
    A request whose body is refused (413, or 408 when it trickles in) as soon
    as it breaks its site's L{kcoral.web.bounds.BodyBounds}, without reading
    or buffering the rest. A body is kept in memory, unless its site has a
    L{kcoral.web.spool.Spool} and it is larger than the spool's threshold:
    then it is written to a file in threads while it arrives (never on the
    reactor thread), and the request is processed once every write has
    ended. Either way L{body} is the whole body; C{content} holds it only
    when it is in memory.

    A request its site L{streams<kcoral.web.site.KCoralSite.streams>}, with
    a body of known length over the spool's threshold, is processed as soon
    as its head is whole: its L{body} is then kept in memory as it arrives
    (within the spool's L{kept<kcoral.web.spool.Spool.kept>} budget), else
    written to a file; readers follow it while it arrives, and its client is
    read only while one does. Answered before its
    body has all arrived (an error, say), it reads and drops the rest of the
    body, and closes its connection after the answer the way a refusal does
    (L{kcoral.web.channel.KCoralChannel.refuse}), so that its client reads
    the answer rather than a reset.
    """

    channel: KCoralChannel
    content: RequestBody | None
    _refused = False
    _received = 0
    _started = None
    _spooling: SpoolWriter | None = None
    _holds: Holds | None = None
    _body: IBody | None = None
    #: Processed while its body (of C{_expected} bytes) arrives, which has
    #: not all arrived yet.
    _arriving = False
    _expected = 0
    #: Where its body goes as it arrives, when not into its content: a
    #: spool's writer, the stream's joiner, or nowhere (L{_dropped}).
    _write: Callable[[bytes], object] | None = None
    #: Where the chunks of a streamed body go, once joined (L{_join}).
    _keep: Callable[[bytes], object]
    _small: bytearray

    @property
    def request_id(self) -> str:
        rid = getattr(self, "_request_id", None)
        if rid is None:
            rid = self._request_id = request_id_from(self.requestHeaders.getRawHeaders(HEADER, [None])[0])
        return rid

    def gotLength(self, length):
        channel = self.channel
        site = channel.site
        self._started = site.clock.seconds()
        method, uri, version = channel.headers_complete()
        # The one path everything reads (the guard here, then the resources,
        # Klein and the metrics): Twisted parses it from the canonical target
        # (requestReceived), never from the raw one.
        try:
            path, self._target = canonical(uri)
        except BadRequest as e:
            self.path = form_of(uri)
            self._refuse(e)
            return
        self.path = path
        error = site.bounds.refuse_length(length)
        if error is not None:
            self._refuse(error)
            return
        guard = site.client_guard
        if guard is not None and method == b"POST" and guarded(path):
            # Refused before a byte of its body is read, let alone spooled.
            answer = guard.refusal(self, self.request_id)
            if answer is not None:
                self._refuse_with(self.code, self._raw_answer(answer))
                return
        self.content = RequestBody()
        if not takes_body(method, path):
            # No route reads it (a GET's, a POST to /health): read within the
            # bounds, as any body is, and dropped as it arrives, never held.
            self._write = _dropped
            return
        spool = site.spool
        if spool is not None and (length is None or length > spool.threshold):
            self._holds = Holds(IPushProducer(channel.transport, None), channel, site.clock)
            if length is not None and site.streams(method, path):
                self._stream(spool, length, method, version)
                return
            self._spooling = spool.writer(self._holds, self._spool_failed, length)
            self._write = self._spooling.write

    def _stream(self, spool: Spool, length: int, method: bytes, version: bytes) -> None:
        """Process this request now, its body (of C{length} bytes) kept in
        memory while the spool's budget allows, else written to a file, and
        read as fast as it is forwarded: nothing while it waits for a
        member, then at the member's pace."""
        holds = self._holds
        assert holds is not None  # made with the spool
        body = spool.kept(length)
        if body is None:
            self._spooling = spool.writer(holds, self._spool_failed, length)
            self._keep = self._spooling.write
            body = self._spooling.body
            assert body is not None  # of known length
        else:
            self._keep = body.arrived
        self._write = self._join
        self._body = body
        self._small = bytearray()
        self._arriving = True
        self._expected = length
        holds.hold(UNREAD)
        body.paced = self._paced
        body.stalled = self._stalled
        self.notifyFinish().addBoth(self._let_go)
        super().requestReceived(method, self._target, version)

    def _join(self, data: bytes) -> None:
        """Hand C{data} on to the body, small chunks joined first: a budget
        counts bytes, and a client sending tiny TCP segments would otherwise
        have tens of bytes of object kept (or queued for writing) for each."""
        small = self._small
        if not small and len(data) >= JOIN_BYTES:
            self._keep(data)
            return
        small += data
        if len(small) >= JOIN_BYTES or self._received >= self._expected:
            self._keep(bytes(small))
            small.clear()

    @property
    def body(self) -> IBody:
        """The whole body, once the request has been received."""
        if self._body is not None:
            return self._body
        assert self.content is not None  # a received request has one
        return MemoryBody(self.content.getvalue())

    def handleContentChunk(self, data):
        if self._refused:
            return
        self._received += len(data)
        site = self.channel.site
        # The time its client was held (not read) is not the client's.
        held = self._holds.held_seconds() if self._holds is not None else 0.0
        error = site.bounds.refuse_received(self._received, site.clock.seconds() - self._started - held)
        if error is not None:
            self._refuse(error)
            return
        write = self._write
        if write is None:
            # The content of now, never a write bound to it and kept: that
            # would keep the content as long as the request, which whatever
            # still refers to it (a Deferred's callbacks) may keep long after
            # Twisted lets go of the content.
            assert self.content is not None  # made by gotLength
            self.content.write(data)
        else:
            write(data)
        if self._arriving and self._received >= self._expected:
            # Its last byte: the client is never held again, and its
            # connection's idle timeout is back on before Twisted's channel
            # sets it aside for the processing that follows.
            self._paced(True)

    def _refuse(self, error: KCoralError) -> None:
        self.channel.site.logger.warn("{request_id} refused: {message}",
                                      request_id=self.request_id, message=error.message)
        self._refuse_with(error.status, raw_error_response(error, self.request_id, self.path))

    def _refuse_with(self, status: int, response: bytes) -> None:
        """Answer C{response} (a whole HTTP response) at once, reading no more."""
        # Read by the channel once gotLength returns: a client told to go on
        # with a body already refused would send it for nothing.
        withhold_continue(self)
        self._refused = True
        # What arrived is let go at once, and what still arrives is dropped.
        self.content = RequestBody()
        self._write = _dropped
        if self._spooling is not None:
            self._spooling.discard()
            self._spooling = None
        self._read_the_rest()
        channel = self.channel
        channel.site.metrics.observe(self.path or b"other", status, 0.0)
        if not self._arriving:
            channel.refuse(response)
            return
        # Processed while its body arrived: what it waits on (a forward of
        # that body) is cancelled as if its client had left, and an answer
        # already under way cannot be followed by another.
        self._arriving = False
        if self.startedWriting:
            channel.discard_input()
            assert channel.transport is not None
            channel.transport.abortConnection()
        else:
            channel.refuse(response)
            self.connectionLost(Failure(ConnectionDone(f"refused with {status}")))

    def _read_the_rest(self) -> None:
        """Read (and drop) what its client still sends: a client held while
        its answer is sent, then closed on, would get a reset, not the answer."""
        if self._holds is not None:
            self._holds.release_all()

    def _raw_answer(self, body: bytes) -> bytes:
        """The whole HTTP response of C{body} with this request's status and
        headers, for an answer given before Twisted's request machinery runs."""
        head = [b"HTTP/1.1 %d %s" % (self.code, http.RESPONSES[self.code])]
        self.setHeader(HEADER, self.request_id.encode())
        for name, values in self.responseHeaders.getAllRawHeaders():
            head.extend(name + b": " + value for value in values)
        head.append(b"Connection: close")
        return b"\r\n".join(head) + b"\r\n\r\n" + body

    def requestReceived(self, command, path, version):
        # Twisted's channel hands on the target as its request line spelled
        # it: each request is parsed from its canonical one (gotLength).
        if self._refused:
            return
        if self._arriving:
            # Processed since its head: its body has now all arrived (and is
            # written to its file as the spool goes, while readers follow).
            self._arriving = False
            return
        if self._spooling is None:
            super().requestReceived(command, self._target, version)
            return
        # The channel reads nothing more until this request is done: its
        # processing may wait for the last writes.
        d = self._spooling.finish()
        d.addCallbacks(self._spooled, self._spool_failed, callbackArgs=(command, version))

    def _spooled(self, body: IBody, command: bytes, version: bytes) -> None:
        self._spooling = None
        if self.channel is None:  # its client went away meanwhile
            body.close()
            return
        self._body = body
        self.notifyFinish().addBoth(lambda _: body.close())
        super().requestReceived(command, self._target, version)

    def _spool_failed(self, failure: Failure) -> None:
        self._spooling = None
        if self.channel is None or self._refused:
            return
        self.channel.site.logger.failure("{request_id} could not spool its body",
                                         failure, request_id=self.request_id)
        self._refuse(InternalError("could not buffer the request body"))

    def _paced(self, following: bool) -> None:
        """Whether a reader follows the body as it arrives: if none does
        (none has started, or the one that did is paused), its client is
        held until one does."""
        assert self._holds is not None  # paced bodies are spooled
        if following or self._received >= self._expected:
            self._holds.release(UNREAD)
        else:
            self._holds.hold(UNREAD)

    def _stalled(self) -> None:
        """Its body arrives too slowly for the forward that waits on it (and
        holds a member's slot meanwhile): refused, which frees the member."""
        if self._arriving and not self._refused:
            self._refuse(RequestTimeout(
                f"request body arrives under {PACE_BYTES_PER_SECOND} bytes/s while forwarded"))

    def _let_go(self, _) -> None:
        """A body processed while it arrived is no longer needed."""
        if self._spooling is not None:
            self._spooling.discard()
            self._spooling = None
        assert self._body is not None
        self._body.close()

    def connectionLost(self, reason):
        if self._holds is not None:
            self._holds.drop()
        if self._spooling is not None:
            self._spooling.discard()
            self._spooling = None
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
        if self._arriving and self.channel is not None:
            # Answered before its body ended: the rest cannot be told from a
            # next request, so it is dropped and the connection closes.
            self._arriving = False
            # Twisted's channel answers "Expect: 100-continue" once gotLength
            # returns, and this request may be answered from within it (an
            # error found in its head): a stray 100 would follow the answer.
            withhold_continue(self)
            self.close_after_response()
            self.channel.discard_input()
            self._read_the_rest()
        site = self.channel.site if self.channel is not None else None
        if site is not None and not self.finished and self._started is not None:
            site.metrics.observe(self.path, self.code, site.clock.seconds() - self._started)
        return super().finish()


def _dropped(data: bytes) -> None:
    """Where a body nobody reads goes, as it arrives."""
