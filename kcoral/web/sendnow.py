"""
Writes that leave at once. A Twisted TCP transport keeps what it is given
and sends it on the reactor's next turn, once every other connection found
ready with it has been served. On a busy Router that delay sits between a
worker's answer and the next run sent to that worker, whose slot stands
idle meanwhile while the Router parses other clients' requests: with a
trivial program from 16 connections it halved the Router's throughput
against HAProxy's (``bench/compare.py``; ``doc/benchmarks.rst``, "Writes
sent at once").

L{SendNow} wraps a connection's protocol; it sends each write on the socket
itself, never registering the connection with the reactor for writing (two
system calls a send) while the socket takes all. Once a write does not fit,
or sending could reenter a protocol (a producer paused, or waiting to be
asked for more; a connection closing), that write and every later one go
through the transport's buffer, and after each the transport sends what it
holds (C{doWrite}, the call the reactor itself makes once the socket is
writable) where that cannot reenter a protocol, else on the reactor's turn. Twisted offers no
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

from kcoral.web.seams import io_size, send_buffered, send_some, set_io_size, tcp_connection, unhindered

#: Bytes a connection reads, and sends, at once (and buffers for writing
#: before it pauses its producer).
READ_BYTES = 1 << 20


class SendNow(policies.ProtocolWrapper):
    """The transport of a protocol whose writes are sent at once."""

    _descriptor: FileDescriptor | None = None
    #: Writes not yet sent, while the transport's own buffer is unused.
    _unsent: list[bytes]
    #: Set once a write went into the transport's buffer: from then on every
    #: write follows it there, and leaves in order on the reactor's turns.
    _buffered = False

    def makeConnection(self, transport):
        # A TCP connection is a descriptor the reactor writes; anything else
        # (a TLS layer, a test's transport) is written as it always was.
        self._descriptor = tcp_connection(transport)
        if self._descriptor is not None:
            self._unsent = []
        super().makeConnection(transport)

    def dataReceived(self, data):
        self._carries(len(data))
        super().dataReceived(data)

    def write(self, data):
        self._carries(len(data))
        if self._sends():
            self._unsent.append(data)
        else:
            super().write(data)
        self._send()

    def writeSequence(self, data):
        self._carries(sum(map(len, data)))
        if self._sends():
            self._unsent.extend(data)
        else:
            super().writeSequence(data)
        self._send()

    def _sends(self) -> bool:
        """Whether this wrapper sends a write itself: on a TCP connection
        with nothing in its transport's buffer, ever, and where sending
        cannot reenter a producer (paused, or waiting to be asked for more)
        or a closing connection; from the first write that is not, the
        transport's buffer takes every write."""
        transport = self._descriptor
        if transport is None or self._buffered:
            return False
        if transport.disconnecting or not unhindered(transport):
            self._flush()
            self._buffered = True
            return False
        return True

    def loseConnection(self):
        # What a together() block still holds goes first.
        self._flush()
        super().loseConnection()

    def loseWriteConnection(self):
        self._flush()
        half_close = getattr(self.transport, "loseWriteConnection", None)
        if half_close is None:  # a transport with no half-close
            self.loseConnection()
        else:
            half_close()

    def _carries(self, size: int) -> None:
        """C{size} bytes passed at once: as many as a read takes, or more,
        and the connection reads and sends L{READ_BYTES} at a time from now on."""
        transport = self._descriptor
        if transport is not None and io_size(transport) <= size and \
                io_size(transport) < READ_BYTES:
            set_io_size(transport, READ_BYTES)

    def unregisterProducer(self):
        super().unregisterProducer()
        self._send()

    def _send(self) -> None:
        transport = self._descriptor
        # Once lost, the connection has no socket: a layer above that still
        # writes as it is told of the loss (TLS, its close_notify) writes nothing.
        if transport is None or transport.disconnecting or not transport.connected:
            return
        if _held.depth:
            _held.written[self] = None
            return
        if not self._buffered:
            self._flush()
            return
        if unhindered(transport):
            # What it returns on failure the reactor gets again on its turn:
            # the connection stays registered for writing until all is sent.
            send_buffered(transport)

    def _flush(self) -> None:
        """
        Sends the unsent writes with one system call. The transport's own
        write would register the connection for writing and, once its buffer
        is sent, unregister it: two more system calls (C{epoll_ctl}) for each
        send, three sends a request through a Router.
        """
        transport = self._descriptor
        if transport is None or not self._unsent:
            return
        data = self._unsent[0] if len(self._unsent) == 1 else b"".join(self._unsent)
        self._unsent = []
        if not data or not transport.connected:
            return
        sent = send_some(transport, data)
        if sent < len(data):
            # The socket is full (or failed): the rest waits in the
            # transport's buffer, for the reactor to send as it can.
            self._buffered = True
            transport.write(data[sent:])


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
