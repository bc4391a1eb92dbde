"""
HTTP helpers for tests: requests with treq (no connection kept between
tests, since servers come and go), raw-socket exchanges for what no
well-behaved client sends, and a L{KCoralSite} on fake transports.
"""

from __future__ import annotations

import json
import select
import socket
import time

import attrs
import treq
from prometheus_client import CollectorRegistry
from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport
from twisted.logger import Logger
from twisted.web.client import HTTPConnectionPool
from twisted.web.resource import Resource

from kcoral.metrics import HttpMetrics
from kcoral.protocol.wire import PROGRAM_HEADER, REQUEST_CONTENT_TYPE
from kcoral.router.call import Call
from kcoral.web.body import MemoryBody
from kcoral.web.family import RUN
from kcoral.web.site import KCoralSite

#: A client's run, as a Router forwards it.
RUN_CALL = Call(RUN, b"/v1/run", "forwarded-1", ((b"Content-Type", REQUEST_CONTENT_TYPE.encode()),))


@attrs.frozen
class Answer:
    code: int
    headers: object
    body: bytes

    def header(self, name: str) -> str | None:
        values = self.headers.getRawHeaders(name.encode())
        return values[0].decode() if values else None

    @property
    def json(self):
        return json.loads(self.body)

    @property
    def request_id(self) -> str | None:
        return self.header("X-Request-ID")

    def error(self) -> dict:
        """The JSON error object, checked against the error contract."""
        assert self.header("Content-Type") == "application/json", self
        info = self.json["error"]
        assert isinstance(info["type"], str) and isinstance(info["message"], str)
        assert info["request_id"] == self.request_id, (info, self.request_id)
        return info


async def request(method: str, url: str, *, body: bytes | None = None,
                  headers: dict | None = None, timeout: float = 60) -> Answer:
    pool = HTTPConnectionPool(reactor, persistent=False)
    response = await treq.request(method, url, data=body, headers=headers or {}, pool=pool,
                                  timeout=timeout)
    content = await treq.content(response)
    return Answer(response.code, response.headers, content)


async def post_run(base: str, body: bytes, *, program_digest: str | None = None,
                   request_id: str | None = None) -> Answer:
    headers = {"Content-Type": REQUEST_CONTENT_TYPE}
    if program_digest:
        headers[PROGRAM_HEADER] = program_digest
    if request_id:
        headers["X-Request-ID"] = request_id
    return await request("POST", base + "/v1/run", body=body, headers=headers)


def raw_exchange(port: int, head: bytes, chunks=(), *, timeout: float = 30.0) -> bytes:
    """
    Send C{head} (request line and headers) and then C{chunks} over a plain
    socket, stop sending as soon as the server answers or closes, and return
    everything the server sent until it closed the connection. Blocking: run
    it in a thread.
    """
    deadline = time.monotonic() + timeout
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        for chunk in chunks:
            sock.setblocking(False)
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                data = None
            finally:
                sock.settimeout(timeout)
            if data is not None:
                received += data
                break  # answered (or closed) before we finished sending
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        while time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            received += data
    return received


def parse_raw(response: bytes) -> tuple[int, dict, bytes]:
    """Status, lower-cased headers and body of a raw HTTP/1.1 response."""
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        decoded, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            decoded, rest = decoded + rest[:size], rest[size + 2:]
        body = decoded
    return status, headers, body


# -- a KCoralSite on fake transports and a fake clock ----------------------------------------------

class Hello(Resource):
    isLeaf = True

    def render_GET(self, request):
        return b"hello"

    def render_POST(self, request):
        return b"got %d" % len(request.content.getvalue())


def fake_site(clock, max_request_bytes: int = 1000, resource=None, log: Logger | None = None,
              **kw) -> KCoralSite:
    """A L{KCoralSite} of C{resource} (default: L{Hello}) on C{clock}, logging to C{log}."""
    metrics = HttpMetrics(CollectorRegistry(), frozenset({"/"}))
    return KCoralSite(resource or Hello(), metrics=metrics, max_request_bytes=max_request_bytes,
                      log=log or Logger(), clock=clock, **kw)


def connect(site):
    """A connection to C{site} over a C{StringTransport}: (channel, transport)."""
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    transport = StringTransport()
    channel.makeConnection(transport)
    return channel, transport


class AsKCoralSite(Resource):
    """
    C{wrapped}, under a site that is not KCoral's (C{StubTreq}'s): each
    request it renders is given the L{body<kcoral.web.request.KCoralRequest.body>}
    a KCoral request has, its content in memory; the C{notifyFinish()} of
    each is in C{finishing}.
    """

    isLeaf = True

    def __init__(self, wrapped):
        super().__init__()
        self.wrapped = wrapped
        self.finishing: list = []

    def render(self, request):
        # Twisted's content: in memory, or in a file when large.
        request.content.seek(0)
        request.body = MemoryBody(request.content.read())
        self.finishing.append(request.notifyFinish())
        return self.wrapped.render(request)


#: How long a check that nothing arrived waits: the reactor does not run
#: meanwhile, so what Twisted buffered cannot be sent during it.
NOTHING_SECONDS = 0.2


class Listener:
    """A plain listening socket on loopback, outside the reactor."""

    def __init__(self):
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]

    def accept(self) -> socket.socket:
        peer, _ = self.socket.accept()
        peer.setblocking(False)
        return peer

    def close(self):
        self.socket.close()


def readable(peer: socket.socket, seconds: float) -> bytes:
    """What C{peer} has received within C{seconds}, without running the reactor."""
    ready, _, _ = select.select([peer], [], [], seconds)
    return peer.recv(1 << 16) if ready else b""


class Pulling:
    """A pull producer, which a transport asks for more whenever it is empty."""

    def resumeProducing(self):
        pass

    def stopProducing(self):
        pass
