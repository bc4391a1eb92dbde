"""
Cancellation on disconnect, in one place: the answer of a request is the
result of its handler's Deferred, and a client that goes away first cancels
that Deferred, as Klein does for the routes it dispatches itself.

The cancellation travels down whatever the handler waits on: the Router's
wait for capacity (L{kcoral.common.queue}), its forwarded request and the
reading of its answer (L{kcoral.router.proxy}), a server's wait for an
admission slot (L{kcoral.server.admission}). A run already on a device
cannot be interrupted; its answer, like any answer for a client that left,
is dropped here.
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.web.errors import internal_error

log = Logger()


def answer_with(request, d: Deferred) -> None:
    """Answer C{request} with the bytes C{d} fires with (a failure the
    handler did not expect: a JSON 500); cancel C{d} when the client leaves."""
    left = request.notifyFinish()
    left.addErrback(lambda _: d.cancel())
    d.addBoth(_answer, request, left)
    d.addErrback(lambda failure: log.failure("{request_id} could not answer", failure,
                                             request_id=request.request_id))


def _answer(result: bytes | Failure, request, left: Deferred) -> None:
    if left.called:
        # The client went away: nobody to answer, and a cancellation is no error.
        if isinstance(result, Failure) and not result.check(CancelledError):
            log.failure("{request_id} failed after the client went away", result,
                        request_id=request.request_id)
        return
    request.write(internal_error(request, result) if isinstance(result, Failure) else result)
    request.finish()
