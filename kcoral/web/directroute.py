"""
A resource that sends one hot route (C{POST /v1/run}) straight to its
handler, and every other request through the Klein app behind it.

Why: Klein's per-request work (binding and matching its URL map, adapting
the request, its maybeDeferreds and error-handler chain) costs 26-37 us of
CPU per run in each service, more than half as much again as the rest of a
Router's resource tree and HTTP server spend on it, and a run pays it in
both the Router and the server (doc/benchmarks.rst, "Routing", measured
with bench/routing.py). Klein still declares the route, so that it lists it
and answers its other methods with 405.

Everything else is as Klein does it (L{kcoral.web.cancellation}): a client
that goes away cancels the handler's Deferred, an answer for a client that
left is dropped, and a failure the handler did not expect gets the JSON 500
of Klein's error handler.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from kcoral.web.auth import IGuard
from kcoral.web.cancellation import answer_with


class DirectRoute(Resource):
    """C{POST path} goes to C{handler} (a request to a Deferred of the body)
    once C{guard} (if any) admits it, everything else to C{fallback}."""

    isLeaf = True

    def __init__(self, path: bytes, handler: Callable[..., Deferred], fallback: Resource, *,
                 guard: IGuard | None = None):
        super().__init__()
        self._path = path
        self._handler = handler
        self._fallback = fallback
        self._guard = guard

    def render(self, request):
        if request.method != b"POST" or request.path != self._path:
            return self._fallback.render(request)
        if self._guard is not None:
            refused = self._guard.refusal(request, request.request_id)
            if refused is not None:
                return refused
        answer_with(request, self._handler(request))
        return NOT_DONE_YET

