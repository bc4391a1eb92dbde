"""
Re-dispatch in the Router's forward loop (L{kcoral.router.forward}), with fake
workers behind C{treq.testing.StubTreq} on a fake clock: a run whose client
sends C{X-KCoral-Redispatch: true} is run again after the loss of its node,
up to C{max_redispatches} times and with the same request id; without it the
loss stays a 502. A run that passed its worker's run limit (504
C{run_timeout}) is answered, and never sent again.
"""

from __future__ import annotations

import json

from twisted.web.http_headers import Headers

from kcoral.common.report import parse_report
from kcoral.errors import NodeFailure, RunTimeout, error_body
from kcoral.protocol.wire import REDISPATCH_HEADER, REQUEST_CONTENT_TYPE
from kcoral.router.call import Call
from kcoral.web.body import MemoryBody
from kcoral.web.family import RUN
from tests.fakes import FakeWorker, node_report
from tests.test_forward import Routed


class Redispatched:
    """A client's request (as a Router's handler reads it) that allows a second run."""

    request_id = "redispatched-1"
    path = b"/v1/run"
    method = b"POST"

    def __init__(self, value: bytes = b"true"):
        self.requestHeaders = Headers({b"Content-Type": [REQUEST_CONTENT_TYPE.encode()],
                                       REDISPATCH_HEADER.encode(): [value]})


def call(request: Redispatched) -> Call:
    """The call a Router's handler forwards C{request} as."""
    return Call.of(request, RUN)


def forward(routed: Routed, forwarder, request):
    done: list = []
    forwarder.forward(call(request), MemoryBody(b"run"), None).addCallbacks(
        lambda a: done.append(("ok", a)), lambda f: done.append(("failed", f.value)))
    routed.client.flush()
    return done


def test_only_true_asks_for_redispatch():
    """The header allows a second run only with the value true (any case)."""
    assert call(Redispatched(b"true")).redispatch and call(Redispatched(b"True ")).redispatch
    assert not call(Redispatched(b"1")).redispatch and not call(Redispatched(b"no")).redispatch


class FirstLost:
    """Hosts whose connection is lost once sent: the first one asked about, only."""

    def __init__(self) -> None:
        self.host: str | None = None

    def __contains__(self, host: str) -> bool:
        if self.host is None:
            self.host = host
        return host == self.host


def test_a_run_lost_on_one_node_is_answered_by_another():
    """A run that asked for re-dispatch, lost after it was sent, is answered by another member."""
    lost = FirstLost()
    routed = Routed("10.0.0.1", "10.0.0.2", lost=lost)
    workers = {"10.0.0.1": FakeWorker(200, b"ran"), "10.0.0.2": FakeWorker(200, b"ran")}
    done = forward(routed, routed.serve(**workers), Redispatched())
    assert done[0][0] == "ok" and done[0][1].body == b"ran"
    hosts = [r.url.split("/")[2].split(":")[0] for r in routed.client.requests]
    assert hosts[0] == lost.host and len(hosts) == 2 and hosts[1] != lost.host
    ids = {tuple(r.headers.getRawHeaders(b"X-Request-ID")) for r in routed.client.requests}
    assert ids == {(b"redispatched-1",)}
    assert routed.pool.active() == 0


def test_redispatches_are_bounded():
    """Past max_redispatches losses the run is a 502: one first try plus that many again."""
    routed = Routed("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4",
                    lost={"10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"})
    forwarder = routed.serve()
    done = forward(routed, forwarder, Redispatched())
    kind, error = done[0]
    assert kind == "failed" and isinstance(error, NodeFailure)
    assert len(routed.client.requests) == 1 + forwarder.max_redispatches
    assert routed.pool.active() == 0


def test_without_the_header_a_lost_run_stays_a_502():
    """A run whose client did not allow a second run is sent once: its loss is a 502."""
    routed = Routed("10.0.0.1", "10.0.0.2", lost={"10.0.0.1", "10.0.0.2"})
    forwarder = routed.serve()
    done = forward(routed, forwarder, Redispatched(b"false"))
    assert isinstance(done[0][1], NodeFailure) and len(routed.client.requests) == 1


def test_the_same_node_runs_it_again_once_it_is_reported_back():
    """With one node, a re-dispatched run waits for its member to be reported again, then runs there."""
    lost = {"10.0.0.1"}
    routed = Routed("10.0.0.1", lost=lost)
    forwarder = routed.serve(**{"10.0.0.1": FakeWorker(200, b"ran")})
    done = forward(routed, forwarder, Redispatched())
    assert not done and len(routed.scheduler.queue) == 1
    lost.clear()
    routed.pool.report("10.0.0.1", parse_report(node_report(host="10.0.0.1", capacities=(1,))))
    routed.client.flush()
    assert done[0][0] == "ok" and done[0][1].body == b"ran"
    assert len(routed.client.requests) == 2


def test_a_run_timeout_is_passed_on_and_never_run_again():
    """A member's 504 run_timeout is the client's answer as it came, sent nowhere else, even
    to a client that allows a second run."""
    body = json.dumps(error_body(RunTimeout("still running"), "redispatched-1")).encode()
    routed = Routed("10.0.0.1", "10.0.0.2")
    workers = {"10.0.0.1": FakeWorker(504, body), "10.0.0.2": FakeWorker(504, body)}
    done = forward(routed, routed.serve(**workers), Redispatched())
    kind, answer = done[0]
    assert kind == "ok" and (answer.code, answer.body) == (504, body)
    assert len(routed.client.requests) == 1 and routed.pool.active() == 0
