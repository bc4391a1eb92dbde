"""
Client authentication (L{kcoral.web.auth}):

 - in process: the guard compares every token in constant time, reads a
   tokens file (comments, blank lines) and reads it again, keeping the
   tokens in force when the file turns bad; a Router's runs and node list
   need a client token while /health, /readyz and /metrics stay open and
   node control keeps the node token; a run without the token is refused
   from its head, before its body; no refusal logs or quotes a token;
   the options that turn it on;
 - with real processes: a Router with a tokens file, a client with the
   right, a wrong and no token, C{kcoral status --token}, the file changed
   and SIGHUP (the old token refused, the new one accepted); a standalone
   node's gateway with C{KCORAL_CLIENT_TOKEN}, whose workers need none.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import pytest_twisted
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python import usage

from kcoral import Client, Program
from kcoral.errors import Unauthorized
from kcoral.router.service import RouterConfig
from kcoral.taps.node import NodeOptions
from kcoral.taps.router import RouterOptions
from kcoral.web import auth
from kcoral.web.auth import (
    CLIENT_ROUTES,
    MAX_TOKENS_FILE_BYTES,
    TokenGuard,
    TokensFile,
    client_guard,
    read_tokens,
)
from tests.conftest import server_args, server_env
from tests.harness import START_TIMEOUT, kcoral_argv, until
from tests.httputil import connect, fake_site, parse_raw, request
from tests.test_routed import start_node, start_router
from tests.test_router_app import TOKEN as NODE_TOKEN
from tests.test_router_app import Router, assert_error
from tests.test_spool import Bodies

TOKEN = "client-t0ken.abc~+/=="
OTHER = "another-client-token"


@pytest.fixture
def logged():
    """The text of every log event while the test runs."""
    lines: list[str] = []

    def observer(event):
        lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observer)
    yield lines
    globalLogPublisher.removeObserver(observer)


def tokens_file(path, *lines: str) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


# -- the guard ----------------------------------------------------------------------------------

def test_every_token_is_compared_in_constant_time(monkeypatch):
    """Every configured token is compared with compare_digest, as digests, whether one matches or not."""
    calls = []

    def spy(a, b):
        calls.append((len(a), len(b)))
        return original(a, b)

    original = auth.compare_digest
    monkeypatch.setattr(auth, "compare_digest", spy)
    guard = TokenGuard.of(["first", TOKEN, "third"], CLIENT_ROUTES)
    for header, admitted in [(b"Bearer first", True), (f"bearer {TOKEN}".encode(), True),
                             (b"Bearer nope", False), (b"Bearer " + b"x" * 10000, False)]:
        calls.clear()
        assert guard.admits(header) is admitted
        # SHA-256 digests: the same length whatever was presented.
        assert calls == [(32, 32)] * 3


@pytest.mark.parametrize("header", [None, b"", b"Bearer", b"Bearer ", TOKEN.encode(),
                                    f"Basic {TOKEN}".encode(), f"Bearer{TOKEN}".encode(),
                                    f"Bearer {TOKEN[:-1]}".encode(), f"Bearer {TOKEN}x".encode()])
def test_anything_but_the_bearer_token_is_refused(header):
    """A missing header, another scheme, no space, a truncated or longer token are all refused."""
    assert not TokenGuard.of([TOKEN], CLIENT_ROUTES).admits(header)


def test_no_tokens_means_open():
    """A guard without tokens admits every request (the default: no client authentication)."""
    assert TokenGuard.of([], CLIENT_ROUTES).admits(None)


def test_a_tokens_file_leaves_out_comments_and_blank_lines(tmp_path):
    """One token a line; blank lines, whole-line and end-of-line # comments are left out."""
    path = tokens_file(tmp_path / "tokens", "# the CI's token", "", "  ci-token  ",
                       "laptop-token # alice, until May", "   # indented comment", "\t")
    assert read_tokens(path) == ["ci-token", "laptop-token"]


@pytest.mark.parametrize("lines, says", [
    ((), "holds no token"),
    (("# only a comment", ""), "holds no token"),
    (("good-token", "two words"), "line 2 of"),
    (("good-token", "caf\u00e9"), "line 2 of"),
])
def test_a_bad_tokens_file_is_refused_without_quoting_it(tmp_path, lines, says):
    """An empty file, or a line that is no bearer token, is refused, by line number, quoting no line."""
    path = tokens_file(tmp_path / "tokens", *lines)
    with pytest.raises(ValueError, match=says) as raised:
        read_tokens(path)
    assert "good-token" not in str(raised.value) and "words" not in str(raised.value)


def test_a_tokens_file_over_the_bound_is_refused(tmp_path):
    """A file larger than the bound is refused instead of being read whole on the reactor's thread."""
    path = tokens_file(tmp_path / "tokens", *["t" * 99] * (MAX_TOKENS_FILE_BYTES // 100 + 1))
    with pytest.raises(ValueError, match="over"):
        read_tokens(path)


def test_a_tokens_file_read_again_swaps_the_tokens(tmp_path, logged):
    """After reload, the new file's tokens are in force and the old ones refused; a bad file keeps them."""
    path = tmp_path / "tokens"
    tokens = TokensFile(tokens_file(path, TOKEN), fixed=["fixed-token"], reactor=Clock())
    assert tokens.guard.admits(f"Bearer {TOKEN}".encode())
    tokens_file(path, OTHER)
    tokens.reload()
    assert not tokens.guard.admits(f"Bearer {TOKEN}".encode())
    assert tokens.guard.admits(f"Bearer {OTHER}".encode())
    assert tokens.guard.admits(b"Bearer fixed-token")
    for broken in ["# emptied by a truncated write", "not a token"]:
        tokens_file(path, broken)
        tokens.reload()
        assert tokens.guard.admits(f"Bearer {OTHER}".encode())
    path.unlink()
    tokens.reload()
    assert tokens.guard.admits(f"Bearer {OTHER}".encode())
    text = "\n".join(logged)
    assert "kept the client tokens in force" in text and "2 in force" in text
    assert OTHER not in text and TOKEN not in text and "fixed-token" not in text


def test_a_tokens_file_read_again_tells_its_followers(tmp_path):
    """Each follower is called every time the file is read again, a file that cannot be
    read included: the processes that read the same file read it again with it."""
    path = tmp_path / "tokens"
    tokens = TokensFile(tokens_file(path, TOKEN), reactor=Clock())
    told: list[str] = []
    tokens.followers += [lambda: told.append("a"), lambda: told.append("b")]
    tokens.reload()
    path.unlink()
    tokens.reload()
    assert told == ["a", "b", "a", "b"]


def test_a_missing_tokens_file_stops_the_service_at_start(tmp_path):
    """A tokens file that cannot be read is an error when the service is made, not an open door."""
    with pytest.raises(OSError):
        client_guard(RouterConfig(client_tokens_file=str(tmp_path / "missing")), Clock())
    assert client_guard(RouterConfig(), Clock()) is None


# -- a Router's routes, in process --------------------------------------------------------------

@pytest.fixture
def guarded():
    return Router(client_token=TOKEN, node_token=NODE_TOKEN, max_queued_requests=0)


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize("headers", [{}, bearer("forged-value"), bearer(NODE_TOKEN),
                                     {"Authorization": TOKEN}])
def test_runs_and_the_node_list_need_the_client_token(guarded, headers, logged):
    """POST /v1/run and GET /v1/nodes without the client token are a JSON 401 asking for Bearer."""
    for method, path in [("POST", "/v1/run"), ("GET", "/v1/nodes")]:
        response, body = guarded.json(method, path, body=b"frame", headers=headers)
        info = assert_error(response, body, 401, "unauthorized")
        assert response.headers.getRawHeaders(b"WWW-Authenticate") == [b"Bearer"]
        assert "runs and the node list need a valid bearer token" in info["message"]
        assert TOKEN not in json.dumps(body) and NODE_TOKEN not in json.dumps(body)
    text = "\n".join(logged)
    assert text.count("refused a client request for ") == 2
    assert TOKEN not in text and NODE_TOKEN not in text and "forged-value" not in text


def test_the_client_token_admits_runs_and_the_node_list(guarded):
    """With the client token, a run reaches the forwarder (503: no node) and the node list answers."""
    response, body = guarded.json("POST", "/v1/run", body=b"frame", headers=bearer(TOKEN))
    assert_error(response, body, 503)
    response, body = guarded.json("GET", "/v1/nodes", headers=bearer(TOKEN))
    assert response.code == 200 and body == {"nodes": []}


def test_a_run_without_the_token_is_refused_from_its_head(logged):
    """A run guard answers a POST /v1/run without the token 401 from its head: no 100 Continue."""
    resource = Bodies()
    site = fake_site(Clock(), max_request_bytes=1 << 30, resource=resource,
                     client_guard=TokenGuard.of([TOKEN], CLIENT_ROUTES))
    head = (b"POST /v1/run?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 268435456\r\n"
            b"Expect: 100-continue\r\nX-Request-ID: early-1\r\n")
    channel, transport = connect(site)
    channel.dataReceived(head + b"\r\n")
    status, headers, body = parse_raw(transport.value())
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert headers["x-request-id"] == "early-1" and headers["connection"] == "close"
    assert json.loads(body)["error"]["request_id"] == "early-1"
    assert b"100 Continue" not in transport.value() and resource.requests == []
    assert "refused a client request for early-1 with no token" in "\n".join(logged)
    channel, transport = connect(site)
    channel.dataReceived(head + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
    assert transport.value().startswith(b"HTTP/1.1 100 Continue")


def test_health_readiness_and_metrics_stay_open(guarded):
    """/health, /readyz and /metrics answer without any token."""
    for path in ["/health", "/readyz"]:
        response, _ = guarded.json("GET", path)
        assert response.code == 503
    response, content = guarded.request("GET", "/metrics")
    assert response.code == 200 and b"kcoral_nodes" in content


def test_node_control_keeps_the_node_token(guarded):
    """A report needs the node token: the client token does not admit it."""
    response, body = guarded.put("gpu-a", token=TOKEN)
    assert_error(response, body, 401)
    response, body = guarded.put("gpu-a", token=NODE_TOKEN)
    assert response.code == 200


# -- options ------------------------------------------------------------------------------------

def test_the_client_token_comes_from_the_environment(monkeypatch):
    """KCORAL_CLIENT_TOKEN sets a Router's and a standalone server's --client-token; the flag wins."""
    monkeypatch.setenv("KCORAL_CLIENT_TOKEN", TOKEN)
    for options in [RouterOptions(), NodeOptions()]:
        options.parseOptions([])
        assert options["client-token"] == TOKEN
    options = RouterOptions()
    options.parseOptions(["--client-token", OTHER])
    assert options.router_config().client_token == OTHER


@pytest.mark.parametrize("option", [["--client-token", TOKEN], ["--client-tokens-file", "tokens"],
                                    ["--tls-client-ca", "ca.pem"]])
def test_client_authentication_under_a_router_is_a_usage_error(option):
    """A node under --router leaves client authentication to the Router: asking for it is an error."""
    with pytest.raises(usage.UsageError, match="the Router checks clients"):
        NodeOptions().parseOptions(["--router", "http://r:9000", "--node-id", "n", *option])


def test_the_environment_token_is_unused_under_a_router(monkeypatch):
    """A node under --router ignores KCORAL_CLIENT_TOKEN (one secret may serve a whole deployment)."""
    monkeypatch.setenv("KCORAL_CLIENT_TOKEN", TOKEN)
    options = NodeOptions()
    options.parseOptions(["--router", "http://r:9000", "--node-id", "n"])
    assert options["client-token"] is None


def test_a_client_ca_needs_a_certificate():
    """--tls-client-ca without --tls-cert (or with --listen) is a usage error."""
    for argv in [["--tls-client-ca", "ca.pem"], ["--tls-client-ca", "ca.pem", "--listen", "tcp:0"]]:
        with pytest.raises(usage.UsageError, match="--tls-client-ca needs --tls-cert"):
            RouterOptions().parseOptions(argv)


def test_a_client_token_that_is_no_bearer_token_is_refused_unquoted():
    """A client token with a space or a newline is refused by the client, without quoting it."""
    with pytest.raises(ValueError, match="not a bearer token") as raised:
        Client("http://127.0.0.1:1", token="s3cret\r\nX-Injected: 1")
    assert "s3cret" not in str(raised.value)


# -- real processes -----------------------------------------------------------------------------

def quick_program():
    return Program.from_function(lambda v: v * 2 - 1, np.ones(3, np.float32))


def run_with(url: str, token: str | None, rid: str):
    """A run through the blocking client (in a thread): its result, or the error it raised."""
    x = np.arange(3, dtype=np.float32)

    def run():
        try:
            with Client(url, token=token) as client:
                return client.run(quick_program(), x, request_id=rid)
        except Unauthorized as e:
            return e

    return deferToThread(run)


async def kcoral_status(processes, router_url: str, *extra: str):
    """C{kcoral status --json} against C{router_url}: its exit status and output."""
    child = processes.spawn(kcoral_argv("status", "--router", router_url, "--json", *extra),
                            name="status", env={"KCORAL_CLIENT_TOKEN": None})
    code = await child.exited(30)
    return code, "\n".join(child.output.lines)


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_router_with_a_tokens_file(processes, tmp_path):
    """Right, wrong and missing tokens on a real Router; after SIGHUP the file's new token alone works."""
    path = tmp_path / "tokens"
    tokens_file(path, "# rotated monthly", TOKEN)
    router = await start_router(processes, "--client-tokens-file", str(path),
                                "--node-token", NODE_TOKEN, name="auth-router")
    await start_node(processes, router.url, "auth-node", env={"KCORAL_NODE_TOKEN": NODE_TOKEN,
                                                              "KCORAL_CLIENT_TOKEN": TOKEN})

    async def ready():
        answer = await request("GET", router.url + "/v1/nodes", headers=bearer(TOKEN), timeout=10)
        return answer.code == 200 and answer.json["nodes"][0]["state"] == "ready"

    await until(ready, "auth-node ready", 60, 0.1)
    np.testing.assert_allclose(await run_with(router.url, TOKEN, "auth-right"),
                               np.arange(3) * 2 - 1)
    for token in [None, "wrong-token"]:
        refused = await run_with(router.url, token, "auth-refused")
        assert isinstance(refused, Unauthorized) and refused.request_id == "auth-refused"
    answer = await request("GET", router.url + "/v1/nodes", timeout=10)
    assert answer.code == 401 and answer.header("WWW-Authenticate") == "Bearer"
    assert (await request("GET", router.url + "/health", timeout=10)).code == 200

    code, text = await kcoral_status(processes, router.url, "--token", TOKEN)
    assert code == 0 and '"auth-node"' in text
    code, text = await kcoral_status(processes, router.url)
    assert code == 1 and "401 unauthorized" in text

    # Rotation: the file changes, SIGHUP, and only the new token works.
    tokens_file(path, OTHER)
    since = router.process.mark()
    router.process.signal("HUP")
    await router.process.wait_for_line(r"read the client tokens of .* again: 1 in force", 10, since)
    assert isinstance(await run_with(router.url, TOKEN, "auth-old"), Unauthorized)
    np.testing.assert_allclose(await run_with(router.url, OTHER, "auth-new"), np.arange(3) * 2 - 1)
    assert router.process.running

    logs = "\n".join(router.process.output.lines)
    assert "refused a client request for auth-refused with no token" in logs
    assert "refused a client request for auth-refused with a wrong token" in logs
    for secret in [TOKEN, OTHER, NODE_TOKEN, "wrong-token"]:
        assert secret not in logs


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_standalone_node_takes_the_token_and_its_workers_need_none(processes):
    """A gateway with KCORAL_CLIENT_TOKEN refuses runs without it, and runs them with it on workers."""
    args = server_args("--cpu-workers", "2")
    child = processes.spawn(kcoral_argv(*args), name="auth-gateway",
                            env={**server_env(), "KCORAL_CLIENT_TOKEN": TOKEN})
    listening = await child.wait_for_line(r"kcoral gateway listening on (?P<url>\S+)", START_TIMEOUT)
    url = listening.group("url")

    async def ready():
        return (await request("GET", url + "/readyz", timeout=10)).code == 200

    await until(ready, "the gateway ready", START_TIMEOUT, 0.2)
    assert isinstance(await run_with(url, None, "gw-refused"), Unauthorized)
    np.testing.assert_allclose(await run_with(url, TOKEN, "gw-right"), np.arange(3) * 2 - 1)
    await child.wait_for_line(r"\[worker\d\] .*gw-right", 10)
    assert TOKEN not in "\n".join(child.output.lines)
