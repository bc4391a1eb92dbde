"""
One model name, one signature, across a Router's pool (and a gateway's): a
member that reports a ready model under a name other members serve with
another signature has it refused, with the reason, logged once, and is
never given its inferences; the claim passes on once none serves it.
"""

from __future__ import annotations

import json

import pytest
from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher

from kcoral.common.queue import WaitQueue
from kcoral.common.report import InvalidReport, ModelState, WorkerReport, parse_report
from kcoral.router.forward import Forwarder
from kcoral.router.inference import RouterInference
from kcoral.router.pool import READY, Pool
from kcoral.router.proxy import Proxy
from kcoral.router.residency import Demand
from kcoral.router.scheduler import Scheduler
from tests.fakes import FakeWorkers, node_report
from tests.test_router_inference import Answer

SMALL, LARGE = "a" * 64, "b" * 64


def report(signature: str, *, session: str = "s1", host: str = "10.0.0.1") -> dict:
    """A node of one worker with model mlp ready, of C{signature}."""
    body = node_report(session, host=host)
    body["workers"][0]["models"] = [{"name": "mlp", "version": "1", "state": "READY",
                                     "reason": "", "signature": signature}]
    return body


class Fleet:
    """A pool on a fake clock, its nodes made ready by their reports."""

    def __init__(self):
        self.clock = Clock()
        self.pool = Pool(self.clock, recovery_threshold=1)
        self.errors: list[dict] = []
        #: What each worker says of its models, by URL.
        self.said: dict[str, list[dict]] = {}

    def report(self, node_id: str, body: dict) -> None:
        for worker in body["workers"]:
            self.said[worker["url"]] = worker.get("models", [])
        self.pool.report(node_id, parse_report(body))
        self.pool.observe()

    def member(self, node_id: str):
        return self.pool.nodes[node_id].members["worker0"]

    def answer(self, url: str, **kwargs):
        """A worker's answer to its /health or its repository index: the models it says."""
        if url.endswith("/health"):
            body: object = {"models": self.said[url.removesuffix("/health")]}
        else:
            body = self.said[url.removesuffix("/v2/repository/index")]
        return succeed(Answer(200, json.dumps(body).encode()))

    def index(self, asked: bool = False) -> list[dict]:
        """The front's repository index: from the reports, or (C{asked}) each worker asked."""
        scheduler = Scheduler(self.pool, WaitQueue(self.clock, 16, 30.0))
        forwarder = Forwarder(scheduler, Proxy(FakeWorkers().client()), self.clock)
        ask = self.answer if asked else None
        front = RouterInference(pool=self.pool, forwarder=forwarder, get=ask, post=ask,
                                is_ready=lambda: True, clock=self.clock, most_waiting=8)
        return front.repository_index().result


@pytest.fixture
def errors():
    """The error events logged while the test runs."""
    events: list[dict] = []

    def observer(event):
        if event["log_level"] >= LogLevel.error:
            events.append(event)
    globalLogPublisher.addObserver(observer)
    yield events
    globalLogPublisher.removeObserver(observer)


def test_a_later_node_with_another_signature_is_refused_loudly(errors):
    """The second node's mlp of another signature is unavailable with the reason, logged once,
    and the index's ready mlp says why, whether read from reports or asked of each worker."""
    fleet = Fleet()
    fleet.report("first", report(SMALL))
    for _ in range(3):
        fleet.report("second", report(LARGE, session="s2", host="10.0.0.2"))
    first, second = fleet.member("first"), fleet.member("second")
    assert fleet.pool.nodes["second"].state == READY
    assert first.ready_models == {"mlp": 0} and second.ready_models == {}
    [refused] = second.models
    assert refused.state == "UNAVAILABLE" and "second/worker0 serves another model" in refused.reason
    assert "first/worker0" in refused.reason
    assert [e["reason"] for e in errors] == [refused.reason]
    [entry] = fleet.index()
    assert entry["state"] == "READY" and entry["reason"] == refused.reason
    # Asked, the refused worker says its mlp is READY: it stays refused, and the index says so.
    assert fleet.index(asked=True) == [entry]
    assert second.ready_models == {} and fleet.member("first").ready_models == {"mlp": 0}
    assert len(errors) == 1


def test_inferences_never_reach_the_refused_member():
    """However loaded the member that claimed the name, an inference waits for it, never the other."""
    fleet = Fleet()
    fleet.report("first", report(SMALL))
    fleet.report("second", report(LARGE, session="s2", host="10.0.0.2"))
    first = fleet.member("first")
    picked = fleet.pool.pick(Demand.of_model("mlp"))
    assert picked is first
    first.active = first.capacity
    assert fleet.pool.pick(Demand.of_model("mlp")) is None


def test_one_signature_on_many_nodes_is_served_by_all():
    """Nodes that report the same signature all have the model ready."""
    fleet = Fleet()
    fleet.report("first", report(SMALL))
    fleet.report("second", report(SMALL, session="s2", host="10.0.0.2"))
    assert fleet.member("first").ready_models == fleet.member("second").ready_models == {"mlp": 0}
    assert fleet.index() == [{"name": "mlp", "version": "1", "state": "READY", "reason": ""}]


def test_the_claim_passes_on_once_its_holder_leaves():
    """When the claiming node deregisters, the other's next report has its model ready."""
    fleet = Fleet()
    fleet.report("first", report(SMALL))
    fleet.report("second", report(LARGE, session="s2", host="10.0.0.2"))
    assert fleet.pool.leave("first", "s1")
    fleet.report("second", report(LARGE, session="s2", host="10.0.0.2"))
    assert fleet.member("second").ready_models == {"mlp": 0}
    # And the first, back, is now the later one.
    fleet.report("first", report(SMALL, session="s3"))
    assert fleet.member("first").ready_models == {}


def test_a_gateways_worker_restarted_with_another_model_is_refused():
    """In a gateway's static pool, a worker that comes back with another mlp than its sibling
    (the bundle replaced under it) has it refused; the sibling keeps serving."""
    fleet = Fleet()

    def worker(name: str, signature: str) -> WorkerReport:
        return WorkerReport(name, f"http://127.0.0.1:{9000 + int(name[-1])}", True, 1, 0, models=(
            ModelState("mlp", signature=signature),))
    fleet.pool.set_static("local", [worker("worker0", SMALL), worker("worker1", SMALL)],
                          gpu_target="cpu", runtime={})
    fleet.pool.set_static("local", [worker("worker0", SMALL), worker("worker1", LARGE)],
                          gpu_target="cpu", runtime={})
    members = fleet.pool.nodes["local"].members
    assert members["worker0"].ready_models == {"mlp": 0} and members["worker1"].ready_models == {}
    assert "local/worker1 serves another model" in members["worker1"].models[0].reason


def test_the_claimant_changing_its_own_model_does_not_change_the_name():
    """The first member to serve mlp coming back with another one is refused while another
    member still serves the first; the name keeps its signature."""
    fleet = Fleet()
    fleet.report("first", report(SMALL))
    fleet.report("second", report(SMALL, session="s2", host="10.0.0.2"))
    fleet.report("first", report(LARGE))
    assert fleet.member("first").ready_models == {}
    assert fleet.member("second").ready_models == {"mlp": 0}
    assert "first/worker0 serves another model" in fleet.member("first").models[0].reason


def test_a_malformed_signature_is_an_invalid_report():
    """A signature that is not 64 lowercase hex characters makes the report invalid."""
    for bad in ("A" * 64, "a" * 63, 7, None):
        with pytest.raises(InvalidReport):
            parse_report(report(bad))
