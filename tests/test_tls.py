"""
TLS, with a CA generated in the test (L{tests.tlsutil}):

 - a Router and a node on TLS (C{--tls-cert}, C{--tls-key}, C{--tls-ca}): the
   supervisor registers with the C{https://} Router, the Router sends work to
   C{https://} workers, a client with an SSL context runs a program;
 - a wrong certificate is refused with a clear log line: a Router's
   certificate from another CA, or for another host (the supervisor's log; the
   node never joins); a worker's certificate for another host (the
   supervisor's log; the node never becomes ready); a worker the Router cannot
   verify (the Router's log; the request is never sent, the client sees 503,
   never a 502);
 - the node token is never sent over plain HTTP to a non-loopback address
   without a warning (unit level), and L{tls_problem} names what TLS refused.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl

import numpy as np
import pytest
import pytest_twisted
from OpenSSL import SSL
from service_identity import VerificationError
from service_identity.hazmat import DNS_ID, DNSMismatch
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.web.client import ResponseNeverReceived
from twisted.web.resource import Resource
from twisted.web.server import Site

from kcoral import Client, Program
from kcoral.node.reporter import Reporter
from kcoral.protocol.wire import REQUEST_CONTENT_TYPE
from kcoral.router.proxy import NotSent, Proxy
from kcoral.web.endpoint import ListenAddress
from kcoral.web.outgoing import tls_problem
from tests.conftest import server_args, server_env
from tests.harness import START_TIMEOUT, kcoral_argv, until
from tests.httputil import RUN_CALL
from tests.test_routed import FAST_NODE, start_router
from tests.test_server import run_frame
from tests.tlsutil import TestCA

TOKEN = "tls-token-c0ffee1234"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two CAs (the deployment's, and another one) and their certificates."""
    base = tmp_path_factory.mktemp("pki")
    good = TestCA(base / "good", "KCoral deployment CA")
    other = TestCA(base / "other", "Some other CA")
    return {
        "ca": good,
        "other_ca": other,
        # Both names a client may use for this machine.
        "router": good.issue("router"),
        "node": good.issue("node"),
        # Signed by the right CA, for the wrong host.
        "elsewhere": good.issue("elsewhere", dns=("gpu-z.example",), ips=("10.9.9.9",)),
        # Valid for the address only, not the name "localhost".
        "address_only": good.issue("address-only", dns=(), ips=("127.0.0.1",)),
        # The right names, the wrong CA.
        "impostor": other.issue("impostor"),
    }


# -- blocking HTTPS helpers (in threads) ---------------------------------------------------------

def _connection(url: str, context, timeout: float):
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    if url.startswith("https:"):
        return http.client.HTTPSConnection(host, int(port), context=context, timeout=timeout)
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def http_get(url: str, path: str, context) -> tuple[int, dict]:
    conn = _connection(url, context, 10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def http_post(url: str, body: bytes, rid: str, context: ssl.SSLContext) -> tuple[int, dict]:
    conn = _connection(url, context, 60)
    try:
        conn.request("POST", "/v1/run", body=body,
                     headers={"Content-Type": REQUEST_CONTENT_TYPE, "X-Request-ID": rid})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


async def nodes_of(router_url: str, context) -> dict:
    status, body = await deferToThread(http_get, router_url, "/v1/nodes", context)
    assert status == 200
    return {n["node_id"]: n for n in body["nodes"]}


def spawn_node(processes, router_url: str, node_id: str, *extra: str):
    args = server_args("--router", router_url, "--node-id", node_id, *FAST_NODE, *extra)
    return processes.spawn(kcoral_argv(*args), name=node_id,
                           env={**server_env(), "KCORAL_NODE_TOKEN": TOKEN})


def quick_program():
    return Program.from_function(lambda v: v * 3 + 1, np.ones(3, np.float32))


# -- a deployment on TLS ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_router_and_node_on_tls(processes, pki):
    """A Router and node on TLS register and serve a trusting client; other clients and plain HTTP fail."""
    ca = pki["ca"]
    router = await start_router(processes, *pki["router"].options(), "--tls-ca", ca.path,
                                "--node-token", TOKEN, name="tls-router")
    assert router.url.startswith("https://127.0.0.1:")
    node = spawn_node(processes, router.url, "tls-node", *pki["node"].options(), "--tls-ca", ca.path)
    await node.wait_for_line(r"worker0 is ready at https://127\.0\.0\.1:\d+", START_TIMEOUT)
    # The supervisor reached the https Router (certificate and host checked).
    await node.wait_for_line(r"registered with the Router as tls-node", 30)

    context = ca.client_context()

    async def ready():
        nodes = await nodes_of(router.url, context)
        return nodes if nodes.get("tls-node", {}).get("state") == "ready" else None

    nodes = await until(ready, "tls-node ready", 60, 0.1)
    [worker] = nodes["tls-node"]["workers"]
    assert worker["url"].startswith("https://127.0.0.1:") and worker["healthy"]

    # A client with an SSL context runs a program: the Router reaches the
    # https worker, verifying it against --tls-ca.
    program = quick_program()
    x = np.arange(3, dtype=np.float32)

    def run():
        with Client(router.url, ssl_context=context) as client:
            return client.run(program, x, request_id="over-tls-1")

    result = await deferToThread(run)
    np.testing.assert_allclose(result, x * 3 + 1)
    await node.wait_for_line(r"\[worker0\] .*over-tls-1 compiled program", 10)

    # A client that does not trust the deployment's CA is refused.
    with pytest.raises(ssl.SSLCertVerificationError):
        await deferToThread(http_get, router.url, "/health", ssl.create_default_context())
    # Plain HTTP to the TLS port gets no answer.
    host, port = router.url.split("//")[1].rsplit(":", 1)

    def plain():
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            return e
        finally:
            conn.close()

    assert not isinstance(await deferToThread(plain), int)

    logs = "\n".join(router.process.output.lines + node.output.lines)
    assert "plain HTTP" not in logs and TOKEN not in logs
    assert not re.search(r"TLS .*failed|not valid for", logs), logs


# -- Twisted endpoint strings ------------------------------------------------------------------

def ssl_endpoint(issued, interface: str = "127.0.0.1") -> str:
    return f"ssl:0:interface={interface}:privateKey={issued.key}:certKey={issued.cert}"


def test_the_url_of_an_endpoint_string_comes_from_where_it_listens():
    """The URL of a listening endpoint string is https for ssl, bracketed for IPv6, http+unix for a socket."""
    from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress

    tls = ListenAddress(description="ssl:0:privateKey=k.pem:certKey=c.pem")
    assert tls.url(IPv4Address("TCP", "10.0.0.2", 9443)) == "https://10.0.0.2:9443"
    plain = ListenAddress(description="tcp6:0:interface=\\:\\:1")
    assert plain.url(IPv6Address("TCP", "::1", 9000)) == "http://[::1]:9000"
    assert ListenAddress(description="unix:/run/kcoral.sock").url(
        UNIXAddress(b"/run/kcoral.sock")) == "http+unix:///run/kcoral.sock"


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_router_listens_on_an_endpoint_string(processes, pki):
    """A Router started with --listen and an ssl endpoint string serves https."""
    router = await start_router(processes, "--listen", ssl_endpoint(pki["router"]),
                                name="listen-router")
    assert router.url.startswith("https://127.0.0.1:")
    status, health = await deferToThread(http_get, router.url, "/health", pki["ca"].client_context())
    assert status == 503 and health["status"] == "unavailable"


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_server_listens_on_an_endpoint_string(start_server, pki):
    """A server started with --listen and an ssl endpoint string runs programs over https."""
    server = await start_server("--listen", ssl_endpoint(pki["node"]), name="listen-server")
    assert server.url.startswith("https://127.0.0.1:")
    program, x = quick_program(), np.arange(3, dtype=np.float32)

    def run():
        with Client(server.url, ssl_context=pki["ca"].client_context()) as client:
            return client.run(program, x)

    np.testing.assert_allclose(await deferToThread(run), x * 3 + 1)


@pytest.mark.parametrize("args, says", [
    (["router", "--listen", "tcp:0", "--tls-cert", "c.pem"], "--listen takes the place of --tls-cert"),
    (["server", "--listen", "tcp:0", "--router", "http://127.0.0.1:9", "--node-id", "n"],
     "--listen is for a server without --router"),
    (["router", "--listen", "tcp:port=notaport"], "--listen tcp:port=notaport: ValueError"),
    (["router", "--listen", "nonsense:0"], "--listen nonsense:0: ValueError"),
    (["router", "--listen", "ssl:0:privateKey=/nonexistent.pem"], "--listen ssl:0:privateKey="),
])
@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_wrong_listen_option_is_a_one_line_error(processes, args, says):
    """A conflicting or malformed --listen option exits with a one-line error and no traceback."""
    child = processes.spawn(kcoral_argv(*args), name="bad-listen")
    assert await child.exited(60) in (1, 2)
    lines = [line for line in child.output.lines if line.strip()]
    assert any(says in line for line in lines), lines
    assert not any("Traceback" in line for line in lines), lines


# -- wrong certificates ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("certificate,refusal", [
    ("impostor", r"certificate verify failed"),
    ("elsewhere", r"the peer's TLS certificate is not valid for 127\.0\.0\.1"),
])
@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_the_supervisor_refuses_a_router_with_a_wrong_certificate(processes, pki, certificate,
                                                                        refusal):
    """A supervisor refuses a Router certified by another CA or for another host, and never registers."""
    issued = pki[certificate]
    router = await start_router(processes, *issued.options(), "--node-token", TOKEN,
                                name="wrong-router")
    node = spawn_node(processes, router.url, "careful-node", "--tls-ca", pki["ca"].path)
    line = await node.wait_for_line(rf"the Router is unreachable \(.*{refusal}", START_TIMEOUT)
    assert "TLS" in line.string
    await node.wait_for_line(r"worker0 is ready at", START_TIMEOUT)
    # What must not happen has no event: give it a few heartbeats' time.
    await deferLater(reactor, 1.0, lambda: None)
    assert not node.matching(r"registered with the Router")
    # Nothing reached the Router: the node never joined.
    context = pki["other_ca" if certificate == "impostor" else "ca"].client_context()
    context.check_hostname = False  # this test's client reads the list whatever the name
    assert await nodes_of(router.url, context) == {}
    assert TOKEN not in "\n".join(node.output.lines + router.process.output.lines)


@pytest.mark.slow
@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_worker_certificate_for_another_host_never_becomes_ready(processes, pki):
    """A worker certified for another host never becomes ready, and the problem is logged once."""
    ca = pki["ca"]
    router = await start_router(processes, "--node-token", TOKEN, "--tls-ca", ca.path,
                                name="plain-router")
    node = spawn_node(processes, router.url, "misnamed-node", *pki["elsewhere"].options(),
                      "--tls-ca", ca.path)
    await node.wait_for_line(r"worker0 at https://127\.0\.0\.1:\d+: the peer's TLS certificate "
                             r"is not valid for 127\.0\.0\.1", START_TIMEOUT)
    await node.wait_for_line(r"registered with the Router as misnamed-node", 30)
    # What must not happen has no event: give it several probes' time.
    await deferLater(reactor, 2.0, lambda: None)
    nodes = await nodes_of(router.url, None)
    assert nodes["misnamed-node"]["state"] != "ready"
    assert not nodes["misnamed-node"]["workers"][0]["healthy"]
    assert not node.matching(r"worker0 is ready at")
    # The problem is logged once, not at every probe.
    assert len(node.matching(r"not valid for 127\.0\.0\.1")) == 1


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("case", ["another CA", "another host"])
@pytest_twisted.ensureDeferred
async def test_the_router_refuses_a_worker_it_cannot_verify(processes, pki, case):
    """A run for a worker the Router cannot verify is never sent: the client gets 503 no_ready_node."""
    ca = pki["ca"]
    router = await start_router(processes, "--node-token", TOKEN, "--tls-ca", ca.path,
                                name="checking-router")
    if case == "another CA":
        # The supervisor trusts the other CA (so its own probes pass); the
        # Router does not.
        extra = (*pki["impostor"].options(), "--tls-ca", pki["other_ca"].path)
        refusal = r"certificate verify failed"
    else:
        # The certificate names 127.0.0.1 (the supervisor's probes use that)
        # but not "localhost", the host the node advertises to the Router.
        extra = (*pki["address_only"].options(), "--tls-ca", ca.path, "--advertise-host", "localhost")
        refusal = r"not valid for localhost"
    node = spawn_node(processes, router.url, "unverifiable", *extra)
    await node.wait_for_line(r"worker0 is ready at https://", START_TIMEOUT)

    async def ready():
        nodes = await nodes_of(router.url, None)
        return nodes.get("unverifiable", {}).get("state") == "ready"

    await until(ready, "the node's report accepted", 60, 0.1)
    body = run_frame(quick_program(), [np.ones(3, np.float32)])
    mark = router.process.mark()
    status, answer = await deferToThread(http_post, router.url, body, "unverified-1", None)
    # Never sent, so never a 502: the Router tried, found no node it could
    # trust, and answered 503.
    assert status == 503, answer
    info = json.loads(answer)["error"]
    assert info["reason"] == "no_ready_node" and info["request_id"] == "unverified-1"
    await router.process.wait_for_line(
        rf"TLS with https://\S+ failed, the request was not sent: .*{refusal}", 10, since=mark)
    assert not router.process.matching(r"unverified-1 failed on", since=mark)
    assert not node.matching(r"unverified-1")


# -- unit level -------------------------------------------------------------------------------------

def _warnings(router_url: str, token: str | None) -> list[str]:
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        Reporter(None, router_url, "gpu-a", token, report=dict, timeout=1.0)
    finally:
        globalLogPublisher.removeObserver(events.append)
    return [formatEvent(e) for e in events if "plain HTTP" in formatEvent(e)]


@pytest.mark.parametrize("url,token,warned", [
    ("http://10.0.0.5:9000", TOKEN, True),
    ("http://router.internal:9000", TOKEN, True),
    ("http://[2001:db8::1]:9000", TOKEN, True),
    ("https://10.0.0.5:9000", TOKEN, False),
    ("http://127.0.0.1:9000", TOKEN, False),
    ("http://localhost:9000", TOKEN, False),
    ("http://[::1]:9000", TOKEN, False),
    ("http://10.0.0.5:9000", None, False),
])
def test_a_token_over_plain_http_to_another_host_is_warned_about(url, token, warned):
    """A token over plain HTTP to a host not on loopback is warned about, without the token itself."""
    lines = _warnings(url, token)
    assert bool(lines) == warned, lines
    assert not any(TOKEN in line for line in lines)


def test_tls_problem_names_what_tls_refused():
    """tls_problem describes a failed verification or a host mismatch, and is None for other errors."""
    refused = SSL.Error([("SSL routines", "", "certificate verify failed")])
    untrusted = ResponseNeverReceived([Failure(refused)])
    assert "certificate verify failed" in tls_problem(untrusted)
    assert "--tls-ca" in tls_problem(untrusted)
    misnamed = ResponseNeverReceived([Failure(VerificationError(
        errors=[DNSMismatch(mismatched_id=DNS_ID("gpu-a.example"))]))])
    assert "not valid for gpu-a.example" in tls_problem(misnamed)
    assert tls_problem(ResponseNeverReceived([Failure(ConnectionError())])) is None
    assert tls_problem(ValueError("x")) is None


class _Hello(Resource):
    isLeaf = True

    def render_POST(self, request):
        return b"ran"


@pytest.mark.parametrize("certificate", ["impostor", "elsewhere"])
@pytest_twisted.ensureDeferred
async def test_the_proxy_counts_a_refused_certificate_as_not_sent(pki, certificate):
    """A worker certificate that fails verification makes the proxy raise NotSent; a valid one is served."""
    # Regression: a host name mismatch fails with service-identity's
    # VerificationError, not SSL.Error, and was taken for a connection lost
    # after sending (502, "it may have run").
    issued = pki[certificate]
    port = await ListenAddress("127.0.0.1", 0, issued.cert, issued.key).endpoint(reactor).listen(
        Site(_Hello()))
    from kcoral.web.body import MemoryBody
    from kcoral.web.outgoing import Outgoing

    outgoing = Outgoing(reactor, ca_path=pki["ca"].path)
    proxy = Proxy(outgoing.client)
    try:
        with pytest.raises(NotSent, match="TLS with"):
            await proxy.forward(f"https://127.0.0.1:{port.getHost().port}", RUN_CALL,
                                MemoryBody(b"x"))
        # The same server, with the right certificate, takes the request.
        right = pki["node"]
        good = await ListenAddress("127.0.0.1", 0, right.cert, right.key).endpoint(reactor).listen(
            Site(_Hello()))
        try:
            answer = await proxy.forward(f"https://127.0.0.1:{good.getHost().port}", RUN_CALL,
                                         MemoryBody(b"x"))
            assert answer.code == 200 and answer.body == b"ran"
        finally:
            await good.stopListening()
    finally:
        await outgoing.close()
        await port.stopListening()


# -- certificate files ------------------------------------------------------------------------------

async def _fetch(issued, ca_path: str) -> int | str:
    """Serve with C{issued}; GET it through an L{Outgoing} trusting C{ca_path}."""
    from kcoral.web.outgoing import Outgoing

    port = await ListenAddress("127.0.0.1", 0, issued.cert, issued.key).endpoint(reactor).listen(
        Site(_Hello()))
    outgoing = Outgoing(reactor, ca_path=ca_path)
    try:
        response = await outgoing.client.post(f"https://127.0.0.1:{port.getHost().port}/", data=b"")
        await response.content()
        return response.code
    except Exception as e:
        return tls_problem(e) or repr(e)
    finally:
        await outgoing.close()
        await port.stopListening()


def _closed_within(port: int, seconds: float) -> bool:
    """Whether a connection to C{port} is closed by the server within C{seconds}."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=seconds) as sock:
            return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest_twisted.ensureDeferred
async def test_a_connection_beyond_the_cap_is_closed_also_under_tls(pki):
    """Past the connection cap, the server closes a TLS connection too."""
    from tests.httputil import fake_site

    issued = pki["node"]
    site = fake_site(reactor, max_connections=0)
    port = await ListenAddress("127.0.0.1", 0, issued.cert, issued.key).endpoint(reactor).listen(site)
    try:
        assert await deferToThread(_closed_within, port.getHost().port, 10)
    finally:
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_a_certificate_chain_is_sent_whole(tmp_path):
    """The intermediates of a --tls-cert file are sent, so clients that trust only the root verify it."""
    # --tls-cert may hold the service's certificate followed by intermediate
    # CAs; clients trust only the root. (Regression: only the first
    # certificate of the file was sent, so such chains could not be verified.)
    root = TestCA(tmp_path / "root", "Root CA")
    intermediate = TestCA(tmp_path / "intermediate", "Intermediate CA", parent=root)
    issued = intermediate.issue("chained")
    assert open(issued.cert).read().count("BEGIN CERTIFICATE") == 2
    assert await _fetch(issued, root.path) == 200
    # Python's own TLS client agrees.
    site = await ListenAddress("127.0.0.1", 0, issued.cert, issued.key).endpoint(reactor).listen(
        Site(_Health()))
    try:
        status, _ = await deferToThread(http_get, f"https://127.0.0.1:{site.getHost().port}",
                                        "/", root.client_context())
        assert status == 200
    finally:
        await site.stopListening()


@pytest_twisted.ensureDeferred
async def test_a_ca_file_may_hold_several_cas(tmp_path, pki):
    """Every CA in a --tls-ca file is trusted, not only the first."""
    # (Regression: only the first CA of a --tls-ca file was trusted.)
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(open(pki["other_ca"].path, "rb").read() + open(pki["ca"].path, "rb").read())
    assert await _fetch(pki["node"], str(bundle)) == 200
    assert await _fetch(pki["impostor"], str(bundle)) == 200
    assert "certificate verify failed" in await _fetch(pki["impostor"], pki["ca"].path)


def test_a_key_that_does_not_match_its_certificate_is_a_one_line_error(pki):
    """A key that does not match its certificate, or a file without a certificate, raises ValueError."""
    address = ListenAddress("127.0.0.1", 0, pki["node"].cert, pki["impostor"].key)
    with pytest.raises(ValueError, match="--tls-cert .* with --tls-key"):
        address.endpoint(reactor)
    with pytest.raises(ValueError, match="no PEM certificate"):
        ListenAddress("127.0.0.1", 0, pki["node"].key, pki["node"].key).endpoint(reactor)


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_kcoral_router_with_a_wrong_key_exits_1_with_one_line(pki, processes):
    """kcoral router with a key that does not match its certificate exits 1 with one error line."""
    child = processes.spawn(kcoral_argv("router", "--port", "0", "--tls-cert", pki["router"].cert,
                                        "--tls-key", pki["impostor"].key), name="bad-key")
    assert await child.exited(60) == 1
    lines = [line for line in child.output.lines if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kcoral: error: --tls-cert "), lines


class _Health(Resource):
    isLeaf = True

    def render_GET(self, request):
        return b"{}"
