"""
Progress bars for large uploads (C{progress=True}), against a real server:
a body of 64 MiB or more shows a bar, on the captured standard error, that
reaches the body's size; smaller bodies, and clients without C{progress},
write nothing.
"""

from __future__ import annotations

from io import BytesIO

import numpy as np
import pytest
import pytest_twisted
from tqdm import tqdm
from twisted.internet.task import Cooperator
from twisted.internet.testing import StringTransport
from twisted.internet.threads import deferToThread
from twisted.web.client import FileBodyProducer

from kcoral import AsyncClient, Client, Program
from kcoral.client.progress import PROGRESS_BYTES, CountingProducer, upload_bar

jax = pytest.importorskip("jax")

@pytest.fixture(scope="module")
def large() -> np.ndarray:
    """One input that makes the body just over the bar's threshold."""
    return np.full(PROGRESS_BYTES // 4, 0.5, np.float32)


@pytest.fixture(scope="module")
def total(large):
    return Program.from_function(lambda x: x.sum(), large)


def finished_bar(length: int) -> str:
    """What a bar that has counted C{length} bytes of C{length} shows."""
    size = tqdm.format_sizeof(length, divisor=1024)
    return f"100%|██████████| {size}/{size} "


def run_blocking(url: str, program: Program, array: np.ndarray, progress: bool) -> int:
    with Client(url, progress=progress) as client:
        assert client.run(program, array) == pytest.approx(array.sum())
        return client.bytes_sent


def test_counting_producer_counts_each_piece():
    """CountingProducer passes a body on unchanged and counts each piece as it is written."""
    steps: list = []
    # One piece a step, each step run by hand: the cooperator's clock is ours.
    cooperator = Cooperator(terminationPredicateFactory=lambda: lambda: True, scheduler=steps.append)
    body = bytes(range(256)) * 1000
    counted: list[int] = []
    producer = CountingProducer(FileBodyProducer(BytesIO(body), cooperator, readSize=10_000),
                                counted.append)
    assert producer.length == len(body)
    consumer = StringTransport()
    done = producer.startProducing(consumer)
    while steps:
        steps.pop(0)()
    assert done.called
    assert consumer.value() == body
    assert counted == [10_000] * (len(body) // 10_000) + [len(body) % 10_000]


def test_no_bar_under_the_threshold():
    """A body under 64 MiB gets no bar."""
    assert upload_bar(PROGRESS_BYTES - 1, "http://127.0.0.1:9000") is None


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_blocking_client_shows_a_bar(server, total, large, capsys):
    """Client(progress=True) shows a bar over the whole of a body over 64 MiB, named after the URL."""
    sent = await deferToThread(run_blocking, server.url, total, large, True)
    assert sent > PROGRESS_BYTES
    shown = capsys.readouterr().err
    assert f"upload to {server.url}: " in shown
    assert finished_bar(sent) in shown


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_no_bar_unasked_or_small(server, total, large, capsys):
    """Without progress, or for a body under 64 MiB, the client writes nothing."""
    await deferToThread(run_blocking, server.url, total, large, False)
    small = Program.from_function(lambda x: x.sum(), large[:1024])
    await deferToThread(run_blocking, server.url, small, large[:1024], True)
    assert capsys.readouterr() == ("", "")


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_async_client_shows_a_bar(server, total, large, capsys):
    """AsyncClient(progress=True) counts the body as treq writes it, to the end."""
    # Weights the server has not seen: those it holds go by reference.
    unseen = large + 0.25
    client = AsyncClient(server.url, progress=True)
    try:
        assert await client.run(total, unseen) == pytest.approx(unseen.sum())
    finally:
        await client.close()
    assert client.bytes_sent > PROGRESS_BYTES
    assert finished_bar(client.bytes_sent) in capsys.readouterr().err
