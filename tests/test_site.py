"""
The pieces of L{kcoral.web.site.KCoralSite}, each on its own and on fakes
(C{StringTransport}, C{Clock}): the body bounds, the connection cap and
close, the channel's refusal and graceful close, the JSON 400 wrapper, and
the Site that composes them. Hostile clients against the whole Site are in
L{tests.test_hostile}.
"""

from __future__ import annotations

import gc
import select
import socket
import ssl

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.internet.threads import deferToThread
from twisted.logger import Logger, formatEvent
from twisted.python.failure import Failure
from twisted.web.resource import Resource

from kcoral.errors import PayloadTooLarge, RequestTimeout
from kcoral.web.badrequest import TWISTED_BAD_REQUEST, JSONBadRequest
from kcoral.web.bounds import BODY_GRACE_SECONDS, MIN_BODY_BYTES_PER_SECOND, BodyBounds
from kcoral.web.channel import LINGER_SECONDS, KCoralChannel
from kcoral.web.connections import Connections, Refused
from kcoral.web.endpoint import tls_options
from kcoral.web.request import KCoralRequest
from tests.httputil import connect, fake_site, parse_raw
from tests.tlsutil import TestCA


class Lines:
    """A Logger whose events are kept as formatted lines."""

    def __init__(self):
        self.lines: list[str] = []
        self.log = Logger(observer=lambda event: self.lines.append(formatEvent(event)))


def at_the_cap(open_: int) -> str:
    """The line a site logs when it starts refusing connections."""
    return f"{open_} connections are open, the most this service takes: closing new ones until some close"


class FakeChannel:
    """What L{Connections} asks of a channel: to close when idle, and its transport."""

    def __init__(self):
        self.transport = StringTransport()
        self.asked_to_close = False

    def close_when_idle(self):
        self.asked_to_close = True


# -- BodyBounds ---------------------------------------------------------------------------------

def test_a_request_answered_leaves_nothing_for_the_collector():
    """Requests answered one after another on a connection, their bodies in
    memory, leave no garbage that only the cycle collector frees: a request
    and its body's intake do not hold each other (a service under load would
    otherwise run the collector several times as often, and stall on it)."""
    site = fake_site(Clock())
    channel, transport = connect(site)
    request = b"POST /v1/run HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    channel.dataReceived(request)
    gc.collect()
    for _ in range(20):
        channel.dataReceived(request)
    assert transport.value().count(b"HTTP/1.1 200 OK") == 21
    assert gc.collect() == 0


def test_a_length_past_the_limit_is_refused_before_the_body_is_read():
    """A Content-Length over max_bytes is a 413 naming both; one at the limit, or none, is not."""
    bounds = BodyBounds(1000)
    error = bounds.refuse_length(1001)
    assert isinstance(error, PayloadTooLarge)
    assert error.message == "request body of 1001 bytes exceeds the limit of 1000 bytes"
    assert bounds.refuse_length(1000) is None and bounds.refuse_length(None) is None


def test_received_bytes_past_the_limit_are_refused():
    """More bytes received than max_bytes is a 413, whatever the rate."""
    bounds = BodyBounds(1000)
    error = bounds.refuse_received(1001, 0.0)
    assert isinstance(error, PayloadTooLarge)
    assert error.message == "request body exceeds the limit of 1000 bytes"
    assert bounds.refuse_received(1000, 0.0) is None


def test_the_rate_is_held_only_once_the_grace_has_passed():
    """Under the least rate, a body is refused with a 408 only after the grace."""
    bounds = BodyBounds(1 << 30)
    assert bounds.refuse_received(1, BODY_GRACE_SECONDS) is None
    error = bounds.refuse_received(100, 20.0)
    assert isinstance(error, RequestTimeout)
    assert error.message == ("request body arrives at 5 bytes/s, "
                             f"under the least of {MIN_BODY_BYTES_PER_SECOND}")
    assert bounds.refuse_received(MIN_BODY_BYTES_PER_SECOND * 20, 20.0) is None


# -- Connections --------------------------------------------------------------------------------

def test_no_limit_admits_every_connection():
    """Without a limit every connection is admitted."""
    connections = Connections(Clock(), Logger())
    for _ in range(100):
        connections.add(FakeChannel())
    assert connections.admit()


def test_at_the_limit_connections_are_refused_and_said_so_once():
    """At the limit admit() is false, and only the first refusal is logged, with the open count."""
    logged = Lines()
    connections = Connections(Clock(), logged.log, 2)
    assert connections.admit()
    connections.add(FakeChannel())
    assert connections.admit() and logged.lines == []
    connections.add(FakeChannel())
    assert not connections.admit() and not connections.admit()
    assert logged.lines == [at_the_cap(2)]


def test_a_close_below_the_limit_says_taking_again_once():
    """The first close below the limit after refusals logs how many were refused, once."""
    logged = Lines()
    connections = Connections(Clock(), logged.log, 2)
    channels = [FakeChannel(), FakeChannel()]
    for channel in channels:
        connections.add(channel)
    for _ in range(3):
        connections.admit()
    connections.discard(channels[0])
    connections.discard(channels[1])
    assert logged.lines[1:] == ["taking connections again; 3 were closed at the limit"]


def test_a_callable_limit_is_read_at_each_connection():
    """A callable limit is asked anew each time, so the cap follows it."""
    limit = [1]
    connections = Connections(Clock(), Logger(), lambda: limit[0])
    connections.add(FakeChannel())
    assert connections.limit == 1 and not connections.admit()
    limit[0] = 5
    assert connections.limit == 5 and connections.admit()


def test_closing_no_connections_fires_at_once():
    """close() with no connection open has fired already, and sets no timer."""
    clock = Clock()
    fired: list = []
    Connections(clock, Logger()).close(10.0).addCallback(fired.append)
    assert fired == [None] and clock.getDelayedCalls() == []


def test_closing_asks_each_connection_and_fires_when_the_last_is_gone():
    """close() asks every channel to close when idle and fires, its timer cancelled, at the last."""
    clock = Clock()
    connections = Connections(clock, Logger())
    channels = [FakeChannel(), FakeChannel()]
    for channel in channels:
        connections.add(channel)
    fired: list = []
    connections.close(10.0).addCallback(fired.append)
    assert all(channel.asked_to_close for channel in channels)
    connections.discard(channels[0])
    assert fired == []
    connections.discard(channels[1])
    assert fired == [None] and clock.getDelayedCalls() == []


def test_closing_aborts_the_connections_still_open_at_the_timeout():
    """Connections still open C{timeout} seconds after close() are aborted."""
    clock = Clock()
    connections = Connections(clock, Logger())
    channel = FakeChannel()
    connections.add(channel)
    connections.close(10.0)
    clock.advance(9.9)
    assert not channel.transport.disconnected
    clock.advance(0.1)
    assert channel.transport.disconnected


def test_a_refused_connection_is_aborted_as_soon_as_it_is_made():
    """Refused aborts its transport (a TLS wrapper would leave a bare close open)."""
    transport = StringTransport()
    Refused().makeConnection(transport)
    assert transport.disconnected and transport.value() == b""


# -- KCoralChannel ------------------------------------------------------------------------------

def test_a_refusal_is_answered_then_what_follows_discarded_until_the_linger_ends():
    """refuse() writes its answer, closes the writing side, reads nothing more, aborts after the linger."""
    clock = Clock()
    wrapper, transport = connect(fake_site(clock))
    channel = wrapper.wrappedProtocol
    channel.refuse(b"the answer")
    wrapper.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert transport.value() == b"the answer" and transport.disconnecting
    clock.advance(LINGER_SECONDS - 0.1)
    assert not transport.disconnected
    clock.advance(0.1)
    assert transport.disconnected


def test_an_idle_connection_closes_at_once_when_asked():
    """close_when_idle() closes a connection with no request in progress now."""
    wrapper, transport = connect(fake_site(Clock()))
    wrapper.wrappedProtocol.close_when_idle()
    assert transport.disconnecting


def test_a_busy_connection_closes_only_after_its_answer():
    """close_when_idle() lets the request in progress finish, then closes."""
    wrapper, transport = connect(fake_site(Clock()))
    wrapper.dataReceived(b"POST /v1/run HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nabc")
    wrapper.wrappedProtocol.close_when_idle()
    assert not transport.disconnecting
    wrapper.dataReceived(b"def")
    assert transport.value().endswith(b"got 6") and transport.disconnecting


def test_a_lost_connection_leaves_the_site_and_its_timers():
    """A lost connection is no longer among the site's channels, and leaves no timer behind."""
    clock = Clock()
    site = fake_site(clock, header_timeout=10.0)
    wrapper, _ = connect(site)
    channel = wrapper.wrappedProtocol
    assert site.channels == {channel}
    channel.refuse(b"no")
    wrapper.connectionLost(Failure(ConnectionDone()))
    assert site.channels == set() and clock.getDelayedCalls() == []


# -- JSONBadRequest -----------------------------------------------------------------------------

def test_the_json_400_before_any_request_has_a_fresh_id_and_is_counted():
    """Twisted's bare 400 with no request yet becomes a JSON 400 with a new id, counted as 'other'."""
    site = fake_site(Clock())
    wrapper, transport = connect(site)
    wrapper.write(TWISTED_BAD_REQUEST)
    status, headers, body = parse_raw(transport.value())
    assert status == 400 and len(headers["x-request-id"]) == 32
    assert b'"bad_request"' in body
    assert site.metrics.registry.get_sample_value(
        "kcoral_http_requests_total", {"route": "other", "code": "400"}) == 1


# -- KCoralSite ---------------------------------------------------------------------------------

def test_the_site_wraps_each_channel_once():
    """Each connection is a KCoralChannel under one JSONBadRequest, no other wrapper."""
    wrapper = fake_site(Clock()).buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    assert type(wrapper) is JSONBadRequest and type(wrapper.wrappedProtocol) is KCoralChannel


def test_past_its_cap_the_site_builds_refused_connections():
    """With max_connections open, the site builds a Refused protocol for the next one."""
    logged = Lines()
    site = fake_site(Clock(), max_connections=1, log=logged.log)
    connect(site)
    assert isinstance(site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40001)), Refused)
    assert logged.lines == [at_the_cap(1)]


# -- the order Twisted calls KCoralRequest's overrides in ---------------------------------------

class Traced(KCoralRequest):
    """A KCoral request that notes each call Twisted makes into its
    overrides, with what it relies on being there at that moment."""

    calls: list[tuple] = []

    def gotLength(self, length):
        self.calls.append(("gotLength", length, self.getHeader(b"X-Probe")))
        super().gotLength(length)

    def handleContentChunk(self, data):
        self.calls.append(("handleContentChunk", len(data)))
        super().handleContentChunk(data)

    def requestReceived(self, command, path, version):
        self.calls.append(("requestReceived", path))
        super().requestReceived(command, path, version)

    def process(self):
        self.calls.append(("process", self.uri))
        super().process()

    def render(self, resrc):
        self.calls.append(("render",))
        super().render(resrc)

    def finish(self):
        self.calls.append(("finish",))
        return super().finish()

    def connectionLost(self, reason):
        self.calls.append(("connectionLost",))
        super().connectionLost(reason)


def traced(**site_options):
    """A site of L{Traced} requests, one connection to it, and the calls noted."""
    site = fake_site(Clock(), **site_options)
    site.requestFactory = Traced
    Traced.calls = []
    channel, transport = connect(site)
    return channel, transport, Traced.calls


def test_twisted_calls_the_overrides_in_the_order_they_rely_on():
    """The head whole (every header, its length) before gotLength; each chunk after it; then
    requestReceived with the raw target, which process, render and finish follow."""
    channel, transport, calls = traced()
    channel.dataReceived(b"POST /v1/ru%6E HTTP/1.1\r\nHost: x\r\nX-Probe: seen\r\n"
                         b"Content-Length: 6\r\n\r\nabc")
    assert calls == [("gotLength", 6, b"seen"), ("handleContentChunk", 3)]
    channel.dataReceived(b"def")
    # Twisted hands on the target as sent: the request parses its canonical one instead.
    assert calls[2:] == [("handleContentChunk", 3), ("requestReceived", b"/v1/ru%6E"),
                         ("process", b"/v1/run"), ("render",), ("finish",)]
    assert transport.value().endswith(b"got 6")


def test_a_chunked_body_has_no_length_and_arrives_decoded():
    """gotLength(None) for a chunked body, whose chunks come decoded, before requestReceived."""
    channel, _, calls = traced()
    channel.dataReceived(b"POST /v1/run HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"3\r\nabc\r\n0\r\n\r\n")
    assert [c[:2] for c in calls[:3]] == [("gotLength", None), ("handleContentChunk", 3),
                                           ("requestReceived", b"/v1/run")]


def test_100_continue_is_sent_only_once_gotLength_has_returned():
    """Twisted answers Expect: 100-continue after gotLength, so a refusal there can withdraw it."""
    channel, transport, calls = traced(max_request_bytes=10)
    head = b"POST /v1/run HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
    channel.dataReceived(head % 6)
    assert calls[0][0] == "gotLength" and transport.value() == b"HTTP/1.1 100 Continue\r\n\r\n"
    channel, transport, calls = traced(max_request_bytes=10)
    channel.dataReceived(head % 11)
    assert b"100 Continue" not in transport.value() and parse_raw(transport.value())[0] == 413


def test_a_client_gone_mid_body_is_told_to_the_request():
    """A connection lost while a body arrives reaches the request's connectionLost, never requestReceived."""
    channel, _, calls = traced()
    channel.dataReceived(b"POST /v1/run HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nabc")
    channel.connectionLost(Failure(ConnectionDone()))
    assert [c[0] for c in calls] == ["gotLength", "handleContentChunk", "connectionLost"]


@pytest_twisted.ensureDeferred
async def test_a_tls_connection_closed_for_its_header_deadline_says_so_at_once(tmp_path):
    """Over TLS, an idle connection past its head deadline gets its close alert at once."""
    issued = TestCA(tmp_path).issue("site")
    port = reactor.listenSSL(0, fake_site(reactor, header_timeout=0.5),
                             tls_options(issued.cert, issued.key), interface="127.0.0.1")
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))

    def ask_then_wait() -> bytes | None:
        """Answered once, then what the idle connection gets within 5 s (None: nothing)."""
        with socket.create_connection(("127.0.0.1", port.getHost().port), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname="localhost") as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            answer = b""
            while not answer.endswith(b"hello"):
                answer += conn.recv(4096)
            readable, _, _ = select.select([conn], [], [], 5.0)
            return conn.recv(4096) if readable else None

    try:
        assert await deferToThread(ask_then_wait) == b""  # the close alert: the end of the stream
    finally:
        await port.stopListening()


class TakesItsBody(Resource):
    """Answers C{ok}, keeping what C{take} made of each request (its body
    taken as a handler takes it)."""

    isLeaf = True

    def __init__(self, take):
        super().__init__()
        self.take = take
        self.taken: list = []

    def render(self, request):
        self.taken.append(self.take(request))
        return b"ok"


def _posted_hello(take) -> tuple[object, bytes]:
    """What C{take} made of a POST of 5 bytes, and what the site answered."""
    resource = TakesItsBody(take)
    channel, transport = connect(fake_site(Clock(), resource=resource))
    channel.dataReceived(b"POST /v1/run HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello")
    [taken] = resource.taken
    return taken, transport.value()


def _read(request) -> tuple[memoryview, object]:
    read: list = []
    request.body.read().addCallback(read.append)
    return read[0], request.content


def test_a_body_in_memory_is_read_as_a_view_of_the_content():
    """A body kept in memory is what request.body reads, with no copy: a view
    of the request's content."""
    (view, content), answer = _posted_hello(_read)
    assert bytes(view) == b"hello"
    content.getbuffer()[0:1] = b"j"  # the same memory
    assert bytes(view) == b"jello"
    assert parse_raw(answer)[0] == 200


def test_a_body_in_memory_is_sent_as_its_contents_own_bytes():
    """A body kept in memory is sent (by a Router, on each try) as the bytes
    its content holds: the same object every time, not a copy each."""
    (first, again), answer = _posted_hello(lambda request: (request.body.send(),
                                                             request.body.send()))
    assert first == b"hello" and again is first
    assert parse_raw(answer)[0] == 200
