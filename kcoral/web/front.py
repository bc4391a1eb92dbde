"""
A service's whole HTTP API in one resource: the API families it serves
mounted once, one handler per route of theirs (L{kcoral.web.family}); the
client guard applied, in this one place, to every route that needs the
client token; a wrong method answered 405 from the same declaration; and
everything else (C{/health}, C{/metrics}, the dashboard) sent to the
service's Klein app.

Why the families' routes skip Klein: Klein's per-request work (binding
and matching its URL map, adapting the request, its maybeDeferreds and
error-handler chain) costs 26-37 us of CPU per run in each service, more
than half as much again as the rest of a Router's resource tree and HTTP
server spend on it, and a run pays it in both the Router and the server
(doc/benchmarks.rst, "Routing", measured with bench/routing.py). A route
found here is one dictionary lookup (a fixed path) or a few regular
expressions (a model's, an array's).

Everything else is as Klein does it (L{kcoral.web.cancellation}): a client
that goes away cancels the handler's Deferred, an answer for a client that
left is dropped, and a failure the handler did not expect gets a JSON 500.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET

from kcoral.web.auth import IGuard
from kcoral.web.cancellation import answer_with
from kcoral.web.errors import internal_error, method_not_allowed
from kcoral.web.family import CLIENT, Route, Routes

#: A route's handler: the request, then the names its path's segments give
#: (C{model=...}); its answer's bytes, or a Deferred of them.
Handler = Callable[..., Any]


class Front(Resource):
    """
    A request for one of C{routes} goes to its handler once C{guard} (if
    any) admits it, where the route needs the client token; every other
    request to C{fallback}.
    """

    isLeaf = True

    def __init__(self, fallback: IResource, routes: Mapping[Route, Handler], *,
                 guard: IGuard | None = None):
        super().__init__()
        self._fallback = fallback
        self._guard = guard
        self._handlers = dict(routes)
        self._routes = Routes(self._handlers)

    def render(self, request):
        found = self._routes.find(request.path)
        if found is None:
            return self._fallback.render(request)
        route, segments = found
        if self._guard is not None and route.guard == CLIENT:
            refused = self._guard.refusal(request, request.request_id)
            if refused is not None:
                return refused
        if request.method not in route.methods:
            request.setHeader(b"Allow", route.allow)
            return method_not_allowed(request)
        try:
            answer = self._handlers[route](request, **segments)
        except Exception:
            return internal_error(request, Failure())
        if isinstance(answer, Deferred):
            answer_with(request, answer)
            return NOT_DONE_YET
        return answer
