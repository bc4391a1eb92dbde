"""
The inference protocol's gRPC service (C{inference.GRPCInferenceService})
for one L{IInferenceFront}.

gRPC's server runs its handlers in a pool of threads; each handler asks the
reactor for its answer (one C{blockingCallFromThread}) and does the
conversions to and from the REST form in its own thread, so that the reactor
never copies a tensor for it. An inference travels in the REST form, as the
front takes it: no front needs a model's manifest to serve gRPC.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from twisted.application import service
from twisted.internet import threads
from twisted.internet.defer import CancelledError, Deferred, fail, maybeDeferred, succeed
from twisted.logger import Logger

from kcoral.errors import KCoralError, ModelNotReady, ServerBusy
from kcoral.inference.front import IInferenceFront, InferCall
from kcoral.protocol.inference import grpc_of_rest_answer, rest_of_grpc_infer
from kcoral.web.auth import IGuard
from kcoral.web.family import TRACE_HEADERS
from kcoral.web.requestid import request_id_from

log = Logger()

#: The metadata keys of the request id, and of a client token.
REQUEST_ID = "x-request-id"
AUTHORIZATION = "authorization"

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}


def status_code_of(error: KCoralError) -> grpc.StatusCode:
    """The gRPC status of a KCoral error: that of its HTTP status (a model
    that cannot serve: the precondition of a loaded model fails)."""
    if isinstance(error, ModelNotReady):
        return grpc.StatusCode.FAILED_PRECONDITION
    code = _CODES.get(error.status)
    if code is not None:
        return code
    return grpc.StatusCode.INVALID_ARGUMENT if 400 <= error.status < 500 else grpc.StatusCode.INTERNAL


class GrpcFront(service.Service):
    """
    Serves C{front} over gRPC on C{host}:C{port} (0: any free port, then in
    L{port} once started), messages of at most C{max_message_bytes}, in TLS
    when given C{tls} (the certificate and key files, PEM; with C{client_ca},
    clients must present a certificate it signed). With a C{guard}, all but
    ServerLive, ServerReady and ServerMetadata need the client token in the
    C{authorization} metadata.
    """

    def __init__(self, front: IInferenceFront, *, reactor, host: str = "127.0.0.1", port: int = 0,
                 max_message_bytes: int = 64 << 20, threads: int = 128,
                 max_calls: int = 1024,
                 guard: IGuard | None = None, tls: tuple[str, str] | None = None,
                 client_ca: str | None = None):
        self.front = front
        self.guard = guard
        self.host = host
        self.port = port
        self._reactor = reactor
        self._max_message_bytes = max_message_bytes
        self._threads = threads
        self._max_calls = max_calls
        self._tls = tls
        self._client_ca = client_ca
        self._server: grpc.Server | None = None

    def _credentials(self) -> grpc.ServerCredentials:
        assert self._tls is not None
        cert, key = (_read(path) for path in self._tls)
        ca = _read(self._client_ca) if self._client_ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=ca is not None)

    def startService(self) -> None:
        # Each call holds a thread while the front answers it (a batch, a
        # queue wait): enough threads that a front's batches fill from many
        # clients at once, and a bound on the calls waiting for one, past
        # which gRPC answers RESOURCE_EXHAUSTED.
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="grpc"),
            maximum_concurrent_rpcs=self._max_calls,
            options=[("grpc.max_receive_message_length", self._max_message_bytes),
                     ("grpc.max_send_message_length", self._max_message_bytes)])
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(self), server)
        host = f"[{self.host}]" if ":" in self.host else self.host
        address = f"{host}:{self.port}"
        if self._tls is None:
            self.port = server.add_insecure_port(address)
        else:
            self.port = server.add_secure_port(address, self._credentials())
        server.start()
        # Held while it serves: a gRPC server that is garbage-collected stops.
        self._server = server
        super().startService()
        log.info("serving the inference protocol over gRPC on {host}:{port}", host=self.host,
                 port=self.port)

    def stopService(self, grace: float = 5.0) -> Deferred[None]:
        super().stopService()
        server, self._server = self._server, None
        if server is None:
            return succeed(None)
        # The wait runs in a thread: handlers still running need the reactor
        # to answer them.
        return threads.deferToThreadPool(self._reactor, self._reactor.getThreadPool(),
                                         lambda: server.stop(grace).wait())

    def call(self, context: grpc.ServicerContext, ask: Callable[[str], Any],
             answer: Callable[[Any], Any], *, guarded: bool = True) -> Any:
        """
        C{answer} (run in this thread) of what C{ask(request_id)} fires with,
        asked on the reactor's thread once the guard (if C{guarded}) admits
        the call; a KCoral error from either aborts the call with its status.
        An RPC that ends first cancels what it asked.
        """
        metadata = dict(context.invocation_metadata())
        rid = request_id_from(_ascii(metadata.get(REQUEST_ID)))
        context.set_trailing_metadata(((REQUEST_ID, rid),))
        asked: list[Deferred] = []

        def on_reactor() -> Deferred:
            if guarded and self.guard is not None:
                error = self.guard.refused(_ascii(metadata.get(AUTHORIZATION)), rid)
                if error is not None:
                    raise error
            d = maybeDeferred(ask, rid)
            asked.append(d)
            return d

        def ended() -> None:
            # Also called once the RPC is answered, when what it asked has
            # fired: no wake-up of the reactor for that (a stale read only
            # costs a cancel that does nothing).
            for d in asked:
                if not d.called:
                    self._reactor.callFromThread(d.cancel)

        context.add_callback(ended)
        try:
            return answer(threads.blockingCallFromThread(self._reactor, on_reactor))
        except CancelledError:
            context.abort(grpc.StatusCode.CANCELLED, "the call was cancelled")
        except KCoralError as e:
            (log.debug if e.relayed else log.info)(
                "{request_id} answered {status}: {message}", request_id=rid, status=e.status,
                message=e.message)
            message = f"{e.message} ({e.reason})" if isinstance(e, ServerBusy) and e.reason else e.message
            context.abort(status_code_of(e), message)
        except Exception as e:
            log.failure("{request_id} internal error", request_id=rid)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")

    def forwarded(self, context: grpc.ServicerContext) -> dict[bytes, bytes]:
        """The metadata an inference forwards, as HTTP headers."""
        metadata = dict(context.invocation_metadata())
        return {name: value.encode() for name in TRACE_HEADERS
                if isinstance(value := metadata.get(name.decode()), str)}


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


def _tensors(specs: list[dict]) -> list[service_pb2.ModelMetadataResponse.TensorMetadata]:
    return [service_pb2.ModelMetadataResponse.TensorMetadata(
        name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in specs]


class _Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The service's methods, each one call of the front."""

    def __init__(self, served: GrpcFront):
        self._served = served

    @property
    def _front(self) -> IInferenceFront:
        return self._served.front

    def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return self._served.call(context, lambda rid: self._front.ready(),
                                 lambda ready: service_pb2.ServerReadyResponse(ready=ready),
                                 guarded=False)

    def ServerMetadata(self, request, context):
        return self._served.call(context, lambda rid: self._front.metadata(), lambda value: (
            service_pb2.ServerMetadataResponse(name=value["name"], version=value["version"],
                                               extensions=value["extensions"])), guarded=False)

    def ModelReady(self, request, context):
        return self._served.call(
            context, lambda rid: self._front.model_ready(request.name, request.version or None),
            lambda ready: service_pb2.ModelReadyResponse(ready=ready))

    def ModelMetadata(self, request, context):
        return self._served.call(
            context, lambda rid: self._front.model_metadata(request.name, request.version or None),
            lambda value: service_pb2.ModelMetadataResponse(
                name=value["name"], versions=value["versions"], platform=value["platform"],
                inputs=_tensors(value["inputs"]), outputs=_tensors(value["outputs"])))

    def ModelConfig(self, request, context):
        return self._served.call(
            context, lambda rid: self._front.model_config(request.name, request.version or None),
            lambda value: service_pb2.ModelConfigResponse(config=json_format.ParseDict(
                value, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)))

    def RepositoryIndex(self, request, context):
        return self._served.call(
            context, lambda rid: self._front.repository_index(),
            lambda models: service_pb2.RepositoryIndexResponse(models=[
                service_pb2.RepositoryIndexResponse.ModelIndex(
                    name=m["name"], version=m["version"], state=m["state"], reason=m["reason"])
                for m in models if not request.ready or m["state"] == "READY"]))

    def ModelStatistics(self, request, context):
        return self._served.call(
            context, lambda rid: self._front.model_statistics(request.name or None,
                                                              request.version or None),
            lambda value: json_format.ParseDict(value, service_pb2.ModelStatisticsResponse(),
                                                ignore_unknown_fields=True))

    def RepositoryModelLoad(self, request, context):
        return self._served.call(context, lambda rid: self._front.load_model(request.model_name),
                                 lambda _: service_pb2.RepositoryModelLoadResponse())

    def RepositoryModelUnload(self, request, context):
        return self._served.call(context, lambda rid: self._front.unload_model(request.model_name),
                                 lambda _: service_pb2.RepositoryModelUnloadResponse())

    def ModelInfer(self, request, context):
        headers = self._served.forwarded(context)
        try:
            # Converted here, in gRPC's thread; a bad request is answered
            # after the guard has admitted the call, as every answer is.
            rest = rest_of_grpc_infer(request)
        except KCoralError as e:
            refused = e
            return self._served.call(context, lambda rid: fail(refused), lambda _: None)
        return self._served.call(
            context, lambda rid: self._front.infer(
                rest.model, rest.version, InferCall(rest.body, rest.header_length, rid, headers)),
            lambda answer: grpc_of_rest_answer(answer.body, answer.header_length))
