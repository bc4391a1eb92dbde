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

import numpy as np
import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from kcoral import Program
from kcoral.router.proxy import NotSent
from kcoral.web.body import READ_BYTES, FileReader, MemoryBody, SpooledBody
from kcoral.web.spool import WAITING_BYTES, Serial, Spool
from tests.httputil import ForwardedRequest, connect, fake_site, parse_raw
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
    body = SpooledBody(file, len(data), Serial(threads))
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
    from twisted.internet import reactor

    data = os.urandom(3 * READ_BYTES + 7)
    file = (tmp_path / "body").open("w+b")
    file.write(data)
    file.flush()
    body = SpooledBody(file, len(data), Serial(Spool(reactor).in_thread))
    peer = Peer()
    try:
        url = f"http://127.0.0.1:{peer.serve(_BusyOnce())}"
        with pytest.raises(NotSent):
            await peer.proxy.forward(url, ForwardedRequest(), body)
        answer = await peer.proxy.forward(url, ForwardedRequest(), body)
        assert answer.code == 200 and answer.body == hashlib.sha256(data).hexdigest().encode()
    finally:
        await peer.close()
        await body.close()


# -- through a real Router --------------------------------------------------------------------

@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_large_input_runs_through_a_router(processes):
    """A run with a 24 MiB input, spooled by the Router on its way, gets the right answer."""
    from twisted.internet.threads import deferToThread

    from tests.test_routed import start_node, start_router, until_ready
    from tests.test_server import attempt

    router = await start_router(processes)
    await start_node(processes, router.url, "node-a")
    await until_ready(router, "node-a")
    x = np.arange(6 << 20, dtype=np.float32)  # 24 MiB
    program = Program.from_function(lambda v: (v * 2).sum(), x)
    result = await deferToThread(attempt, router.url, program, x)
    assert float(result) == pytest.approx(float((x * 2).sum()), rel=1e-5)
