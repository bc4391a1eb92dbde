"""
Writes sent at once (L{kcoral.web.sendnow}): over a real TCP connection, a
write through L{SendNow} is on the wire before the reactor's next turn, where
Twisted alone holds it until then; and the wrapper leaves a write to the
reactor wherever sending it at once could reenter a protocol.
"""

from __future__ import annotations

import pytest_twisted
from twisted.internet import protocol, reactor
from twisted.internet.abstract import FileDescriptor
from twisted.internet.address import IPv4Address
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactor, StringTransport

from kcoral.web.sendnow import READ_BYTES, SendNow, SendNowEndpoint, SendNowFactory, together
from tests.httputil import NOTHING_SECONDS, Listener, Pulling, fake_site, readable


async def connected(endpoint) -> protocol.Protocol:
    return await endpoint.connect(protocol.Factory.forProtocol(protocol.Protocol))


@pytest_twisted.ensureDeferred
async def test_a_write_is_sent_before_the_reactors_turn():
    """Through SendNowEndpoint, a write is on the wire as soon as write() returns."""
    listener = Listener()
    try:
        client = await connected(SendNowEndpoint(TCP4ClientEndpoint(reactor, "127.0.0.1", listener.port)))
        peer = listener.accept()
        assert isinstance(client.transport, SendNow)  # the protocol's own, wrapped
        client.transport.write(b"hello")
        client.transport.writeSequence([b" ", b"world"])
        assert readable(peer, 5.0) == b"hello world"
        client.transport.loseConnection()
        peer.close()
    finally:
        listener.close()


@pytest_twisted.ensureDeferred
async def test_without_it_twisted_holds_the_write_until_its_turn():
    """The control: on a plain endpoint the same write waits for the reactor."""
    listener = Listener()
    try:
        client = await connected(TCP4ClientEndpoint(reactor, "127.0.0.1", listener.port))
        peer = listener.accept()
        client.transport.write(b"hello")
        assert readable(peer, NOTHING_SECONDS) == b""
        client.transport.loseConnection()
        peer.close()
    finally:
        listener.close()


class Descriptor(FileDescriptor):
    """A connected descriptor whose socket takes everything: C{sent} is what
    went out, by the real C{doWrite}, and when."""

    connected = 1

    def __init__(self):
        super().__init__(reactor=MemoryReactor())
        self.sent = b""
        #: Each send's bytes, in order.
        self.sends: list[bytes] = []

    def writeSomeData(self, data):
        self.sent += bytes(data)
        self.sends.append(bytes(data))
        return len(data)

    def getPeer(self):
        return IPv4Address("TCP", "127.0.0.1", 40000)

    def getHost(self):
        return IPv4Address("TCP", "127.0.0.1", 8000)


def wrapped(transport) -> SendNow:
    wrapper = SendNowFactory(protocol.Factory.forProtocol(protocol.Protocol)).buildProtocol(None)
    wrapper.makeConnection(transport)
    return wrapper


def test_each_write_is_sent():
    """Every write and write sequence is sent at once, under a running push producer too."""
    transport = Descriptor()
    wrapper = wrapped(transport)
    wrapper.write(b"a")
    wrapper.writeSequence([b"b", b"c"])
    assert transport.sent == b"abc"
    wrapper.registerProducer(protocol.Protocol(), True)
    wrapper.write(b"d")
    assert transport.sent == b"abcd"


def test_a_paused_producer_is_left_to_the_reactor():
    """Sending all could resume a paused producer from inside its own write: left
    to the reactor, and sent once the producer is gone."""
    transport = Descriptor()
    wrapper = wrapped(transport)
    wrapper.registerProducer(protocol.Protocol(), True)
    transport.producerPaused = True
    wrapper.write(b"a")
    assert transport.sent == b""
    wrapper.unregisterProducer()
    assert transport.sent == b"a"


def test_a_pull_producer_is_left_to_the_reactor():
    """A pull producer is asked for more when the transport empties: left to the reactor."""
    transport = Descriptor()
    wrapper = wrapped(transport)
    wrapper.registerProducer(Pulling(), False)
    wrapper.write(b"a")
    assert transport.sent == b""


def test_a_closing_connection_is_left_to_the_reactor():
    """Once closing, the reactor's own turn sends the rest and then closes."""
    transport = Descriptor()
    wrapper = wrapped(transport)
    transport.loseConnection()
    wrapper.write(b"a")
    assert transport.sent == b""


class Lost(Descriptor):
    """A descriptor that, as a TCP connection, has no socket once it is lost."""

    def writeSomeData(self, data):
        if self.disconnected:
            raise AttributeError("'Client' object has no attribute 'socket'")
        return super().writeSomeData(data)


def test_a_write_after_the_connection_was_lost_is_dropped():
    """A layer that writes as the connection is lost (TLS: close_notify) writes nothing, fails nothing."""
    transport = Lost()
    wrapper = wrapped(transport)
    wrapper.registerProducer(protocol.Protocol(), True)
    transport.producerPaused = True
    wrapper.write(b"a")  # from here on every write goes through the transport's buffer
    wrapper.unregisterProducer()
    transport.connectionLost(None)
    wrapper.write(b"alert")
    assert transport.sent == b"a"


class Registering(MemoryReactor):
    """A MemoryReactor that counts the descriptors registered for writing."""

    def __init__(self):
        super().__init__()
        self.registered = 0

    def addWriter(self, writer):
        self.registered += 1
        super().addWriter(writer)


class Filling(Descriptor):
    """A descriptor whose socket takes at most C{room} bytes, then nothing
    until C{room} is raised again."""

    def __init__(self, room: int):
        super().__init__()
        self.reactor = Registering()
        self.room = room

    def writeSomeData(self, data):
        taken = bytes(data)[:self.room]
        self.room -= len(taken)
        return super().writeSomeData(taken) if taken else 0


def test_a_write_the_socket_takes_is_sent_unregistered():
    """A write the socket takes whole leaves in one send, the connection never
    registered with the reactor for writing (a system call each way)."""
    transport = Filling(room=100)
    wrapper = wrapped(transport)
    wrapper.write(b"head")
    wrapper.writeSequence([b"bo", b"dy"])
    assert transport.sends == [b"head", b"body"]
    assert transport.reactor.registered == 0


def test_what_the_socket_cannot_take_waits_and_later_writes_follow_it():
    """The rest of a write the socket took in part waits in the transport's buffer,
    for the reactor's turn; every later write leaves after it, in order."""
    transport = Filling(room=3)
    wrapper = wrapped(transport)
    wrapper.write(b"abcdef")
    assert transport.sent == b"abc" and transport.reactor.registered == 1
    wrapper.write(b"gh")
    assert transport.sent == b"abc"
    transport.room = 100
    transport.doWrite()
    assert transport.sent == b"abcdefgh"


def test_another_transport_is_written_as_before():
    """A transport that is no write descriptor (a TLS layer, a test's) is only written."""
    transport = StringTransport()
    wrapped(transport).write(b"a")
    assert transport.value() == b"a"


def test_a_connection_reads_large_only_once_it_carries_large_data():
    """A connection reads and sends Twisted's sizes until a read fills them (or a write
    exceeds them); from then on READ_BYTES at a time."""
    transport = Descriptor()
    default = transport.bufferSize
    wrapper = wrapped(transport)
    wrapper.dataReceived(b"GET /health HTTP/1.1\r\n\r\n")
    wrapper.write(b"x" * 1000)
    assert transport.bufferSize == default < READ_BYTES
    wrapper.dataReceived(b"b" * default)
    assert transport.bufferSize == transport.SEND_LIMIT == READ_BYTES
    other = Descriptor()
    wrapped(other).write(b"y" * default)
    assert other.bufferSize == other.SEND_LIMIT == READ_BYTES


def test_writes_together_leave_in_one_send():
    """The writes of a together() block leave as it ends, none before: one send a connection."""
    transport = Descriptor()
    wrapper = wrapped(transport)
    other = Descriptor()
    second = wrapped(other)
    with together():
        wrapper.writeSequence([b"HTTP/1.1 200 OK\r\n", b"\r\n"])
        with together():
            wrapper.write(b"he")
            second.write(b"x")
        wrapper.write(b"ad and body")
        assert transport.sends == other.sends == []
    assert transport.sends == [b"HTTP/1.1 200 OK\r\n\r\nhead and body"]
    assert other.sends == [b"x"]
    wrapper.write(b"!")
    assert transport.sends[1:] == [b"!"]


def test_a_sites_answer_leaves_head_and_body_in_one_send():
    """A KCoral site's answer goes out whole in one send: its peer wakes once to read it."""
    transport = Descriptor()
    connection = fake_site(Clock()).buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    connection.makeConnection(transport)
    connection.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert len(transport.sends) == 1
    assert transport.sends[0].startswith(b"HTTP/1.1 200 ") and transport.sends[0].endswith(b"\r\n\r\nhello")
