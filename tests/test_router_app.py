"""
The Router's HTTP resource in process, through C{treq.testing.StubTreq} on a
fake clock: health and readiness, the node list, node registration,
heartbeats and deregistration, report validation and node tokens. Its
forward-and-retry loop is tested in L{tests.test_forward}.
"""

from __future__ import annotations

import json

import pytest
from treq.testing import StubTreq
from twisted.internet.task import Clock

from kcoral.router.app import MAX_CONTROL_BYTES
from kcoral.router.service import RouterConfig, build_router
from tests.fakes import RUNTIME, node_report
from tests.httputil import AsKCoralSite

RID = b"X-Request-ID"
TOKEN = "s3cret-token"


class Router:
    """A Router's resource (built like the real one) on a fake clock."""

    def __init__(self, **config):
        self.clock = Clock()
        self.app, self.site = build_router(RouterConfig(**config), self.clock)
        self.pool = self.app.pool
        self.treq = StubTreq(AsKCoralSite(self.app.resource()))

    def request(self, method, path, *, body=None, headers=None):
        done = []
        d = self.treq.request(method, "http://router.test" + path, data=body, headers=headers)
        d.addCallback(lambda response: self.treq.content(response).addCallback(
            lambda content: (response, content)))
        d.addBoth(done.append)
        self.treq.flush()
        assert done, f"{method} {path} was not answered"
        if not isinstance(done[0], tuple):
            done[0].raiseException()
        return done[0]

    def json(self, method, path, **kw):
        response, content = self.request(method, path, **kw)
        assert response.headers.getRawHeaders(b"Content-Type") == [b"application/json"]
        assert response.headers.getRawHeaders(RID), "no X-Request-ID"
        return response, json.loads(content)

    def put(self, node_id, report=None, *, token=None, raw=None, headers=None):
        headers = dict(headers or {}, **{"Content-Type": "application/json"})
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        body = raw if raw is not None else json.dumps(report or node_report()).encode()
        return self.json("PUT", f"/v1/nodes/{node_id}", body=body, headers=headers)

    def ready(self, node_id="gpu-a", report=None, **kw):
        report = report or node_report()
        for _ in range(self.pool.recovery_threshold):
            response, body = self.put(node_id, report, **kw)
            assert response.code == 200, body
            self.clock.advance(1)
            self.pool.observe()
        assert self.pool.nodes[node_id].state == "ready"


def assert_error(response, body, status, type_=None):
    assert response.code == status, body
    info = body["error"]
    assert isinstance(info["message"], str) and info["message"]
    assert info["request_id"] == response.headers.getRawHeaders(RID)[0].decode()
    if type_ is not None:
        assert info["type"] == type_
    return info


@pytest.fixture
def router():
    return Router()


# -- health and readiness ------------------------------------------------------------

def test_health_is_unavailable_without_a_node(router):
    """With no node, /health and /readyz answer 503 unavailable, nothing counted."""
    response, body = router.json("GET", "/health")
    assert response.code == 503
    assert body["status"] == "unavailable"
    assert body["capacity"] == 0 and body["active"] == 0 and body["queued"] == 0
    assert body["gpu_target"] is None
    assert body["nodes"]["ready"] == 0
    assert isinstance(body["version"], str)
    response, body = router.json("GET", "/readyz")
    assert response.code == 503 and body["ready"] is False


def test_health_is_unavailable_while_the_only_node_joins(router):
    """While its only node joins, /health is 503 unavailable, counting it joining."""
    router.put("gpu-a")
    response, body = router.json("GET", "/health")
    assert response.code == 503 and body["status"] == "unavailable"
    assert body["nodes"]["joining"] == 1


def test_health_is_ok_with_a_ready_node_and_sums_capacity(router):
    """With ready nodes, /health is 200 ok with their target, runtime and summed capacity."""
    router.ready("gpu-a", node_report(capacities=(2, 3)))
    router.ready("gpu-b", node_report(capacities=(4,), host="10.0.0.2"))
    response, body = router.json("GET", "/health")
    assert response.code == 200
    assert body["status"] == "ok"
    assert body["gpu_target"] == "sm_90"
    assert body["runtime"] == RUNTIME
    assert body["capacity"] == 9
    assert body["nodes"]["ready"] == 2
    response, body = router.json("GET", "/readyz")
    assert response.code == 200 and body["ready"] is True


def test_health_counts_only_ready_nodes(router):
    """/health sums the capacity of ready nodes only, counting joining ones apart."""
    router.ready("gpu-a", node_report(capacities=(2,)))
    router.put("gpu-b", node_report(capacities=(8,), host="10.0.0.2"))  # still joining
    _, body = router.json("GET", "/health")
    assert body["capacity"] == 2
    assert body["nodes"]["ready"] == 1 and body["nodes"]["joining"] == 1


def test_health_after_the_last_node_goes_stale(router):
    """Once its last node stops reporting, /health is 503 unavailable, the node unhealthy."""
    router.ready()
    for _ in range(10):
        router.clock.advance(1)
        router.pool.observe()
    response, body = router.json("GET", "/health")
    assert response.code == 503 and body["status"] == "unavailable"
    assert body["nodes"]["unhealthy"] == 1


def test_health_while_draining(router):
    """A draining Router answers /health with 503 draining, even with a ready node."""
    router.ready()
    router.app.scheduler.drain()
    response, body = router.json("GET", "/health")
    assert response.code == 503 and body["status"] == "draining"


def test_every_answer_carries_the_request_id(router):
    """The client's request id is echoed on answers and in error bodies."""
    response, _ = router.json("GET", "/health", headers={"X-Request-ID": "trace-42"})
    assert response.headers.getRawHeaders(RID) == [b"trace-42"]
    response, body = router.put("gpu-a", raw=b"not json", headers={"X-Request-ID": "trace-43"})
    assert assert_error(response, body, 400)["request_id"] == "trace-43"


def test_unknown_routes_answer_json_errors(router):
    """An unknown route is a JSON 404 not_found, a wrong method a JSON 405."""
    response, body = router.json("GET", "/v1/nope")
    assert_error(response, body, 404, "not_found")
    response, body = router.json("POST", "/health")
    assert_error(response, body, 405)


# -- the node list -----------------------------------------------------------------

def test_node_list_is_empty_at_first(router):
    """GET /v1/nodes lists no node before any reports."""
    response, body = router.json("GET", "/v1/nodes")
    assert response.code == 200 and body == {"nodes": []}


def test_node_list(router):
    """GET /v1/nodes lists each node's state, target, runtime, capacity, report age and worker URLs."""
    router.ready("gpu-a", node_report(capacities=(2, 3)))
    router.clock.advance(1.5)
    router.put("gpu-b", node_report(host="10.0.0.2", healthy=False))
    router.clock.advance(0.5)
    response, body = router.json("GET", "/v1/nodes")
    assert response.code == 200
    nodes = {n["node_id"]: n for n in body["nodes"]}
    assert set(nodes) == {"gpu-a", "gpu-b"}
    a, b = nodes["gpu-a"], nodes["gpu-b"]
    for node in (a, b):
        assert {"node_id", "state", "gpu_target", "runtime", "capacity", "active",
                "last_report_age_seconds"} <= set(node)
    assert a["state"] == "ready" and b["state"] == "joining"
    assert a["gpu_target"] == "sm_90" and a["runtime"] == RUNTIME
    assert a["capacity"] == 5 and a["active"] == 0
    assert b["capacity"] == 0  # no healthy worker
    assert a["last_report_age_seconds"] == pytest.approx(3.0)
    assert b["last_report_age_seconds"] == pytest.approx(0.5)
    assert [w["url"] for w in a["workers"]] == ["http://10.0.0.1:8000", "http://10.0.0.1:8001"]
    assert a["endpoints"] == ["http://10.0.0.1:8000", "http://10.0.0.1:8001"]


# -- registration and heartbeats --------------------------------------------------------

def test_registration(router):
    """A first report registers a joining node with its session, and tells it the report interval."""
    response, body = router.put("gpu-a")
    assert response.code == 200
    assert body["node_id"] == "gpu-a" and body["state"] == "joining"
    assert body["status_check_interval_seconds"] == 1.0
    assert router.pool.nodes["gpu-a"].session == "s1"


def test_heartbeats_bring_a_node_to_ready(router):
    """Enough healthy reports bring a joining node to ready."""
    router.put("gpu-a")
    router.clock.advance(1)
    router.pool.observe()
    router.put("gpu-a")
    router.clock.advance(1)
    router.pool.observe()
    response, body = router.put("gpu-a")
    assert response.code == 200 and body["state"] == "ready"


def test_a_draining_heartbeat(router):
    """A report that says draining makes a ready node draining, and the Router unavailable."""
    router.ready()
    response, body = router.put("gpu-a", node_report(draining=True))
    assert response.code == 200 and body["state"] == "draining"
    _, health = router.json("GET", "/health")
    assert health["status"] == "unavailable" and health["nodes"]["draining"] == 1


@pytest.mark.parametrize("why,raw", [
    ("not JSON", b"this is not json"),
    ("not UTF-8", b"\xff\xfe{}"),
    ("deep JSON", b"[" * 30000 + b"]" * 30000),
    ("a list", b"[]"),
    ("empty", b""),
])
def test_unparseable_reports_are_refused(router, why, raw):
    """A report that is not a JSON object is a 400, and registers no node."""
    response, body = router.put("gpu-a", raw=raw)
    assert_error(response, body, 400)
    assert router.pool.nodes == {}


def _with(**changes):
    report = node_report()
    worker = changes.pop("worker", None)
    if worker:
        report["workers"][0].update(worker)
    report.update(changes)
    return report


@pytest.mark.parametrize("why,report", [
    ("absurd capacity", _with(worker={"capacity": 10 ** 9})),
    ("negative capacity", _with(worker={"capacity": -1})),
    ("capacity as text", _with(worker={"capacity": "2"})),
    ("capacity as a bool", _with(worker={"capacity": True})),
    ("capacity as a float", _with(worker={"capacity": 2.0})),
    ("not a URL", _with(worker={"url": "not a url"})),
    ("a URL with a path", _with(worker={"url": "http://10.0.0.1:8000/evil"})),
    ("a URL without a port", _with(worker={"url": "http://10.0.0.1"})),
    ("a file URL", _with(worker={"url": "file:///etc/passwd"})),
    ("a URL with credentials", _with(worker={"url": "http://me:pw@10.0.0.1:8000"})),
    ("a bad port", _with(worker={"url": "http://10.0.0.1:99999"})),
    ("no workers", _with(workers=[])),
    ("too many workers", _with(workers=[
        {"name": f"w{i}", "url": f"http://10.0.0.1:{9000 + i}", "healthy": True, "capacity": 1}
        for i in range(65)])),
    ("duplicate worker names", _with(workers=[
        {"name": "w", "url": "http://10.0.0.1:9000", "healthy": True, "capacity": 1},
        {"name": "w", "url": "http://10.0.0.1:9001", "healthy": True, "capacity": 1}])),
    ("no session", _with(session=None)),
    ("a huge session", _with(session="x" * 10000)),
    ("runtime not a mapping", _with(runtime=["jax"])),
    ("runtime with numbers", _with(runtime={"jax": 4})),
])
def test_invalid_reports_are_refused(router, why, report):
    """A report with an invalid field is a 400 naming the report, and registers no node."""
    response, body = router.put("gpu-a", report)
    info = assert_error(response, body, 400)
    assert "report" in info["message"]
    assert router.pool.nodes == {}


def test_a_bad_node_id_is_refused(router):
    """A node id outside 1-64 of [A-Za-z0-9._-] is a 400, and registers no node."""
    response, body = router.put("bad%20id")
    assert_error(response, body, 400)
    response, body = router.put("x" * 65)
    assert_error(response, body, 400)
    assert router.pool.nodes == {}


def test_an_oversized_report_is_refused(router):
    """A report over the control limit is a 413, and registers no node."""
    report = node_report()
    report["padding"] = "x" * (MAX_CONTROL_BYTES + 1)
    response, body = router.put("gpu-a", report)
    assert_error(response, body, 413)
    assert router.pool.nodes == {}


def test_a_node_beyond_the_pools_bound_is_refused_with_503(router):
    """A node past the pool's bound is a 503 too_many_nodes; the pool and health stay."""
    router.pool.max_nodes = 1
    router.ready()
    response, body = router.put("gpu-b", node_report(session="s2", host="10.0.0.9"))
    info = assert_error(response, body, 503)
    assert info["reason"] == "too_many_nodes" and "tracks 1 nodes" in info["message"]
    assert list(router.pool.nodes) == ["gpu-a"]
    response, _ = router.json("GET", "/health")
    assert response.code == 200


def test_a_second_live_session_is_refused_with_409(router):
    """A second live session for a node id is a 409 naming it; the first keeps it."""
    router.ready()
    response, body = router.put("gpu-a", node_report(session="s2", host="10.0.0.9"))
    info = assert_error(response, body, 409)
    assert "gpu-a" in info["message"]
    node = router.pool.nodes["gpu-a"]
    assert node.session == "s1" and node.state == "ready"
    assert [m.url for m in node.members.values()] == ["http://10.0.0.1:8000"]


def test_a_stale_session_is_taken_over(router):
    """A new session takes over a node id whose session went stale, as a joining node."""
    router.ready()
    router.clock.advance(6)
    response, body = router.put("gpu-a", node_report(session="s2"))
    assert response.code == 200 and body["state"] == "joining"
    assert router.pool.nodes["gpu-a"].session == "s2"


# -- deregistration ------------------------------------------------------------------------

def test_deregistration(router):
    """DELETE with the node's session makes it gone, and the Router unavailable without it."""
    router.ready()
    response, body = router.json("DELETE", "/v1/nodes/gpu-a?session=s1")
    assert response.code == 200 and body["left"] is True
    assert router.pool.nodes["gpu-a"].state == "gone"
    response, _ = router.json("GET", "/health")
    assert response.code == 503


def test_deregistration_of_another_session_is_ignored(router):
    """DELETE with another session, or of an unknown node, is a 404 and changes nothing."""
    router.ready()
    response, body = router.json("DELETE", "/v1/nodes/gpu-a?session=s2")
    assert_error(response, body, 404)
    response, body = router.json("DELETE", "/v1/nodes/nobody?session=s1")
    assert_error(response, body, 404)
    assert router.pool.nodes["gpu-a"].state == "ready"


# -- node tokens --------------------------------------------------------------------------------

@pytest.fixture
def secured():
    return Router(node_token=TOKEN)


@pytest.mark.parametrize("authorization", [
    None,
    "",
    "Bearer",
    "Bearer ",
    "Bearer wrong",
    f"Bearer {TOKEN[:-1]}",
    f"Bearer {TOKEN}x",
    f"Bearer {TOKEN.upper()}",
    f"Basic {TOKEN}",
    TOKEN,
    f"Bearer{TOKEN}",
])
def test_control_requests_need_the_token(secured, authorization):
    """A report without the right bearer token is a 401 asking for Bearer, never quoting it."""
    headers = {} if authorization is None else {"Authorization": authorization}
    response, body = secured.put("gpu-a", headers=headers)
    info = assert_error(response, body, 401, "unauthorized")
    assert TOKEN not in json.dumps(body)
    assert TOKEN not in info["message"]
    assert response.headers.getRawHeaders(b"WWW-Authenticate") == [b"Bearer"]
    assert secured.pool.nodes == {}


def test_the_right_token_is_accepted(secured):
    """A report with the right bearer token, the scheme in any case, is accepted."""
    response, body = secured.put("gpu-a", token=TOKEN)
    assert response.code == 200 and body["state"] == "joining"
    response, _ = secured.put("gpu-a", headers={"Authorization": f"bearer {TOKEN}"})
    assert response.code == 200


def test_deregistration_needs_the_token(secured):
    """DELETE without the right token is a 401 and leaves the node; with it, the node leaves."""
    secured.ready(token=TOKEN)
    response, body = secured.json("DELETE", "/v1/nodes/gpu-a?session=s1")
    assert_error(response, body, 401)
    response, body = secured.json("DELETE", "/v1/nodes/gpu-a?session=s1",
                                  headers={"Authorization": "Bearer nope"})
    assert_error(response, body, 401)
    assert secured.pool.nodes["gpu-a"].state == "ready"
    response, body = secured.json("DELETE", "/v1/nodes/gpu-a?session=s1",
                                  headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.code == 200 and body["left"] is True


def test_the_token_does_not_guard_client_routes(secured):
    """The node token guards no client route: /health and /v1/nodes answer without it."""
    response, _ = secured.json("GET", "/health")
    assert response.code == 503
    response, body = secured.json("GET", "/v1/nodes")
    assert response.code == 200 and body == {"nodes": []}


def test_a_refusal_log_names_the_node_and_never_the_token(secured):
    """A refused control request is logged with its node id, and no line holds the token."""
    from twisted.logger import formatEvent, globalLogPublisher

    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        secured.put("gpu-z", token="wrong-" + TOKEN)
    finally:
        globalLogPublisher.removeObserver(events.append)
    lines = [formatEvent(e) for e in events]
    refusals = [line for line in lines if "gpu-z" in line]
    assert refusals, lines
    assert not any(TOKEN in line for line in lines)


# -- metrics ---------------------------------------------------------------------------------------

def test_metrics_list_nodes_by_state(router):
    """/metrics counts nodes by state, each node's active requests and the queue."""
    router.ready()
    response, content = router.request("GET", "/metrics")
    assert response.code == 200
    text = content.decode()
    assert 'kcoral_nodes{state="ready"} 1.0' in text
    assert 'kcoral_node_active_requests{node="gpu-a"} 0.0' in text
    assert "kcoral_queued_requests 0.0" in text


def test_the_router_takes_fewer_client_connections_as_its_pool_grows(router):
    # One descriptor kept for each run it may send to a worker.
    """The client connection cap drops by the capacity of each node that joins."""
    before = router.site.connections.limit
    router.ready(report=node_report(capacities=(2, 3)))
    assert router.site.connections.limit == before - 5


def test_the_router_takes_more_client_connections_when_a_node_leaves(router):
    """A node that deregisters no longer holds connections of the cap."""
    before = router.site.connections.limit
    router.ready(report=node_report(capacities=(4,)))
    router.json("DELETE", "/v1/nodes/gpu-a?session=s1")
    assert router.site.connections.limit == before
