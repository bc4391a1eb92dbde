"""
Outgoing HTTP (L{kcoral.web.outgoing}) and the Router's proxy URLs: the
per-request work they do once (endpoints, parsed URLs) and the body producer
that writes a small body with the request head.
"""

from __future__ import annotations

import io
import json

import pytest
import pytest_twisted
import treq
from hyperlink import EncodedURL
from twisted.internet import reactor
from twisted.internet.error import CannotListenError
from twisted.internet.testing import StringTransport
from twisted.web import resource, server
from twisted.web.client import URI, BrowserLikePolicyForHTTPS, FileBodyProducer, HTTPConnectionPool
from twisted.web.error import SchemeNotSupported

from kcoral.logs import debug_enabled, start_console_logging
from kcoral.router.proxy import NotSent, Proxy, _RunURL
from kcoral.web.body import MemoryBody
from kcoral.web.outgoing import INLINE_BODY_BYTES, BytesProducer, Endpoints, Outgoing, body_producer
from kcoral.web.sendnow import SendNowEndpoint
from tests.fakes import FakeWorker
from tests.harness import until
from tests.httputil import RUN_CALL, AsKCoralSite


def test_a_small_body_is_written_at_once():
    """A small body's producer writes it whole, in one synchronous write."""
    producer = body_producer(b"x" * 300)
    assert isinstance(producer, BytesProducer) and producer.length == 300
    consumer = StringTransport()
    done = producer.startProducing(consumer)
    # Synchronously, in one write: no cooperator turn after the head.
    assert done.called
    assert consumer.value() == b"x" * 300


def test_large_bodies_and_files_stream_as_treq_would():
    """Bodies above the inline limit, and files, get treq's FileBodyProducer."""
    assert isinstance(body_producer(b"x" * (INLINE_BODY_BYTES + 1)), FileBodyProducer)
    assert isinstance(body_producer(io.BytesIO(b"abc")), FileBodyProducer)


def test_endpoints_are_made_once_per_scheme_host_and_port():
    """One endpoint per scheme, host and port is made and reused; https ones are wrapped in TLS."""
    endpoints = Endpoints(reactor, BrowserLikePolicyForHTTPS())
    first = endpoints.endpointForURI(URI.fromBytes(b"http://127.0.0.1:8000/v1/run"))
    assert isinstance(first, SendNowEndpoint)  # TCP, each write sent at once
    assert endpoints.endpointForURI(URI.fromBytes(b"http://127.0.0.1:8000/health")) is first
    assert endpoints.endpointForURI(URI.fromBytes(b"http://127.0.0.1:8001/v1/run")) is not first
    tls = endpoints.endpointForURI(URI.fromBytes(b"https://127.0.0.1:8000/v1/run"))
    assert tls is not first and not isinstance(tls, SendNowEndpoint)  # wrapped in TLS


def test_other_schemes_are_refused():
    """A scheme other than http and https is refused with SchemeNotSupported."""
    with pytest.raises(SchemeNotSupported):
        Endpoints(reactor, BrowserLikePolicyForHTTPS()).endpointForURI(
            URI.fromBytes(b"ftp://127.0.0.1:21/x"))


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://node-1.example:9443"])
def test_a_run_url_is_its_own_uri(url):
    """A parsed run URL is its own URI, with the text, host and port of hyperlink's; a copy is a plain URL."""
    parsed = _RunURL.parse(url + "/v1/run")
    plain = EncodedURL.from_text(url + "/v1/run")
    assert parsed.to_uri() is parsed
    assert parsed.to_uri().to_text() == plain.to_uri().to_text() == url + "/v1/run"
    assert (parsed.host, parsed.port) == (plain.host, plain.port)
    # A copy (which treq makes only to add query parameters) is a plain URL.
    copy = parsed.replace(query=(("a", "b"),))
    assert copy.to_uri().to_text() == plain.replace(query=(("a", "b"),)).to_uri().to_text()


def test_a_run_url_may_name_an_ipv6_worker():
    # hyperlink's to_uri() IDNA-encodes the host, which fails for '::1':
    # treq could not reach a worker that reported an IPv6 address.
    """A run URL may name an IPv6 host, which hyperlink's to_uri() would reject."""
    parsed = _RunURL.parse("http://[::1]:8000/v1/run")
    assert parsed.to_uri().to_text() == "http://[::1]:8000/v1/run"
    assert parsed.host == "::1" and parsed.port == 8000


def test_the_proxy_parses_each_member_url_once():
    """The proxy parses a member's URL once and reuses the result."""
    proxy = Proxy(Outgoing(reactor).client)
    url = "http://127.0.0.1:8000"
    assert proxy.url_of(url, b"/v1/run") is proxy.url_of(url, b"/v1/run")


def test_debug_lines_are_skipped_only_where_no_one_sees_them(monkeypatch):
    """debug_enabled() is false only once the console logs above debug."""
    from twisted.logger import LogLevel

    import kcoral.logs

    monkeypatch.setattr(kcoral.logs, "_debug", True)
    monkeypatch.setattr(kcoral.logs.globalLogBeginner, "beginLoggingTo", lambda *a, **k: None)
    assert debug_enabled()  # twistd, tests: nobody said debug events are dropped
    start_console_logging(io.StringIO())
    assert not debug_enabled()
    start_console_logging(io.StringIO(), level=LogLevel.debug)
    assert debug_enabled()


class _Echo(resource.Resource):
    isLeaf = True

    def render_POST(self, request):
        request.setHeader(b"Content-Type", b"application/octet-stream")
        return b"got " + request.content.read()


class Peer:
    """Local HTTP servers, and an L{Outgoing} and a L{Proxy} that reach them."""

    def __init__(self):
        self.outgoing = Outgoing(reactor)
        self.proxy = Proxy(self.outgoing.client)
        self._ports: list = []

    def serve(self, served: resource.Resource, interface: str = "127.0.0.1") -> int:
        """Serve C{served} on an ephemeral port of C{interface}; the port number."""
        self._ports.append(reactor.listenTCP(0, server.Site(served), interface=interface))
        return self._ports[-1].getHost().port

    async def close(self):
        await self.outgoing.close()
        for port in self._ports:
            await port.stopListening()


@pytest_twisted.async_yield_fixture
async def peer():
    peer = Peer()
    yield peer
    await peer.close()


@pytest_twisted.ensureDeferred
async def test_outgoing_posts_through_a_reused_connection(peer):
    """Small and large bodies are posted and answered over one persistent connection."""
    url = f"http://127.0.0.1:{peer.serve(_Echo())}/echo"
    for body in (b"small", b"y" * (INLINE_BODY_BYTES + 10)):
        response = await peer.outgoing.client.post(url, data=body)
        assert response.code == 200
        assert await response.content() == b"got " + body
    # One persistent connection served both.
    assert sum(len(c) for c in peer.outgoing.pool._connections.values()) == 1


@pytest_twisted.ensureDeferred
async def test_treq_reaches_an_ipv6_worker_through_a_run_url(peer):
    """treq posts to a worker on IPv6 loopback through a run URL."""
    try:
        port = peer.serve(_Echo(), "::1")
    except CannotListenError:
        pytest.skip("no IPv6 loopback here")
    url = _RunURL.parse(f"http://[::1]:{port}/v1/run")
    response = await peer.outgoing.client.post(url, data=b"run", allow_redirects=False)
    assert await response.content() == b"got run"


class _Busy(resource.Resource):
    """A worker that turns runs away with 503, with or without a KCoral error."""

    isLeaf = True

    def __init__(self, body: bytes):
        super().__init__()
        self.body = body

    def render_POST(self, request):
        request.setResponseCode(503)
        return self.body


@pytest.mark.parametrize("body, says", [
    (json.dumps({"error": {"type": "server_busy", "message": "the server is draining",
                           "reason": "draining", "request_id": "x"}}).encode(), "503 draining"),
    (b"<html>maintenance</html>", "503 HTTP 503: <html>maintenance</html>"),
])
@pytest_twisted.ensureDeferred
async def test_a_503_from_a_worker_is_not_sent_and_says_why(peer, body, says):
    """A worker's 503 is NotSent, saying its reason or the start of its body."""
    url = f"http://127.0.0.1:{peer.serve(_Busy(body))}"
    with pytest.raises(NotSent) as caught:
        await peer.proxy.forward(url, RUN_CALL, MemoryBody(b"run"))
    assert str(caught.value) == f"{url} turned it away with {says}"


class _Cookies(resource.Resource):
    """Sets a cookie, and answers with the Cookie header it was sent."""

    isLeaf = True

    def render_POST(self, request):
        request.addCookie(b"session", b"x", path=b"/")
        return request.getHeader(b"Cookie") or b"none"


@pytest_twisted.ensureDeferred
async def test_outgoing_keeps_no_cookies(peer):
    """A Set-Cookie from one worker is never replayed, to it or to another."""
    url = f"http://127.0.0.1:{peer.serve(_Cookies())}/v1/run"
    seen = []
    for _ in range(2):
        response = await peer.outgoing.client.post(url, data=b"run")
        assert response.headers.getRawHeaders(b"Set-Cookie") == [b"session=x; Path=/"]
        seen.append(await response.content())
    assert seen == [b"none", b"none"]
    assert list(peer.outgoing.client._cookiejar) == []


@pytest_twisted.ensureDeferred
async def test_a_run_whose_client_left_is_not_sent_again(peer):
    """A client leaves while its run waits at a worker: the Router closes its
    request to the worker, and sends the run nowhere else for nobody."""
    from kcoral.common.report import parse_report
    from kcoral.router.service import RouterConfig, build_router

    worker = FakeWorker(hold=True)
    worker_url = f"http://127.0.0.1:{peer.serve(worker)}"
    app, site = build_router(RouterConfig(recovery_threshold=1), reactor)
    try:
        app.pool.report("held", parse_report({
            "session": "s", "gpu_target": "cpu", "runtime": {}, "workers": [
                {"name": "worker0", "url": worker_url, "healthy": True, "capacity": 4}]}))
        app.pool.observe()
        router_port = peer.serve(AsKCoralSite(site.resource))
        client = HTTPConnectionPool(reactor, persistent=False)
        leaving = treq.post(f"http://127.0.0.1:{router_port}/v1/run", data=b"run", pool=client)
        leaving.addErrback(lambda _: None)

        await until(lambda: worker.runs, "the run at the worker", 10)
        leaving.cancel()
        # The Router closed its request to the worker and released the lease,
        # all in the turn that saw the client go; a second forward would have
        # happened in that turn too.
        await until(lambda: worker.lost, "the worker's request closed", 10)
        await until(lambda: app.pool.active() == 0, "the lease released", 10)
        assert len(worker.runs) == 1 and worker.lost == worker.runs
        assert len(app.scheduler.queue) == 0
    finally:
        await app.outgoing.close()
