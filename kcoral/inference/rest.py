"""
The inference protocol's REST routes (L{kcoral.web.family.INFERENCE}) for
one L{IInferenceFront}. Errors are the protocol's C{{"error": "message"}}, which
Triton's and KServe's clients read, with KCoral's status codes and request
id header.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, maybeDeferred, succeed
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.errors import BadRequest, KCoralError, LoadFailed
from kcoral.inference.cudasharedmemory import CudaSharedMemory
from kcoral.inference.front import (
    IInferenceFront,
    InferAnswer,
    InferCall,
    load_config,
    load_files,
)
from kcoral.inference.message import IInferMessage, RestMessage
from kcoral.inference.sharedmemory import OFF, Caller, Placement, SharedMemory
from kcoral.protocol.counts import MOST_BYTES, read_count
from kcoral.protocol.decoupled import DECOUPLED_HEADER
from kcoral.protocol.sequence import OWNER_HEADER
from kcoral.web.auth import request_authorization
from kcoral.web.body import held
from kcoral.web.errors import internal_error
from kcoral.web.family import (
    CUDA_REGION_STATUS,
    CUDA_REGION_UNREGISTER,
    CUDA_REGISTER,
    CUDA_STATUS,
    CUDA_UNREGISTER,
    FORMED_BATCH_HEADER,
    INFERENCE_HEADER_LENGTH,
    LIVE,
    MODEL_CONFIG,
    MODEL_INFER,
    MODEL_LOAD,
    MODEL_METADATA,
    MODEL_READY,
    MODEL_STATISTICS,
    MODEL_UNLOAD,
    READY,
    REPOSITORY_INDEX,
    SERVER_METADATA,
    SHM_REGION_STATUS,
    SHM_REGION_UNREGISTER,
    SHM_REGISTER,
    SHM_STATUS,
    SHM_UNREGISTER,
    STATISTICS,
    TRACE_HEADERS,
    VERSION_CONFIG,
    VERSION_INFER,
    VERSION_METADATA,
    VERSION_READY,
    VERSION_STATISTICS,
    Route,
)
from kcoral.web.front import Handler
from kcoral.web.responses import error_response, with_length

log = Logger()

#: The most a repository index request's body (its filter) may hold.
MAX_INDEX_BODY = 64 * 1024
#: The most a shared-memory registration's body may hold.
MAX_REGISTER_BODY = 4 * 1024


def _json(request, status: int, value: Any) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", b"application/json")
    return with_length(request, json.dumps(value).encode())


def _status(request, ok: bool) -> bytes:
    # Health and readiness are in the status alone, as Triton answers them.
    request.setResponseCode(200 if ok else 503)
    return with_length(request, b"")


def _header_length(request) -> int | None:
    value = request.getHeader(INFERENCE_HEADER_LENGTH)
    if value is None:
        return None
    length = read_count(value, MOST_BYTES)
    if length is None:
        raise BadRequest("Inference-Header-Content-Length must be a count of bytes, in digits")
    return length


def _load_request(data: memoryview, model: str) -> tuple[str | None, dict[str, bytes]]:
    """The configuration (None: none) and the files that a load request's
    body carries; it may be as large as any request, so this runs off the
    reactor."""
    if not data.nbytes or not bytes(data).strip():
        return None, {}
    try:
        value = json.loads(bytes(data))
    except (ValueError, RecursionError):
        raise LoadFailed(f"failed to load '{model[:64]}': the request is not JSON") from None
    parameters = value.get("parameters", {}) if isinstance(value, dict) else None
    if not isinstance(parameters, dict):
        raise LoadFailed(f"failed to load '{model[:64]}': a load request is "
                         '{"parameters": {"config": "<JSON>", "file:<path>": "<base64>"}}')
    return load_config(model, parameters), load_files(model, parameters, _base64)


def _base64(value: object) -> bytes:
    """A file's content as REST carries it: base64 text."""
    if not isinstance(value, str):
        raise ValueError("a file's content must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise ValueError("a file's content is not base64") from None


def _caller(request) -> Caller:
    """Who sent C{request}: its token, and the host it came from."""
    return Caller(request_authorization(request), getattr(request.getClientAddress(), "host", ""))


def _registration(request) -> object:
    """The JSON value of a registration's (small) body."""
    data = held(request.body, MAX_REGISTER_BODY)
    if data is None:
        raise BadRequest(f"a registration is over {MAX_REGISTER_BODY} bytes")
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise BadRequest("the registration is not JSON") from None


class InferenceRoutes:
    """
    The inference protocol's routes of C{front}, one handler each (by the
    routes L{kcoral.web.family.INFERENCE} declares), for a service's
    L{kcoral.web.front.Front} to mount; it also applies the client guard
    and answers wrong methods. A client that goes away cancels what it waits
    for. Inputs are views of the request body, as a
    L{kcoral.web.request.KCoralRequest} keeps it (a plain C{BytesIO} body
    cannot be closed while they live). With C{from_fronts} (a server's,
    which a node's fronts forward to), it takes what a front says of a
    request in its headers: the client whose sequences it steps
    (L{OWNER_HEADER}), else its token, and that it is answered on a stream
    (L{DECOUPLED_HEADER}); a front's own requests come from clients, which
    say neither: their sequences are always their token's, and a decoupled
    model is refused to them over REST.
    """

    def __init__(self, front: IInferenceFront, shared_memory: SharedMemory | None = None, *,
                 from_fronts: bool = False, cuda_memory: CudaSharedMemory | None = None):
        self._front = front
        self._shared_memory = shared_memory or SharedMemory(refused=OFF, max_bytes=0)
        self._cuda_memory = cuda_memory or CudaSharedMemory()
        self._from_fronts = from_fronts

    def handlers(self) -> dict[Route, Handler]:
        """Each route of the family, and its handler."""
        model, version = self.model_route, self.version_route
        return {
            LIVE: self.live, READY: self.ready, SERVER_METADATA: self.metadata,
            REPOSITORY_INDEX: self.repository_index,
            MODEL_METADATA: model(self._front.model_metadata, self._json),
            VERSION_METADATA: version(self._front.model_metadata, self._json),
            MODEL_READY: model(self._front.model_ready, _status),
            VERSION_READY: version(self._front.model_ready, _status),
            MODEL_CONFIG: model(self._front.model_config, self._json),
            VERSION_CONFIG: version(self._front.model_config, self._json),
            MODEL_INFER: self.infer, VERSION_INFER: self.infer,
            STATISTICS: lambda request: self._answer(
                request, lambda: self._front.model_statistics(None, None),
                lambda value: _json(request, 200, value)),
            MODEL_STATISTICS: model(self._front.model_statistics, self._json),
            VERSION_STATISTICS: version(self._front.model_statistics, self._json),
            MODEL_LOAD: self.load,
            MODEL_UNLOAD: self.control(self._front.unload_model),
            SHM_STATUS: lambda request: self._regions(request, None),
            SHM_REGION_STATUS: self._regions,
            SHM_UNREGISTER: lambda request: self._unregister(request, None),
            SHM_REGION_UNREGISTER: self._unregister,
            SHM_REGISTER: self.register,
            CUDA_STATUS: lambda request: self._cuda_regions(request, None),
            CUDA_REGION_STATUS: self._cuda_regions,
            CUDA_UNREGISTER: lambda request: self._cuda_unregister(request, None),
            CUDA_REGION_UNREGISTER: self._cuda_unregister,
            CUDA_REGISTER: self.cuda_register,
        }

    def model_route(self, ask: Callable[[str, str | None], Deferred],
                    render: Callable[[Any, Any], bytes]) -> Handler:
        """The handler of a model's route (its current version) that answers
        with C{render} of what C{ask} fires with."""
        return lambda request, model: self._answer(
            request, lambda: ask(model, None), lambda value: render(request, value))

    def version_route(self, ask: Callable[[str, str | None], Deferred],
                      render: Callable[[Any, Any], bytes]) -> Handler:
        """As L{model_route}, for a route that names the model's version."""
        return lambda request, model, version: self._answer(
            request, lambda: ask(model, version), lambda value: render(request, value))

    def control(self, act: Callable[[str], Deferred]) -> Handler:
        """The handler of a model's load or unload route, that C{act}s on it."""
        return lambda request, model: self._answer(
            request, lambda: act(model), lambda value: _json(request, 200, value))

    def load(self, request, model: str) -> Deferred[bytes]:
        """A model's load route: its body, if any, C{{"parameters": {"config":
        "<JSON>", "file:<path>": "<base64>", ...}}}."""
        def load(loaded: tuple[str | None, dict[str, bytes]]) -> Deferred[dict]:
            config, files = loaded
            return self._front.load_model(model, config, files)

        def call() -> Deferred[dict]:
            return request.body.read().addCallback(
                lambda body: deferToThread(_load_request, body, model)).addCallback(load)
        return self._answer(request, call, lambda value: _json(request, 200, value))

    @staticmethod
    def _json(request, value: Any) -> bytes:
        return _json(request, 200, value)

    def _answer(self, request, call: Callable[[], Deferred],
                render: Callable[[Any], bytes]) -> Deferred[bytes]:
        """Answer C{request} with C{render} of what C{call} fires with."""
        d = maybeDeferred(call)
        d.addCallback(render)
        d.addErrback(self._failed, request)
        # The front cancels it when its client goes away, and drops an
        # answer for a client that left.
        return d

    def _failed(self, failure: Failure, request) -> bytes | Failure:
        if failure.check(CancelledError):
            return failure  # the client went away: nobody to answer
        error = failure.value
        if isinstance(error, KCoralError):
            # A member's answer passed on was logged by the member, and by
            # the forwarder naming it: once is enough.
            (log.debug if error.relayed else log.info)(
                "{request_id} answered {status}: {message}", request_id=request.request_id,
                status=error.status, message=error.message)
            # Its frames hold the request (its body) in a cycle only the
            # collector frees, which in a process of JAX's many objects runs
            # seldom: refused large requests piled up in memory.
            failure.cleanFailure()
            return error_response(request, error)
        return internal_error(request, failure)

    # -- the server -----------------------------------------------------------------------------

    def live(self, request) -> bytes:
        return _status(request, True)

    def ready(self, request) -> Deferred[bytes]:
        return self._answer(request, self._front.ready, lambda ok: _status(request, ok))

    def metadata(self, request) -> Deferred[bytes]:
        return self._answer(request, self._front.metadata, lambda value: _json(request, 200, value))

    def repository_index(self, request) -> bytes | Deferred[bytes]:
        def render(models: list[dict]) -> bytes:
            if only_ready:
                models = [m for m in models if m.get("state") == "READY"]
            return _json(request, 200, models)

        try:
            only_ready = self._only_ready(request)
        except BadRequest as e:
            return error_response(request, e)
        return self._answer(request, self._front.repository_index, render)

    def _only_ready(self, request) -> bool:
        """Whether the index request asks for the ready models alone."""
        data = held(request.body, MAX_INDEX_BODY)
        if data is None:
            raise BadRequest(f"a repository index request is over {MAX_INDEX_BODY} bytes")
        if not data.strip():
            return False
        try:
            value = json.loads(data)
        except (ValueError, RecursionError):
            raise BadRequest("the repository index request is not JSON") from None
        if not isinstance(value, dict) or not isinstance(value.get("ready", False), bool):
            raise BadRequest('a repository index request is {"ready": true|false}')
        return value.get("ready", False)

    # -- system shared memory ---------------------------------------------------------------

    def _regions(self, request, region: str | None) -> Deferred[bytes]:
        return self._answer(
            request, lambda: maybeDeferred(self._shared_memory.status, _caller(request), region),
            lambda value: _json(request, 200, value))

    def _unregister(self, request, region: str | None) -> Deferred[bytes]:
        return self._answer(
            request, lambda: maybeDeferred(self._shared_memory.unregister, _caller(request), region),
            lambda _: _status(request, True))

    def register(self, request, region: str) -> Deferred[bytes]:
        """A region's registration: C{{"key", "offset", "byte_size"}}."""
        def call() -> Deferred[None]:
            value = _registration(request)
            if not isinstance(value, dict):
                raise BadRequest('a registration is {"key": "/name", "offset": 0, "byte_size": N}')
            self._shared_memory.register(_caller(request), region, value.get("key"),
                                         value.get("offset", 0), value.get("byte_size"))
            return succeed(None)

        return self._answer(request, call, lambda _: _status(request, True))

    def _cuda_regions(self, request, region: str | None) -> Deferred[bytes]:
        return self._answer(
            request, lambda: maybeDeferred(self._cuda_memory.status, _caller(request), region),
            lambda value: _json(request, 200, value))

    def _cuda_unregister(self, request, region: str | None) -> Deferred[bytes]:
        return self._answer(
            request, lambda: maybeDeferred(self._cuda_memory.unregister, _caller(request), region),
            lambda _: _status(request, True))

    def cuda_register(self, request, region: str) -> Deferred[bytes]:
        """A CUDA region's registration: C{{"raw_handle": {"b64": ...},
        "device_id", "byte_size"}}, checked before it is refused where no
        worker holds a GPU."""
        return self._answer(request, lambda: maybeDeferred(
            lambda: self._cuda_memory.register(
                _caller(request), self._cuda_memory.registration(region, _registration(request)))),
            lambda _: _status(request, True))

    # -- inferences -----------------------------------------------------------------------------

    def infer(self, request, model: str, version: str | None = None) -> Deferred[bytes]:
        def call() -> Deferred:
            encoding = request.getHeader(b"Content-Encoding")
            if encoding not in (None, b"identity"):
                raise BadRequest("compressed inference requests are not served")
            header_length = _header_length(request)
            headers = {name: value for name in TRACE_HEADERS
                       if (value := request.getHeader(name)) is not None}
            formed = request.getHeader(FORMED_BATCH_HEADER) == b"true"
            # Whose sequences it may step: the client a front names (a
            # digest of the client's token), else the token it presents.
            named = request.getHeader(OWNER_HEADER) if self._from_fronts else None
            owner = named or _caller(request).token
            # A front answering a stream forwards it so: a decoupled model's
            # answers come back as one, for it to send one at a time.
            decoupled = self._from_fronts and request.getHeader(DECOUPLED_HEADER) == b"true"

            def ask(body: memoryview) -> Deferred:
                message = RestMessage(body, header_length)
                resolved = self._shared_memory.resolve(_caller(request), message)
                if resolved is None:
                    return self._front.infer(model, version, InferCall(
                        message, request.request_id, headers, formed, owner, decoupled))

                def placed(resolution: tuple[IInferMessage, Placement]) -> Deferred[InferAnswer]:
                    message, placement = resolution
                    return self._front.infer(model, version, InferCall(
                        message, request.request_id, headers, formed, owner, decoupled)
                    ).addCallback(placement.place)

                return resolved.addCallback(placed)

            return request.body.read().addCallback(ask)

        def render(answer: InferAnswer) -> bytes:
            if answer.header_length is None:
                request.setHeader(b"Content-Type", b"application/json")
            else:
                request.setHeader(b"Content-Type", b"application/octet-stream")
                request.setHeader(INFERENCE_HEADER_LENGTH, b"%d" % answer.header_length)
            return with_length(request, answer.body)

        return self._answer(request, call, render)
