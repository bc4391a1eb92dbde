"""
The inference protocol's gRPC service (C{inference.GRPCInferenceService})
for one L{IInferenceFront}, served by the reactor itself: gRPC is HTTP/2,
spoken here with the C{h2} library (which does no I/O of its own), so that a
call takes the same path through the reactor as an HTTP request does, with
no thread, event loop or hand-off of its own.

A call is one HTTP/2 stream: its metadata is the stream's HEADERS, its
message one length-prefixed frame (a flag byte, then four bytes of length,
big-endian) in the stream's DATA, and its status the trailing HEADERS
(C{grpc-status}, C{grpc-message}). Each call is judged in this order, each
step before the next costs anything:

 1. the streams of a connection (C{SETTINGS_MAX_CONCURRENT_STREAMS}) and
    its header list (C{SETTINGS_MAX_HEADER_LIST_SIZE}) are bounded by HTTP/2
    itself, and the calls of all connections by C{max_calls}: past it,
    RESOURCE_EXHAUSTED;
 2. the client token, read from the HEADERS: a call without it ends
    UNAUTHENTICATED before a byte of its message is read; the stream is
    reset, and whatever DATA was already on its way is dropped as it comes;
 3. the message's length, read from its 5-byte prefix: one over
    C{max_message_bytes} ends RESOURCE_EXHAUSTED before the rest is read;
 4. the message must arrive within C{message_seconds}, awaited by at most
    C{max_unread} calls at once (the oldest of them ends RESOURCE_EXHAUSTED
    when another must wait); ServerLive, ServerReady and ServerMetadata
    never read theirs, so that no number of slow calls keeps a probe waiting;
 5. the method runs (L{GrpcMethods}), and its answer is sent.

A streaming method's call (ModelStreamInfer) carries any number of
messages, each judged as in 3 and 4 (4 from its first byte to its last:
a stream may wait between messages) and answered on the stream in order;
its messages in flight are bounded by C{max_in_flight}, past which what the
client sends is held unacknowledged, so that its own flow-control window
stops it.

Whatever a turn of the reactor sends, on one connection, goes in one write.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable
from typing import cast
from urllib.parse import quote

import grpc
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes, Settings
from hpack import NeverIndexedHeaderTuple
from hyperframe.frame import GoAwayFrame
from twisted.application import service
from twisted.internet.defer import CancelledError, Deferred, fail, maybeDeferred, succeed
from twisted.internet.endpoints import SSL4ServerEndpoint, TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.interfaces import IConsumer, IDelayedCall, IPushProducer, ITCPTransport
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Interface, implementer

from kcoral.common.keepalive import DEFAULT_KEEPALIVE
from kcoral.errors import KCoralError, ServerBusy
from kcoral.inference.cudasharedmemory import CudaSharedMemory
from kcoral.inference.front import IInferenceFront
from kcoral.inference.grpcmethods import (
    CALLER_HOST,
    CALLER_TOKEN,
    SERVICE,
    GrpcMethods,
    Method,
    status_code_of,
)
from kcoral.inference.sharedmemory import SharedMemory
from kcoral.web.auth import IGuard, presented
from kcoral.web.endpoint import SharedPortEndpoint, tls_options
from kcoral.web.requestid import numbered, request_id_from

__all__ = ["MAX_IN_FLIGHT", "MAX_UNREAD", "MESSAGE_SECONDS", "SERVICE", "SWEEP_SECONDS", "GrpcFront"]

log = Logger()

#: How long a call's message may take to arrive once its metadata has (256
#: MiB at 10 MB/s takes 27 s), as the REST front's head timeout bounds a head.
MESSAGE_SECONDS = 30.0
#: The most calls that may wait for their message at once: clients that open
#: calls and send nothing hold at most these, each at most L{MESSAGE_SECONDS}.
MAX_UNREAD = 64
#: How often the calls waiting for their message are checked against
#: L{MESSAGE_SECONDS}.
SWEEP_SECONDS = 1.0
#: The streams one connection may have open at once, and the size of a
#: call's HEADERS (its metadata); a connection past either is ended.
MAX_STREAMS = 256
MAX_HEADER_LIST_BYTES = 64 << 10
#: How much a client may send, per stream and per connection, before this
#: side acknowledges it: enough that a large message is not paced by round
#: trips (every byte is acknowledged as it arrives, but those of a stream
#: at its L{MAX_IN_FLIGHT}; the message's size is bounded by its prefix).
WINDOW_BYTES = 4 << 20
#: The messages of one stream (ModelStreamInfer) in flight at once: being
#: answered, or answered and waiting for the client's window. Enough that a
#: client streaming small requests has a batch's worth of them in the
#: batcher at once and the round trip hidden; few enough that a stream
#: holds at most that many messages and answers, and never grows for a
#: client that does not read.
MAX_IN_FLIGHT = 32
#: What may be written to a client that is behind on reading, of the frames
#: no flow-control window holds back (an answer's headers, a ping's answer),
#: before its connection is dropped: far more than the few such frames the
#: calls a connection may have open make.
MAX_UNREAD_BYTES = 1 << 20

_PREFIX = struct.Struct(">BI")
_PATH = f"/{SERVICE}/".encode()
_RESPONSE = ((b":status", b"200"), (b"content-type", b"application/grpc"))
_OK = b"0"
#: What grpc-message carries as it is; every other byte is percent-encoded.
_PRINTABLE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
_CONFIG = H2Configuration(client_side=False, header_encoding=None, validate_outbound_headers=False,
                          normalize_outbound_headers=False, validate_inbound_headers=False,
                          normalize_inbound_headers=False)


class _Ended(Exception):
    """Why a call ends now: its status C{code} and C{details}."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


def _request_id_header(request_id: str) -> NeverIndexedHeaderTuple:
    """The call's request id, sent without a place in the connection's
    header table: a value seen once would take one, pushing out the
    headers every answer repeats, which would then be sent whole again."""
    return NeverIndexedHeaderTuple(b"x-request-id", request_id.encode())


def _status(code: grpc.StatusCode) -> bytes:
    return str(code.value[0]).encode()


def _framed(message: bytes) -> memoryview:
    return memoryview(_PREFIX.pack(0, len(message)) + message)


class _Framer:
    """
    Cuts the DATA of a call into its messages, each read whole once all of
    it has arrived: L{_Ended} for a compressed message, or one over C{bound}
    bytes as soon as its prefix says so.
    """

    __slots__ = ("_bound", "_buffered", "_chunks", "_length")

    def __init__(self, bound: int):
        self._bound = bound
        self._chunks: deque[memoryview] = deque()
        self._buffered = 0
        # The length of the message being read, once its prefix is.
        self._length: int | None = None

    def add(self, data: bytes) -> None:
        if data:
            self._chunks.append(memoryview(data))
            self._buffered += len(data)

    @property
    def empty(self) -> bool:
        """Whether no part of a message is here."""
        return self._length is None and not self._buffered

    def next(self) -> bytes | None:
        """The next message, once all of it is here (None till then)."""
        if self._length is None:
            if self._buffered < _PREFIX.size:
                return None
            compressed, length = _PREFIX.unpack(self._take(_PREFIX.size))
            if compressed:
                raise _Ended(grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not served")
            if length > self._bound:
                raise _Ended(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"a message of {length} bytes is over the bound of {self._bound}")
            self._length = length
        if self._buffered < self._length:
            return None
        message, self._length = self._take(self._length), None
        return message

    def _take(self, size: int) -> bytes:
        """The first C{size} bytes here (there are as many)."""
        self._buffered -= size
        chunks = self._chunks
        parts = []
        while size:
            chunk = chunks[0]
            if len(chunk) <= size:
                parts.append(chunks.popleft())
                size -= len(chunk)
            else:
                parts.append(chunk[:size])
                chunks[0] = chunk[size:]
                size = 0
        return parts[0].tobytes() if len(parts) == 1 else b"".join(parts)


class _Call:
    """What every call is: one stream of one connection, its DATA cut into
    messages by C{framer}; C{opened}: its answer's HEADERS are sent."""

    __slots__ = ("connection", "deadline", "framer", "metadata", "method", "opened", "request_id",
                 "stream_id")

    def __init__(self, connection: _Connection, stream_id: int, method: Method, request_id: str,
                 metadata: dict[bytes, bytes]):
        self.connection = connection
        self.stream_id = stream_id
        self.method = method
        self.request_id = request_id
        self.metadata = metadata
        self.framer = _Framer(connection.served.max_message_bytes)
        self.opened = False
        # The call's own deadline (its grpc-timeout), if it sent one.
        self.deadline: IDelayedCall | None = None

    @property
    def live(self) -> bool:
        """Whether the call is still being answered."""
        return self.connection.calls.get(self.stream_id) is self


class _ICall(Interface):
    """What happens to a call, as its connection tells it."""

    def receive(data: bytes, length: int) -> bool:
        """Takes the next DATA of the call (C{length} bytes of the client's
        flow-control window): whether it holds them unacknowledged."""

    def half_closed() -> None:
        """The client has sent the last of the call."""

    def drain() -> None:
        """The server stops: the call takes no new message."""

    def cancel() -> None:
        """The call ended unanswered: cancels what it was having answered."""


@implementer(_ICall)
class _Unary(_Call):
    """A call of a unary method: one message, one answer."""

    __slots__ = ("answering", "message")

    def __init__(self, *args):
        super().__init__(*args)
        self.message: bytes | None = None
        self.answering: Deferred[bytes] | None = None

    def receive(self, data: bytes, length: int) -> bool:
        if self.answering is None:
            self.framer.add(data)
            try:
                if self.message is None:
                    self.message = self.framer.next()
                if self.message is not None and not self.framer.empty:
                    raise _Ended(grpc.StatusCode.INVALID_ARGUMENT, "a unary call carries one message")
            except _Ended as why:
                self.connection.end(self, why)
        return False

    def half_closed(self) -> None:
        if self.answering is not None:
            return
        if self.message is not None:
            self.connection.served.waiting.pop(self, None)
            self.run(self.message)
        else:
            self.connection.end(self, _Ended(
                grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its message"
                if self.framer.empty else "the call ended in the middle of its message"))

    def drain(self) -> None:
        """Answered all the same: the server took it."""

    def cancel(self) -> None:
        if self.answering is not None:
            self.answering.cancel()

    def run(self, message: bytes) -> None:
        self.answering = d = maybeDeferred(self.method.read, message, self.metadata).addCallback(
            self.method.answer, self.request_id, self.metadata)
        d.addCallbacks(self._answered, self._failed)

    def _answered(self, answer: bytes) -> None:
        self.connection.answer(self, answer)

    def _failed(self, failure: Failure) -> None:
        if self.live:
            self.connection.end(self, self.connection.why(self.request_id, failure), logged=True)


#: What a message of a stream not yet read holds as its read.
_UNREAD = object()


class _Answer:
    """One message of a stream being answered: its request id, what it
    says once read (or how its reading failed) until it is handed on to be
    answered, then its answers, serialized, once it has them (a decoupled
    model's request may have none, or several)."""

    __slots__ = ("answer", "deferred", "read", "request_id")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.read: object = _UNREAD
        self.answer: list[bytes] | None = None
        #: Its reading, then its answering.
        self.deferred: Deferred | None = None


@implementer(_ICall)
class _Streamed(_Call):
    """
    A call of a streaming method: each message is answered on the stream,
    in the order the messages came whatever order their answers are ready
    in, with what the method answers or, for a message it fails, the error
    (the call goes on). Once the client has sent its last message and each
    one is answered, the call ends OK.

    At most C{max_in_flight} messages of the call are in flight at once:
    being answered, or answered and waiting for the client's flow-control
    window. While it has that many it starts none, and the DATA that comes
    is held unacknowledged: a client that does not read its answers is
    stopped by its own window, and never has more than that many answered
    for it. The time bound of the front's calls holds for each message of
    a stream, from its first byte to its last (not between messages).
    """

    __slots__ = ("answers", "closing", "count", "held", "pumping", "reading", "stopping")

    def __init__(self, *args):
        super().__init__(*args)
        # The messages started and not yet sent, in order.
        self.answers: deque[_Answer] = deque()
        # The messages started and not yet handed on to be answered, in order.
        self.reading: deque[_Answer] = deque()
        self.count = 0
        # The window the client has used for DATA held unacknowledged.
        self.held = 0
        self.closing = False
        self.stopping = False
        self.pumping = False

    @property
    def full(self) -> bool:
        connection = self.connection
        return (len(self.answers) + connection.unsent(self.stream_id)
                >= connection.served.max_in_flight)

    def receive(self, data: bytes, length: int) -> bool:
        if self.stopping:
            return False  # no message is taken any more: dropped as it comes
        self.framer.add(data)
        self.pump()
        if self.live and self.full:
            self.held += length
            return True
        return False

    def half_closed(self) -> None:
        self.closing = True
        self.pump()

    def drain(self) -> None:
        # The messages started are answered; the call then ends UNAVAILABLE
        # unless the client had sent its last.
        self.stopping = True
        self.pump()

    def cancel(self) -> None:
        answers, self.answers = self.answers, deque()
        self.reading.clear()
        for answer in answers:
            if answer.deferred is not None:
                answer.deferred.cancel()

    def pump(self) -> None:
        """Starts the messages that are here while there is room, gives the
        client back the window it used for those held, and ends the call
        once all is answered."""
        if self.pumping or not self.live:
            return
        self.pumping = True
        started = False
        try:
            while not (self.stopping or self.full):
                message = self.framer.next()
                if message is None:
                    break
                self._start(message)
                started = True
        except _Ended as why:
            self.connection.end(self, why)
            return
        finally:
            self.pumping = False
        if not self.live:
            return
        if self.held and not self.full:
            self.connection.acknowledge(self.stream_id, self.held)
            self.held = 0
        served = self.connection.served
        reading = not (self.framer.empty or self.stopping or self.full)
        if started or not reading:
            served.waiting.pop(self, None)
        if reading and self not in served.waiting:
            served.wait_for_message(self)
        self._settle()

    def _start(self, message: bytes) -> None:
        self.count += 1
        answer = _Answer(numbered(self.request_id, self.count))
        self.answers.append(answer)
        self.reading.append(answer)
        answer.deferred = d = maybeDeferred(self.method.read, message, self.metadata)
        d.addBoth(self._read, answer)

    def _read(self, read: object, answer: _Answer) -> None:
        answer.read = read
        self._hand_on()

    def _hand_on(self) -> None:
        """Hands each message read on to be answered in the order the
        messages came, whatever order their reads end in: a large message
        is read in a thread, and a small one after it, read at once, must
        not reach the model first (a sequence's steps run in the order
        they reach it)."""
        while self.reading and self.reading[0].read is not _UNREAD:
            answer = self.reading.popleft()
            read, answer.read = answer.read, None
            if isinstance(read, Failure):
                answer.deferred = d = fail(read)
                read = None
            else:
                answer.deferred = d = maybeDeferred(self.method.answer, read, answer.request_id,
                                                    self.metadata)
            d.addCallbacks(self._answered, self._failed, callbackArgs=(answer,),
                           errbackArgs=(answer, read))

    def _answered(self, result: list[tuple[bytes, ...]], answer: _Answer) -> None:
        streamed = self.method.streamed
        assert streamed is not None
        answer.answer = [streamed.answered(message) for message in result]
        self._send()

    def _failed(self, failure: Failure, answer: _Answer, read: object) -> None:
        if not self.live:
            return  # ended, and its answers cancelled with it
        streamed = self.method.streamed
        assert streamed is not None
        answer.answer = [streamed.failed(read, self.connection.why(answer.request_id,
                                                                   failure).details)]
        self._send()

    def _send(self) -> None:
        """Sends the answers ready in order, then takes more messages."""
        while self.answers and self.answers[0].answer is not None:
            answers = self.answers.popleft().answer
            assert answers is not None
            for message in answers:
                self.connection.deliver(self, message)
        self.pump()

    def _settle(self) -> None:
        if self.answers:
            return
        if self.closing and self.framer.empty:
            self.connection.finish(self, None)
        elif self.stopping:
            self.connection.finish(self, _Ended(grpc.StatusCode.UNAVAILABLE, "the server is stopping"))
        elif self.closing and not self.full:
            self.connection.end(self, _Ended(grpc.StatusCode.INVALID_ARGUMENT,
                                             "the call ended in the middle of a message"))


class _Unsent:
    """What a stream has left to send as the client's flow-control window
    opens: its messages' bytes, then its trailers once it has ended."""

    __slots__ = ("data", "trailers")

    def __init__(self):
        self.data: deque[memoryview] = deque()
        self.trailers: tuple | None = None


@implementer(IPushProducer)
class _Connection(Protocol):
    """
    One client's HTTP/2 connection, each of its streams a call.

    It is its transport's producer: while what was written waits for the
    client to read it, answers are held as though the client's window were
    shut (so that a stream stops at its bound, and its client's own window
    then stops it), and a connection that goes on making frames that no
    window holds back (headers, pings' answers) past L{MAX_UNREAD_BYTES} is
    dropped. A client that asks and does not read holds a bounded number of
    answers, never a growing buffer.
    """

    transport: ITCPTransport

    def __init__(self, served: GrpcFront):
        self.served = served
        self._h2 = H2Connection(config=_CONFIG)
        self.calls: dict[int, _Unary | _Streamed] = {}
        # What waits for the client's flow-control window, by stream.
        self._sending: dict[int, _Unsent] = {}
        self._flushing = False
        self._going_away = False
        # Whether the client is behind on reading, and what has been
        # written since it fell behind.
        self._paused = False
        self._unread = 0

    def connectionMade(self) -> None:
        self.served.connections.add(self)
        cast(IConsumer, self.transport).registerProducer(self, True)
        # A stream may wait hours for its answer with nothing crossing: only
        # the kernel's probes tell a silent client's host from a patient one.
        DEFAULT_KEEPALIVE.apply_to(self.transport)
        # An answer is often written just after a window update: Nagle's
        # algorithm would hold it until the client's delayed ACK (40 ms).
        no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if no_delay is not None:
            no_delay(True)
        self._h2.local_settings = Settings(client=False, initial_values={
            SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
            SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_BYTES,
            SettingCodes.INITIAL_WINDOW_SIZE: WINDOW_BYTES})
        self._h2.initiate_connection()
        self._h2.increment_flow_control_window(WINDOW_BYTES)
        if self.served.draining:
            self.go_away()
        self._flush()

    def dataReceived(self, data: bytes) -> None:
        try:
            events = self._h2.receive_data(data)
        except ProtocolError as e:
            # h2 has queued the GOAWAY that says why, and sends nothing after
            # it: the calls in flight cannot be answered.
            log.info("gRPC connection from {peer} ended: {error}", peer=self.transport.getPeer(),
                     error=e)
            self._drop_calls()
            self._flush()
            self._close()
            return
        for event in events:
            if isinstance(event, DataReceived):
                self._data(event)
            elif isinstance(event, RequestReceived):
                self._request(event)
            elif isinstance(event, StreamEnded):
                call = self.calls.get(event.stream_id)
                if call is not None:
                    call.half_closed()
            elif isinstance(event, WindowUpdated):
                self._window(event.stream_id)
            elif isinstance(event, StreamReset):
                self._reset(event.stream_id)
            elif isinstance(event, ConnectionTerminated):
                # Once the client's GOAWAY is read, h2 sends nothing more:
                # the calls in flight cannot be answered.
                self._drop_calls()
                self._close()
        self._flush()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.served.connections.discard(self)
        self._drop_calls()
        self.served.lost(self)

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._unread = 0
        self._window(0)
        self._later()

    def stopProducing(self) -> None:
        """The connection is lost (L{connectionLost} follows)."""

    def _close(self) -> None:
        # A transport with a producer waits for it to unregister to close.
        cast(IConsumer, self.transport).unregisterProducer()
        self.transport.loseConnection()

    def _drop_calls(self) -> None:
        for call in list(self.calls.values()):
            self._drop(call)

    @property
    def idle(self) -> bool:
        return not self.calls

    # -- sending ----------------------------------------------------------------------------

    def _flush(self) -> None:
        self._flushing = False
        data = self._h2.data_to_send()
        if data:
            if self._paused:
                self._unread += len(data)
                if self._unread > MAX_UNREAD_BYTES:
                    log.info("gRPC connection from {peer} dropped: {size} bytes unread",
                             peer=self.transport.getPeer(), size=self._unread)
                    self.transport.abortConnection()
                    return
            self.transport.write(data)
        if self._going_away and not self.calls and not self._sending:
            self._close()

    def _later(self) -> None:
        """Sends what is queued at the end of this turn, with whatever else
        this turn queues."""
        if not self._flushing:
            self._flushing = True
            self.served.reactor.callLater(0, self._flush)

    def go_away(self) -> None:
        """Tells the client to open no more calls here; the connection
        closes once the calls it has are answered."""
        if not self._going_away:
            self._going_away = True
            # Written past h2, whose connection, once it has sent a GOAWAY,
            # sends nothing more: not even the answers of the calls in flight.
            goaway = GoAwayFrame(0)
            goaway.last_stream_id = self._h2.highest_inbound_stream_id
            self.transport.write(self._h2.data_to_send() + goaway.serialize())
            for call in list(self.calls.values()):
                call.drain()
            if not self.calls and not self._sending:
                self._close()

    def answer(self, call: _Unary, message: bytes) -> None:
        """Answers C{call} with C{message}, and ends it."""
        if self.calls.pop(call.stream_id, None) is None:
            return
        self._settled(call)
        if self._closed(call.stream_id):
            return
        self._h2.send_headers(call.stream_id, _RESPONSE)
        self._send(call.stream_id, _framed(message),
                   ((b"grpc-status", _OK), _request_id_header(call.request_id)))
        self._later()

    def deliver(self, call: _Streamed, message: bytes) -> None:
        """Sends C{message} on C{call}, which goes on."""
        if self._closed(call.stream_id):
            return  # the client reset it: its StreamReset follows
        if not call.opened:
            call.opened = True
            self._h2.send_headers(call.stream_id, _RESPONSE)
        self._send(call.stream_id, _framed(message))
        self._later()

    def finish(self, call: _Streamed, why: _Ended | None) -> None:
        """Ends C{call} OK, or as C{why} says, once what it has sent leaves."""
        if self.calls.pop(call.stream_id, None) is None:
            return
        self._settled(call)
        if why is not None:
            log.info("{request_id} answered {code}: {message}", request_id=call.request_id,
                     code=why.code.name, message=why.details)
        if self._closed(call.stream_id):
            return
        trailers = _trailers(why, call.request_id)
        self._send(call.stream_id, None, trailers if call.opened else (*_RESPONSE, *trailers))
        self._later()

    def unsent(self, stream_id: int) -> int:
        """How many messages of C{stream_id} wait for the client's window."""
        unsent = self._sending.get(stream_id)
        return 0 if unsent is None else len(unsent.data)

    def acknowledge(self, stream_id: int, length: int) -> None:
        """Gives the client back C{length} bytes of its window on C{stream_id}."""
        self._h2.acknowledge_received_data(length, stream_id)
        self._later()

    def _send(self, stream_id: int, data: memoryview | None, trailers: tuple | None = None) -> None:
        """Sends C{data}, then the C{trailers} that end the stream, as far
        as the client's window allows; the rest waits for it to open."""
        unsent = self._sending.get(stream_id)
        if unsent is None:
            unsent = self._sending[stream_id] = _Unsent()
        if data:
            unsent.data.append(data)
        if trailers is not None:
            unsent.trailers = trailers
        self._push(stream_id, unsent)

    def _push(self, stream_id: int, unsent: _Unsent) -> None:
        h2 = self._h2
        data = unsent.data
        while data:
            if self._paused:
                return
            size = min(len(data[0]), h2.local_flow_control_window(stream_id), h2.max_outbound_frame_size)
            if size <= 0:
                return
            h2.send_data(stream_id, data[0][:size].tobytes())
            if size == len(data[0]):
                data.popleft()
            else:
                data[0] = data[0][size:]
        del self._sending[stream_id]
        if unsent.trailers is not None:
            h2.send_headers(stream_id, unsent.trailers, end_stream=True)
            if not self._closed(stream_id):
                # The client still sends: nothing more of the call is read.
                h2.reset_stream(stream_id, ErrorCodes.NO_ERROR)

    def _window(self, stream_id: int) -> None:
        for waiting_id in [stream_id] if stream_id else list(self._sending):
            unsent = self._sending.get(waiting_id)
            if unsent is None:
                continue
            if self._closed(waiting_id):
                del self._sending[waiting_id]
                continue
            self._push(waiting_id, unsent)
            call = self.calls.get(waiting_id)
            if isinstance(call, _Streamed):
                call.pump()

    def _closed(self, stream_id: int) -> bool:
        """Whether nothing more can be sent on C{stream_id}: both ends have
        ended it, or the client has reset it. h2 reads all the frames of a
        read before its events are taken, so a stream the client reset may
        be closed while the events ahead of its reset (its metadata, its
        message) are still being taken."""
        stream = self._h2.streams.get(stream_id)
        return stream is None or stream.closed

    def end(self, call: _Unary | _Streamed, why: _Ended, logged: bool = False) -> None:
        """Ends C{call} now with the status of C{why} (logged unless
        C{logged} already), dropping what it has not sent and cancelling
        what it was having answered; whatever else it sends is dropped."""
        if self.calls.pop(call.stream_id, None) is None:
            return
        self._settled(call)
        if not logged:
            log.info("{request_id} answered {code}: {message}", request_id=call.request_id,
                     code=why.code.name, message=why.details)
        self._sending.pop(call.stream_id, None)
        self._refuse(call.stream_id, why, call.request_id, call.opened)
        call.cancel()

    def _refuse(self, stream_id: int, why: _Ended, request_id: str, opened: bool = False) -> None:
        """The trailers of C{why} (trailers only, unless the answer's
        HEADERS are sent), then a reset if the client still sends: nothing
        more of the call is read."""
        if self._closed(stream_id):
            return
        trailers = _trailers(why, request_id)
        self._send(stream_id, None, trailers if opened else (*_RESPONSE, *trailers))
        self._later()

    def _settled(self, call: _Unary | _Streamed) -> None:
        self.served.waiting.pop(call, None)
        self.served.calls -= 1
        if call.deadline is not None and call.deadline.active():
            call.deadline.cancel()

    def _drop(self, call: _Unary | _Streamed) -> None:
        """Forgets C{call} unanswered, cancelling what it was having answered."""
        if self.calls.pop(call.stream_id, None) is not None:
            self._settled(call)
        call.cancel()

    def why(self, request_id: str, failure: Failure) -> _Ended:
        """What C{failure} of the answer to C{request_id} tells the client,
        logged once."""
        error = failure.value
        if isinstance(error, KCoralError):
            (log.debug if error.relayed else log.info)(
                "{request_id} answered {status}: {message}", request_id=request_id,
                status=error.status, message=error.message)
            message = (f"{error.message} ({error.reason})" if isinstance(error, ServerBusy) and error.reason
                       else error.message)
            # Its frames hold the call's message in a cycle only the
            # collector frees, seldom in a process of JAX's many objects.
            failure.cleanFailure()
            return _Ended(status_code_of(error), message)
        if isinstance(error, CancelledError):
            return _Ended(grpc.StatusCode.CANCELLED, "the call was cancelled")
        log.failure("{request_id} internal error", failure, request_id=request_id)
        return _Ended(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}")

    # -- receiving --------------------------------------------------------------------------

    def _request(self, event: RequestReceived) -> None:
        stream_id = event.stream_id
        if self._closed(stream_id):
            return  # its StreamReset follows
        metadata: dict[bytes, bytes] = {}
        authorization: list[bytes] = []
        for key, value in event.headers:
            if key == b"authorization":
                authorization.append(value)
            else:
                metadata[key] = value
        request_id = request_id_from(metadata.get(b"x-request-id"))
        # Who calls, for the methods that answer each client its own (its
        # shared-memory regions): set here, whatever the client sent.
        metadata[CALLER_TOKEN] = presented(authorization) or b""
        metadata[CALLER_HOST] = getattr(self.transport.getPeer(), "host", "").encode()
        path = metadata.get(b":path", b"")
        method = self.served.methods.get(path[len(_PATH):].decode("ascii", "replace")) \
            if path.startswith(_PATH) else None
        served = self.served
        try:
            if method is None:
                raise _Ended(grpc.StatusCode.UNIMPLEMENTED, f"no method {path.decode('ascii', 'replace')}")
            if served.draining or self._going_away:
                raise _Ended(grpc.StatusCode.UNAVAILABLE, "the server is stopping")
            if served.calls >= served.max_calls:
                raise _Ended(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{served.max_calls} calls are already in progress")
            if not method.open and served.guard is not None:
                error = served.guard.refused(presented(authorization), request_id)
                if error is not None:
                    raise _Ended(status_code_of(error), error.message)
        except _Ended as why:
            log.info("{request_id} answered {code}: {message}", request_id=request_id,
                     code=why.code.name, message=why.details)
            self._refuse(stream_id, why, request_id)
            return
        call: _Unary | _Streamed = (_Streamed if method.streamed is not None else _Unary)(
            self, stream_id, method, request_id, metadata)
        self.calls[stream_id] = call
        served.calls += 1
        timeout = metadata.get(b"grpc-timeout")
        if timeout is not None:
            seconds = _seconds(timeout)
            if seconds is not None:
                call.deadline = served.clock.callLater(seconds, self.end, call, _Ended(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed"))
        if isinstance(call, _Unary):
            if method.open:
                call.run(b"")
            else:
                served.wait_for_message(call)

    def _data(self, event: DataReceived) -> None:
        call = self.calls.get(event.stream_id)
        if call is None or not call.receive(event.data, event.flow_controlled_length):
            self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)

    def _reset(self, stream_id: int) -> None:
        self._sending.pop(stream_id, None)
        call = self.calls.get(stream_id)
        if call is not None:
            self._drop(call)


def _trailers(why: _Ended | None, request_id: str) -> tuple:
    """The trailing metadata that ends a call OK (C{why} None), or as C{why} says."""
    if why is None:
        return (b"grpc-status", _OK), _request_id_header(request_id)
    return ((b"grpc-status", _status(why.code)),
            (b"grpc-message", quote(why.details, safe=_PRINTABLE).encode()),
            _request_id_header(request_id))


_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def _seconds(timeout: bytes) -> float | None:
    """A C{grpc-timeout} value in seconds (None: not one: at most 8 digits
    and a unit)."""
    unit = _UNITS.get(timeout[-1:])
    digits = timeout[:-1]
    if unit is None or not 1 <= len(digits) <= 8 or not digits.isdigit():
        return None
    return int(digits) * unit


class GrpcFront(service.Service):
    """
    Serves C{front} over gRPC on C{host}:C{port} (0: any free port, then in
    L{port} once started), messages of at most C{max_message_bytes}, in TLS
    when given C{tls} (the certificate and key files, PEM; with C{client_ca},
    clients must present a certificate it signed), offering HTTP/2 by ALPN.
    With a C{guard}, all but ServerLive, ServerReady and ServerMetadata need
    the client token in the C{authorization} metadata. At most C{max_calls}
    calls at once, of which at most C{max_unread} wait for their message,
    each at most C{message_seconds} by C{clock} (the reactor's unless given);
    at most C{max_in_flight} messages of a stream in flight at once.
    Its clients' system and CUDA shared-memory regions are in
    C{shared_memory} and C{cuda_memory} (by default, neither is served).
    With C{share_port}, other processes may serve the same port (a node's
    front processes): the kernel gives each its share of the connections.
    """

    def __init__(self, front: IInferenceFront, *, reactor, host: str = "127.0.0.1", port: int = 0,
                 max_message_bytes: int = 64 << 20, max_calls: int = 1024,
                 max_unread: int = MAX_UNREAD, message_seconds: float = MESSAGE_SECONDS,
                 max_in_flight: int = MAX_IN_FLIGHT, guard: IGuard | None = None,
                 tls: tuple[str, str] | None = None, client_ca: str | None = None, clock=None,
                 share_port: bool = False, shared_memory: SharedMemory | None = None,
                 cuda_memory: CudaSharedMemory | None = None):
        self.front = front
        self.methods = GrpcMethods(front, shared_memory, cuda_memory=cuda_memory)
        self.guard = guard
        self.host = host
        self.port = port
        self.reactor = reactor
        self.clock = clock or reactor
        self.max_message_bytes = max_message_bytes
        self.max_calls = max_calls
        self.max_in_flight = max_in_flight
        self._max_unread = max_unread
        self._message_seconds = message_seconds
        self._tls = tls
        self._client_ca = client_ca
        self._share_port = share_port
        self.calls = 0
        self.draining = False
        self.connections: set[_Connection] = set()
        # The calls waiting for their message, oldest first, by deadline.
        self.waiting: dict[_Unary | _Streamed, float] = {}
        self._sweep = LoopingCall(self._expire)
        self._sweep.clock = self.clock
        self._listening = None
        self._stopped: Deferred[None] | None = None

    @property
    def unread(self) -> int:
        """How many calls wait for their message now."""
        return len(self.waiting)

    def _endpoint(self):
        tls = None if self._tls is None else tls_options(*self._tls, self._client_ca,
                                                         protocols=(b"h2",))
        if self._share_port:
            return SharedPortEndpoint(self.reactor, self.port, self.host, tls)
        if tls is not None:
            return SSL4ServerEndpoint(self.reactor, self.port, tls, interface=self.host)
        if ":" in self.host:
            return TCP6ServerEndpoint(self.reactor, self.port, interface=self.host)
        return TCP4ServerEndpoint(self.reactor, self.port, interface=self.host)

    def factory(self) -> Factory:
        """The factory of this front's connections, one per client connection."""
        return Factory.forProtocol(lambda: _Connection(self))

    def startService(self) -> None:
        # The port is bound now, as the service starts (endpoints listen at
        # once), so that it is known when the service has started.
        listening = self._endpoint().listen(self.factory())
        listening.addCallback(self._bound)
        self._sweep.start(SWEEP_SECONDS, now=False)
        super().startService()

    def _bound(self, port) -> None:
        self._listening = port
        self.port = port.getHost().port
        log.info("serving the inference protocol over gRPC on {host}:{port}", host=self.host,
                 port=self.port)

    def wait_for_message(self, call: _Unary | _Streamed) -> None:
        """C{call} waits for its message; the oldest waiting ends if too
        many do: a client that opens calls and sends nothing ends its own,
        not the others', whose messages come right after their metadata."""
        if len(self.waiting) >= self._max_unread:
            oldest = next(iter(self.waiting))
            oldest.connection.end(oldest, _Ended(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the call's message had not arrived when {self._max_unread} more calls waited "
                "for theirs"))
        self.waiting[call] = self.clock.seconds() + self._message_seconds

    def _expire(self) -> None:
        now = self.clock.seconds()
        while self.waiting:
            call, deadline = next(iter(self.waiting.items()))
            if deadline > now:
                return
            call.connection.end(call, _Ended(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the call's message did not arrive within {self._message_seconds:g} s"))

    def lost(self, connection: _Connection) -> None:
        if self._stopped is not None and not self.connections:
            stopped, self._stopped = self._stopped, None
            stopped.callback(None)

    def stopService(self, grace: float = 5.0) -> Deferred[None]:
        """Stops taking connections and calls (GOAWAY), answers the calls in
        flight, and closes each connection once its calls are answered;
        those still open after C{grace} seconds are closed then."""
        super().stopService()
        if self._sweep.running:
            self._sweep.stop()
        self.draining = True
        stopping = succeed(None) if self._listening is None else maybeDeferred(
            self._listening.stopListening)
        self._listening = None
        if not self.connections:
            return stopping
        self._stopped = stopped = Deferred[None]()
        for connection in list(self.connections):
            connection.go_away()
        late = self.clock.callLater(grace, self._close_all)
        stopped.addBoth(_cancelling(late))
        return stopping.addCallback(lambda _: stopped)

    def _close_all(self) -> None:
        for connection in list(self.connections):
            connection.transport.abortConnection()


def _cancelling(timer) -> Callable[[object], object]:
    def cancel(result: object) -> object:
        if timer.active():
            timer.cancel()
        return result
    return cancel
