"""
The front door: every request's one canonical path (L{kcoral.web.path}),
read alike by the guard, the resources and the metrics, so that no spelling
of a path is routed one way and guarded another; bodies nobody reads never
held; what C{/health} shows without the token. Then the class, not the
cases: a property (hypothesis) over every route of each front (a real
standalone server, a node's gateway and a Router with a node, all with a
client token), every spelling of its path, with and without the token.
"""

from __future__ import annotations

import collections
import json

import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.web.resource import Resource

from kcoral.errors import BadRequest
from kcoral.web.auth import CLIENT_ROUTES, TokenGuard
from kcoral.web.family import ARRAYS, CLIENT, FAMILIES, RUN
from kcoral.web.path import canonical
from tests.conftest import server_args, server_env
from tests.harness import SERVER_READY, START_TIMEOUT, until
from tests.httputil import connect, fake_site, parse_raw, raw_exchange, request
from tests.test_routed import start_node, start_router
from tests.test_router_app import Router

TOKEN = "front-door-token"


@pytest.mark.parametrize("target, path", [
    (b"/v1/run", b"/v1/run"), (b"/v1/ru%6E", b"/v1/run"), (b"/v1/ru%6e", b"/v1/run"),
    (b"/%761/n%6Fdes?x=%41", b"/v1/nodes?x=%41"), (b"/", b"/"), (b"*", b"*"),
    (b"/v2/models/a.b-c~d_1/infer", b"/v2/models/a.b-c~d_1/infer"),
    (b"/v2/models/%7E%2d%2E%5F/infer", b"/v2/models/~-._/infer"), (b"/.well", b"/.well"),
    (b"/V1/run", b"/V1/run"), (b"/v1/run?a=b/../c;d", b"/v1/run?a=b/../c;d"),
])
def test_escapes_of_unreserved_characters_are_decoded_once(target, path):
    """An escaped unreserved character is the character; case and the query are kept as sent."""
    assert canonical(target) == (path.partition(b"?")[0], path)


@pytest.mark.parametrize("target, says", [
    (b"//v1/run", "empty segment"), (b"/v1//nodes", "empty segment"), (b"/v1/run/", "empty segment"),
    (b"/v1%2Frun", "escaped '/'"), (b"/v1%2frun", "escaped '/'"), (b"/v1/r%3Bun", "escaped ';'"),
    (b"/v1/ru%256E", "escaped '%'"), (b"/v1/run%00", "escaped"), (b"/v1/run%", "starts no escape"),
    (b"/v1/run%6", "starts no escape"), (b"/v1/./run", "dot segment"), (b"/x/../v1/run", "dot segment"),
    (b"/v1/run/..", "dot segment"), (b"/v1/%2e%2E/run", "dot segment"), (b"/v1/run;x=1", ";parameters"),
    (b"/v1/run;", ";parameters"), (b"http://host/v1/run", "must be a path"), (b"v1/run", "must be a path"),
    (b"/v1/r\xc3\xbcn", "not allowed"), (b"/v1/run\\", "not allowed"), (b"/v1/<run>", "not allowed"),
])
def test_spellings_that_would_change_routing_are_refused(target, says):
    """Reserved escapes (a slash too), empty and dot segments, ;params, foreign bytes: refused."""
    with pytest.raises(BadRequest, match=says):
        canonical(target)


class Seen(Resource):
    """Answers 200, keeping what each request's path, URI and segments read,
    and what its content holds once its body has arrived."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.seen: list[tuple] = []
        self.kept: list[bytes] = []

    def render(self, request):
        self.seen.append((request.path, request.uri, request.prepath + request.postpath))
        self.kept.append(request.content.getvalue())
        return b"ok"


def exchange(site, head: bytes) -> tuple[int, dict, bytes, bytes]:
    """Status, headers and body of C{site}'s answer to C{head}; and all it wrote."""
    channel, transport = connect(site)
    channel.dataReceived(head)
    status, headers, body = parse_raw(transport.value())
    return status, headers, body, transport.value()


def test_everything_downstream_reads_the_canonical_path():
    """The resource sees one path, in C{path}, C{uri} and the segments alike; the metrics label it."""
    resource = Seen()
    site = fake_site(Clock(), resource=resource)
    status, _, _, _ = exchange(site, b"GET /%761/ru%6E?q=%2F HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200
    assert resource.seen == [(b"/v1/run", b"/v1/run?q=%2F", [b"v1", b"run"])]
    assert site.metrics.requests.labels("/v1/run", "200")._value.get() == 1


def test_an_escaped_guarded_path_is_guarded_from_its_head():
    """C{POST /v1/ru%6E} without the token is refused from its head, as C{/v1/run} is."""
    resource = Seen()
    site = fake_site(Clock(), max_request_bytes=1 << 30, resource=resource,
                     client_guard=TokenGuard.of([TOKEN], CLIENT_ROUTES))
    status, headers, _, raw = exchange(
        site, b"POST /v1/ru%6E HTTP/1.1\r\nHost: x\r\nContent-Length: 268435456\r\n"
              b"Expect: 100-continue\r\n\r\n")
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert b"100 Continue" not in raw and resource.seen == []


@pytest.mark.parametrize("method, target", [
    (b"POST", b"//v1/run"), (b"POST", b"/v1%2Frun"), (b"GET", b"/v1//nodes"), (b"POST", b"/v1//run"),
    (b"DELETE", b"//v1/arrays/x"), (b"GET", b"/v1/nodes;x"), (b"POST", b"/v1/./run"),
])
def test_a_refused_spelling_is_a_json_400_from_its_head(method, target):
    """A path refused is a JSON 400 with the request id, its body never read, nothing routed."""
    resource = Seen()
    site = fake_site(Clock(), max_request_bytes=1 << 30, resource=resource,
                     client_guard=TokenGuard.of([TOKEN], CLIENT_ROUTES))
    status, headers, body, raw = exchange(
        site, method + b" " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 268435456\r\n"
              b"Expect: 100-continue\r\nX-Request-ID: odd-1\r\n\r\n")
    assert status == 400 and headers["x-request-id"] == "odd-1"
    error = json.loads(body)["error"]
    assert error["request_id"] == "odd-1" and error["type"] == "bad_request"
    assert b"100 Continue" not in raw and resource.seen == []


def test_a_refused_inference_path_takes_the_protocols_error_form():
    """Under C{/v2}, spelled plainly or escaped, a refused path's 400 is C{{"error": message}}."""
    for target in [b"/v2/models/a%2Fb/infer", b"/%762/models//infer"]:
        status, _, body, _ = exchange(fake_site(Clock(), resource=Seen()),
                                      b"POST " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 400 and isinstance(json.loads(body)["error"], str)


@pytest.mark.parametrize("head, kept", [
    (b"POST /health", b""), (b"GET /v1/nodes", b""), (b"DELETE /v1/arrays/x", b""),
    (b"POST /v2/models/m/ready", b""), (b"POST /v1/run", b"abcdef"),
    (b"PUT /v1/nodes/n", b"abcdef"), (b"POST /v2/models/m/infer", b"abcdef"),
])
def test_a_body_no_route_reads_is_dropped_as_it_arrives(head, kept):
    """Only a POST or PUT to a route that takes that method keeps its body; any other is dropped."""
    resource = Seen()
    exchange(fake_site(Clock(), resource=resource),
             head + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nabcdef")
    assert resource.kept == [kept]


# -- the families' routes, mounted once --------------------------------------------------------

def bearer() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("method, path, allow", [
    ("GET", "/v1/run", b"POST"), ("PUT", "/v1/run", b"POST"), ("POST", "/v1/nodes", b"GET, HEAD"),
    ("POST", "/v1/arrays/x-1", b"DELETE, GET, HEAD"), ("GET", "/v1/arrays", b"DELETE"),
    ("GET", "/v2/models/m/infer", b"POST"), ("POST", "/v2/health/live", b"GET, HEAD"),
])
def test_a_method_a_route_does_not_take_is_a_405_from_its_declaration(method, path, allow):
    """A wrong method on a family's route is a JSON 405 whose Allow lists the declared methods."""
    response, body = Router(client_token=TOKEN).json(method, path, body=b"x", headers=bearer())
    assert response.code == 405 and response.headers.getRawHeaders(b"Allow") == [allow]
    # The inference protocol's errors are the message alone.
    error = body["error"]
    assert "is not allowed here" in (error if path.startswith("/v2") else error["message"])


def test_the_guard_answers_before_the_method_is_checked():
    """Without the token a wrong method on a guarded route is a 401: its methods are not told."""
    response, _ = Router(client_token=TOKEN).json("GET", "/v1/run")
    assert response.code == 401 and not response.headers.hasHeader(b"Allow")


# -- /health on a protected service --------------------------------------------------------------

def test_a_protected_gateways_health_lists_its_workers_only_to_a_client():
    """Without the client token a gateway's /health has no workers (their URLs); with it, all."""
    gateway = Router(client_token=TOKEN, health_lists_workers=True)
    gateway.ready()
    _, open_health = gateway.json("GET", "/health")
    _, full = gateway.json("GET", "/health", headers={"Authorization": f"Bearer {TOKEN}"})
    assert "workers" not in open_health and full["workers"][0]["url"].startswith("http")
    assert {k: v for k, v in full.items() if k != "workers"} == open_health
    _, dashboard = gateway.json("GET", "/v1/dashboard")
    assert "workers" not in dashboard["health"]
    # Without a client token set, nothing is hidden.
    open_gateway = Router(health_lists_workers=True)
    open_gateway.ready()
    assert "workers" in open_gateway.json("GET", "/health")[1]


# -- real processes -----------------------------------------------------------------------------

#: The body limit of this module's services.
LIMIT = 8 << 20
MiB = 1 << 20


@pytest_twisted.async_fixture(scope="module")
async def standalone(module_processes):
    """A standalone server with a client token."""
    return await module_processes.start_service(
        server_args("--max-request-bytes", str(LIMIT)), name="door-server", ready=SERVER_READY,
        env={**server_env(), "KCORAL_CLIENT_TOKEN": TOKEN})


def rss_bytes(pid: int) -> int:
    """The resident memory of process C{pid}."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _chunked(total: int, size: int = MiB):
    """A chunked body of C{total} bytes, in chunks of C{size}, and its end."""
    chunk = b"%x\r\n" % size + b"x" * size + b"\r\n"
    for _ in range(total // size):
        yield chunk
    yield b"0\r\n\r\n"


def _refused_bodies(port: int) -> list[int]:
    """Six 4 MiB bodies no route reads (405), then four chunked bodies past the limit (413)."""
    statuses = []
    body = b"x" * (4 * MiB)
    for _ in range(6):
        head = (b"POST /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
        statuses.append(parse_raw(raw_exchange(port, head, [body[at:at + MiB] for at in
                                                            range(0, len(body), MiB)]))[0])
    for _ in range(4):
        head = (b"POST /v1/run HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
        statuses.append(parse_raw(raw_exchange(port, head, _chunked(LIMIT + 2 * MiB)))[0])
    return statuses


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_standalone_server_holds_no_refused_body(standalone):
    """Bodies no route reads, and bodies refused past the limit, leave no memory behind them."""
    pid = standalone.process.pid
    before = rss_bytes(pid)
    statuses = await deferToThread(_refused_bodies, standalone.port)
    assert statuses == [405] * 6 + [413] * 4
    # Held, they would be 24 MiB of unread bodies and 4 x 8 MiB of refused
    # ones, until a garbage collection.
    assert rss_bytes(pid) - before < 16 * MiB


#: What a probe sees of a protected standalone server, and what only a client does.
PROBE_FIELDS = {"status", "gpu_target", "capacity", "active", "queued", "runtime", "devices", "version"}
CLIENT_FIELDS = {"cache", "models", "instance", "sandbox"}


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_protected_servers_health_shows_a_probe_only_what_it_needs(standalone):
    """Without the token /health has its status and capacity, not its cache, models, kept-array
    instance or sandbox."""
    probe = await request("GET", standalone.url + "/health", timeout=10)
    client = await request("GET", standalone.url + "/health", timeout=10,
                           headers={"Authorization": f"Bearer {TOKEN}"})
    assert probe.code == client.code == 200
    assert set(probe.json) == PROBE_FIELDS and set(client.json) == PROBE_FIELDS | CLIENT_FIELDS


# -- every route x every spelling x with and without the token, on each front -------------------

#: The node token of this module's Router (never sent by the property below).
NODE_TOKEN = "door-node-token"


@pytest_twisted.async_fixture(scope="module")
async def gateway(module_processes):
    """A standalone node's gateway (two workers) with a client token."""
    service = await module_processes.start_service(
        server_args("--cpu-workers", "2", "--max-request-bytes", str(LIMIT)), name="door-gateway",
        env={**server_env(), "KCORAL_CLIENT_TOKEN": TOKEN})
    await until_ready(service.url)
    return service


@pytest_twisted.async_fixture(scope="module")
async def routed(module_processes):
    """A Router with a client token and a node token, and one node behind it."""
    router = await start_router(module_processes, "--node-token", NODE_TOKEN,
                                "--max-request-bytes", str(LIMIT), name="door-router",
                                env={"KCORAL_CLIENT_TOKEN": TOKEN})
    await start_node(module_processes, router.url, "door-node", env={"KCORAL_NODE_TOKEN": NODE_TOKEN})
    await until_ready(router.url)
    return router


async def until_ready(url: str) -> None:
    async def ready():
        return (await request("GET", url + "/readyz", timeout=10)).code == 200

    await until(ready, f"{url} ready", START_TIMEOUT, 0.2)


#: Every route each kind of front serves: the families' (their names filled
#: in) and the service's own.
_FILLED = {"model": "mlp", "version": "1", "kept": "a1b2c3d4e5f60718-0", "node_id": "door-node",
           "region": "door-region"}
_SERVER_ROUTES = [(route.path(**_FILLED), route) for family in (RUN, ARRAYS) for route in family.routes]
_OWN = [("/health", None), ("/readyz", None), ("/metrics", None)]
_ROUTER_ROUTES = [(route.path(**_FILLED), route) for family in FAMILIES for route in family.routes]
_ROUTER_OWN = [("/", None), ("/dashboard/page.js", None), ("/v1/dashboard", None)]
#: Whether a front serves a family: a standalone server without a model
#: repository serves neither the node list nor the inference protocol.
FRONT_ROUTES = {"server": _SERVER_ROUTES + _OWN + [(p, r) for p, r in _ROUTER_ROUTES
                                                   if r not in RUN.routes + ARRAYS.routes],
                "gateway": _ROUTER_ROUTES + _OWN + _ROUTER_OWN,
                "router": _ROUTER_ROUTES + _OWN + _ROUTER_OWN}


def _escape(code: int, upper: bool) -> str:
    escape = f"%{code:02X}"
    return escape if upper else escape.lower()


#: Ways to spell a path otherwise.
SPELLINGS = ["escape", "escape any byte", "case", "double", "dot", "params", "trailing"]


@st.composite
def spellings(draw, path: str) -> str:
    """C{path} spelled another way, by no change or several: escapes of its
    characters (a slash too) in either case, escaped bytes of any value,
    changed case, doubled slashes, dot segments (escaped or not),
    C{;params}, a trailing slash."""
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(SPELLINGS))
        at = draw(st.integers(0, len(path) - 1))
        if kind == "escape" and path[at] != "%":
            path = path[:at] + _escape(ord(path[at]), draw(st.booleans())) + path[at + 1:]
        elif kind == "escape any byte":
            path = path[:at] + _escape(draw(st.integers(0, 255)), draw(st.booleans())) + path[at:]
        elif kind == "case":
            path = path[:at] + path[at].swapcase() + path[at + 1:]
        elif kind == "trailing":
            path += "/"
        elif kind != "escape":
            # At a segment's end: before a slash, or at the path's end.
            cut = draw(st.sampled_from([i for i, c in enumerate(path) if c == "/"] + [len(path)]))
            insert = {"double": "/", "params": ";p=1",
                      "dot": draw(st.sampled_from(["/.", "/..", "/%2e", "/%2E%2e", "/x/.."]))}[kind]
            path = path[:cut] + insert + path[cut:]
    return path


@st.composite
def attempts(draw, front: str):
    """A request for one of C{front}'s routes: its method, its path as
    declared and as spelled, and whether it carries the client token."""
    path, route = draw(st.sampled_from(FRONT_ROUTES[front]))
    methods = sorted(m.decode() for m in route.methods if m != b"HEAD") if route else ["GET"]
    method = draw(st.sampled_from([*methods, "GET", "POST", "DELETE"]))
    return method, path, route, draw(spellings(path)), draw(st.booleans())


def _send(port: int, method: str, target: str, token: bool, rid: str) -> tuple[int, dict, bytes]:
    body = b"{}" if method in ("POST", "PUT") else b""
    head = (f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Request-ID: {rid}\r\n"
            f"Content-Length: {len(body)}\r\n" + (f"Authorization: Bearer {TOKEN}\r\n" if token else "")
            + "\r\n").encode()
    return parse_raw(raw_exchange(port, head + body, timeout=30))


def _probe(front: str, port: int, examples: int) -> collections.Counter:
    """Send C{examples} attempts at C{front}; check each answer; count them."""
    counts: collections.Counter = collections.Counter()
    serial = iter(range(10 ** 9))

    @settings(max_examples=examples, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(attempts(front))
    def prop(attempt):
        method, path, route, spelled, token = attempt
        rid = f"door-{front}-{next(serial)}"
        status, headers, body = _send(port, method, spelled, token, rid)
        counts[status] += 1
        assert status != 500 and not 501 <= status <= 599 or status == 503, (attempt, status, body)
        assert headers.get("x-request-id") == rid, (attempt, headers)
        if route is not None and route.guard == CLIENT and not token:
            # Whatever the spelling: refused (400), unauthorized (401), or
            # no route at all (404: another case is another path).
            assert status in (400, 401, 404), (attempt, status, body)
        if status >= 400 and method != "HEAD":
            assert "error" in json.loads(body), (attempt, body)

    prop()
    return counts


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_no_spelling_of_a_guarded_route_passes_the_guard(standalone, gateway, routed):
    """Every route, spelled every way, with and without the token, on each front: a request
    the guard refuses is refused whatever its spelling, nothing answers 500, each front stays healthy."""
    fronts = {"server": standalone, "gateway": gateway, "router": routed}
    for name, service in fronts.items():
        await deferToThread(_probe, name, service.port, 120)
    for service in fronts.values():
        assert (await request("GET", service.url + "/health", timeout=10)).code == 200
        assert service.process.running


def _twice_authorized(port: int, first: str, second: str) -> int:
    head = (f"DELETE /v1/arrays/a1b2c3d4e5f60718-0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Authorization: Bearer {first}\r\nAuthorization: Bearer {second}\r\n\r\n").encode()
    return parse_raw(raw_exchange(head=head, port=port, timeout=30))[0]


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_two_authorization_headers_are_never_one_token(standalone, gateway, routed):
    """Two Authorization lines are refused whichever holds the token: a proxy in front that
    reads one of them never admits what this service reads in the other."""
    for service in (standalone, gateway, routed):
        for first, second in ((TOKEN, "wrong"), ("wrong", TOKEN), (TOKEN, TOKEN)):
            assert await deferToThread(_twice_authorized, service.port, first, second) == 401


def _head(port: int, path: str) -> tuple[int, dict]:
    head = f"HEAD {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    status, headers, _ = parse_raw(raw_exchange(port, head, timeout=30))
    return status, headers


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_head_request_is_answered_without_a_line_about_its_body(standalone):
    """HEAD on a guarded route and on /health: its status and the GET's length, and no log
    line per request about a body Twisted left out (a way to fill the log)."""
    since = standalone.process.mark()
    for path, code in (("/v1/arrays/a1b2c3d4e5f60718-0", 401), ("/health", 200), ("/nothing", 404)):
        status, headers = await deferToThread(_head, standalone.port, path)
        assert status == code and int(headers["content-length"]) > 0
    # A refusal logged after them: the HEADs' lines, if any, are in by then.
    assert await deferToThread(_send, standalone.port, "GET", "/v1/arrays/x", False, "heads-done") \
        and await standalone.process.wait_for_line(r"heads-done", 10, since)
    assert standalone.process.matching("returning a message body", since) == []


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_head_line_past_the_bound_is_answered_not_cut(standalone):
    """A request line or a header line past the line bound gets a JSON 400 with a request id,
    not a connection closed without a word; the service stays healthy."""
    for head in (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n"):
        status, headers, body = parse_raw(await deferToThread(raw_exchange, standalone.port, head))
        assert status == 400 and json.loads(body)["error"]["request_id"] == headers["x-request-id"]
    assert (await request("GET", standalone.url + "/health", timeout=10)).code == 200
