"""JSON answers for the routes nobody serves, and for unexpected errors, on
every KCoral service (Klein would answer both in HTML)."""

from __future__ import annotations

from twisted.logger import Logger
from twisted.python.failure import Failure
from werkzeug.exceptions import MethodNotAllowed as NoSuchMethod
from werkzeug.exceptions import NotFound as NoSuchRoute

from kcoral.errors import InternalError, MethodNotAllowed, NotFound
from kcoral.web.responses import error_response

log = Logger()


def install(app) -> None:
    """Make C{app} (a Klein app) answer unknown routes and methods in JSON."""

    @app.handle_errors(NoSuchRoute)
    def not_found(self, request, failure):
        path = request.path.decode("ascii", "replace")[:100]
        return error_response(request, NotFound(f"no route {path}"))

    @app.handle_errors(NoSuchMethod)
    def not_allowed(self, request, failure):
        return method_not_allowed(request)

    @app.handle_errors(Exception)
    def internal(self, request, failure):
        return internal_error(request, failure)


def method_not_allowed(request) -> bytes:
    """A JSON 405 for a method the request's target does not take."""
    method = request.method.decode("ascii", "replace")[:20]
    return error_response(request, MethodNotAllowed(f"{method} is not allowed here"))


def internal_error(request, failure: Failure) -> bytes:
    """Log an unexpected failure and answer a JSON 500 that names only its type."""
    log.failure("{request_id} internal error", failure, request_id=request.request_id)
    return error_response(request, InternalError(f"internal error: {type(failure.value).__name__}"))
