"""JSON answers for the routes nobody serves, and for unexpected errors, on
every KCoral service (Klein would answer both in HTML)."""

from __future__ import annotations

from twisted.logger import Logger
from werkzeug.exceptions import MethodNotAllowed, NotFound

from kcoral.errors import BadRequest, ProgramFailed, error_body
from kcoral.web.responses import json_response

log = Logger()


def install(app) -> None:
    """Make C{app} (a Klein app) answer unknown routes and methods in JSON."""

    @app.handle_errors(NotFound)
    def not_found(self, request, failure):
        error = BadRequest(f"no route {request.path.decode('ascii', 'replace')[:100]}")
        error.type = "not_found"
        return json_response(request, 404, error_body(error, request.request_id))

    @app.handle_errors(MethodNotAllowed)
    def not_allowed(self, request, failure):
        return method_not_allowed(request)

    @app.handle_errors(Exception)
    def internal(self, request, failure):
        return internal_error(request, failure)


def method_not_allowed(request) -> bytes:
    """A JSON 405 for a method the request's target does not take."""
    error = BadRequest(f"{request.method.decode('ascii', 'replace')[:20]} is not allowed here")
    error.type = "method_not_allowed"
    return json_response(request, 405, error_body(error, request.request_id))


def internal_error(request, failure) -> bytes:
    """Log an unexpected failure and answer a JSON 500 that names only its type."""
    log.failure("{request_id} internal error", failure, request_id=request.request_id)
    error = ProgramFailed(f"internal error: {failure.type.__name__}")
    error.type = "internal_error"
    return json_response(request, 500, error_body(error, request.request_id))
