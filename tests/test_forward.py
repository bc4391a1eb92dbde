"""
The Router's forward-and-retry loop (L{kcoral.router.forward}) in process: a
pool of fake workers behind C{treq.testing.StubTreq}, on a fake clock.
"""

from __future__ import annotations

import json

import attrs
from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock

from kcoral.common.queue import WaitQueue
from kcoral.common.report import parse_report
from kcoral.errors import MissingContent, NodeFailure, RequestTimeout, ServerBusy, error_body
from kcoral.router.forward import MAX_HOLDER_TRIES, MAX_NOT_SENT, Forwarder
from kcoral.router.pool import Pool
from kcoral.router.proxy import Proxy
from kcoral.router.residency import Demand
from kcoral.router.scheduler import Scheduler
from kcoral.web.body import MemoryBody
from tests.fakes import FakeWorker, FakeWorkers, node_report
from tests.httputil import RUN_CALL


class Routed:
    """A pool of one-worker nodes, one per host, and a Forwarder to them."""

    def __init__(self, *hosts: str, **client):
        self.clock = Clock()
        self.pool = Pool(self.clock, max_status_age_seconds=5.0, unhealthy_threshold=3,
                         recovery_threshold=1, node_retention_seconds=600.0)
        for host in hosts:
            self.pool.report(host, parse_report(node_report(host=host, capacities=(1,))))
        self.pool.observe()
        self.scheduler = Scheduler(self.pool, WaitQueue(self.clock, 16, 30.0))
        self.waits: list = []
        self.workers: FakeWorkers | None = None
        self.client_options = client

    def serve(self, **workers: FakeWorker) -> Forwarder:
        self.workers = FakeWorkers(**workers)
        self.client = self.workers.client(**self.client_options)
        return Forwarder(self.scheduler, Proxy(self.client), self.clock,
                         observe_wait=self.waits.append)

    def member(self, host: str):
        [member] = self.pool.nodes[host].members.values()
        return member

    def forward(self, forwarder: Forwarder, demand: Demand | None = None, body=None,
                request=None):
        """The outcome of one forward, settled: ('ok', answer) or ('failed', exception)."""
        done: list = []
        d = forwarder.forward(request or RUN_CALL, body or MemoryBody(b"run"), demand)
        d.addCallbacks(lambda a: done.append(("ok", a)), lambda f: done.append(("failed", f.value)))
        self.client.flush()
        return d, done


def test_a_run_is_answered_by_the_member_it_was_leased():
    """A worker's answer comes back as it is, and its lease is released."""
    routed = Routed("10.0.0.1")
    worker = FakeWorker(200, b"result")
    _, done = routed.forward(routed.serve(**{"10.0.0.1": worker}))
    kind, answer = done[0]
    assert kind == "ok" and answer.code == 200 and answer.body == b"result"
    assert len(worker.runs) == 1 and routed.pool.active() == 0 and routed.waits == [0.0]


def test_a_503_from_a_worker_is_tried_on_another():
    """A member that turns a run away with 503 did not run it: another one does."""
    routed = Routed("10.0.0.1", "10.0.0.2")
    busy, free = FakeWorker(503, b"{}"), FakeWorker(200, b"ran")
    _, done = routed.forward(routed.serve(**{"10.0.0.1": busy, "10.0.0.2": free}))
    assert done[0][0] == "ok" and done[0][1].body == b"ran"
    assert len(free.runs) == 1 and len(busy.runs) <= 1
    assert routed.pool.active() == 0


def test_tries_of_runs_nobody_takes_are_bounded():
    """When every member turns the run away, it is a 503 no_ready_node after MAX_NOT_SENT tries."""
    hosts = [f"10.0.0.{i}" for i in range(1, MAX_NOT_SENT + 2)]
    routed = Routed(*hosts)
    busy = {host: FakeWorker(503, b"{}") for host in hosts}
    _, done = routed.forward(routed.serve(**busy))
    kind, error = done[0]
    assert kind == "failed" and isinstance(error, ServerBusy) and error.reason == "no_ready_node"
    assert sum(len(w.runs) for w in busy.values()) == MAX_NOT_SENT and routed.pool.active() == 0
    assert len(routed.waits) == 1  # one run, one wait for capacity, however many tries


def test_a_refused_connection_is_tried_on_another_member():
    """A connection that could not be made sent nothing: another member runs it."""
    routed = Routed("10.0.0.1", "10.0.0.2", refused={"10.0.0.1"})
    free = FakeWorker(200, b"ran")
    _, done = routed.forward(routed.serve(**{"10.0.0.2": free}))
    assert done[0][0] == "ok" and len(free.runs) == 1
    assert routed.pool.active() == 0


def test_a_connection_lost_after_sending_is_a_502_never_retried():
    """A run that may have started is a NodeFailure, and goes to no other member."""
    routed = Routed("10.0.0.1", "10.0.0.2", lost={"10.0.0.1", "10.0.0.2"})
    _, done = routed.forward(routed.serve())
    kind, error = done[0]
    assert kind == "failed" and isinstance(error, NodeFailure)
    assert routed.pool.active() == 0


class LateBody:
    """A body whose client let the forward wait: it had not all arrived, and came too slowly."""

    length = 3

    def send(self) -> bytes:
        return b"run"

    def behind(self) -> bool:
        return True


#: A run whose client consents to a second run.
ASKS_REDISPATCH = attrs.evolve(RUN_CALL, redispatch=True)


def test_a_connection_lost_while_the_body_was_late_is_the_clients_408():
    """A member that gave up on a late body is not blamed: a 408, the member not suspect,
    and the run sent nowhere else even though its client allows a second run."""
    routed = Routed("10.0.0.1", "10.0.0.2", lost={"10.0.0.1", "10.0.0.2"})
    _, done = routed.forward(routed.serve(), body=LateBody(), request=ASKS_REDISPATCH)
    kind, error = done[0]
    assert kind == "failed" and isinstance(error, RequestTimeout) and error.status == 408
    assert not any(routed.member(host).suspect for host in ("10.0.0.1", "10.0.0.2"))
    assert routed.pool.active() == 0


def test_a_cancelled_forward_is_not_retried_nor_a_502():
    """A client that leaves cancels its forward: CancelledError, lease released, no other try."""
    routed = Routed("10.0.0.1", "10.0.0.2")
    held, other = FakeWorker(hold=True), FakeWorker(200, b"ran")
    d, done = routed.forward(routed.serve(**{"10.0.0.1": held, "10.0.0.2": other}))
    if not held.runs:  # the pool's pick went to the other host: hold both
        other.hold = True
        held, other = other, held
        d, done = routed.forward(routed.serve(**{"10.0.0.1": other, "10.0.0.2": held}))
    assert held.runs and not done
    d.cancel()
    routed.client.flush()
    kind, error = done[0]
    assert kind == "failed" and isinstance(error, CancelledError)
    assert len(held.runs) == 1 and not other.runs
    assert routed.pool.active() == 0 and len(routed.scheduler.queue) == 0


def test_a_cancelled_wait_for_capacity_leaves_the_queue():
    """A client that leaves while its run waits for a lease leaves the queue, sending nothing."""
    routed = Routed("10.0.0.1")
    held = FakeWorker(hold=True)
    forwarder = routed.serve(**{"10.0.0.1": held})
    routed.forward(forwarder)
    waiting, done = routed.forward(forwarder)
    assert len(routed.scheduler.queue) == 1 and not done
    waiting.cancel()
    assert isinstance(done[0][1], CancelledError) and len(routed.scheduler.queue) == 0
    assert len(held.runs) == 1


#: A run of a program with 16 MiB of weights, both sent by reference.
PROGRAM, WEIGHTS = "b" * 64, "a" * 64
RUN = Demand(PROGRAM, ((WEIGHTS, 16 << 20),))


def lacking(*digests: str) -> FakeWorker:
    """A worker that answers 409: it does not hold C{digests}."""
    missing = MissingContent("not held", details={"missing": list(digests)})
    return FakeWorker(409, json.dumps(error_body(missing, "rid")).encode())


def test_a_409_is_placed_again_on_a_member_that_holds_what_was_lacking():
    """A member believed to hold the referenced weights answers 409: the run
    goes to another member believed to hold them, not back to its client for
    an upload."""
    routed = Routed("10.0.0.1", "10.0.0.2")
    # The first member is believed to hold it all (it has since evicted the
    # weights), so the run goes there first; the second holds the weights.
    routed.member("10.0.0.1").held.learn(RUN, 0.0)
    routed.member("10.0.0.2").held.learn(Demand("c" * 64, RUN.inputs), 0.0)
    stale, holder = lacking(WEIGHTS), FakeWorker(200, b"ran")
    _, done = routed.forward(routed.serve(**{"10.0.0.1": stale, "10.0.0.2": holder}), RUN)
    kind, answer = done[0]
    assert kind == "ok" and answer.code == 200 and answer.body == b"ran"
    assert len(stale.runs) == 1 and len(holder.runs) == 1
    assert not routed.member("10.0.0.1").held.holds_every([WEIGHTS])
    assert routed.pool.active() == 0 and len(routed.waits) == 1


def test_a_409_of_a_cold_start_goes_back_to_the_client():
    """A run placed on a member known to lack its weights (cheaper than the
    compile where they are) is a cold start: that member's 409 goes back to
    the client, whose upload it is, and the run is not moved to the holder."""
    routed = Routed("10.0.0.1", "10.0.0.2")
    routed.member("10.0.0.1").held.learn(Demand(PROGRAM), 0.0)
    routed.member("10.0.0.2").held.learn(Demand("c" * 64, RUN.inputs), 0.0)
    cold, holder = lacking(WEIGHTS), FakeWorker(200, b"ran")
    _, done = routed.forward(routed.serve(**{"10.0.0.1": cold, "10.0.0.2": holder}), RUN)
    kind, answer = done[0]
    assert kind == "ok" and answer.code == 409
    assert len(cold.runs) == 1 and not holder.runs and routed.pool.active() == 0


def test_a_409_no_member_can_resolve_goes_back_to_the_client():
    """Where no other member holds what a member lacked, the client gets a 409
    naming it (and sends it inline); no member is tried in vain."""
    routed = Routed("10.0.0.1", "10.0.0.2")
    routed.member("10.0.0.1").held.learn(RUN, 0.0)
    stale, other = lacking(WEIGHTS), FakeWorker(200, b"ran")
    _, done = routed.forward(routed.serve(**{"10.0.0.1": stale, "10.0.0.2": other}), RUN)
    kind, error = done[0]
    assert kind == "failed" and isinstance(error, MissingContent) and error.missing == [WEIGHTS]
    assert len(stale.runs) == 1 and not other.runs and routed.pool.active() == 0


def test_tries_after_409s_are_bounded():
    """Members believed to hold a run's content but answering 409 are tried at most
    MAX_HOLDER_TRIES times after the first; the last 409 is the client's."""
    hosts = [f"10.0.0.{i}" for i in range(1, MAX_HOLDER_TRIES + 3)]
    routed = Routed(*hosts)
    for host in hosts:
        routed.member(host).held.learn(RUN, 0.0)
    workers = {host: lacking(WEIGHTS) for host in hosts}
    _, done = routed.forward(routed.serve(**workers), RUN)
    kind, answer = done[0]
    assert kind == "ok" and answer.code == 409
    assert sum(len(w.runs) for w in workers.values()) == 1 + MAX_HOLDER_TRIES
    assert routed.pool.active() == 0


def _silent_routed(**client) -> tuple[Routed, FakeWorker, FakeWorker]:
    """Two nodes whose workers hold every run, the pool ending runs on a
    node silent for 20 s; returns it and the workers of 10.0.0.1 and 10.0.0.2."""
    routed = Routed("10.0.0.1", "10.0.0.2", **client)
    routed.pool.silent_node_seconds = 20.0
    return routed, FakeWorker(hold=True), FakeWorker(hold=True)


def _report(routed: Routed, host: str) -> None:
    routed.pool.report(host, parse_report(node_report(host=host, capacities=(1,))))


def test_a_run_on_a_node_whose_reports_stopped_ends_with_a_502():
    """A run on a node silent for silent_node_seconds is a 502 then, not before; its request closes."""
    routed, first, second = _silent_routed()
    d, done = routed.forward(routed.serve(**{"10.0.0.1": first, "10.0.0.2": second}))
    held, other = ("10.0.0.1", "10.0.0.2") if first.runs else ("10.0.0.2", "10.0.0.1")
    worker = first if first.runs else second
    for _ in range(19):
        routed.clock.advance(1)
        _report(routed, other)
        routed.pool.observe()
    assert not done and routed.pool.nodes[held].runs
    routed.clock.advance(1)
    routed.pool.observe()
    routed.client.flush()
    kind, error = done[0]
    assert kind == "failed" and isinstance(error, NodeFailure)
    assert f"node {held} sent no report for 20 s" in error.message
    assert worker.lost == worker.runs  # the request to the worker was closed
    assert routed.pool.active() == 0 and not routed.pool.nodes[held].runs


def test_a_long_run_on_a_node_that_reports_is_never_ended():
    """A run on a node that keeps reporting waits for its answer however long it runs."""
    routed, first, second = _silent_routed()
    d, done = routed.forward(routed.serve(**{"10.0.0.1": first, "10.0.0.2": second}))
    for _ in range(3600):
        routed.clock.advance(1)
        for host in ("10.0.0.1", "10.0.0.2"):
            _report(routed, host)
        routed.pool.observe()
    assert not done and routed.pool.active() == 1
    d.cancel()
    routed.client.flush()


def test_a_run_that_allows_it_goes_elsewhere_when_its_node_falls_silent():
    """A re-dispatchable run on a node that falls silent is sent to another node, and answered there."""
    routed, first, second = _silent_routed()
    forwarder = routed.serve(**{"10.0.0.1": first, "10.0.0.2": second})
    d, done = routed.forward(forwarder, request=attrs.evolve(RUN_CALL, redispatch=True))
    held, other = ("10.0.0.1", "10.0.0.2") if first.runs else ("10.0.0.2", "10.0.0.1")
    answering = second if first.runs else first
    answering.hold = False
    for _ in range(20):
        routed.clock.advance(1)
        _report(routed, other)
        routed.pool.observe()
    routed.client.flush()
    assert done and done[0][0] == "ok" and done[0][1].body == b"ran"
    assert len(answering.runs) == 1
