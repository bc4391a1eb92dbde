"""
Silent peers: TCP keepalive (L{kcoral.common.keepalive}) on every
connection between hosts (the services' listening sites, their outgoing
pool, and the blocking client's connection; each read back from the real
socket's options), and the blocking client facing a Router host gone silent
(test hosts of C{bench.support.hosts}).
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import succeed
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python import usage
from twisted.web import server

from bench.support import hosts
from kcoral.client.connection import Connection
from kcoral.common.keepalive import DEFAULT_KEEPALIVE, MOST_COUNT, MOST_SECONDS, Keepalive
from kcoral.inference.h2front import GrpcFront
from kcoral.taps import router as router_tap
from kcoral.web.outgoing import KeepaliveEndpoint, Outgoing
from tests.httputil import Hello, fake_site

SHORT = Keepalive(idle_seconds=3, interval_seconds=1, count=2)


def probes(sock: socket.socket) -> tuple[int, int, int, int]:
    """(SO_KEEPALIVE, idle, interval, count) as the kernel holds them for C{sock}."""
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT))


def test_the_bound_is_idle_plus_each_probe():
    """A silent peer is noticed after the idle time and every unanswered probe: 16 s by default."""
    assert SHORT.bound == 5
    assert DEFAULT_KEEPALIVE.bound == 16


def test_apply_sets_the_kernels_probes():
    """apply() turns keepalive on with the idle time, interval and count the kernel then holds."""
    with socket.socket() as sock:
        SHORT.apply(sock)
        assert probes(sock) == (1, 3, 1, 2)


class _Layer:
    """A protocol layer as a transport (a TLS one, say): no socket of its own."""

    def __init__(self, transport, handle=None):
        self.transport = transport
        self._handle = handle

    def getHandle(self):
        return self._handle


def test_apply_to_finds_the_socket_under_other_layers():
    """The TCP socket under layers that hold none (a TLS connection's) is the one probed."""
    with socket.socket() as sock:
        class TCP:
            def getHandle(self):
                return sock

        assert SHORT.apply_to(_Layer(_Layer(TCP(), handle=object())))
        assert probes(sock)[0] == 1


def test_apply_to_leaves_what_is_not_tcp():
    """A UNIX socket, or a transport with no socket at all, is left as it is."""
    with socket.socket(socket.AF_UNIX) as unix:
        assert not SHORT.apply_to(_Layer(None, handle=unix))
    assert not SHORT.apply_to(object())
    assert not SHORT.apply_to(None)


def test_the_endpoint_probes_each_connection_it_makes():
    """KeepaliveEndpoint hands back the protocol its endpoint made, its socket probed."""
    with socket.socket() as sock:
        protocol = Protocol()
        protocol.transport = _Layer(None, handle=sock)

        class Made:
            def connect(self, factory):
                return succeed(protocol)

        connected = []
        KeepaliveEndpoint(Made(), SHORT).connect(Factory()).addCallback(connected.append)
        assert connected == [protocol]
        assert probes(sock) == (1, 3, 1, 2)


def test_a_sites_connection_is_probed():
    """Each connection a KCoralSite accepts is probed with the site's keepalive."""
    site = fake_site(Clock(), keepalive=SHORT)
    with socket.socket() as sock:
        channel = site.buildProtocol(None)
        channel.makeConnection(_Layer(None, handle=sock))
        assert probes(sock) == (1, 3, 1, 2)
        channel.connectionLost(None)


def test_a_grpc_fronts_connection_is_probed():
    """Each connection a gRPC front accepts is probed with the default keepalive."""
    grpc_front = GrpcFront(None, reactor=Clock())
    with socket.socket() as sock:
        transport = StringTransport()
        transport.getHandle = lambda: sock  # type: ignore[attr-defined]
        connection = grpc_front.factory().buildProtocol(None)
        connection.makeConnection(transport)
        assert probes(sock) == (1, 10, 2, 3)
        connection.connectionLost(None)


def test_the_blocking_clients_connection_is_probed():
    """The blocking client's connection to a Router is probed with the default keepalive."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        conn = Connection("127.0.0.1", listener.getsockname()[1], timeout=5)
        try:
            assert probes(conn.sock) == (1, 10, 2, 3)
        finally:
            conn.close()


@pytest_twisted.ensureDeferred
async def test_outgoing_connections_are_probed():
    """A real connection of the outgoing pool (a Router's to a worker) carries the kernel's probes."""
    port = reactor.listenTCP(0, server.Site(Hello()), interface="127.0.0.1")
    outgoing = Outgoing(reactor, keepalive=SHORT)
    try:
        response = await outgoing.client.get(f"http://127.0.0.1:{port.getHost().port}/")
        assert await response.content() == b"hello"
        # Answered, the connection waits in the pool for the next request.
        [connection] = [c for kept in outgoing.pool._connections.values() for c in kept]
        assert probes(connection.transport.getHandle()) == (1, 3, 1, 2)
    finally:
        await outgoing.close()
        await port.stopListening()


@pytest.mark.slow
def test_a_client_whose_router_went_silent_gets_a_node_failure():
    """A Router whose link goes silent mid-request is a NodeFailure within the keepalive bound, not a hang."""
    from kcoral import Client
    from kcoral.errors import NodeFailure

    with hosts.Hosts(["client", "router"]) as h:
        with h.entered("router"):
            listener = socket.create_server((h.address("router"), 9000))
        accepted: list[socket.socket] = []
        with listener:
            waiter = threading.Thread(target=lambda: accepted.append(listener.accept()[0]),
                                      daemon=True)
            waiter.start()
            with h.entered("client"):
                client = Client(f"http://{h.address('router')}:9000", busy_timeout=1.0)
            outcome: list[BaseException] = []

            def ask():
                try:
                    client.health()
                except BaseException as e:
                    outcome.append(e)

            asking = threading.Thread(target=ask, daemon=True)
            with h.entered("client"):
                asking.start()
            waiter.join(10)
            assert accepted, "the request never arrived"
            h.cut("router")
            started = time.monotonic()
            asking.join(DEFAULT_KEEPALIVE.bound + 15)
            took = time.monotonic() - started
            client.close()
            accepted[0].close()
    assert outcome and isinstance(outcome[0], NodeFailure), outcome
    assert "went silent" in outcome[0].message
    assert took <= DEFAULT_KEEPALIVE.bound + 2


class _Health(http.server.BaseHTTPRequestHandler):
    """A Router's /health, as far as a client's health() reads it."""

    def do_GET(self):
        body = json.dumps({"status": "ok"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_client_goes_on_past_a_router_that_answers_no_connection():
    """A Router host that is cut off costs a client its connect_timeout, then the next Router answers."""
    from kcoral import Client

    with hosts.Hosts(["client", "silent", "live"]) as h:
        with h.entered("live"):
            live = http.server.HTTPServer((h.address("live"), 9000), _Health)
        serving = threading.Thread(target=live.serve_forever, daemon=True)
        serving.start()
        try:
            h.cut("silent")
            with h.entered("client"):
                client = Client([f"http://{h.address('silent')}:9000",
                                 f"http://{h.address('live')}:9000"], connect_timeout=1.0)
                started = time.monotonic()
                assert client.health() == {"status": "ok"}
                took = time.monotonic() - started
            client.close()
        finally:
            live.shutdown()
            live.server_close()
    assert 1.0 <= took < 3.0


def test_the_limits_are_the_kernels():
    """The options' largest values are the kernel's: each is taken by a socket, one more is not."""
    with socket.socket() as sock:
        Keepalive(MOST_SECONDS, MOST_SECONDS, MOST_COUNT).apply(sock)
        assert probes(sock) == (1, MOST_SECONDS, MOST_SECONDS, MOST_COUNT)
        for past in (Keepalive(idle_seconds=MOST_SECONDS + 1), Keepalive(interval_seconds=MOST_SECONDS + 1),
                     Keepalive(count=MOST_COUNT + 1)):
            with pytest.raises(OSError):
                past.apply(sock)


@pytest.mark.parametrize("option, most", [("--keepalive-idle-seconds", MOST_SECONDS),
                                          ("--keepalive-interval-seconds", MOST_SECONDS),
                                          ("--keepalive-count", MOST_COUNT)])
def test_the_router_refuses_keepalive_past_the_kernels_limit(option, most):
    """A Router's keepalive option past the kernel's limit is refused as it starts, naming it,
    rather than failing every connection it accepts."""
    options = router_tap.Options()
    options.parseOptions([option, str(most)])
    with pytest.raises(usage.UsageError, match=f"{option}: must be at most {most}"):
        router_tap.Options().parseOptions([option, str(most + 1)])
