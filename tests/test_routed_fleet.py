"""
Integration test of content shared by a fleet of clients, with real
processes on loopback and real JAX: a C{kcoral router} (its default body
limit) with two CPU nodes, and fresh clients that know nothing of what the
workers hold.
"""

from __future__ import annotations

import numpy as np
import pytest
import pytest_twisted
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.threads import deferToThread

from kcoral import AsyncClient, Client, Program
from kcoral.client.exchange import REFERENCE_FIRST_BYTES
from tests.test_routed import metrics_of, start_node, start_router, until_ready
from tests.test_server import sample

pytestmark = pytest.mark.integration


async def conflicts(urls: list[str]) -> float:
    """The 409s the workers at C{urls} answered to runs, together."""
    return sum([sample(await metrics_of(url), "kcoral_http_requests_total", route="/v1/run",
                       code="409") for url in urls])


def run_fresh(url: str, program: Program, *args) -> tuple[np.ndarray, int]:
    """A run by a new blocking client: its outputs, and the bytes it sent."""
    with Client(url, busy_timeout=30) as client:
        return client.run(program, *args), client.bytes_sent


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_a_second_fresh_client_does_not_upload_the_weights_again(processes):
    """Weights one client uploaded through a Router are not uploaded by the
    next fresh client: it sends them by reference, and the Router places its
    run on the worker that holds them (no 409, a body of a few KiB)."""
    router = await start_router(processes)
    a, b = await gatherResults([
        Deferred.fromCoroutine(start_node(processes, router.url, node_id))
        for node_id in ("node-a", "node-b")], consumeErrors=True)
    await until_ready(router, "node-a", "node-b")
    workers = [a.worker_url, b.worker_url]

    weights = np.random.default_rng(3).standard_normal(REFERENCE_FIRST_BYTES, np.float32)
    x = np.float32(2)
    program = Program.from_function(lambda w, v: (w * v).sum(), weights, x)
    expected = (weights * x).sum()

    first = AsyncClient(router.url, busy_timeout=30)
    try:
        got = await first.run(program, weights, x)
    finally:
        await first.close()
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    # Its reference first drew a 409, and then it sent them inline, once.
    assert first.bytes_sent > weights.nbytes
    assert await conflicts(workers) == 1

    got, sent = await deferToThread(run_fresh, router.url, program, weights, x)
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    assert sent < weights.nbytes // 64
    assert await conflicts(workers) == 1
