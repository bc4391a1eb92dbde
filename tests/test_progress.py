"""
Progress bars for large uploads (C{progress=True}), against a real server:
a body of 64 MiB or more shows a bar, on the captured standard error, that
reaches the body's size; smaller bodies, and clients without C{progress},
write nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import pytest_twisted
from tqdm import tqdm
from twisted.internet.threads import deferToThread

from kcoral import AsyncClient, Client, Program
from kcoral.client.progress import PROGRESS_BYTES

pytestmark = pytest.mark.integration

jax = pytest.importorskip("jax")

#: One input that makes the body just over the bar's threshold.
LARGE = np.full(PROGRESS_BYTES // 4, 0.5, np.float32)


@pytest.fixture(scope="module")
def total():
    return Program.from_function(lambda x: x.sum(), LARGE)


def finished_bar(length: int) -> str:
    """What a bar that has counted C{length} bytes of C{length} shows."""
    size = tqdm.format_sizeof(length, divisor=1024)
    return f"100%|██████████| {size}/{size} "


def run_blocking(url: str, program: Program, array: np.ndarray, progress: bool) -> int:
    with Client(url, progress=progress) as client:
        assert client.run(program, array) == pytest.approx(array.sum())
        return client.bytes_sent


@pytest_twisted.ensureDeferred
async def test_blocking_client_shows_a_bar(server, total, capsys):
    """Client(progress=True) shows a bar over the whole of a body over 64 MiB, named after the URL."""
    sent = await deferToThread(run_blocking, server.url, total, LARGE, True)
    assert sent > PROGRESS_BYTES
    shown = capsys.readouterr().err
    assert f"upload to {server.url}: " in shown
    assert finished_bar(sent) in shown


@pytest_twisted.ensureDeferred
async def test_no_bar_unasked_or_small(server, total, capsys):
    """Without progress, or for a body under 64 MiB, the client writes nothing."""
    await deferToThread(run_blocking, server.url, total, LARGE, False)
    small = Program.from_function(lambda x: x.sum(), LARGE[:1024])
    await deferToThread(run_blocking, server.url, small, LARGE[:1024], True)
    assert capsys.readouterr() == ("", "")


@pytest_twisted.ensureDeferred
async def test_async_client_shows_a_bar(server, total, capsys):
    """AsyncClient(progress=True) counts the body as treq writes it, to the end."""
    client = AsyncClient(server.url, progress=True)
    try:
        assert await client.run(total, LARGE) == pytest.approx(LARGE.sum())
    finally:
        await client.close()
    assert client.bytes_sent > PROGRESS_BYTES
    assert finished_bar(client.bytes_sent) in capsys.readouterr().err
