"""
Large request bodies spooled to a file (L{kcoral.web.spool}) and read back
(L{kcoral.web.body}): on a L{KCoralSite} over C{StringTransport}, with the
spool's thread calls run one at a time by the test; a spooled body sent
again by the proxy after a 503, over loopback; and a run with a 24 MiB
input through a real Router.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IPullProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from zope.interface import implementer

from kcoral import Program
from kcoral.router.proxy import NotSent
from kcoral.web.body import (
    PACE_BYTES_PER_SECOND,
    PACE_WINDOW_SECONDS,
    READ_BYTES,
    FileReader,
    MemoryBody,
    SpooledBody,
)
from kcoral.web.intake import JOIN_BYTES
from kcoral.web.spool import KEPT_BYTES, SPOOL_THRESHOLD, WAITING_BYTES, Spool, serial
from tests.harness import until
from tests.httputil import RUN_CALL, connect, fake_site, parse_raw
from tests.test_outgoing import Peer

THRESHOLD = 1000


class Threads:
    """The spool's threads, run by the test: each call waits until L{run}."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.results: list = []

    def __call__(self, f, *args) -> Deferred:
        d: Deferred = Deferred()
        self.calls.append((f, args, d))
        return d

    def run(self) -> None:
        """Run every call waiting, and those they lead to, in order."""
        while self.calls:
            f, args, d = self.calls.pop(0)
            try:
                result = f(*args)
            except Exception:
                d.errback(Failure())
            else:
                self.results.append(result)
                d.callback(result)


class Bodies(Resource):
    """Keeps each POSTed request; answers once the test calls C{answer}."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.requests: list = []

    def render_POST(self, request):
        self.requests.append(request)
        return NOT_DONE_YET


class Spooled:
    """A site with a spool of threshold L{THRESHOLD} bytes, and one connection to it."""

    def __init__(self, tmp_path):
        self.threads = Threads()
        self.resource = Bodies()
        self.site = fake_site(Clock(), max_request_bytes=64 << 20, resource=self.resource,
                              spool=Spool(Clock(), THRESHOLD, str(tmp_path), self.threads))
        self.channel, self.transport = connect(self.site)

    def post(self, body: bytes, chunks: int = 1) -> None:
        self.channel.dataReceived(b"POST /v1/run HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                                  % len(body))
        step = -(-len(body) // chunks)
        for start in range(0, len(body), step):
            self.channel.dataReceived(body[start:start + step])

    def content(self, body: SpooledBody) -> bytes:
        return os.pread(body.file.fileno(), body.length + 1, 0)


@pytest.fixture
def spooled(tmp_path):
    return Spooled(tmp_path)


def test_a_body_under_the_threshold_stays_in_memory(spooled):
    """A body at the threshold is processed at once, in memory, with no thread call."""
    spooled.post(b"x" * THRESHOLD)
    [request] = spooled.resource.requests
    assert request.body == MemoryBody(b"x" * THRESHOLD)
    assert spooled.threads.calls == []


def test_a_body_over_the_threshold_lands_in_a_file_before_processing(spooled):
    """A larger body is written in threads, and processed only once the last write has ended."""
    body = os.urandom(50_000)
    spooled.post(body, chunks=7)
    assert spooled.resource.requests == [] and spooled.threads.calls
    spooled.threads.run()
    [request] = spooled.resource.requests
    assert isinstance(request.body, SpooledBody) and request.body.length == len(body)
    assert spooled.content(request.body) == body


def test_a_chunked_body_goes_to_a_file_only_past_the_threshold(spooled):
    """A body of unknown length stays in memory while it is small, and is spooled once it is not."""
    head = b"POST /v1/run HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    spooled.channel.dataReceived(head + b"a\r\n" + b"s" * 10 + b"\r\n0\r\n\r\n")
    [small] = spooled.resource.requests
    assert small.body == MemoryBody(b"s" * 10) and spooled.threads.calls == []
    small.finish()
    large = b"%x\r\n%s\r\n" % (2 * THRESHOLD, b"L" * 2 * THRESHOLD)
    spooled.channel.dataReceived(head + large + b"0\r\n\r\n")
    spooled.threads.run()
    request = spooled.resource.requests[-1]
    assert spooled.content(request.body) == b"L" * 2 * THRESHOLD


def test_the_client_is_paused_while_too_many_bytes_wait_to_be_written(spooled):
    """Past WAITING_BYTES unwritten the transport is paused; written, it is resumed."""
    spooled.post(b"p" * (3 * WAITING_BYTES), chunks=6)
    assert spooled.transport.producerState == "paused"
    spooled.threads.run()
    assert spooled.transport.producerState == "producing"
    [request] = spooled.resource.requests
    assert request.body.length == 3 * WAITING_BYTES


def test_the_file_is_closed_once_the_request_is_done(spooled):
    """Answering the request closes its file, after the reads before it."""
    spooled.post(b"d" * 5000)
    spooled.threads.run()
    [request] = spooled.resource.requests
    file = request.body.file
    request.finish()
    spooled.threads.run()
    assert file.closed


def test_the_file_is_closed_when_the_client_goes_away(spooled):
    """A client gone during a write leaves no file open once the write has ended."""
    spooled.post(b"g" * 5000)
    assert len(spooled.threads.calls) == 1  # the write that creates the file
    spooled.channel.connectionLost(Failure(ConnectionDone()))
    spooled.threads.run()
    file = spooled.threads.results[0]
    assert file.closed and spooled.resource.requests == []


def test_a_failed_write_is_a_json_500(spooled):
    """A body that cannot be written is answered 500 (an internal error), and is not processed."""
    spooled.site.spool.directory = "/nonexistent/spool"
    spooled.post(b"f" * 5000)
    spooled.threads.run()
    status, _, body = parse_raw(spooled.transport.value())
    assert status == 500 and b"internal_error" in body
    assert spooled.resource.requests == []


class Consumer:
    """A consumer that pauses its producer after each write, as a full transport would."""

    def __init__(self, pause: bool):
        self.data: list[bytes] = []
        self.pause = pause
        self.producer = None

    def write(self, data: bytes) -> None:
        self.data.append(data)
        if self.pause:
            self.producer.pauseProducing()


def test_a_reader_sends_the_whole_file_and_waits_while_paused(tmp_path):
    """A reader reads one chunk at a time, none while paused; a second reader sends it all again."""
    threads = Threads()
    data = os.urandom(2 * READ_BYTES + 5)
    file = (tmp_path / "body").open("w+b")
    file.write(data)
    file.flush()
    body = SpooledBody(len(data), serial(threads), file, len(data))
    for _ in range(2):
        reader = body.send()
        assert isinstance(reader, FileReader) and reader.length == len(data)
        consumer = Consumer(pause=True)
        consumer.producer = reader
        done = reader.startProducing(consumer)
        threads.run()
        assert len(consumer.data) == 1 and not threads.calls
        consumer.pause = False
        reader.resumeProducing()
        threads.run()
        assert b"".join(consumer.data) == data and done.called
    body.close()
    threads.run()
    assert file.closed


class _BusyOnce(Resource):
    """Answers its first run 503, then every run with the digest of its body."""

    isLeaf = True
    busy = True

    def render_POST(self, request):
        if self.busy:
            self.busy = False
            request.setResponseCode(503)
            return b"busy"
        return hashlib.sha256(request.content.read()).hexdigest().encode()


@pytest_twisted.ensureDeferred
async def test_a_spooled_body_is_sent_again_whole_after_a_503(tmp_path):
    """A member's 503 and then a second forward: the spooled body is read again from its start."""

    data = os.urandom(3 * READ_BYTES + 7)
    file = (tmp_path / "body").open("w+b")
    file.write(data)
    file.flush()
    body = SpooledBody(len(data), serial(Spool(reactor).in_thread), file, len(data))
    peer = Peer()
    try:
        url = f"http://127.0.0.1:{peer.serve(_BusyOnce())}"
        with pytest.raises(NotSent):
            await peer.proxy.forward(url, RUN_CALL, body)
        answer = await peer.proxy.forward(url, RUN_CALL, body)
        assert answer.code == 200 and answer.body == hashlib.sha256(data).hexdigest().encode()
    finally:
        await peer.close()
        await body.close()


# -- through a real Router --------------------------------------------------------------------

@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_large_input_runs_through_a_router(processes):
    """A run with a 24 MiB input, spooled by the Router on its way, gets the right answer."""

    from tests.test_routed import start_node, start_router, until_ready
    from tests.test_server import attempt

    router = await start_router(processes)
    await start_node(processes, router.url, "node-a")
    await until_ready(router, "node-a")
    x = np.arange(6 << 20, dtype=np.float32)  # 24 MiB
    program = Program.from_function(lambda v: (v * 2).sum(), x)
    result = await deferToThread(attempt, router.url, program, x)
    assert float(result) == pytest.approx(float((x * 2).sum()), rel=1e-5)


@attrs.frozen
class Streamed:
    """A site that forwards bodies while they arrive, on a fake clock, sent the head of a POST."""

    clock: Clock
    threads: Threads
    spool: Spool
    channel: object
    transport: object
    request: object

    def follow(self) -> tuple[FileReader, list]:
        """A reader following the body, and the failures its request finishes with."""
        gone: list = []
        self.request.notifyFinish().addErrback(gone.append)
        consumer = Consumer(pause=False)
        reader = consumer.producer = self.request.body.send()
        reader.startProducing(consumer)
        return reader, gone


def streamed_post(tmp_path, length: int, **spool_options) -> Streamed:
    """The head of a POST of C{length} bytes, sent to a site that streams every body."""
    threads, resource, clock = Threads(), Bodies(), Clock()
    spool = Spool(clock, THRESHOLD, str(tmp_path), threads, **spool_options)
    site = fake_site(clock, max_request_bytes=64 << 20, resource=resource, spool=spool,
                     streams=lambda method, path: True)
    channel, transport = connect(site)
    channel.dataReceived(b"POST /v1/run HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                         % length)
    [request] = resource.requests
    return Streamed(clock, threads, spool, channel, transport, request)


@pytest.mark.parametrize("kept_bytes", [0, KEPT_BYTES], ids=["on-disk", "in-memory"])
def test_a_streamed_body_is_read_only_while_a_reader_follows_it(tmp_path, kept_bytes):
    """A request its site streams is processed at its head; its client is not read (nor timed
    out, nor timed for its rate) until a reader follows the body, which then gets each chunk as
    it arrives; done, it lets go of its file, or of its share of the memory kept."""
    body = os.urandom(50_000)
    post = streamed_post(tmp_path, len(body), kept_bytes=kept_bytes)
    clock, threads, spool = post.clock, post.threads, post.spool
    channel, transport, request = post.channel, post.transport, post.request
    assert transport.producerState == "paused"
    # Longer than the idle timeout, and than the body's grace at the least rate.
    clock.advance(120)
    assert not transport.disconnecting
    consumer = Consumer(pause=False)
    reader = consumer.producer = request.body.send()
    done = reader.startProducing(consumer)
    assert transport.producerState == "producing"
    for start in range(0, len(body), 10_000):
        clock.advance(1)
        channel.dataReceived(body[start:start + 10_000])
    assert b"".join(consumer.data) == body and done.called
    assert transport.value() == b"" and not transport.disconnecting
    threads.run()
    assert kept_bytes == 0 or spool.kept(kept_bytes) is None  # its share taken
    request.finish()
    threads.run()
    if kept_bytes == 0:
        assert request.body.file.closed
    else:
        assert request.body.chunks is None and spool.kept(kept_bytes) is not None


def test_a_streamed_body_that_trickles_in_is_refused_and_its_handling_cancelled(tmp_path):
    """A body read by a forward, but arriving under the least rate, is refused with a 408, and
    what its handler waits on learns that its client is gone."""
    post = streamed_post(tmp_path, 50_000)
    clock, channel, transport = post.clock, post.channel, post.transport
    reader, gone = post.follow()
    for _ in range(12):
        clock.advance(1)
        channel.dataReceived(b"t" * 100)
    status, _, body = parse_raw(transport.value())
    assert status == 408 and b"request_timeout" in body
    assert len(gone) == 1 and transport.producerState == "producing"


def _fail_the_next_write(threads: Threads) -> None:
    """The spool's next call, a write of the body, fails (a full disk)."""
    _, _, d = threads.calls.pop(0)
    d.errback(Failure(OSError(28, "No space left on device")))


def test_a_streamed_body_whose_write_fails_once_whole_is_refused_as_processed(tmp_path):
    """A streamed body all arrived, whose file's write then fails before its request is
    answered, is refused as a request already processed is (a 500, and what its handler waits
    on learns that its client is gone), not only answered."""
    post = streamed_post(tmp_path, 50_000, kept_bytes=0)
    gone: list = []
    post.request.notifyFinish().addErrback(gone.append)
    post.channel.dataReceived(b"w" * 50_000)
    assert post.threads.calls, "a write still pending once the body is whole"
    _fail_the_next_write(post.threads)
    status, _, body = parse_raw(post.transport.value())
    assert status == 500 and b"internal_error" in body
    assert len(gone) == 1


def test_a_write_that_fails_after_the_answer_adds_nothing_to_the_connection(tmp_path):
    """A streamed request answered and done while its body's writes still run: a write that
    then fails writes nothing more to its connection, which goes on."""
    post = streamed_post(tmp_path, 50_000, kept_bytes=0)
    post.channel.dataReceived(b"w" * 50_000)
    post.request.setResponseCode(400)
    post.request.write(b"refused")
    post.request.finish()
    answered = post.transport.value()
    _fail_the_next_write(post.threads)
    post.threads.run()
    assert post.transport.value() == answered
    assert answered.count(b"HTTP/1.1 ") == 1 and not post.transport.disconnecting


# -- forwarded while it arrives, through a Router in this process ------------------------------

#: Over the spool's threshold, so that the Router forwards it while it arrives.
LARGE = SPOOL_THRESHOLD + 4 * READ_BYTES


class Member(Protocol):
    """
    A worker's connection that reads a request's head, hashes its body as it
    comes (keeping none of it) and does what its factory's C{act} says with
    each chunk: answer, turn it away, drop the connection, or wait.
    """

    def __init__(self, act: Callable[[Member], object]):
        self.act = act
        self.head = b""
        self.length: int | None = None
        self.count = 0
        self.digest = hashlib.sha256()
        self.answered = self.lost = False
        self._buffer = b""

    def dataReceived(self, data: bytes) -> None:
        if self.length is None:
            self._buffer += data
            if b"\r\n\r\n" not in self._buffer:
                return
            self.head, _, data = self._buffer.partition(b"\r\n\r\n")
            self._buffer = b""
            self.length = int(re.search(rb"(?i)content-length: *(\d+)", self.head).group(1))
        self.count += len(data)
        self.digest.update(data)
        if not self.answered:
            self.act(self)

    @property
    def whole(self) -> bool:
        return self.length is not None and self.count == self.length

    def answer(self, code: int, body: bytes) -> None:
        self.answered = True
        self.transport.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                             % (code, len(body), body))
        self.transport.loseConnection()

    def connectionLost(self, reason=None) -> None:
        self.lost = True


def answers_its_digest(member: Member) -> None:
    if member.whole:
        member.answer(200, member.digest.hexdigest().encode())


class Members(Factory):
    """Two workers' ports; the n-th connection to either acts as C{acts[n]} (then
    as the last)."""

    def __init__(self, *acts: Callable[[Member], object]):
        self.acts = acts
        self.connections: list[Member] = []

    def buildProtocol(self, addr):
        member = Member(self.acts[min(len(self.connections), len(self.acts) - 1)])
        self.connections.append(member)
        return member


@implementer(IPullProducer)
class Chunks:
    """C{count} writes of C{chunk} to C{transport}, as its buffer drains."""

    def __init__(self, transport, chunk: bytes, count: int):
        self.transport, self.chunk, self.left = transport, chunk, count
        self.done = False

    def resumeProducing(self) -> None:
        if self.left:
            self.left -= 1
            self.transport.write(self.chunk)
        elif not self.done:
            self.done = True
            self.transport.unregisterProducer()

    def stopProducing(self) -> None:
        self.left = 0


class Uploader(Protocol):
    """A client's connection to the Router, keeping what it is answered."""

    def __init__(self):
        self.answer = b""
        self.closed = False

    def dataReceived(self, data: bytes) -> None:
        self.answer += data

    def connectionLost(self, reason=None) -> None:
        self.closed = True

    def head(self, length: int, extra: bytes = b"") -> None:
        self.transport.write(b"POST /v1/run HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n%s\r\n"
                             % (length, extra))

    def send(self, chunk: bytes, count: int = 1) -> Chunks:
        chunks = Chunks(self.transport, chunk, count)
        self.transport.registerProducer(chunks, False)
        return chunks


class StreamingRouter:
    """A Router's site in this process on a loopback port, in front of two
    workers (capacity 1 each) on ports of their own."""

    def __init__(self, members: Members, kept_bytes: int):
        from kcoral.common.report import parse_report
        from kcoral.router.service import RouterConfig, build_router

        self.members = members
        self._ports = [reactor.listenTCP(0, members, interface="127.0.0.1") for _ in range(2)]
        self.app, site = build_router(RouterConfig(recovery_threshold=1), reactor)
        site.spool.kept_bytes = kept_bytes
        self.app.pool.report("n", parse_report({
            "session": "s", "gpu_target": "cpu", "runtime": {}, "workers": [
                {"name": f"worker{i}", "url": f"http://127.0.0.1:{port.getHost().port}",
                 "healthy": True, "capacity": 1} for i, port in enumerate(self._ports)]}))
        self.app.pool.observe()
        self._ports.append(reactor.listenTCP(0, site, interface="127.0.0.1"))

    @property
    def port(self) -> int:
        """The Router's port."""
        return self._ports[-1].getHost().port

    async def upload(self, length: int = LARGE, headers: bytes = b"") -> Uploader:
        """A client connected, that has sent the head of a run of C{length} bytes."""
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.port)
        client = await connectProtocol(endpoint, Uploader())
        client.head(length, headers)
        return client

    async def close(self) -> None:
        await self.app.outgoing.close()
        for port in self._ports:
            await port.stopListening()


@pytest.fixture(params=[0, KEPT_BYTES], ids=["on-disk", "in-memory"])
def kept_bytes(request):
    return request.param


@pytest_twisted.async_yield_fixture
async def streaming(request, kept_bytes):
    router = StreamingRouter(Members(*request.param), kept_bytes)
    yield router
    await router.close()


def _digest_of(chunk: bytes, count: int) -> bytes:
    digest = hashlib.sha256()
    for _ in range(count):
        digest.update(chunk)
    return digest.hexdigest().encode()


def _whole(answer: bytes) -> bool:
    head, found, body = answer.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    return bool(found and length and len(body) >= int(length.group(1)))


async def _answer_of(client: Uploader) -> tuple[int, bytes]:
    await until(lambda: client.closed or _whole(client.answer), "an answer", 60)
    status, _, body = parse_raw(client.answer)
    return status, body


@pytest.mark.parametrize("streaming", [(answers_its_digest,)], indirect=True)
@pytest_twisted.ensureDeferred
async def test_a_large_body_reaches_the_member_while_it_arrives(streaming):
    """The Router forwards a body over the spool's threshold before its last byte arrives."""
    chunk = os.urandom(READ_BYTES)
    count = LARGE // READ_BYTES
    client = await streaming.upload(count * READ_BYTES)
    most = client.send(chunk, count - 1)
    await until(lambda: most.done and streaming.members.connections and
                streaming.members.connections[0].count >= READ_BYTES,
                "the body's start at the member", 30)
    [member] = streaming.members.connections
    assert not member.whole
    client.send(chunk)
    status, body = await _answer_of(client)
    assert status == 200 and body == _digest_of(chunk, count)


def _busy_after(size: int) -> Callable[[Member], object]:
    def act(member: Member) -> None:
        if member.count >= size:
            member.answer(503, b'{"error": {"type": "server_busy", "message": "full"}}')
    return act


@pytest.mark.parametrize("streaming", [(_busy_after(READ_BYTES), answers_its_digest),
                                       (_busy_after(LARGE), answers_its_digest)], indirect=True)
@pytest_twisted.ensureDeferred
async def test_a_run_turned_away_is_sent_whole_to_another_member(streaming):
    """A 503 before or after the body has all arrived: another member gets it all, from its start."""
    chunk = os.urandom(READ_BYTES)
    count = LARGE // READ_BYTES
    client = await streaming.upload(count * READ_BYTES)
    client.send(chunk, count)
    status, body = await _answer_of(client)
    first, second = streaming.members.connections
    assert first.answered and second.whole and second.head.startswith(b"POST /v1/run ")
    assert status == 200 and body == _digest_of(chunk, count)


def _lost_after(size: int) -> Callable[[Member], object]:
    def act(member: Member) -> None:
        if member.count >= size:
            member.answered = True
            member.transport.abortConnection()
    return act


@pytest.mark.parametrize("streaming", [(_lost_after(READ_BYTES), answers_its_digest)], indirect=True)
@pytest_twisted.ensureDeferred
async def test_a_member_lost_during_the_body_is_a_502_never_resent(streaming):
    """A connection lost after part of the body was sent: a 502, the rest dropped, no second member."""
    chunk = os.urandom(READ_BYTES)
    client = await streaming.upload(LARGE)
    client.send(chunk, 2 * SPOOL_THRESHOLD // READ_BYTES)
    status, body = await _answer_of(client)
    assert status == 502 and b"node_failure" in body
    assert len(streaming.members.connections) == 1
    await until(lambda: streaming.app.pool.active() == 0, "the lease released", 10)


@pytest.mark.parametrize("streaming", [(lambda member: None,)], indirect=True)
@pytest_twisted.ensureDeferred
async def test_a_client_gone_mid_body_cancels_its_forward(streaming):
    """A client that leaves while its body is being forwarded closes the member's request."""
    chunk = os.urandom(READ_BYTES)
    client = await streaming.upload(LARGE)
    client.send(chunk, 2)
    await until(lambda: streaming.members.connections and streaming.members.connections[0].count
                >= READ_BYTES, "the body's start at the member", 30)
    client.transport.abortConnection()
    [member] = streaming.members.connections
    await until(lambda: member.lost, "the member's request closed", 10)
    await until(lambda: streaming.app.pool.active() == 0, "the lease released", 10)
    assert len(streaming.members.connections) == 1


@pytest.mark.parametrize("streaming", [(answers_its_digest,)], indirect=True)
@pytest_twisted.ensureDeferred
async def test_a_run_refused_at_its_head_closes_its_connection(streaming):
    """A run answered before its body arrived (a bad header) gets its JSON error, and its
    connection closes after it: the rest of the body is dropped, never read as a request."""
    client = await streaming.upload(LARGE, b"X-KCoral-Devices: none\r\n")
    client.send(os.urandom(READ_BYTES), 2)
    status, body = await _answer_of(client)
    assert status == 400 and b"X-KCoral-Devices" in body
    await until(lambda: client.closed, "the connection closed", 10)
    assert streaming.members.connections == []


def _peak_rss() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s*(\d+) kB", status).group(1)) << 10


@pytest.mark.parametrize("streaming", [(answers_its_digest,)], indirect=True)
@pytest_twisted.ensureDeferred
async def test_a_256_mib_body_passes_in_bounded_memory(streaming):
    """256 MiB pass from a client through the Router to a member while this process (all
    three) grows by less than 64 MiB."""
    chunk = os.urandom(READ_BYTES)
    count = 256
    Path("/proc/self/clear_refs").write_text("5")
    before = _peak_rss()
    client = await streaming.upload(count * READ_BYTES)
    client.send(chunk, count)
    status, body = await _answer_of(client)
    assert status == 200 and body == _digest_of(chunk, count)
    assert _peak_rss() - before < 64 << 20


def _send_part_then_read(port: int, head: bytes, part: int) -> bytes:
    """What a blocking client reads after sending C{head} and C{part} bytes of its body (not all
    of it), writing through its socket's buffers before it reads anything."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        chunk = b"x" * (1 << 16)
        for _ in range(part // len(chunk)):
            s.sendall(chunk)
        answer = b""
        while data := s.recv(1 << 16):
            answer += data
        return answer


@pytest.mark.parametrize("streaming", [(answers_its_digest,)], indirect=True)
@pytest.mark.parametrize("extra, status", [(b"X-KCoral-Devices: 64\r\n", 422),
                                           (b"X-KCoral-Devices: none\r\n", 400)])
@pytest_twisted.ensureDeferred
async def test_an_early_answer_reaches_a_client_still_sending_its_body(streaming, extra, status):
    """A run the Router answers before its body has arrived: a client that goes on sending part
    of the body (more than the sockets buffer) then reads gets the JSON answer, not a reset."""
    port = streaming.port
    head = b"POST /v1/run HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n%s\r\n" % (LARGE, extra)
    answer = await deferToThread(_send_part_then_read, port, head, 4 * READ_BYTES)
    got, _, body = parse_raw(answer)
    assert got == status and b'"error"' in body and b"request_id" in body
    assert streaming.members.connections == []


def test_a_body_is_behind_only_when_late_while_a_forward_waits_on_it():
    """A body still arriving is behind when, while a reader last followed it, it arrived under
    the pace a forward asks; time a reader spent paused (the member's) is not counted."""
    clock = Clock()
    body = SpooledBody(10 * PACE_BYTES_PER_SECOND, serial(Threads()), chunks=[], clock=clock)
    consumer = Consumer(pause=False)
    reader = consumer.producer = body.send()
    reader.startProducing(consumer)
    clock.advance(1)
    body.arrived(b"x" * PACE_BYTES_PER_SECOND)
    assert not body.behind()
    reader.pauseProducing()  # the member is slow to read: its time, not the client's
    clock.advance(30)
    assert not body.behind()
    reader.resumeProducing()
    clock.advance(2)
    body.arrived(b"x" * 100)
    assert body.behind()
    reader.stopProducing()  # the forward failed: judged on the time it waited
    clock.advance(30)
    assert body.behind()
    body.arrived(b"x" * (body.length - body.received))
    assert not body.behind()  # all of it arrived: whatever failed, it was not the client


def test_a_streamed_body_under_the_forward_pace_is_refused_once_a_window_ends(tmp_path):
    """A body a forward waits on that keeps the least rate of every body, but not the pace a
    forward asks, is refused with a 408 when its window ends, and its handling is cancelled
    (so its member is freed); time the forward was paused by its member is not counted."""
    post = streamed_post(tmp_path, 64 << 20)
    clock, channel, transport = post.clock, post.channel, post.transport
    reader, gone = post.follow()
    channel.dataReceived(b"f" * (5 * PACE_BYTES_PER_SECOND))
    reader.pauseProducing()
    clock.advance(60)  # the member's time
    reader.resumeProducing()
    for _ in range(int(PACE_WINDOW_SECONDS) - 1):
        clock.advance(1)
        channel.dataReceived(b"t" * 4096)  # well over the least rate of any body
    assert transport.value() == b"" and not gone
    clock.advance(1)
    status, _, body = parse_raw(transport.value())
    assert status == 408 and b"request_timeout" in body
    assert len(gone) == 1 and transport.producerState == "producing"


def test_a_streamed_body_sent_in_tiny_segments_is_kept_in_few_chunks(tmp_path):
    """Tiny segments of a body kept in memory are joined before it keeps them (each kept chunk
    but the last is at least JOIN_BYTES), and a reader still gets every byte, in order."""
    body = os.urandom(3 * JOIN_BYTES + 1000)
    post = streamed_post(tmp_path, len(body))
    channel, request = post.channel, post.request
    consumer = Consumer(pause=False)
    reader = consumer.producer = request.body.send()
    done = reader.startProducing(consumer)
    for start in range(0, len(body), 100):
        channel.dataReceived(body[start:start + 100])
    assert b"".join(consumer.data) == body and done.called
    chunks = request.body.chunks
    assert 1 < len(chunks) <= len(body) // JOIN_BYTES + 1
    assert all(len(chunk) >= JOIN_BYTES for chunk in chunks[:-1])


def test_a_whole_body_is_read_from_its_file_or_its_chunks(tmp_path):
    """SpooledBody.read gives all of a body that has arrived: read from its file in its
    serial's thread, or joined from the chunks it is kept in."""
    data = os.urandom(2 * READ_BYTES + 3)
    file = (tmp_path / "body").open("w+b")
    file.write(data)
    file.flush()
    in_thread = Threads()
    on_file: list = []
    SpooledBody(len(data), serial(in_thread), file, len(data)).read().addCallback(on_file.append)
    assert on_file == []  # nothing read on the calling thread
    in_thread.run()
    in_memory = SpooledBody(len(data), serial(in_thread), chunks=[data[:5], data[5:]]).read()
    assert on_file == [data] and in_memory.result == data
