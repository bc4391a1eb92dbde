"""
Twisted's behaviour that KCoral relies on beyond its documented API
(L{kcoral.web.seams}): one contract test per seam, each named in the seam's
docstring, each exercising Twisted alone (its own channel, request and site
over a C{StringTransport}, or its own TCP connection), so that a Twisted
release breaking a seam fails here, naming it.
"""

from __future__ import annotations

import socket
from typing import Any

import attrs
import pytest
import pytest_twisted
from twisted.internet import protocol, reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IPushProducer
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web import http, server
from twisted.web.resource import Resource
from zope.interface import implementer

from kcoral.web.seams import (
    BAD_REQUEST,
    close_after_requests,
    drop_input,
    io_size,
    requests_of,
    send_buffered,
    send_some,
    set_io_size,
    tcp_connection,
    unhindered,
    withhold_continue,
)
from tests.httputil import NOTHING_SECONDS, Listener, Pulling, readable


class Held(Resource):
    """Answers nothing until told: keeps each request it renders."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.requests: list[server.Request] = []

    def render(self, request):
        self.requests.append(request)
        return server.NOT_DONE_YET


class Seen(Resource):
    """Answers C{ok}, keeping whether a Server header was set by then."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.server_header: list[bool] = []

    def render(self, request):
        self.server_header.append(request.responseHeaders.hasHeader(b"Server"))
        return b"ok"


def channel_of(site: server.Site, transport: StringTransport | None = None):
    """A connection to Twisted's own C{site}: (channel, transport)."""
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    transport = transport or StringTransport()
    channel.makeConnection(transport)
    return channel, transport


def site_of(resource=None, request_factory=None, channel=http.HTTPChannel) -> server.Site:
    """Twisted's site of C{resource}, building C{channel}s (HTTP/1.1 itself,
    as KCoral's site does, not the wrapper that picks HTTP/2 by TLS)."""
    site = server.Site(resource or Seen())
    if request_factory is not None:
        site.requestFactory = request_factory
    site.protocol = channel
    return site


@pytest.mark.parametrize("head", [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/1.1\r\nNo colon here\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
    b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 600 + b"\r\n",
])
def test_malformed_http_is_answered_with_BAD_REQUEST(head):
    """HTTP Twisted cannot parse is answered with exactly BAD_REQUEST, then closed."""
    channel, transport = channel_of(site_of())
    channel.dataReceived(head)
    assert transport.value() == BAD_REQUEST
    assert transport.disconnecting


def test_requests_of_lists_those_in_progress():
    """A request is in requests_of from its request line until it is finished,
    and is the last one while its head is parsed (when Twisted answers BAD_REQUEST)."""
    written: list[tuple[bytes, list]] = []

    class Watching(StringTransport):
        def write(self, data):
            written.append((data, list(requests_of(channel))))
            super().write(data)

    resource = Held()
    channel, transport = channel_of(site_of(resource), Watching())
    channel.dataReceived(b"GET /a HTTP/1.1\r\n")
    assert len(requests_of(channel)) == 1
    channel.dataReceived(b"\r\n")
    [request] = resource.requests
    assert requests_of(channel) == [request]
    request.finish()
    assert requests_of(channel) == []
    channel.dataReceived(b"GET /b HTTP/1.1\r\nNo colon\r\n\r\n")
    data, then = written[-1]
    assert data == BAD_REQUEST
    assert len(then) == 1 and then[0] is not request


def test_drop_input_drops_the_rest():
    """Once drop_input runs from gotLength, neither the rest of the read in
    which the head ended nor any later read reaches the request."""
    chunks: list[bytes] = []
    received: list[bytes] = []

    class Dropping(server.Request):
        def gotLength(self, length):
            super().gotLength(length)
            drop_input(self.channel)

        def handleContentChunk(self, data):
            chunks.append(data)

        def requestReceived(self, command, path, version):
            received.append(path)

    channel, _ = channel_of(site_of(request_factory=Dropping))
    channel.dataReceived(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nhello")
    channel.dataReceived(b"world")
    channel.dataReceived(b"GET / HTTP/1.1\r\n\r\n")
    assert chunks == [] and received == []


@pytest.mark.parametrize("withheld", [False, True])
def test_withhold_continue_from_gotLength(withheld):
    """Twisted answers Expect: 100-continue after gotLength returns, reading the
    header then: withheld there, no 100 is sent."""

    class Expecting(server.Request):
        def gotLength(self, length):
            super().gotLength(length)
            if withheld:
                withhold_continue(self.requestHeaders)

    channel, transport = channel_of(site_of(request_factory=Expecting))
    channel.dataReceived(b"POST / HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    assert (b"100 Continue" in transport.value()) is not withheld


def test_close_after_requests():
    """After close_after_requests, the connection closes once the request in
    progress is finished, and a request pipelined behind it is not answered."""
    resource = Held()
    channel, transport = channel_of(site_of(resource))
    channel.dataReceived(b"GET /a HTTP/1.1\r\n\r\n")
    close_after_requests(channel)
    channel.dataReceived(b"GET /b HTTP/1.1\r\n\r\n")
    [request] = resource.requests
    request.write(b"a")
    request.finish()
    assert transport.disconnecting
    assert len(resource.requests) == 1


def test_head_lines_come_request_line_first():
    """lineReceived gets each line of the head, the request line first, and
    none of the body."""
    lines: list[bytes] = []

    class Lines(http.HTTPChannel):
        def lineReceived(self, line):
            lines.append(line)
            super().lineReceived(line)

    channel, _ = channel_of(site_of(channel=Lines))
    channel.dataReceived(b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 6\r\n\r\nbody\r\n")
    assert lines == [b"POST /x HTTP/1.1", b"Host: h", b"Content-Length: 6", b""]


def test_gotLength_comes_with_the_head():
    """gotLength is called with the announced length (None: chunked) before
    any of the body is handed on, and what it writes precedes all else."""
    calls: list[object] = []

    class Early(server.Request):
        def gotLength(self, length):
            calls.append(("length", length))
            self.channel.transport.write(b"EARLY")
            super().gotLength(length)

        def handleContentChunk(self, data):
            calls.append(("chunk", data))
            super().handleContentChunk(data)

    channel, transport = channel_of(site_of(request_factory=Early))
    channel.dataReceived(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello")
    channel.dataReceived(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n")
    assert calls == [("length", 5), ("chunk", b"hello"), ("length", None), ("chunk", b"hi")]
    assert transport.value().startswith(b"EARLY")


def test_requestReceived_gets_the_raw_target():
    """requestReceived is handed the target as the request line spelled it."""
    targets: list[bytes] = []

    class Raw(server.Request):
        def requestReceived(self, command, path, version):
            targets.append(path)
            super().requestReceived(command, path, version)

    channel, _ = channel_of(site_of(request_factory=Raw))
    channel.dataReceived(b"GET /a/%2e%2e//b?x=1 HTTP/1.1\r\n\r\n")
    assert targets == [b"/a/%2e%2e//b?x=1"]


def test_an_overlong_head_line_is_lineLengthExceeded():
    """A head line past MAX_LENGTH calls lineLengthExceeded, and Twisted then
    closes the connection without writing a byte."""
    exceeded: list[int] = []

    class Exceeding(http.HTTPChannel):
        def lineLengthExceeded(self, line):
            exceeded.append(len(line))
            return super().lineLengthExceeded(line)

    channel, transport = channel_of(site_of(channel=Exceeding))
    channel.dataReceived(b"GET /" + b"a" * channel.MAX_LENGTH + b" HTTP/1.1\r\n\r\n")
    assert exceeded and exceeded[0] > channel.MAX_LENGTH
    assert transport.value() == b""
    assert transport.disconnecting


def test_process_names_the_server_before_render():
    """Request.process sets a Server header before it calls render."""
    resource = Seen()
    channel, transport = channel_of(site_of(resource))
    channel.dataReceived(b"GET / HTTP/1.1\r\n\r\n")
    assert resource.server_header == [True]
    assert b"\r\nServer: " in transport.value()


def test_a_lost_request_has_no_channel():
    """A request in progress whose connection is lost has C{channel} None."""
    resource = Held()
    channel, _ = channel_of(site_of(resource))
    channel.dataReceived(b"GET / HTTP/1.1\r\n\r\n")
    channel.connectionLost(Failure(ConnectionDone()))
    [request] = resource.requests
    assert request.channel is None


class Reads(protocol.Protocol):
    """Keeps the size of each read; C{enough} fires once C{wanted} bytes came."""

    def __init__(self):
        self.sizes: list[int] = []
        self.wanted = 0
        self.enough: Deferred[None] = Deferred()

    def dataReceived(self, data):
        self.sizes.append(len(data))
        if sum(self.sizes) >= self.wanted and not self.enough.called:
            self.enough.callback(None)


@attrs.frozen
class TCP:
    """A real TCP connection: the reactor's side (C{transport}, read by
    C{reads}) and its plain socket C{peer}."""

    transport: Any
    reads: Reads
    peer: socket.socket


@pytest_twisted.async_yield_fixture
async def tcp():
    listener = Listener()
    reads = Reads()
    try:
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", listener.port)
        await endpoint.connect(protocol.Factory.forProtocol(lambda: reads))
        connection = TCP(reads.transport, reads, listener.accept())
        yield connection
        connection.transport.loseConnection()
        connection.peer.close()
    finally:
        listener.close()


def test_tcp_connection_is_a_descriptor(tcp):
    """A TCP transport is a descriptor the seams reach; a test's transport is not."""
    assert tcp_connection(tcp.transport) is tcp.transport
    assert tcp_connection(StringTransport()) is None


def test_send_some_sends_at_once(tcp):
    """send_some puts data on the wire before the reactor's turn, and says how much."""
    assert send_some(tcp_connection(tcp.transport), b"hello") == 5
    assert readable(tcp.peer, 5.0) == b"hello"


def test_send_buffered_sends_what_write_kept(tcp):
    """What write() keeps for the reactor's turn, send_buffered sends now."""
    tcp.transport.write(b"kept")
    assert readable(tcp.peer, NOTHING_SECONDS) == b""
    send_buffered(tcp_connection(tcp.transport))
    assert readable(tcp.peer, 5.0) == b"kept"


@pytest_twisted.ensureDeferred
async def test_set_io_size_reads_and_sends_that_much(tcp):
    """After set_io_size, each read and each send is at most that many bytes."""
    connection = tcp_connection(tcp.transport)
    set_io_size(connection, 7)
    assert io_size(connection) == 7
    assert send_some(connection, b"x" * 100) == 7
    tcp.reads.wanted = 100
    tcp.peer.sendall(b"y" * 100)
    await tcp.reads.enough
    assert max(tcp.reads.sizes) <= 7


@implementer(IPushProducer)
class Pushing(Pulling):
    """A streaming producer that does nothing when told."""

    def pauseProducing(self):
        pass


def test_unhindered_follows_the_producer(tcp):
    """unhindered: no producer, or a streaming one the transport has not
    paused; not once the transport pauses it (its buffer past io_size), nor
    with a pull producer."""
    transport = tcp.transport
    connection = tcp_connection(transport)
    assert unhindered(connection)
    transport.registerProducer(Pushing(), True)
    assert unhindered(connection)
    set_io_size(connection, 10)
    transport.write(b"z" * 100)
    assert not unhindered(connection)
    transport.unregisterProducer()
    transport.registerProducer(Pulling(), False)
    assert not unhindered(connection)
    transport.unregisterProducer()
