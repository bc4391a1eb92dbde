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

Whatever a turn of the reactor sends, on one connection, goes in one write.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
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
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred, succeed
from twisted.internet.endpoints import SSL4ServerEndpoint, TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.interfaces import ITCPTransport
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.errors import KCoralError, ServerBusy
from kcoral.inference.front import IInferenceFront
from kcoral.inference.grpcmethods import SERVICE, GrpcMethods, Method, status_code_of
from kcoral.web.auth import IGuard, presented
from kcoral.web.endpoint import SharedPortEndpoint, tls_options
from kcoral.web.requestid import request_id_from

__all__ = ["MAX_UNREAD", "MESSAGE_SECONDS", "SERVICE", "SWEEP_SECONDS", "GrpcFront"]

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
#: trips (every byte is acknowledged as it arrives; the message's size is
#: bounded by its prefix).
WINDOW_BYTES = 4 << 20

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


class _Call:
    """One call: one stream of one connection."""

    __slots__ = ("answering", "connection", "deadline", "length", "metadata", "method", "parts",
                 "received", "request_id", "stream_id")

    def __init__(self, connection: _Connection, stream_id: int, method: Method, request_id: str,
                 metadata: dict[bytes, bytes]):
        self.connection = connection
        self.stream_id = stream_id
        self.method = method
        self.request_id = request_id
        self.metadata = metadata
        # The message's prefix, then its parts as they arrive.
        self.parts: list[bytes] = []
        self.received = 0
        self.length: int | None = None
        self.answering: Deferred | None = None
        # The call's own deadline (its grpc-timeout), if it sent one.
        self.deadline = None

    def take(self, data: bytes, bound: int) -> None:
        """Takes the next DATA of the stream; L{_Ended} if the message is
        compressed, larger than C{bound} bytes, or followed by more."""
        if self.length is None:
            head = b"".join((*self.parts, data))
            if len(head) < _PREFIX.size:
                self.parts = [head]
                return
            compressed, self.length = _PREFIX.unpack_from(head)
            if compressed:
                raise _Ended(grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not served")
            if self.length > bound:
                raise _Ended(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"a message of {self.length} bytes is over the bound of {bound}")
            data = head[_PREFIX.size:]
            self.parts = []
        if data:
            self.parts.append(data)
            self.received += len(data)
        if self.received > self.length:
            raise _Ended(grpc.StatusCode.INVALID_ARGUMENT, "a unary call carries one message")

    @property
    def complete(self) -> bool:
        return self.length is not None and self.received == self.length

    def message(self) -> bytes:
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)


class _Connection(Protocol):
    """One client's HTTP/2 connection, each of its streams a call."""

    transport: ITCPTransport

    def __init__(self, served: GrpcFront):
        self._served = served
        self._h2 = H2Connection(config=_CONFIG)
        self._calls: dict[int, _Call] = {}
        # Answers waiting for the client's flow-control window, by stream.
        self._sending: dict[int, tuple[memoryview, bytes]] = {}
        self._flushing = False
        self._going_away = False

    def connectionMade(self) -> None:
        self._served.connections.add(self)
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
        if self._served.draining:
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
            self.transport.loseConnection()
            return
        for event in events:
            if isinstance(event, DataReceived):
                self._data(event)
            elif isinstance(event, RequestReceived):
                self._request(event)
            elif isinstance(event, StreamEnded):
                self._ended(event.stream_id)
            elif isinstance(event, WindowUpdated):
                self._window(event.stream_id)
            elif isinstance(event, StreamReset):
                self._reset(event.stream_id)
            elif isinstance(event, ConnectionTerminated):
                # Once the client's GOAWAY is read, h2 sends nothing more:
                # the calls in flight cannot be answered.
                self._drop_calls()
                self.transport.loseConnection()
        self._flush()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._served.connections.discard(self)
        self._drop_calls()
        self._served.lost(self)

    def _drop_calls(self) -> None:
        for call in list(self._calls.values()):
            self._drop(call)

    @property
    def idle(self) -> bool:
        return not self._calls

    # -- sending ----------------------------------------------------------------------------

    def _flush(self) -> None:
        self._flushing = False
        data = self._h2.data_to_send()
        if data:
            self.transport.write(data)
        if self._going_away and not self._calls and not self._sending:
            self.transport.loseConnection()

    def _later(self) -> None:
        """Sends what is queued at the end of this turn, with whatever else
        this turn queues."""
        if not self._flushing:
            self._flushing = True
            self._served.reactor.callLater(0, self._flush)

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
            if not self._calls and not self._sending:
                self.transport.loseConnection()

    def _answer(self, call: _Call, message: bytes) -> None:
        if self._calls.pop(call.stream_id, None) is None:
            return
        self._settled(call)
        if self._closed(call.stream_id):
            return
        self._h2.send_headers(call.stream_id, _RESPONSE)
        self._send(call.stream_id, memoryview(_PREFIX.pack(0, len(message)) + message),
                   ((b"grpc-status", _OK), _request_id_header(call.request_id)))
        self._later()

    def _send(self, stream_id: int, data: memoryview, trailers) -> None:
        """Sends C{data} as far as the client's window allows, then the
        trailers; the rest waits for the window to open."""
        h2 = self._h2
        while data:
            size = min(len(data), h2.local_flow_control_window(stream_id), h2.max_outbound_frame_size)
            if size <= 0:
                self._sending[stream_id] = (data, trailers)
                return
            h2.send_data(stream_id, data[:size].tobytes())
            data = data[size:]
        h2.send_headers(stream_id, trailers, end_stream=True)

    def _window(self, stream_id: int) -> None:
        waiting = [stream_id] if stream_id else list(self._sending)
        for waiting_id in waiting:
            pending = self._sending.pop(waiting_id, None)
            if pending is not None and not self._closed(waiting_id):
                self._send(waiting_id, *pending)

    def _closed(self, stream_id: int) -> bool:
        """Whether nothing more can be sent on C{stream_id}: both ends have
        ended it, or the client has reset it. h2 reads all the frames of a
        read before its events are taken, so a stream the client reset may
        be closed while the events ahead of its reset (its metadata, its
        message) are still being taken."""
        stream = self._h2.streams.get(stream_id)
        return stream is None or stream.closed

    def end(self, call: _Call, why: _Ended) -> None:
        """Ends C{call} with the status of C{why} (its answer, if it is
        being asked, is cancelled), and drops whatever else it sends."""
        if self._calls.pop(call.stream_id, None) is None:
            return
        self._settled(call)
        log.info("{request_id} answered {code}: {message}", request_id=call.request_id,
                 code=why.code.name, message=why.details)
        self._refuse(call.stream_id, why, call.request_id)
        if call.answering is not None:
            call.answering.cancel()

    def _refuse(self, stream_id: int, why: _Ended, request_id: str) -> None:
        """A trailers-only answer, then a reset if the client still sends:
        nothing more of the call is read."""
        if self._closed(stream_id):
            return
        h2 = self._h2
        h2.send_headers(stream_id, (*_RESPONSE, (b"grpc-status", _status(why.code)),
                                    (b"grpc-message", quote(why.details, safe=_PRINTABLE).encode()),
                                    _request_id_header(request_id)),
                        end_stream=True)
        if not self._closed(stream_id):
            h2.reset_stream(stream_id, ErrorCodes.NO_ERROR)
        self._later()

    def _settled(self, call: _Call) -> None:
        self._served.waiting.pop(call, None)
        self._served.calls -= 1
        if call.deadline is not None and call.deadline.active():
            call.deadline.cancel()

    def _drop(self, call: _Call) -> None:
        """Forgets C{call} unanswered, cancelling its answer."""
        if self._calls.pop(call.stream_id, None) is not None:
            self._settled(call)
        if call.answering is not None:
            call.answering.cancel()

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
        path = metadata.get(b":path", b"")
        method = self._served.methods.get(path[len(_PATH):].decode("ascii", "replace")) \
            if path.startswith(_PATH) else None
        served = self._served
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
        call = _Call(self, stream_id, method, request_id, metadata)
        self._calls[stream_id] = call
        served.calls += 1
        timeout = metadata.get(b"grpc-timeout")
        if timeout is not None:
            seconds = _seconds(timeout)
            if seconds is not None:
                call.deadline = served.clock.callLater(seconds, self.end, call, _Ended(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed"))
        if method.open:
            self._run(call, b"")
        else:
            served.wait_for_message(call)

    def _data(self, event: DataReceived) -> None:
        stream_id = event.stream_id
        self._h2.acknowledge_received_data(event.flow_controlled_length, stream_id)
        call = self._calls.get(stream_id)
        if call is None or call.answering is not None:
            return
        try:
            call.take(event.data, self._served.max_message_bytes)
        except _Ended as why:
            self.end(call, why)

    def _ended(self, stream_id: int) -> None:
        call = self._calls.get(stream_id)
        if call is None or call.answering is not None:
            return
        if call.complete:
            self._served.waiting.pop(call, None)
            self._run(call, call.message())
        else:
            self.end(call, _Ended(grpc.StatusCode.INVALID_ARGUMENT,
                                  "the call ended without its message" if call.length is None
                                  else "the call ended in the middle of its message"))

    def _reset(self, stream_id: int) -> None:
        self._sending.pop(stream_id, None)
        call = self._calls.get(stream_id)
        if call is not None:
            self._drop(call)

    def _run(self, call: _Call, message: bytes) -> None:
        call.answering = d = maybeDeferred(call.method.answer, message, call.request_id, call.metadata)
        d.addCallbacks(lambda answer: self._answer(call, answer), lambda failure: self._failed(call, failure))

    def _failed(self, call: _Call, failure: Failure) -> None:
        if call.stream_id not in self._calls:
            return  # ended already: reset, timed out, or the connection lost
        error = failure.value
        if isinstance(error, KCoralError):
            (log.debug if error.relayed else log.info)(
                "{request_id} answered {status}: {message}", request_id=call.request_id,
                status=error.status, message=error.message)
            message = (f"{error.message} ({error.reason})" if isinstance(error, ServerBusy) and error.reason
                       else error.message)
            why = _Ended(status_code_of(error), message)
        elif isinstance(error, CancelledError):
            why = _Ended(grpc.StatusCode.CANCELLED, "the call was cancelled")
        else:
            log.failure("{request_id} internal error", failure, request_id=call.request_id)
            why = _Ended(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}")
        self._calls.pop(call.stream_id)
        self._settled(call)
        self._refuse(call.stream_id, why, call.request_id)


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
    each at most C{message_seconds} by C{clock} (the reactor's unless given).
    With C{share_port}, other processes may serve the same port (a node's
    front processes): the kernel gives each its share of the connections.
    """

    def __init__(self, front: IInferenceFront, *, reactor, host: str = "127.0.0.1", port: int = 0,
                 max_message_bytes: int = 64 << 20, max_calls: int = 1024,
                 max_unread: int = MAX_UNREAD, message_seconds: float = MESSAGE_SECONDS,
                 guard: IGuard | None = None, tls: tuple[str, str] | None = None,
                 client_ca: str | None = None, clock=None, share_port: bool = False):
        self.front = front
        self.methods = GrpcMethods(front)
        self.guard = guard
        self.host = host
        self.port = port
        self.reactor = reactor
        self.clock = clock or reactor
        self.max_message_bytes = max_message_bytes
        self.max_calls = max_calls
        self._max_unread = max_unread
        self._message_seconds = message_seconds
        self._tls = tls
        self._client_ca = client_ca
        self._share_port = share_port
        self.calls = 0
        self.draining = False
        self.connections: set[_Connection] = set()
        # The calls waiting for their message, oldest first, by deadline.
        self.waiting: dict[_Call, float] = {}
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

    def startService(self) -> None:
        # The port is bound now, as the service starts (endpoints listen at
        # once), so that it is known when the service has started.
        listening = self._endpoint().listen(Factory.forProtocol(lambda: _Connection(self)))
        listening.addCallback(self._bound)
        self._sweep.start(SWEEP_SECONDS, now=False)
        super().startService()

    def _bound(self, port) -> None:
        self._listening = port
        self.port = port.getHost().port
        log.info("serving the inference protocol over gRPC on {host}:{port}", host=self.host,
                 port=self.port)

    def wait_for_message(self, call: _Call) -> None:
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
