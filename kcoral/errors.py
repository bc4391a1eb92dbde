"""
The errors a KCoral client can see, and the one table that maps them to HTTP.

Every error a KCoral service answers is a class here, listed in L{ERRORS};
servers, the Router and clients all read it, so that a status code means the
same thing everywhere (the table in doc/protocol.rst).
"""

from __future__ import annotations

import json


class KCoralError(Exception):
    """
    Base of every error KCoral raises to a client.

    @ivar status: the HTTP status code that carries this error.
    @ivar type: the stable machine-readable name sent in the JSON body.
    @ivar reason: a finer reason (for 503: C{queue_full}, C{queue_timeout},
        C{no_ready_node}, C{draining}; for 422: C{not_enough_devices},
        C{arrays_apart}; for 504: C{run_timeout}).
    @ivar request_id: the request id the service reported, if any.
    @ivar relayed: whether another KCoral process answered it (and logged
        it): a front that passes it on need not log it again.
    """

    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, reason: str | None = None,
                 request_id: str | None = None, details: dict | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.request_id = request_id
        self.details = details or {}
        self.relayed = False

    def __str__(self) -> str:
        text = self.message
        if self.request_id:
            text += f" (request {self.request_id})"
        return text


class BadRequest(KCoralError):
    """400 or 413: the request itself is malformed or too large."""

    status = 400
    type = "bad_request"


class Unauthorized(BadRequest):
    """401: a run or the node list without a client token, or a node control
    request without the node token, where the service needs one."""

    status = 401
    type = "unauthorized"


class NotFound(BadRequest):
    """404: no such route, or no such node session."""

    status = 404
    type = "not_found"


class ModelNotReady(BadRequest):
    """400: the model failed to load or was unloaded; its state and reason
    are in the message. Not a 503: waiting would not help."""

    type = "model_not_ready"


class LoadFailed(BadRequest):
    """400 (gRPC C{INTERNAL}, as Triton answers it): a model load that
    failed. The message starts C{failed to load 'NAME'}, the words Triton's
    clients look for, and says why; a model served already goes on being
    served."""

    type = "load_failed"


class DecoupledModel(BadRequest):
    """501: an inference of a decoupled model (several answers to one
    request) asked where only one answer can be given (a REST inference,
    gRPC's unary ModelInfer): such a model answers on gRPC's
    ModelStreamInfer. The message is Triton's words, which its clients look
    for: C{REST_DECOUPLED} here (a gRPC front says C{GRPC_DECOUPLED})."""

    status = 501
    type = "decoupled_model"


#: Triton's words for an inference of a decoupled model over REST, and
#: over gRPC's unary ModelInfer.
REST_DECOUPLED = "HTTP end point doesn't support models with decoupled transaction policy"
GRPC_DECOUPLED = "ModelInfer RPC doesn't support models with decoupled transaction policy"


class MethodNotAllowed(BadRequest):
    """405: the route does not take this method."""

    status = 405
    type = "method_not_allowed"


class PayloadTooLarge(BadRequest):
    """413: the request body is larger than the service takes."""

    status = 413
    type = "payload_too_large"


class RequestTimeout(BadRequest):
    """408: the request body arrived too slowly."""

    status = 408
    type = "request_timeout"


class MissingContent(KCoralError):
    """409: the request referenced cached content the server does not hold."""

    status = 409
    type = "missing_content"

    @property
    def missing(self) -> list[str]:
        return list(self.details.get("missing", []))


class NodeConflict(BadRequest):
    """409: a node id already held by another live session."""

    status = 409
    type = "node_conflict"


class ProgramRejected(KCoralError):
    """422: wrong inputs, no matching platform, or a compile failure."""

    status = 422
    type = "program_rejected"


class NotEnoughDevices(ProgramRejected):
    """422, reason C{not_enough_devices}: the program was exported for more
    devices than this server, or any ready member of a pool, owns."""

    def __init__(self, message: str, **kwargs) -> None:
        kwargs.setdefault("reason", "not_enough_devices")
        super().__init__(message, **kwargs)


class ArraysApart(ProgramRejected):
    """422, reason C{arrays_apart}: a run's kept arrays are held by
    different workers, and a run takes them all where they are."""

    def __init__(self, message: str, **kwargs) -> None:
        kwargs.setdefault("reason", "arrays_apart")
        super().__init__(message, **kwargs)


class ArrayLost(KCoralError):
    """410: a kept array its worker no longer holds (deleted, expired, or
    the worker restarted or is gone); C{lost} names them."""

    status = 410
    type = "array_lost"

    @property
    def lost(self) -> list[str]:
        return list(self.details.get("lost", []))


class SequenceLost(KCoralError):
    """410: a step of a sequence whose START this front placed on a worker
    that no longer holds it (gone, restarted, or no longer the sequence's
    worker since the members changed): its state is lost, and the client
    starts the sequence again."""

    status = 410
    type = "sequence_lost"

    def __init__(self, message: str, **kwargs):
        # The inference protocol's errors are their message alone: the
        # reason is in it, where clients look for it.
        super().__init__(f"sequence_lost: {message}", reason="sequence_lost", **kwargs)


class KeptMemoryFull(KCoralError):
    """507, reason C{kept_memory_full}: the outputs a run would keep pass the
    worker's C{--kept-bytes}; it did not run."""

    status = 507
    type = "kept_memory_full"

    def __init__(self, message: str, **kwargs) -> None:
        kwargs.setdefault("reason", "kept_memory_full")
        super().__init__(message, **kwargs)


class ProgramFailed(KCoralError):
    """500: the program failed while running, or an internal error."""

    status = 500
    type = "program_failed"


class InternalError(ProgramFailed):
    """500: an unexpected failure in the service itself, named only by its type."""

    type = "internal_error"


class RunTimeout(ProgramFailed):
    """504, reason C{run_timeout}: the run, or the inference batch it was in,
    was still executing the server's C{--max-run-seconds} after it started,
    and the process running it was ended. Never run again by a Router: a
    second run would take as long."""

    status = 504
    type = "run_timeout"

    def __init__(self, message: str, **kwargs) -> None:
        kwargs.setdefault("reason", "run_timeout")
        super().__init__(message, **kwargs)


class NodeFailure(KCoralError):
    """502: the node was lost after the request may have started."""

    status = 502
    type = "node_failure"


class ServerBusy(KCoralError):
    """503: no capacity now (queue full or expired, no node, draining)."""

    status = 503
    type = "server_busy"


class ProgramExportError(KCoralError, ValueError):
    """A function that cannot be exported or serialized, raised locally."""

    status = 0
    type = "export_error"


#: The errors a client raises, one for each status it tells apart; an
#: answer of any other 4xx status is a L{BadRequest}, any other 5xx a
#: L{ProgramFailed} (L{error_from_body}).
CLIENT_ERRORS: tuple[type[KCoralError], ...] = (
    BadRequest,
    Unauthorized,
    MissingContent,
    PayloadTooLarge,
    ProgramRejected,
    ArrayLost,
    ProgramFailed,
    KeptMemoryFull,
    NodeFailure,
    ServerBusy,
    RunTimeout,
)

#: Every error a KCoral service answers: the client's, and finer ones that a
#: client catches as the class they refine.
ERRORS: tuple[type[KCoralError], ...] = CLIENT_ERRORS + (
    NotFound,
    ModelNotReady,
    LoadFailed,
    MethodNotAllowed,
    RequestTimeout,
    NodeConflict,
    NotEnoughDevices,
    ArraysApart,
    SequenceLost,
    InternalError,
    DecoupledModel,
)

#: The class of each status: the client's, and the finer ones whose status
#: no client error has (404 is L{NotFound}).
ERRORS_BY_STATUS: dict[int, type[KCoralError]] = {
    **{cls.status: cls for cls in ERRORS}, **{cls.status: cls for cls in CLIENT_ERRORS}}


def unknown_model(name: str, version: str | None = None, why: str = "") -> NotFound:
    """404 for a model (or a version of it) not served, in the words of
    Triton, whose clients look for how the message starts; then C{why}."""
    return NotFound(f"Request for unknown model: '{name[:64]}'"
                    + (f" version {version[:32]}" if version else "") + " is not found"
                    + (f": {why}" if why else ""))


def unreadable_version(version: str) -> BadRequest:
    """400 for a model version that is not a version number, in Triton's words."""
    return BadRequest(f"failed to get model version from specified version string "
                      f"'{version[:32]}': a version is a number")


def error_body(error: KCoralError, request_id: str) -> dict:
    """The JSON error object every KCoral service answers with."""
    body = {"type": error.type, "message": error.message, "request_id": request_id}
    if error.reason:
        body["reason"] = error.reason
    body.update(error.details)
    return {"error": body}


def error_from_answer(status: int, content: bytes, request_id: str | None = None) -> KCoralError:
    """The exception an error answer of C{status} with C{content} stands for,
    whether or not C{content} is a KCoral JSON error; C{request_id} is the
    request's, where the body names none (the inference protocol's do not)."""
    try:
        body = json.loads(content)
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep
        body = None
    error = error_from_body(status, body, content[:200].decode("utf-8", "replace"))
    error.request_id = error.request_id or request_id
    error.relayed = True
    return error


def error_from_body(status: int, body: dict | None, fallback: str) -> KCoralError:
    """Rebuild the client-side exception for an error answer."""
    cls = ERRORS_BY_STATUS.get(status)
    if cls is None:
        cls = BadRequest if 400 <= status < 500 else ProgramFailed
    info = (body or {}).get("error") if isinstance(body, dict) else None
    if isinstance(info, str):
        # The inference protocol's form: the message alone.
        return cls(info[:1000])
    if not isinstance(info, dict):
        return cls(f"HTTP {status}: {fallback}")
    details = {k: v for k, v in info.items()
               if k not in ("type", "message", "request_id", "reason")}
    return cls(str(info.get("message", fallback)), reason=info.get("reason"),
               request_id=info.get("request_id"), details=details)
