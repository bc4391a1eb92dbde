"""
The reporter on a fake clock and a fake Router through StubTreq: registration and
heartbeats, the draining report, deregistration, a Router that is away and its
backoff, and one reporter for each of several Routers.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.web.server import NOT_DONE_YET

from kcoral.node.reporter import Reporter, Reporters
from tests.fakes import FakeServers

ROUTER = "http://127.0.0.1:9000"
NODE_URL = ROUTER + "/v1/nodes/gpu-a"
WORKERS = {"workers": [{"name": "worker0", "url": "http://127.0.0.1:8000", "healthy": True,
                        "capacity": 2, "active": 0}], "gpu_target": "cpu", "runtime": {}}


def doubling(failures: int) -> float:
    """A retry delay without jitter: 2, 4, 8 s."""
    return 2.0 * 2 ** failures


def reporter(router, clock, token=None):
    return Reporter(router.client, ROUTER, "gpu-a", token, report=lambda: WORKERS, timeout=1.0,
                    interval=2.0, reactor=clock, retry_delay=doubling)


def started(state: str, token=None):
    """A started reporter whose Router answers 200 with C{state}: (reporter, its client, clock)."""
    router, clock = FakeServers(), Clock()
    router.answer(NODE_URL, 200, {"state": state})
    r = reporter(router, clock, token)
    r.startService()
    return r, router.client, clock


def test_starting_registers_and_then_beats_every_interval():
    """A started reporter PUTs the node's report at once, then every interval."""
    r, http, clock = started("joining")
    assert len(http.sent("PUT")) == 1 and r.connected is True and r.state == "joining"
    clock.advance(2)
    clock.advance(2)
    bodies = http.sent("PUT")
    assert len(bodies) == 3
    assert all(b["session"] == r.session and b["draining"] is False for b in bodies)
    assert bodies[0]["workers"] == WORKERS["workers"]


def test_drain_says_draining_now_and_in_every_later_beat():
    """After drain(), the next report and every heartbeat after it say draining."""
    r, http, clock = started("ready")
    r.drain()
    clock.advance(2)
    assert [b["draining"] for b in http.sent("PUT")] == [False, True, True]


def test_stopping_stops_the_beats_and_deregisters_the_session():
    """A stopped reporter sends no more heartbeats and DELETEs its node."""
    r, http, clock = started("ready")
    stopped = []
    r.stopService().addCallback(stopped.append)
    assert stopped == [None]
    assert http.methods() == ["PUT", "DELETE"]
    clock.advance(10)
    assert len(http.requests) == 2 and clock.getDelayedCalls() == []


class HeldReports(FakeServers):
    """A Router that keeps each report (PUT) unanswered until L{release},
    and answers the rest at once."""

    def __init__(self):
        super().__init__()
        self.held = []

    def render(self, request):
        if request.method == b"PUT":
            self.held.append(request)
            return NOT_DONE_YET
        return super().render(request)

    def release(self):
        for request in self.held:
            request.write(super().render(request))
            request.finish()
        self.held = []
        self.client.flush()


def test_a_report_on_its_way_reaches_the_router_before_the_deregistration():
    """Stopping waits for a heartbeat in flight before its DELETE: arriving after
    it, the heartbeat would register the node again."""
    router, clock = HeldReports(), Clock()
    router.answer(NODE_URL, 200, {"state": "ready"})
    r = reporter(router, clock)
    r.startService()
    stopped = []
    r.stopService().addCallback(stopped.append)
    assert router.client.methods() == ["PUT"] and stopped == []
    router.release()
    assert router.client.methods() == ["PUT", "DELETE"] and stopped == [None]


def test_nothing_is_reported_after_the_deregistration():
    """A heartbeat asked for once the node has left is not sent."""
    r, http, clock = started("ready")
    r.stopService()
    sent = []
    r.send().addCallback(sent.append)
    assert sent == [False] and http.methods() == ["PUT", "DELETE"]


def test_a_router_that_is_away_is_retried_without_failing():
    """An unreachable Router makes send() return False, and the beats go on."""
    router, clock = FakeServers(), Clock()
    http = router.client
    r = reporter(router, clock)
    r.startService()
    assert r.connected is False
    router.answer(NODE_URL, 200, {"state": "joining"})
    clock.advance(2)
    assert r.connected is True and len(http.sent("PUT")) == 2


def test_a_refusal_is_not_a_registration():
    """A Router that answers with an error leaves the reporter disconnected."""
    router, clock = FakeServers(), Clock()
    router.answer(NODE_URL, 409, {"error": {"type": "conflict", "message": "in use"}})
    sent = []
    reporter(router, clock).send().addCallback(sent.append)
    assert sent == [False]


def test_the_token_is_sent_as_a_bearer_header():
    """With a node token every request carries it as Authorization: Bearer."""
    r, http, _ = started("ready", token="s3cret")
    r.stopService()
    assert [req.headers[b"Authorization"] for req in http.requests] == [[b"Bearer s3cret"]] * 2


def test_a_router_that_stays_away_is_retried_less_often():
    """Failed heartbeats in a row wait the retry delay, which grows; a success restores the interval."""
    router, clock = FakeServers(), Clock()
    http = router.client
    reporter(router, clock).startService()
    for delay in (2, 4, 8):
        clock.advance(delay - 0.5)
        before = len(http.requests)
        clock.advance(0.5)
        assert len(http.requests) == before + 1
    router.answer(NODE_URL, 200, {"state": "ready"})
    clock.advance(16)
    clock.advance(2)
    assert len(http.sent("PUT")) == 6


OTHER = "http://127.0.0.1:9001"


def several(clock):
    """Reporters to ROUTER and OTHER, where only ROUTER answers."""
    router = FakeServers()
    router.answer(NODE_URL, 200, {"state": "ready"})
    reporters = Reporters(router.client, [ROUTER, OTHER], "gpu-a", None, report=lambda: WORKERS,
                          timeout=1.0, interval=2.0, reactor=clock, retry_delay=doubling)
    return reporters, router


def test_each_router_is_reported_to_and_retried_on_its_own():
    """With two Routers, the one that answers gets a beat every interval while the one away backs off."""
    clock = Clock()
    reporters, router = several(clock)
    reporters.startService()
    clock.advance(2)
    clock.advance(2)
    urls = [req.url for req in router.client.requests]
    assert urls.count(NODE_URL) == 3
    assert urls.count(OTHER + "/v1/nodes/gpu-a") == 2
    assert [r.connected for r in reporters] == [True, False]


def test_draining_and_stopping_reach_every_router():
    """drain() tells every Router, and stopping deregisters from every Router at once."""
    clock = Clock()
    reporters, router = several(clock)
    reporters.startService()
    reporters.drain()
    stopped = []
    reporters.stopService().addCallback(stopped.append)
    assert stopped and not reporters.running
    sent = [(req.method, req.url.split("/v1")[0]) for req in router.client.requests]
    assert sent.count(("DELETE", ROUTER)) == 1 and sent.count(("DELETE", OTHER)) == 1
    assert [b["draining"] for b in router.client.sent("PUT")] == [False, False, True, True]
    assert clock.getDelayedCalls() == []
