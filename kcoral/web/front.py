"""
A service's whole HTTP API in one resource: the client guard applied, in
this one place, to every guarded path of the families it serves; its hot
routes sent straight to their handlers; each mounted family's paths to that
family's resource; everything else to the service's Klein app.

Why hot routes skip Klein: Klein's per-request work (binding and matching
its URL map, adapting the request, its maybeDeferreds and error-handler
chain) costs 26-37 us of CPU per run in each service, more than half as
much again as the rest of a Router's resource tree and HTTP server spend on
it, and a run pays it in both the Router and the server (doc/benchmarks.rst,
"Routing", measured with bench/routing.py). Klein still declares those
routes, so that it lists them and answers their other methods with 405.

Everything else is as Klein does it (L{kcoral.web.cancellation}): a client
that goes away cancels the handler's Deferred, an answer for a client that
left is dropped, and a failure the handler did not expect gets the JSON 500
of Klein's error handler.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from twisted.internet.defer import Deferred
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET

from kcoral.web.auth import IGuard
from kcoral.web.cancellation import answer_with
from kcoral.web.family import FAMILIES, Family, route_of


class Front(Resource):
    """
    C{POST} to a path of a route in C{hot} (by its family's label, such as
    C{/v2/models/{model}/infer}) goes to its handler (a request to a
    Deferred of the body), a path of a family in C{mounts} to that family's
    resource, and every other request to C{fallback}; each once C{guard}
    (if any) admits it, where its family guards the path.
    """

    isLeaf = True

    def __init__(self, fallback: IResource, *, guard: IGuard | None = None,
                 hot: Mapping[str, Callable[..., Deferred]] | None = None,
                 mounts: Mapping[Family, IResource] | None = None,
                 families: tuple[Family, ...] = FAMILIES):
        super().__init__()
        self._fallback = fallback
        self._guard = guard
        self._hot = dict(hot or {})
        self._mounts = dict(mounts or {})
        self._families = families

    def render(self, request):
        path = request.path
        route = route_of(path, self._families)
        if route is None:
            return self._fallback.render(request)
        family, label = route
        if self._guard is not None and family.guards(path):
            refused = self._guard.refusal(request, request.request_id)
            if refused is not None:
                return refused
        if request.method == b"POST":
            handler = self._hot.get(label)
            if handler is not None:
                answer_with(request, handler(request))
                return NOT_DONE_YET
        return self._mounts.get(family, self._fallback).render(request)
