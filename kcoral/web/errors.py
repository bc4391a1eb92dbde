"""JSON answers for the routes nobody serves, on every KCoral service."""

from __future__ import annotations

from werkzeug.exceptions import MethodNotAllowed, NotFound

from kcoral.errors import BadRequest
from kcoral.web.responses import json_response
from kcoral.errors import error_body


def install(app) -> None:
    """Make C{app} (a Klein app) answer unknown routes and methods in JSON."""

    @app.handle_errors(NotFound)
    def not_found(self, request, failure):
        error = BadRequest(f"no route {request.path.decode('ascii', 'replace')[:100]}")
        error.type = "not_found"
        return json_response(request, 404, error_body(error, request.request_id))

    @app.handle_errors(MethodNotAllowed)
    def not_allowed(self, request, failure):
        error = BadRequest(f"{request.method.decode('ascii', 'replace')} is not allowed here")
        error.type = "method_not_allowed"
        return json_response(request, 405, error_body(error, request.request_id))
