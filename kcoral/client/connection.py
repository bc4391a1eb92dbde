"""
L{Connection}: one blocking, keep-alive HTTP/1.1 client connection, for the
blocking L{kcoral.Client}.

Why not C{http.client}: measured against a local server, it spent ~100 us of
client CPU per trivial run (a third of the round trip the issue budgets)
parsing each answer's headers with the C{email} package and sending the
request head and each body part in separate C{send} calls, which the server
then reads and parses separately. This connection sends the head and all body
parts with one C{sendmsg} (scatter/gather: large arrays are never copied) and
parses answers with plain byte operations. It speaks only what KCoral
services answer: C{Content-Length}, chunked or close-delimited bodies, no
upgrades; anything else is a L{ProtocolError}.
"""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Callable, Sequence

from kcoral.common.keepalive import DEFAULT_KEEPALIVE

#: The longest status or header line accepted, and the most header lines.
MAX_LINE = 65536
MAX_HEADERS = 100
#: sendmsg takes at most IOV_MAX (1024 on Linux) buffers per call.
_IOV_BATCH = 512
#: Over TLS (no sendmsg), parts up to this size are joined with the head.
_JOIN_BYTES = 64 * 1024
#: A counted body goes out in pieces of this size, so that its count moves.
_COUNTED_BYTES = 1 << 20


class ProtocolError(OSError):
    """The peer's answer is not HTTP/1.1 as this client understands it."""


class HTTPAnswer:
    """One HTTP/1.1 answer as read off the socket."""

    __slots__ = ("status", "headers", "body", "will_close")

    def __init__(self, status: int, headers: dict[bytes, bytes], body: bytes, will_close: bool):
        self.status = status
        #: Lower-cased header names; a repeated header keeps its last value.
        self.headers = headers
        self.body = body
        self.will_close = will_close

    def header(self, name: bytes) -> str | None:
        value = self.headers.get(name.lower())
        return None if value is None else value.decode("latin-1")


def _check_header(name: str, value: str) -> None:
    if any(c in name for c in "\r\n:") or "\r" in value or "\n" in value:
        raise ValueError(f"invalid HTTP header {name!r}: {value!r}")


class Connection:
    """
    One connection to C{host}:C{port}; with an C{ssl_context}, over TLS.
    Not thread-safe: the caller serialises requests.
    """

    def __init__(self, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                 timeout: float | None = None):
        self.host = host
        sock = socket.create_connection((host, port), timeout)
        try:
            # Requests and answers are small and latency-bound: no Nagle.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # A run may be silent for as long as its program runs: a Router
            # whose link went silent meanwhile is found by the kernel's
            # probes (a lost connection: the next Router, or a re-dispatch).
            DEFAULT_KEEPALIVE.apply(sock)
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._timeout = sock.gettimeout()
        self._tls = ssl_context is not None
        self._rfile = sock.makefile("rb", buffering=MAX_LINE)
        #: Answers read in full on this connection (more than 0: a reused one).
        self.answers = 0
        #: Whether any byte of the current request's answer has arrived.
        self.answering = False

    def close(self) -> None:
        self._rfile.close()
        self.sock.close()

    def dropped(self) -> bool:
        """Whether the peer has closed this idle connection (readable before
        any request means EOF), so that a request sent on it would be lost."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def settimeout(self, timeout: float | None) -> None:
        # Each settimeout() is an ioctl; most clients never change it.
        if timeout != self._timeout:
            self.sock.settimeout(timeout)
            self._timeout = timeout

    def request(self, method: str, target: str, host_header: str, headers: dict,
                parts: Sequence = (), length: int = 0,
                sent: Callable[[int], object] | None = None) -> HTTPAnswer:
        """Send a request, C{parts} its body of C{length} bytes; C{sent}, if
        given, is called with the size of each piece of the body sent."""
        lines = [f"{method} {target} HTTP/1.1", f"Host: {host_header}"]
        for name, value in headers.items():
            _check_header(name, value)
            lines.append(f"{name}: {value}")
        lines.append(f"Content-Length: {length}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self.answering = False
        if sent is None:
            self._send([head, *parts])
        else:
            self._send_counted(head, parts, sent)
        answer = self._answer(method)
        self.answers += 1
        return answer

    # -- sending ------------------------------------------------------------

    def _send(self, buffers: list) -> None:
        if self._tls:
            # TLS sockets have no sendmsg: join the small leading parts with
            # the head (one record, one packet), send large ones as they are.
            joined, size, i = [], 0, 0
            while i < len(buffers) and size + len(buffers[i]) <= _JOIN_BYTES:
                joined.append(buffers[i])
                size += len(buffers[i])
                i += 1
            if joined:
                self.sock.sendall(b"".join(joined))
            for buffer in buffers[i:]:
                self.sock.sendall(buffer)
            return
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if v.nbytes]
        while views:
            sent = self.sock.sendmsg(views[:_IOV_BATCH])
            # Drop what went out; a partial send leaves a tail to resend.
            while sent and views:
                if sent >= views[0].nbytes:
                    sent -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def _send_counted(self, head: bytes, parts: Sequence, sent: Callable[[int], object]) -> None:
        # One sendall per piece: the cost of sendmsg's batching is nothing
        # next to a body large enough to be counted.
        self.sock.sendall(head)
        for part in parts:
            view = memoryview(part).cast("B")
            for start in range(0, view.nbytes, _COUNTED_BYTES):
                piece = view[start:start + _COUNTED_BYTES]
                self.sock.sendall(piece)
                sent(piece.nbytes)

    # -- receiving ----------------------------------------------------------

    def _line(self) -> bytes:
        line = self._rfile.readline(MAX_LINE + 1)
        if len(line) > MAX_LINE:
            raise ProtocolError("an HTTP line of the answer is too long")
        return line

    def _answer(self, method: str) -> HTTPAnswer:
        while True:
            line = self._line()
            if not line:
                raise ProtocolError("the server closed the connection without answering")
            self.answering = True
            version, _, rest = line.partition(b" ")
            code = rest[:3]
            if not version.startswith(b"HTTP/1.") or not code.isdigit():
                raise ProtocolError(f"not an HTTP/1.x status line: {line[:80]!r}")
            status = int(code)
            headers = self._headers()
            # Interim answers (100 Continue) precede the real one.
            if not 100 <= status < 200:
                break
        connection = headers.get(b"connection", b"").lower()
        will_close = b"close" in connection or (version == b"HTTP/1.0" and b"keep-alive" not in connection)
        if method == "HEAD" or status in (204, 304):
            body = b""
        elif b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            body = self._chunked()
        elif b"content-length" in headers:
            try:
                length = int(headers[b"content-length"])
            except ValueError:
                raise ProtocolError("the answer's Content-Length is not a number") from None
            body = self._rfile.read(length)
            if len(body) != length:
                raise ProtocolError("the server closed the connection in the middle of an answer")
        else:
            body = self._rfile.read()
            will_close = True
        return HTTPAnswer(status, headers, body, will_close)

    def _headers(self) -> dict[bytes, bytes]:
        headers: dict[bytes, bytes] = {}
        for _ in range(MAX_HEADERS + 1):
            line = self._line()
            if line in (b"\r\n", b"\n", b""):
                return headers
            name, colon, value = line.partition(b":")
            if not colon:
                raise ProtocolError(f"malformed header line: {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        raise ProtocolError(f"the answer has more than {MAX_HEADERS} headers")

    def _chunked(self) -> bytes:
        chunks: list[bytes] = []
        while True:
            size_line = self._line().split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise ProtocolError(f"malformed chunk size: {size_line[:40]!r}") from None
            if size == 0:
                self._headers()  # trailers, up to the final empty line
                return b"".join(chunks)
            chunk = self._rfile.read(size)
            if len(chunk) != size or self._rfile.read(2) != b"\r\n":
                raise ProtocolError("the server closed the connection in the middle of an answer")
            chunks.append(chunk)
