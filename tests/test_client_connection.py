"""
The blocking client's HTTP/1.1 connection (L{kcoral.client.connection})
against a scripted peer: body framings, interim answers, keep-alive and
close, partial sends of large scattered bodies, and malformed answers.
"""

from __future__ import annotations

import socket
import threading

import pytest

from kcoral.client.connection import Connection, ProtocolError


class Peer:
    """
    A one-connection loopback server: for each request it reads the head and
    Content-Length body, records them, and writes the next scripted answer.
    """

    def __init__(self, answers: list[bytes], *, close_after: bool = False):
        self._answers = list(answers)
        self._close_after = close_after
        self.requests: list[tuple[bytes, bytes]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock, _ = self._listener.accept()
        with sock, sock.makefile("rb") as rfile:
            for answer in self._answers:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = rfile.readline()
                    if not line:
                        return
                    head += line
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self.requests.append((head, rfile.read(length)))
                sock.sendall(answer)
            if self._close_after:
                sock.shutdown(socket.SHUT_WR)

    def join(self) -> None:
        self._thread.join(10)
        self._listener.close()


def ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + b"".join(h + b"\r\n" for h in extra) + \
        b"Content-Length: %d\r\n\r\n" % len(body) + body


def test_content_length_answers_on_one_keep_alive_connection():
    """Two requests share one keep-alive connection, each sent and answered with a Content-Length."""
    peer = Peer([ok(b"first", b"X-Request-ID: a"), ok(b"second")])
    conn = Connection("127.0.0.1", peer.port)
    one = conn.request("POST", "/v1/run", "h:1", {"X-Request-ID": "a"}, [b"ab", b"cd"], 4)
    two = conn.request("GET", "/health", "h:1", {})
    conn.close()
    peer.join()
    assert (one.status, one.body, one.header(b"x-request-id"), one.will_close) == \
        (200, b"first", "a", False)
    assert (two.status, two.body) == (200, b"second")
    head, body = peer.requests[0]
    assert head.startswith(b"POST /v1/run HTTP/1.1\r\nHost: h:1\r\n")
    assert b"X-Request-ID: a\r\n" in head and b"Content-Length: 4\r\n" in head
    assert body == b"abcd"
    assert peer.requests[1][0].startswith(b"GET /health HTTP/1.1\r\n")


def test_chunked_answer_with_extensions_and_trailers():
    """A chunked answer with extensions and trailers is read exactly, leaving the connection usable."""
    answer = (b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n"
              b"Retry-After: 2\r\n\r\n"
              b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\n")
    peer = Peer([answer, ok(b"next")])
    conn = Connection("127.0.0.1", peer.port)
    first = conn.request("GET", "/", "h", {})
    assert (first.status, first.body, first.header(b"Retry-After")) == (503, b"hello world", "2")
    # The connection stays usable: the chunked body was read exactly.
    assert conn.request("GET", "/", "h", {}).body == b"next"
    conn.close()
    peer.join()


def test_interim_answers_are_skipped():
    """A 100 Continue before the answer is skipped; the final answer is returned."""
    peer = Peer([b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"done")])
    conn = Connection("127.0.0.1", peer.port)
    assert conn.request("POST", "/", "h", {}, [b"x"], 1).body == b"done"
    conn.close()
    peer.join()


def test_close_delimited_and_connection_close_answers():
    """An answer with Connection: close and no length is read until the peer closes, and will close."""
    peer = Peer([b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end"], close_after=True)
    conn = Connection("127.0.0.1", peer.port)
    answer = conn.request("GET", "/", "h", {})
    assert (answer.body, answer.will_close) == (b"until the end", True)
    conn.close()
    peer.join()


def test_http_1_0_answers_close_unless_kept_alive():
    """An HTTP/1.0 answer without keep-alive means the connection will close."""
    peer = Peer([b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"])
    conn = Connection("127.0.0.1", peer.port)
    assert conn.request("GET", "/", "h", {}).will_close
    conn.close()
    peer.join()


def test_a_large_scattered_body_arrives_whole():
    """A body of many buffers, far larger than a socket buffer, arrives whole and in order."""
    # Far more than a socket buffer, in more buffers than one sendmsg takes:
    # exercises partial sends and batching.
    parts = [bytes([i % 251]) * (i * 97 % 4096 + 1) for i in range(1500)]
    parts.append(b"z" * (8 << 20))
    length = sum(len(p) for p in parts)
    peer = Peer([ok(b"got it")])
    conn = Connection("127.0.0.1", peer.port)
    assert conn.request("POST", "/v1/run", "h", {}, parts, length).body == b"got it"
    conn.close()
    peer.join()
    assert peer.requests[0][1] == b"".join(parts)


def test_memoryview_and_numpy_parts():
    """Memoryviews of numpy arrays and empty parts are sent as their bytes."""
    import numpy as np

    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    view = memoryview(array.reshape(-1).view(np.uint8)).cast("B")
    peer = Peer([ok(b"")])
    conn = Connection("127.0.0.1", peer.port)
    conn.request("POST", "/", "h", {}, [b"head", view, b""], 4 + view.nbytes)
    conn.close()
    peer.join()
    assert peer.requests[0][1] == b"head" + array.tobytes()


def test_dropped_sees_a_peer_that_closed_an_idle_connection():
    """dropped() is true once the peer has closed an idle connection."""
    peer = Peer([ok(b"one")], close_after=True)
    conn = Connection("127.0.0.1", peer.port)
    conn.request("GET", "/", "h", {})
    peer.join()
    for _ in range(100):
        if conn.dropped():
            break
        threading.Event().wait(0.01)
    assert conn.dropped()
    conn.close()


@pytest.mark.parametrize("answer, message", [
    (b"", "without answering"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "in the middle of an answer"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", "more than 100 headers"),
    (b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n", "too long"),
])
def test_malformed_answers_are_protocol_errors(answer, message):
    """Each malformed or cut-off answer raises ProtocolError saying what is wrong."""
    peer = Peer([answer], close_after=True)
    conn = Connection("127.0.0.1", peer.port)
    with pytest.raises(ProtocolError, match=message):
        conn.request("GET", "/", "h", {})
    conn.close()
    peer.join()


def test_header_injection_is_refused():
    """A header value holding CR LF raises ValueError instead of being sent."""
    peer = Peer([])
    conn = Connection("127.0.0.1", peer.port)
    with pytest.raises(ValueError):
        conn.request("GET", "/", "h", {"X-Request-ID": "a\r\nEvil: 1"})
    conn.close()
    peer.join()
