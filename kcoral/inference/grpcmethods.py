"""
What each method of the inference protocol's gRPC service
(C{inference.GRPCInferenceService}) does, whatever transport carries it: a
call's raw message in, a Deferred of its raw answer out, or a
L{KCoralError} that L{status_code_of} turns into the call's status.

Every method runs on the reactor's thread: parsing a message (upb) and
encoding an answer cost a few microseconds apiece, less than handing them to
another thread would; an inference's, when large, go to a thread.
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Mapping, Sequence
from typing import Any

import attrs
import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import model_config_pb2, service_pb2
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.python.failure import Failure

from kcoral.common.offreactor import off_reactor
from kcoral.errors import (
    GRPC_DECOUPLED,
    BadRequest,
    DecoupledModel,
    KCoralError,
    LoadFailed,
    ModelNotReady,
)
from kcoral.inference.cudasharedmemory import CudaSharedMemory
from kcoral.inference.front import IInferenceFront, InferAnswer, InferCall, load_config, load_files
from kcoral.inference.message import GrpcAnswer, GrpcMessage, IInferMessage
from kcoral.inference.sharedmemory import OFF, Caller, Placement, SharedMemory
from kcoral.protocol.decoupled import DECOUPLED_ANSWERS, LAST, answers_of, empty_final
from kcoral.protocol.inference import grpc_of_rest_answer
from kcoral.web.family import TRACE_HEADERS

#: The service every method belongs to.
SERVICE = "inference.GRPCInferenceService"

#: The metadata keys of the request id, and of a client token.
REQUEST_ID = "x-request-id"
AUTHORIZATION = "authorization"
#: The keys under which the front gives a method the caller's token and
#: address (pseudo-headers: set by the front, whatever a client sends).
CALLER_TOKEN, CALLER_HOST = b":kcoral-token", b":kcoral-host"

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    # State the client built step by step is gone: not to be retried as it is.
    410: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    # A decoupled model asked for one answer: Triton's code for it.
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    507: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def status_code_of(error: KCoralError) -> grpc.StatusCode:
    """The gRPC status of a KCoral error: that of its HTTP status (a model
    that cannot serve: the precondition of a loaded model fails; a failed
    load: INTERNAL, which Triton's clients expect of it)."""
    if isinstance(error, ModelNotReady):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(error, LoadFailed):
        return grpc.StatusCode.INTERNAL
    code = _CODES.get(error.status)
    if code is not None:
        return code
    return grpc.StatusCode.INVALID_ARGUMENT if 400 <= error.status < 500 else grpc.StatusCode.INTERNAL


@attrs.frozen
class Streamed:
    """
    How a streaming method's call answers each of its messages, on the
    stream: C{answered} makes what is sent of each of a message's
    serialized answers (none, one or more: a decoupled model's), each given
    in parts, C{failed}
    of what the message's read gave (None: its read failed) and the message
    of the error it failed with (the call goes on).
    """

    answered: Callable[[Sequence[bytes]], bytes]
    failed: Callable[[Any, str], bytes]


def _as_sent(message: bytes, metadata: Mapping[bytes, bytes]) -> bytes:
    return message


@attrs.frozen
class Method:
    """
    One method: C{read(message, metadata)} gives (or fires with) what its
    message says, then C{answer(read, request_id, metadata)} fires with the
    serialized answer (a C{streamed} one's: a list of them, each sent). An
    C{open} method needs no client token and never reads its message (it is
    empty): no number of slow calls keeps a probe waiting. A C{streamed}
    one's call carries any number of messages, each answered so, each read
    handed to C{answer} in the order the messages came: a large message is
    read in a thread, and a later one read sooner must not overtake it (a
    sequence's steps run in the order they reach its model).
    """

    answer: Callable[[Any, str, Mapping[bytes, bytes]],
                     Deferred[bytes] | Deferred[list[tuple[bytes, ...]]]]
    open: bool = False
    streamed: Streamed | None = None
    read: Callable[[bytes, Mapping[bytes, bytes]], Any] = _as_sent


def _parsed(message_type, raw: bytes):
    try:
        return message_type.FromString(raw)
    except DecodeError:
        raise BadRequest(f"the message is not a {message_type.DESCRIPTOR.name}") from None


def _tensors(specs: list[dict]) -> list[service_pb2.ModelMetadataResponse.TensorMetadata]:
    return [service_pb2.ModelMetadataResponse.TensorMetadata(
        name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in specs]


def _metadata_response(value: dict) -> service_pb2.ModelMetadataResponse:
    return service_pb2.ModelMetadataResponse(
        name=value["name"], versions=value["versions"], platform=value["platform"],
        inputs=_tensors(value["inputs"]), outputs=_tensors(value["outputs"]))


def _config_response(value: dict) -> service_pb2.ModelConfigResponse:
    return service_pb2.ModelConfigResponse(config=json_format.ParseDict(
        value, model_config_pb2.ModelConfig(), ignore_unknown_fields=True))


def _parameters(request: service_pb2.RepositoryModelLoadRequest) -> dict[str, object]:
    """A load's parameters, each its value (None: it sets none)."""
    return {key: getattr(value, which) if (which := value.WhichOneof("parameter_choice")) else None
            for key, value in request.parameters.items()}


def _bytes(value: object) -> bytes:
    """A file's content as gRPC carries it: a bytes parameter."""
    if not isinstance(value, bytes):
        raise ValueError("a file's content must be a bytes_param")
    return value


def _serialized(respond: Callable[[Any], Any]) -> Callable[[Any], bytes]:
    return lambda value: respond(value).SerializeToString()


class GrpcMethods:
    """The service's methods, each one call of C{front}, on raw bytes."""

    def __init__(self, front: IInferenceFront, shared_memory: SharedMemory | None = None, *,
                 cuda_memory: CudaSharedMemory | None = None):
        self._front = front
        self._shared_memory = shared_memory or SharedMemory(refused=OFF, max_bytes=0)
        self._cuda_memory = cuda_memory or CudaSharedMemory()
        self._methods: dict[str, Method] = {
            "ServerLive": Method(lambda message, rid, metadata: succeed(_LIVE), open=True),
            "ServerReady": self._server_method(
                lambda front: front.ready(), lambda ready: service_pb2.ServerReadyResponse(ready=ready)),
            "ServerMetadata": self._server_method(
                lambda front: front.metadata(), lambda value: service_pb2.ServerMetadataResponse(
                    name=value["name"], version=value["version"], extensions=value["extensions"])),
            "ModelReady": self._model_method(
                service_pb2.ModelReadyRequest, lambda front, name, version: front.model_ready(name, version),
                lambda ready: service_pb2.ModelReadyResponse(ready=ready)),
            "ModelMetadata": self._model_method(
                service_pb2.ModelMetadataRequest,
                lambda front, name, version: front.model_metadata(name, version), _metadata_response),
            "ModelConfig": self._model_method(
                service_pb2.ModelConfigRequest,
                lambda front, name, version: front.model_config(name, version), _config_response),
            "ModelStatistics": self._model_method(
                service_pb2.ModelStatisticsRequest,
                lambda front, name, version: front.model_statistics(name or None, version),
                lambda value: json_format.ParseDict(value, service_pb2.ModelStatisticsResponse(),
                                                    ignore_unknown_fields=True)),
            "RepositoryModelLoad": self._method(
                service_pb2.RepositoryModelLoadRequest,
                lambda front, request: front.load_model(
                    request.model_name, load_config(request.model_name, _parameters(request)),
                    load_files(request.model_name, _parameters(request), _bytes)),
                lambda _: service_pb2.RepositoryModelLoadResponse()),
            "RepositoryModelUnload": self._method(
                service_pb2.RepositoryModelUnloadRequest,
                lambda front, request: front.unload_model(request.model_name),
                lambda _: service_pb2.RepositoryModelUnloadResponse()),
            "RepositoryIndex": Method(self._repository_index),
            "SystemSharedMemoryStatus": self._shm_method(
                service_pb2.SystemSharedMemoryStatusRequest,
                lambda shm, caller, request: _regions(
                    service_pb2.SystemSharedMemoryStatusResponse,
                    shm.status(caller, request.name or None))),
            "SystemSharedMemoryRegister": self._shm_method(
                service_pb2.SystemSharedMemoryRegisterRequest,
                _register),
            "SystemSharedMemoryUnregister": self._shm_method(
                service_pb2.SystemSharedMemoryUnregisterRequest,
                _unregister),
            "CudaSharedMemoryStatus": self._cuda_method(
                service_pb2.CudaSharedMemoryStatusRequest,
                lambda cuda, caller, request: _regions(
                    service_pb2.CudaSharedMemoryStatusResponse,
                    cuda.status(caller, request.name or None))),
            "CudaSharedMemoryUnregister": self._cuda_method(
                service_pb2.CudaSharedMemoryUnregisterRequest, _cuda_unregister),
            "CudaSharedMemoryRegister": self._cuda_method(
                service_pb2.CudaSharedMemoryRegisterRequest, _cuda_register),
            "ModelInfer": Method(self._unary_infer, read=self._read_infer),
            # Each message of the stream is one ModelInfer, answered as one
            # (a decoupled model's: as many times as it answers).
            "ModelStreamInfer": Method(self._stream_infer, read=self._read_infer,
                                       streamed=Streamed(_stream_answer, _stream_error)),
        }

    def items(self) -> ItemsView[str, Method]:
        """Every method, by name."""
        return self._methods.items()

    def get(self, name: str) -> Method | None:
        """The method called C{name} (None: the service has none)."""
        return self._methods.get(name)

    def _server_method(self, ask: Callable[[IInferenceFront], Deferred],
                       respond: Callable[[Any], Any]) -> Method:
        """An open method about the server."""
        return Method(lambda message, rid, metadata: ask(self._front).addCallback(_serialized(respond)),
                      open=True)

    def _method(self, message_type, ask: Callable[[IInferenceFront, Any], Deferred],
                respond: Callable[[Any], Any]) -> Method:
        """A guarded method that asks the front with its parsed message."""
        return Method(lambda message, rid, metadata: ask(
            self._front, _parsed(message_type, message)).addCallback(_serialized(respond)))

    def _model_method(self, message_type, ask: Callable[[IInferenceFront, str, str | None], Deferred],
                      respond: Callable[[Any], Any]) -> Method:
        """A guarded method about one model (and version), named by its message."""
        return self._method(message_type,
                            lambda front, request: ask(front, request.name, request.version or None),
                            respond)

    def _shm_method(self, message_type, act: Callable[[SharedMemory, Caller, Any], Any]) -> Method:
        """A guarded method on the caller's shared-memory regions."""
        return Method(lambda message, rid, metadata: maybeDeferred(
            act, self._shared_memory, _caller(metadata), _parsed(message_type, message)
        ).addCallback(lambda response: response.SerializeToString()))

    def _cuda_method(self, message_type, act: Callable[[CudaSharedMemory, Caller, Any], Any]
                     ) -> Method:
        """A guarded method on the caller's CUDA shared-memory regions."""
        return Method(lambda message, rid, metadata: maybeDeferred(
            act, self._cuda_memory, _caller(metadata), _parsed(message_type, message)
        ).addCallback(lambda response: response.SerializeToString()))

    def _repository_index(self, message: bytes, rid: str, metadata: Mapping[bytes, bytes]
                          ) -> Deferred[bytes]:
        request = _parsed(service_pb2.RepositoryIndexRequest, message)
        return self._front.repository_index().addCallback(lambda models: service_pb2.RepositoryIndexResponse(
            models=[service_pb2.RepositoryIndexResponse.ModelIndex(
                name=m["name"], version=m["version"], state=m["state"], reason=m["reason"])
                for m in models if not request.ready or m["state"] == "READY"]).SerializeToString())

    def _read_infer(self, message: bytes, metadata: Mapping[bytes, bytes]
                    ) -> Deferred[tuple[service_pb2.ModelInferRequest, IInferMessage,
                                        Placement | None]]:
        """An inference's message parsed, with its inputs read out of the
        caller's shared-memory regions and where its outputs go (None: in
        the answer); a large one in a thread."""
        def resolve(pb: service_pb2.ModelInferRequest):
            call = GrpcMessage(pb, len(message))
            resolved = self._shared_memory.resolve(_caller(metadata), call)
            if resolved is None:
                return pb, call, None
            return resolved.addCallback(lambda placed: (pb, *placed))

        return off_reactor(len(message), _parsed, service_pb2.ModelInferRequest, message
                           ).addCallback(resolve)

    def _infer(self, read: tuple[service_pb2.ModelInferRequest, IInferMessage, Placement | None],
               rid: str, metadata: Mapping[bytes, bytes], decoupled: bool
               ) -> Deferred[InferAnswer | GrpcAnswer]:
        pb, message, placement = read
        headers = {name: metadata[name] for name in TRACE_HEADERS if name in metadata}
        answered = self._front.infer(pb.model_name, pb.model_version or None, InferCall(
            message, rid, headers, token=_caller(metadata).token, decoupled=decoupled))
        if placement is not None:
            answered.addCallback(placement.place)
        return answered

    def _unary_infer(self, read: tuple[service_pb2.ModelInferRequest, IInferMessage,
                                       Placement | None],
                     rid: str, metadata: Mapping[bytes, bytes]) -> Deferred[bytes]:
        def refused(failure: Failure) -> Failure:
            # The front refused it in REST's words, which the member a
            # gateway forwarded it to answered in: gRPC's are Triton's own.
            failure.trap(DecoupledModel)
            refusal = failure.value
            assert isinstance(refusal, DecoupledModel)  # trapped
            return Failure(DecoupledModel(GRPC_DECOUPLED, request_id=refusal.request_id))

        return self._infer(read, rid, metadata, decoupled=False).addCallbacks(
            _grpc_form, refused)

    def _stream_infer(self, read: tuple[service_pb2.ModelInferRequest, IInferMessage,
                                        Placement | None],
                      rid: str, metadata: Mapping[bytes, bytes]
                      ) -> Deferred[list[tuple[bytes, ...]]]:
        """Its answers, each in parts: one, or a decoupled model's, one a row
        of its outputs."""
        ended = empty_final(read[0].parameters)
        return self._infer(read, rid, metadata, decoupled=True).addCallback(_answers, ended)


def _caller(metadata: Mapping[bytes, bytes]) -> Caller:
    """Who calls, as the front tells: its token, and its address."""
    return Caller(metadata.get(CALLER_TOKEN) or None, metadata.get(CALLER_HOST, b"").decode())


def _regions(response_type, regions: list[dict]):
    """A status answer (system or CUDA shared memory's) of C{regions}."""
    response = response_type()
    for region in regions:
        response.regions[region["name"]].CopyFrom(response_type.RegionStatus(**region))
    return response


def _register(shm: SharedMemory, caller: Caller,
              request: service_pb2.SystemSharedMemoryRegisterRequest
              ) -> service_pb2.SystemSharedMemoryRegisterResponse:
    shm.register(caller, request.name, request.key, request.offset, request.byte_size)
    return service_pb2.SystemSharedMemoryRegisterResponse()


def _unregister(shm: SharedMemory, caller: Caller,
                request: service_pb2.SystemSharedMemoryUnregisterRequest
                ) -> service_pb2.SystemSharedMemoryUnregisterResponse:
    shm.unregister(caller, request.name or None)
    return service_pb2.SystemSharedMemoryUnregisterResponse()


def _cuda_register(cuda: CudaSharedMemory, caller: Caller,
                   request: service_pb2.CudaSharedMemoryRegisterRequest
                   ) -> Deferred[service_pb2.CudaSharedMemoryRegisterResponse]:
    return cuda.register(caller, cuda.checked(request.name, request.raw_handle, request.device_id,
                                              request.byte_size)).addCallback(
        lambda _: service_pb2.CudaSharedMemoryRegisterResponse())


def _cuda_unregister(cuda: CudaSharedMemory, caller: Caller,
                     request: service_pb2.CudaSharedMemoryUnregisterRequest
                     ) -> service_pb2.CudaSharedMemoryUnregisterResponse:
    cuda.unregister(caller, request.name or None)
    return service_pb2.CudaSharedMemoryUnregisterResponse()


def _grpc_form(answered: InferAnswer | GrpcAnswer) -> bytes | Deferred[bytes]:
    """The serialized answer: as a server made it, or converted from the
    REST answer of a front that forwarded the inference."""
    if isinstance(answered, GrpcAnswer):
        return answered.message
    return off_reactor(len(answered.body), _converted, answered)


def _converted(answered: InferAnswer) -> bytes:
    return grpc_of_rest_answer(answered.body, answered.header_length).SerializeToString()


def _answers(answered: InferAnswer | GrpcAnswer, ended: bool
             ) -> Deferred[list[tuple[bytes, ...]]]:
    """The serialized answers of a stream's message, each in parts (joined
    once, as the stream's message is made): its answer, the last of its
    request's; or a decoupled model's answers (L{answers_of})."""
    if isinstance(answered, GrpcAnswer) and not answered.decoupled:
        return succeed([(answered.message, LAST)])
    size = len(answered.message if isinstance(answered, GrpcAnswer) else answered.body)
    return off_reactor(size, _split, answered, ended)


def _split(answered: InferAnswer | GrpcAnswer, ended: bool) -> list[tuple[bytes, ...]]:
    if isinstance(answered, GrpcAnswer):
        response = service_pb2.ModelInferResponse.FromString(answered.message)
    else:
        response = grpc_of_rest_answer(answered.body, answered.header_length)
        if DECOUPLED_ANSWERS not in response.parameters:
            return [(response.SerializeToString(), LAST)]
    return [(answer,) for answer in answers_of(response, ended)]


#: The key of ModelStreamInferResponse's C{infer_response} (field 2, a message).
_INFER_RESPONSE = bytes([2 << 3 | 2])


def _stream_answer(answer: Sequence[bytes]) -> bytes:
    """A ModelStreamInferResponse of C{answer}, the parts of a serialized
    ModelInferResponse, made without parsing it again and with one copy: a
    message field is its key, its length (a varint), then the message's own
    bytes."""
    length = bytearray()
    size = sum(len(part) for part in answer)
    while size > 0x7F:
        length.append(size & 0x7F | 0x80)
        size >>= 7
    length.append(size)
    return b"".join((_INFER_RESPONSE, length, *answer))


def _stream_error(read: tuple[service_pb2.ModelInferRequest, IInferMessage, Placement | None] | None,
                  message: str) -> bytes:
    """The answer of a request that failed with C{message}: as Triton's,
    it names the request (its id, where it was read), so that a client
    tells which of its requests failed among any number of answers."""
    response = service_pb2.ModelStreamInferResponse(error_message=message)
    if read is not None:
        response.infer_response.id = read[0].id
    return response.SerializeToString()


_LIVE = service_pb2.ServerLiveResponse(live=True).SerializeToString()
