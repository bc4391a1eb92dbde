"""
Writes that leave at once. A Twisted TCP transport keeps what it is given
and sends it on the reactor's next turn, once every other connection found
ready with it has been served. On a busy Router that delay sits between a
worker's answer and the next run sent to that worker, whose slot stands
idle meanwhile while the Router parses other clients' requests: with a
trivial program from 16 connections it halved the Router's throughput
against HAProxy's (``bench/compare.py``; ``doc/benchmarks.rst``, "Writes
sent at once").

L{SendNow} wraps a connection's protocol; after each write it has the TCP
transport send what it holds (C{doWrite}, the call the reactor itself makes
once the socket is writable). Where that call could reenter a protocol (a
producer paused, or waiting to be asked for more; a connection closing) it
leaves the transport to the reactor's turn, as before. Twisted offers no
such option of its own, and no library adds it.

The same wrapper has the transport read and send up to L{READ_BYTES} at a
time, in place of Twisted's 64 KiB reads and 128 KiB sends, once the
connection carries large data: a read that fills Twisted's size, or a
write larger than it. A large body then passes through the protocols above
it (HTTP parsing, a request's bounds, the spool, the client writing it on)
in a sixteenth of the calls; a small request or a probe keeps Twisted's
sizes, since each read allocates its whole size before the socket fills
any of it. The transport's C{bufferSize} is both that read size and what
it buffers for writing before it pauses its producer.

Under TLS the wrapper goes below the TLS layer of an outgoing connection
(L{SendNowEndpoint}); a listening TLS port wraps its protocols above our
reach, so answers over TLS wait for the reactor's turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

from twisted.internet.abstract import FileDescriptor
from twisted.internet.interfaces import IProtocol, IStreamClientEndpoint
from twisted.protocols import policies
from zope.interface import implementer

#: Bytes a connection reads, and sends, at once (and buffers for writing
#: before it pauses its producer).
READ_BYTES = 1 << 20


class SendNow(policies.ProtocolWrapper):
    """The transport of a protocol whose writes are sent at once."""

    _descriptor: FileDescriptor | None = None

    def makeConnection(self, transport):
        # A TCP connection is a descriptor the reactor writes; anything else
        # (a TLS layer, a test's transport) is written as it always was.
        if isinstance(transport, FileDescriptor):
            self._descriptor = transport
        super().makeConnection(transport)

    def dataReceived(self, data):
        self._carries(len(data))
        super().dataReceived(data)

    def write(self, data):
        self._carries(len(data))
        super().write(data)
        self._send()

    def writeSequence(self, data):
        self._carries(sum(map(len, data)))
        super().writeSequence(data)
        self._send()

    def _carries(self, size: int) -> None:
        """C{size} bytes passed at once: as many as a read takes, or more,
        and the connection reads and sends L{READ_BYTES} at a time from now on."""
        transport = self._descriptor
        if transport is not None and transport.bufferSize <= size and \
                transport.bufferSize < READ_BYTES:
            transport.bufferSize = transport.SEND_LIMIT = READ_BYTES

    def unregisterProducer(self):
        super().unregisterProducer()
        self._send()

    def _send(self) -> None:
        transport = self._descriptor
        if transport is None or transport.disconnecting:
            return
        if _held.depth:
            _held.written[self] = None
            return
        producer = transport.producer
        if producer is None or (transport.streamingProducer and not transport.producerPaused):
            # What it returns on failure the reactor gets again on its turn:
            # the connection stays registered for writing until all is sent.
            transport.doWrite()


class _Held:
    """The connections written inside open L{together} blocks (on the
    reactor's thread, the only one that writes to connections)."""

    def __init__(self):
        self.depth = 0
        self.written: dict[SendNow, None] = {}


_held = _Held()


@contextmanager
def together() -> Iterator[None]:
    """
    What is written to connections inside leaves as the (outermost) block
    ends, in one send for each connection: an answer's head with its body,
    so that the client wakes once and reads both, where two sends would cost
    each end a system call and a wake-up more. (A forwarded request is left
    as two: measured, the worker parsing the head while the body is sent
    beats waiting for both.)
    """
    _held.depth += 1
    try:
        yield
    finally:
        _held.depth -= 1
        if not _held.depth:
            written, _held.written = _held.written, {}
            for connection in written:
                connection._send()


class SendNowFactory(policies.WrappingFactory):
    """Wraps each protocol of C{wrappedFactory} in L{SendNow}."""

    protocol = SendNow


@implementer(IStreamClientEndpoint)
class SendNowEndpoint:
    """Connects as C{endpoint} does, with L{SendNow} under the protocol
    (the wrapper stays between the protocol and its transport)."""

    def __init__(self, endpoint: IStreamClientEndpoint):
        self._endpoint = endpoint

    def connect(self, protocolFactory):
        return self._endpoint.connect(SendNowFactory(protocolFactory)).addCallback(_unwrapped)


def _unwrapped(wrapper: IProtocol) -> IProtocol:
    return cast(SendNow, wrapper).wrappedProtocol
