"""
The inference protocol's REST routes (C{/v2/...}) for one
L{IInferenceFront}. Errors are the protocol's C{{"error": "message"}}, which
Triton's and KServe's clients read, with KCoral's status codes and request
id header.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from klein import Klein
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure
from werkzeug.exceptions import MethodNotAllowed as NoSuchMethod
from werkzeug.exceptions import NotFound as NoSuchRoute

from kcoral.errors import BadRequest, InternalError, KCoralError, MethodNotAllowed, NotFound
from kcoral.inference.front import IInferenceFront, InferAnswer, InferCall
from kcoral.protocol.counts import MOST_BYTES, read_count
from kcoral.web.body import SpooledBody, body_of
from kcoral.web.family import INFER_ROUTES, INFERENCE_HEADER_LENGTH, TRACE_HEADERS
from kcoral.web.requestid import RequestIdResource
from kcoral.web.responses import error_response, with_length

log = Logger()

#: The most a repository index request's body (its filter) may hold.
MAX_INDEX_BODY = 64 * 1024


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


def _body(request) -> Deferred[memoryview]:
    """The whole request body: a view of it in memory, or what a KCoral site
    spooled to a file, read in the spool's thread (never on the reactor's)."""
    view = request.content.getbuffer()
    if view.nbytes:
        return succeed(view)
    body = body_of(request)
    if isinstance(body, SpooledBody):
        return body.read().addCallback(memoryview)
    return succeed(view)


class InferenceResource(RequestIdResource):
    """
    A leaf resource serving the C{/v2} routes of C{front}, matched on the
    request's whole path: a site's root, or rendered by the resource there
    (a service's L{kcoral.web.front.Front}, which also applies its client
    guard). A client that goes away cancels what it waits for.
    Inputs are views of the request body, as a
    L{kcoral.web.request.KCoralRequest} keeps it (a plain C{BytesIO} body
    cannot be closed while they live).
    """

    app = Klein()

    def __init__(self, front: IInferenceFront):
        self._front = front
        super().__init__(self.app.resource())

    def hot(self) -> dict[str, Callable[..., Deferred]]:
        """
        The inference routes, by label, for a front to send straight to
        L{posted}: Klein's dispatch of a request (binding and matching its
        URL map, adapting the request, its error-handler chain) costs as much
        as a tenth of a gateway's CPU per inference, as it did for runs.
        """
        return dict.fromkeys(INFER_ROUTES, self.posted)

    def posted(self, request) -> Deferred:
        """The answer to an inference whose path a front matched to an
        inference route: the model (and version) read from its segments."""
        segments = [unquote(s) for s in request.path.decode("ascii", "replace").split("/")]
        # /v2/models/{m}/infer or /v2/models/{m}/versions/{v}/infer
        model, version = segments[3], segments[5] if len(segments) == 7 else None
        return maybeDeferred(self.infer, request, model, version)

    def _answer(self, request, call: Callable[[], Deferred],
                render: Callable[[Any], bytes]) -> Deferred[bytes]:
        """Answer C{request} with C{render} of what C{call} fires with."""
        d = maybeDeferred(call)
        d.addCallback(render)
        d.addErrback(self._failed, request)
        # Klein cancels the Deferred a handler returns when its client goes
        # away, and drops an answer for a client that left.
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
            return error_response(request, error)
        log.failure("{request_id} internal error", failure, request_id=request.request_id)
        return error_response(request, InternalError(f"internal error: {type(failure.value).__name__}"))

    @app.handle_errors(NoSuchRoute)
    def no_route(self, request, failure):
        path = request.path.decode("ascii", "replace")[:100]
        return error_response(request, NotFound(f"no route {path}"))

    @app.handle_errors(NoSuchMethod)
    def no_method(self, request, failure):
        method = request.method.decode("ascii", "replace")[:20]
        return error_response(request, MethodNotAllowed(f"{method} is not allowed here"))

    # -- the server -----------------------------------------------------------------------------

    @app.route("/v2/health/live", methods=["GET"])
    def live(self, request):
        return _status(request, True)

    @app.route("/v2/health/ready", methods=["GET"])
    def ready(self, request):
        return self._answer(request, self._front.ready, lambda ok: _status(request, ok))

    @app.route("/v2", methods=["GET"])
    def metadata(self, request):
        return self._answer(request, self._front.metadata, lambda value: _json(request, 200, value))

    @app.route("/v2/repository/index", methods=["POST"])
    def repository_index(self, request):
        def render(models: list[dict]) -> bytes:
            if only_ready:
                models = [m for m in models if m.get("state") == "READY"]
            return _json(request, 200, models)

        try:
            only_ready = self._only_ready(request)
        except BadRequest as e:
            return error_response(request, e)
        return self._answer(request, self._front.repository_index, render)

    @app.route("/v2/repository/models/<m>/load", methods=["POST"])
    def load_model(self, request, m):
        return self._answer(request, lambda: self._front.load_model(m),
                            lambda value: _json(request, 200, value))

    @app.route("/v2/repository/models/<m>/unload", methods=["POST"])
    def unload_model(self, request, m):
        return self._answer(request, lambda: self._front.unload_model(m),
                            lambda value: _json(request, 200, value))

    def _only_ready(self, request) -> bool:
        """Whether the index request asks for the ready models alone."""
        data = request.content.getvalue()
        if not data.strip():
            return False
        if len(data) > MAX_INDEX_BODY:
            raise BadRequest(f"a repository index request is over {MAX_INDEX_BODY} bytes")
        try:
            value = json.loads(data)
        except (ValueError, RecursionError):
            raise BadRequest("the repository index request is not JSON") from None
        if not isinstance(value, dict) or not isinstance(value.get("ready", False), bool):
            raise BadRequest('a repository index request is {"ready": true|false}')
        return value.get("ready", False)

    # -- models ---------------------------------------------------------------------------------

    @app.route("/v2/models/<m>", methods=["GET"], defaults={"v": None})
    @app.route("/v2/models/<m>/versions/<v>", methods=["GET"])
    def model_metadata(self, request, m, v):
        return self._answer(request, lambda: self._front.model_metadata(m, v),
                            lambda value: _json(request, 200, value))

    @app.route("/v2/models/<m>/ready", methods=["GET"], defaults={"v": None})
    @app.route("/v2/models/<m>/versions/<v>/ready", methods=["GET"])
    def model_ready(self, request, m, v):
        return self._answer(request, lambda: self._front.model_ready(m, v),
                            lambda ok: _status(request, ok))

    @app.route("/v2/models/<m>/config", methods=["GET"], defaults={"v": None})
    @app.route("/v2/models/<m>/versions/<v>/config", methods=["GET"])
    def model_config(self, request, m, v):
        return self._answer(request, lambda: self._front.model_config(m, v),
                            lambda value: _json(request, 200, value))

    @app.route("/v2/models/stats", methods=["GET"], defaults={"m": None, "v": None})
    @app.route("/v2/models/<m>/stats", methods=["GET"], defaults={"v": None})
    @app.route("/v2/models/<m>/versions/<v>/stats", methods=["GET"])
    def model_statistics(self, request, m, v):
        return self._answer(request, lambda: self._front.model_statistics(m, v),
                            lambda value: _json(request, 200, value))

    @app.route("/v2/models/<m>/infer", methods=["POST"], defaults={"v": None})
    @app.route("/v2/models/<m>/versions/<v>/infer", methods=["POST"])
    def infer(self, request, m, v):
        def call() -> Deferred:
            encoding = request.getHeader(b"Content-Encoding")
            if encoding not in (None, b"identity"):
                raise BadRequest("compressed inference requests are not served")
            header_length = _header_length(request)
            headers = {name: value for name in TRACE_HEADERS
                       if (value := request.getHeader(name)) is not None}
            d = _body(request)
            d.addCallback(lambda body: self._front.infer(
                m, v, InferCall(body, header_length, request.request_id, headers)))
            return d

        def render(answer: InferAnswer) -> bytes:
            if answer.header_length is None:
                request.setHeader(b"Content-Type", b"application/json")
            else:
                request.setHeader(b"Content-Type", b"application/octet-stream")
                request.setHeader(INFERENCE_HEADER_LENGTH, b"%d" % answer.header_length)
            return with_length(request, answer.body)

        return self._answer(request, call, render)
