"""
A resource that sends one hot route (C{POST /v1/run}) straight to its
handler, and every other request through the Klein app behind it.

Why: Klein's per-request work (binding and matching its URL map, adapting
the request, two maybeDeferreds and its error-handler chain) measured about
140 us of server CPU per trivial run, over a tenth of the round trip, and as
much again in a Router, which receives every run and sends it on. The answers
are the same: the handler answers every error it expects in JSON, and
anything else gets the JSON 500 that Klein's error handler gives. Klein still
declares the route, so that it lists it and answers its other methods with
405.

Unlike Klein, this does not cancel the handler's Deferred when the client
goes away: each handler watches C{request.notifyFinish()} itself where it
waits (a queue slot, an outgoing request, the reading of its answer), and
an answer that comes after the client left is dropped here.
"""

from __future__ import annotations

from typing import Callable

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from kcoral.web.errors import internal_error

log = Logger()


class DirectRoute(Resource):
    """C{POST path} goes to C{handler} (a request to a Deferred of the body),
    everything else to C{fallback}."""

    isLeaf = True

    def __init__(self, path: bytes, handler: Callable[..., Deferred], fallback: Resource):
        super().__init__()
        self._path = path
        self._handler = handler
        self._fallback = fallback

    def render(self, request):
        if request.method != b"POST" or request.path != self._path:
            return self._fallback.render(request)
        gone: list = []
        request.notifyFinish().addBoth(gone.append)
        d = self._handler(request)
        d.addErrback(lambda failure: internal_error(request, failure))
        d.addCallback(_write, request, gone)
        d.addErrback(lambda failure: log.failure("{request_id} could not answer", failure,
                                                 request_id=request.request_id))
        return NOT_DONE_YET


def _write(body: bytes, request, gone: list) -> None:
    if not gone:
        request.write(body)
        request.finish()
    elif body:
        log.info("{request_id} answer dropped: the client went away", request_id=request.request_id)
