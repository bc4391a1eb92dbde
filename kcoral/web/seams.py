"""
Where KCoral relies on Twisted beyond its documented API: each such
reliance is named here, once, and checked by a contract test of the same
name in C{tests/test_seams.py} that exercises Twisted itself (a real channel
over a C{StringTransport}, a real TCP connection), not KCoral. A Twisted
release that breaks one fails there, naming the seam, before anything built
on it misbehaves.

Besides the names below, KCoral overrides hooks of Twisted's HTTP/1.1
channel and request that Twisted calls in an order its documentation does
not promise; each has its contract test too:

 - C{HTTPChannel.lineReceived} is handed each line of a request head, its
   request line first (C{test_head_lines_come_request_line_first}): the
   channel keeps that line to judge the request from its head alone;
 - C{Request.gotLength} is called once the head is whole, before any of its
   body is read, and what it answers is on the wire before the body
   (C{test_gotLength_comes_with_the_head}); C{requestReceived} then gets the
   target as its request line spelled it (C{test_requestReceived_gets_the_raw_target});
 - C{HTTPChannel.lineLengthExceeded} is called for a head line past
   C{MAX_LENGTH}, and Twisted then writes nothing
   (C{test_an_overlong_head_line_is_lineLengthExceeded});
 - C{server.Request.process} sets a C{Server} header before it calls
   C{render} (C{test_process_names_the_server_before_render});
 - a request's C{channel} is None once its connection is lost
   (C{test_a_lost_request_has_no_channel}).
"""

from __future__ import annotations

from twisted.internet.abstract import FileDescriptor
from twisted.web import http
from twisted.web.http_headers import Headers

#: What Twisted's HTTP/1.1 channel writes to HTTP it cannot parse (request
#: line, header count or size, Content-Length, chunk framing), just before it
#: closes the connection. Contract: C{test_malformed_http_is_answered_with_BAD_REQUEST}.
BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\n\r\n"


def requests_of(channel: http.HTTPChannel) -> list[http.Request]:
    """The requests of C{channel} not yet done, oldest first (the one whose
    head is being read, if any, last). Contract: C{test_requests_of_lists_those_in_progress}."""
    return channel.requests


def drop_input(channel: http.HTTPChannel) -> None:
    """
    Have C{channel} drop whatever else arrives, even the rest of the data
    it is parsing now (the body after a head whose request was just
    refused): its parser hands each read, and after a head the rest of it,
    to the instance's C{dataReceived} and C{rawDataReceived}.
    Contract: C{test_drop_input_drops_the_rest}.
    """
    channel.rawDataReceived = channel.dataReceived = _dropped  # type: ignore[method-assign]


def _dropped(data: bytes) -> None:
    """Where input a channel no longer parses goes."""


def withhold_continue(request_headers: Headers) -> None:
    """Keep the channel of a request (of C{request_headers}) from answering
    C{Expect: 100-continue}: it reads that header only once C{gotLength} has
    returned, so a request refused from its head is not followed by a stray
    100. Contract: C{test_withhold_continue_from_gotLength}."""
    request_headers.removeHeader(b"Expect")


def close_after_requests(channel: http.HTTPChannel) -> None:
    """Have C{channel} close its connection once the requests in progress
    are done, parsing no request after them.
    Contract: C{test_close_after_requests}."""
    channel.persistent = False


def tcp_connection(transport: object) -> FileDescriptor | None:
    """C{transport} if it is a connection the reactor reads and writes
    itself (TCP), whose buffers the names below reach; else None.
    Contract: C{test_tcp_connection_is_a_descriptor}."""
    return transport if isinstance(transport, FileDescriptor) else None


def send_some(connection: FileDescriptor, data: bytes) -> int:
    """Send what of C{data} the socket takes now (up to L{io_size}), with
    one system call and without the reactor; how many bytes it sent (0
    where the connection failed: the reactor finds that again on its turn).
    Contract: C{test_send_some_sends_at_once}."""
    sent = connection.writeSomeData(data)
    return 0 if isinstance(sent, BaseException) else sent


def send_buffered(connection: FileDescriptor) -> None:
    """Send what C{connection} holds in its write buffer now, as the reactor
    does once the socket is writable, and as much as the socket takes.
    Contract: C{test_send_buffered_sends_what_write_kept}."""
    connection.doWrite()


def io_size(connection: FileDescriptor) -> int:
    """Bytes C{connection} reads at a time (and buffers for writing before
    it pauses its producer). Contract: C{test_set_io_size_reads_and_sends_that_much}."""
    return connection.bufferSize


def set_io_size(connection: FileDescriptor, size: int) -> None:
    """Have C{connection} read, and send, up to C{size} bytes at a time.
    Contract: C{test_set_io_size_reads_and_sends_that_much}."""
    connection.bufferSize = connection.SEND_LIMIT = size


def unhindered(connection: FileDescriptor) -> bool:
    """Whether sending on C{connection} now could reenter no producer: it
    has none, or a streaming one that is not paused.
    Contract: C{test_unhindered_follows_the_producer}."""
    producer = connection.producer
    return producer is None or (connection.streamingProducer and not connection.producerPaused)
