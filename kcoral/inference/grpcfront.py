"""
The inference protocol's gRPC service (C{inference.GRPCInferenceService})
for one L{IInferenceFront}.

gRPC's asyncio server runs on an event loop of its own, in one thread (the
gRPC thread), so that a call costs a coroutine, not a thread, for as long as
it lasts: a client that sends a call's metadata and never its message holds
no thread of the service. Every method is served on raw bytes (no
deserializer runs before the handler does), which lets each call be judged
in this order, each step before the next costs anything:

 1. the call count: past C{max_calls} calls at once, RESOURCE_EXHAUSTED;
 2. the client token, read from the metadata: a call without it ends
    UNAUTHENTICATED before a byte of its message is read or parsed;
 3. the message, awaited at most C{message_seconds} (DEADLINE_EXCEEDED
    after) by at most C{max_unread} calls at once (the oldest of them ends
    RESOURCE_EXHAUSTED when another must wait); ServerLive, ServerReady and
    ServerMetadata never read theirs (it is empty), so that no number of
    slow calls keeps a probe waiting;
 4. the message handed to the method (L{GrpcMethods}) on the reactor's
    thread; its answer comes back to the gRPC thread to be sent.

The reactor never waits on gRPC, nor gRPC on the reactor's thread: each
hands the other its work, all that came in one turn for one wake-up
(L{Handoff}), so that the inferences of many calls reach a front's batcher
together.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future as ThreadFuture
from typing import Any

import grpc
from twisted.application import service
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred, succeed
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.errors import KCoralError, ServerBusy
from kcoral.inference.front import IInferenceFront
from kcoral.inference.grpcmethods import (
    AUTHORIZATION,
    REQUEST_ID,
    SERVICE,
    GrpcMethods,
    Method,
    status_code_of,
)
from kcoral.inference.handoff import Handoff
from kcoral.web.auth import IGuard, presented
from kcoral.web.requestid import request_id_from

log = Logger()

#: How long a call's message may take to arrive once its metadata has: gRPC
#: hands over a message only whole, so this bounds the whole of it (256 MiB
#: at 10 MB/s takes 27 s), as the REST front's head timeout does a head.
MESSAGE_SECONDS = 30.0
#: The most calls that may wait for their message at once: clients that open
#: calls and send nothing hold at most these, each at most L{MESSAGE_SECONDS}.
MAX_UNREAD = 64
#: How often the calls waiting for their message are checked against
#: L{MESSAGE_SECONDS}.
SWEEP_SECONDS = 1.0

class _Ended(Exception):
    """Why a call ends now: its status C{code} and C{details}."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


class GrpcFront(service.Service):
    """
    Serves C{front} over gRPC on C{host}:C{port} (0: any free port, then in
    L{port} once started), messages of at most C{max_message_bytes}, in TLS
    when given C{tls} (the certificate and key files, PEM; with C{client_ca},
    clients must present a certificate it signed). With a C{guard}, all but
    ServerLive, ServerReady and ServerMetadata need the client token in the
    C{authorization} metadata. At most C{max_calls} calls at once, of which
    at most C{max_unread} wait for their message, each at most
    C{message_seconds} by C{clock} (the reactor's unless given).
    """

    def __init__(self, front: IInferenceFront, *, reactor, host: str = "127.0.0.1", port: int = 0,
                 max_message_bytes: int = 64 << 20, max_calls: int = 1024,
                 max_unread: int = MAX_UNREAD, message_seconds: float = MESSAGE_SECONDS,
                 guard: IGuard | None = None, tls: tuple[str, str] | None = None,
                 client_ca: str | None = None, clock=None):
        self.front = front
        self.guard = guard
        self.host = host
        self.port = port
        self._reactor = reactor
        self._clock = clock or reactor
        self._max_message_bytes = max_message_bytes
        self._max_calls = max_calls
        self._max_unread = max_unread
        self._message_seconds = message_seconds
        self._tls = tls
        self._client_ca = client_ca
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        # Touched only in the gRPC thread.
        self._calls = 0
        # The reads of the calls waiting for their message, oldest first, by
        # deadline; and why the ones ended early were.
        self._unread: dict[asyncio.Future, float] = {}
        self._ended: dict[asyncio.Future, _Ended] = {}
        self._sweep = LoopingCall(self._sweep_unread)
        self._sweep.clock = self._clock
        # Requests go to the reactor, and answers back, in one turn for all
        # those that came meanwhile (see L{Handoff}).
        self._to_reactor: Handoff | None = None
        self._to_loop: Handoff | None = None

    @property
    def unread(self) -> int:
        """How many calls wait for their message now."""
        return len(self._unread)

    def _credentials(self) -> grpc.ServerCredentials:
        assert self._tls is not None
        cert, key = (_read(path) for path in self._tls)
        ca = _read(self._client_ca) if self._client_ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=ca is not None)

    def startService(self) -> None:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="grpc", daemon=True).start()
        self._loop = loop
        self._to_loop = Handoff(loop.call_soon_threadsafe)
        # Handed over from the loop's own thread once the loop has run what
        # is ready now: the requests whose messages came together go together.
        self._to_reactor = Handoff(lambda run: loop.call_soon(self._reactor.callFromThread, run))
        # Waited for here, as a listening port is bound: the port is known
        # once the service has started (a few milliseconds).
        self._server, self.port = self._in_loop(self._start()).result()
        self._sweep.start(SWEEP_SECONDS, now=False)
        super().startService()
        log.info("serving the inference protocol over gRPC on {host}:{port}", host=self.host,
                 port=self.port)

    async def _start(self) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", self._max_message_bytes),
            ("grpc.max_send_message_length", self._max_message_bytes)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            name: grpc.stream_unary_rpc_method_handler(_handler(self, method))
            for name, method in GrpcMethods(self.front).items()}),))
        host = f"[{self.host}]" if ":" in self.host else self.host
        address = f"{host}:{self.port}"
        if self._tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, self._credentials())
        await server.start()
        return server, port

    def _in_loop(self, coroutine) -> ThreadFuture:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def stopService(self, grace: float = 5.0) -> Deferred[None]:
        super().stopService()
        if self._sweep.running:
            self._sweep.stop()
        server, loop = self._server, self._loop
        if server is None or loop is None:
            return succeed(None)
        # The loop stays: the calls in flight are answered through it.
        self._server = None
        stopped: Deferred[None] = Deferred()

        def done(_: ThreadFuture) -> None:
            loop.call_soon_threadsafe(loop.stop)
            self._reactor.callFromThread(stopped.callback, None)

        # Calls in flight are answered meanwhile: the reactor runs until
        # this Deferred fires.
        asyncio.run_coroutine_threadsafe(server.stop(grace), loop).add_done_callback(done)
        return stopped

    def _sweep_unread(self) -> None:
        """Ends the calls whose message is overdue (asked of the gRPC thread)."""
        if self._unread and self._loop is not None:
            self._loop.call_soon_threadsafe(self._expire, self._clock.seconds())

    def _expire(self, now: float) -> None:
        for read, deadline in list(self._unread.items()):
            if deadline <= now:
                self._end(read, _Ended(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"the call's message did not arrive within "
                                       f"{self._message_seconds:g} s"))

    def _end(self, read: asyncio.Future, why: _Ended) -> None:
        """Ends the call waiting on C{read} with C{why}."""
        del self._unread[read]
        self._ended[read] = why
        read.cancel()

    async def message(self, context: grpc.aio.ServicerContext) -> bytes:
        """
        The call's message, once it has arrived; L{_Ended} if it takes too
        long, or if it is the oldest of too many calls waiting for theirs: a
        client that opens calls and sends nothing ends its own, not the
        others', whose messages come right after their metadata.
        """
        if len(self._unread) >= self._max_unread:
            self._end(next(iter(self._unread)), _Ended(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the call's message had not arrived when {self._max_unread} more calls waited "
                "for theirs"))
        read = asyncio.ensure_future(context.read())
        self._unread[read] = self._clock.seconds() + self._message_seconds
        try:
            message = await read
        except asyncio.CancelledError:
            ended = self._ended.pop(read, None)
            if ended is None:
                raise
            raise ended from None
        finally:
            self._unread.pop(read, None)
        if message is grpc.aio.EOF:
            raise _Ended(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its message")
        return message

    async def on_reactor(self, ask: Callable[[], Any]) -> Any:
        """What C{ask()} (run on the reactor's thread) fires with; a call
        that ends first cancels it."""
        assert self._loop is not None and self._to_loop is not None and self._to_reactor is not None
        answered, to_loop, to_reactor = self._loop.create_future(), self._to_loop, self._to_reactor
        asked: list[Deferred] = []

        def settle(result: object) -> None:
            if answered.cancelled():
                return
            if isinstance(result, Failure):
                answered.set_exception(result.value or CancelledError())
            else:
                answered.set_result(result)

        def start() -> None:
            d = maybeDeferred(ask)
            asked.append(d)
            d.addBoth(lambda result: to_loop(settle, result))

        def cancel() -> None:
            for d in asked:
                d.cancel()

        to_reactor(start)
        try:
            return await answered
        except asyncio.CancelledError:
            to_reactor(cancel)
            raise

    async def serve(self, context: grpc.aio.ServicerContext, answer: Callable[[str], Any], *,
                    guarded: bool = True) -> bytes:
        """
        The serialized answer of one call, C{await answer(request_id)}, once
        the call count and the guard (if C{guarded}) admit it; a KCoral error
        from C{answer} ends the call with its status.
        """
        pairs = tuple(context.invocation_metadata() or ())
        rid = request_id_from(_ascii(dict(pairs).get(REQUEST_ID)))
        context.set_trailing_metadata(((REQUEST_ID, rid),))
        # Every value, as an HTTP request's every Authorization line.
        authorization = presented([_ascii(value) or b"" for key, value in pairs
                                   if key == AUTHORIZATION])
        self._calls += 1
        try:
            ended = await self._answer(authorization, rid, answer, guarded)
        finally:
            self._calls -= 1
        if isinstance(ended, bytes):
            return ended
        # abort raises: the call ends with this status.
        return await context.abort(ended.code, ended.details)

    async def _answer(self, authorization: bytes | None, rid: str, answer: Callable[[str], Any],
                      guarded: bool) -> bytes | _Ended:
        try:
            if self._calls > self._max_calls:
                raise _Ended(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{self._max_calls} calls are already in progress")
            if guarded and self.guard is not None:
                error = self.guard.refused(authorization, rid)
                if error is not None:
                    raise error
            return await answer(rid)
        except _Ended as e:
            log.info("{request_id} answered {code}: {message}", request_id=rid, code=e.code.name,
                     message=e.details)
            return e
        except CancelledError:
            return _Ended(grpc.StatusCode.CANCELLED, "the call was cancelled")
        except KCoralError as e:
            (log.debug if e.relayed else log.info)(
                "{request_id} answered {status}: {message}", request_id=rid, status=e.status,
                message=e.message)
            message = f"{e.message} ({e.reason})" if isinstance(e, ServerBusy) and e.reason else e.message
            return _Ended(status_code_of(e), message)
        except Exception as e:
            log.failure("{request_id} internal error", request_id=rid)
            return _Ended(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _ascii(value: object) -> bytes | None:
    """A text metadata value as an HTTP header's bytes (None: absent or binary)."""
    if not isinstance(value, str):
        return None
    try:
        return value.encode("ascii")
    except UnicodeEncodeError:
        return None


def _handler(served: GrpcFront, method: Method) -> Callable:
    """A stream-unary handler serving C{method} on raw bytes."""
    async def handler(requests, context) -> bytes:
        metadata = {key.encode(): value for key, value in (
            (key, _ascii(value)) for key, value in context.invocation_metadata() or ())
            if value is not None}

        async def answer(rid):
            message = b"" if method.open else await served.message(context)
            return await served.on_reactor(lambda: method.answer(message, rid, metadata))
        return await served.serve(context, answer, guarded=not method.open)
    return handler
