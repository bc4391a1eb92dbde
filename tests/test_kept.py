"""
Kept arrays with real processes: a training loop whose parameters stay on
the worker, equal bit for bit to the same loop in process; the bound on kept
bytes; one kept array used through two Routers in front of one node, with
no state shared between them; and a worker killed under its kept arrays.
"""

from __future__ import annotations

import os
import signal

import attrs
import numpy as np
import pytest
import pytest_twisted
from twisted.internet.defer import gatherResults
from twisted.internet.threads import deferToThread

from kcoral import ArrayLost, AsyncClient, Client, Program, ProgramRejected, RemoteArray
from kcoral.errors import KeptMemoryFull
from tests.conftest import TEST_GPUS
from tests.test_routed import pool_nodes, start_node, start_router, until_ready
from tests.test_server import metrics, sample

pytestmark = pytest.mark.integration

jax = pytest.importorskip("jax")
jnp = jax.numpy

STEPS = 20
RATE = np.float32(0.002)


def mlp_step(params, x, y):
    """One SGD step of a two-layer MLP on a squared loss: (new params, loss)."""

    def loss_of(p):
        hidden = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((hidden @ p["w2"] + p["b2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_of)(params)
    return jax.tree.map(lambda p, g: p - RATE * g, params, grads), loss


def mlp_data():
    rng = np.random.default_rng(7)
    params = {"w1": rng.normal(0, 0.1, (64, 512)).astype(np.float32),
              "b1": np.zeros(512, np.float32),
              "w2": rng.normal(0, 0.1, (512, 1)).astype(np.float32),
              "b2": np.zeros(1, np.float32)}
    x = rng.normal(size=(8, 64)).astype(np.float32)
    y = rng.normal(size=(8, 1)).astype(np.float32)
    return params, x, y


def assert_same(fetched, expected):
    # Bit for bit where the worker runs on this process's device kind.
    if TEST_GPUS:
        np.testing.assert_allclose(fetched, expected, rtol=1e-5, atol=1e-6)
    else:
        assert np.array_equal(fetched, expected)


@pytest_twisted.ensureDeferred
async def test_a_training_loop_keeps_its_parameters_on_the_worker(start_server):
    """20 SGD steps on kept parameters send less than them once and equal the loop in process bit for bit."""
    server = await start_server()
    params, x, y = mlp_data()
    step = Program.from_function(mlp_step, params, x, y)

    def train():
        with Client(server.url) as client:
            remote = jax.tree.map(client.put, params)
            client.run(step, remote, x, y)  # sends the program, once
            sent = client.bytes_sent
            losses = []
            for _ in range(STEPS):
                new, loss = client.run(step, remote, x, y, keep=True)
                client.delete(*jax.tree.leaves(remote))
                remote = new
                losses.append(loss.fetch())
            return client.bytes_sent - sent, jax.tree.map(np.asarray, remote), losses, remote

    sent, fetched, losses, remote = await deferToThread(train)
    assert losses[-1] < losses[0]
    assert all(isinstance(leaf, RemoteArray) for leaf in jax.tree.leaves(remote))
    nbytes = sum(a.nbytes for a in jax.tree.leaves(params))
    assert sent < nbytes, f"{STEPS} steps sent {sent} bytes, the parameters are {nbytes}"

    local, expected = params, []
    jitted = jax.jit(mlp_step)
    for _ in range(STEPS):
        local, loss = jitted(local, x, y)
        expected.append(np.asarray(loss))
    for name in params:
        assert_same(fetched[name], np.asarray(local[name]))
    assert_same(np.array(losses), np.array(expected))
    samples = await metrics(server)
    assert sample(samples, "kcoral_kept_arrays") == len(params) + STEPS
    assert sample(samples, "kcoral_kept_bytes") == nbytes + 4 * STEPS


@pytest_twisted.ensureDeferred
async def test_outputs_past_the_kept_bound_are_refused_before_the_run(start_server):
    """Kept outputs past --kept-bytes are 507 kept_memory_full, not run; fetched outputs still run."""
    server = await start_server("--kept-bytes", "1000")
    program = Program.from_function(lambda v: jnp.zeros(1000, jnp.float32) + v, np.float32(0))

    def runs():
        with Client(server.url) as client:
            with pytest.raises(KeptMemoryFull) as refused:
                client.run(program, np.float32(1), keep=True)
            return refused.value, client.run(program, np.float32(1))

    refused, fetched = await deferToThread(runs)
    assert refused.status == 507 and refused.reason == "kept_memory_full"
    assert fetched.tolist() == [1.0] * 1000
    samples = await metrics(server)
    assert sample(samples, "kcoral_executions_total", outcome="ok") == 1
    assert sample(samples, "kcoral_kept_arrays") == 0


@pytest_twisted.async_fixture(scope="module")
async def two_routers(module_processes):
    """Routers A and B, with no state shared, in front of one node that reports to both."""
    both = [await start_router(module_processes, name=f"kept-router-{n}") for n in "ab"]
    node = await start_node(module_processes, ",".join(r.url for r in both), "kept-node",
                            "--cpu-workers", "2", "--startup-grace-seconds", "10")
    for router in both:
        await until_ready(router, "kept-node")
    return both, node


@pytest_twisted.ensureDeferred
async def test_a_kept_array_is_used_through_either_router(two_routers):
    """An array kept through Router A runs, fetches and deletes through Router B, on its worker."""
    (a, b), _ = two_routers
    double = Program.from_function(lambda v: v * 2, np.zeros(3, np.float32))
    via_a, via_b = AsyncClient(a.url, busy_timeout=30), AsyncClient(b.url, busy_timeout=30)
    try:
        kept = await via_a.put(np.arange(3, dtype=np.float32))
        # Every run of it, through either Router, lands on its worker.
        for _ in range(4):
            doubled = await via_b.run(double, kept, keep=True)
            assert (await via_b.fetch(doubled)).tolist() == [0, 2, 4]
            assert (await via_a.run(double, doubled)).tolist() == [0, 4, 8]
        assert (await via_b.fetch(kept)).tolist() == [0, 1, 2]
        await via_b.delete(kept)
        with pytest.raises(ArrayLost) as lost:
            await via_a.run(double, kept)
        assert lost.value.status == 410 and lost.value.lost == [kept.id]
    finally:
        await gatherResults([via_a.close(), via_b.close()])


@pytest_twisted.ensureDeferred
async def test_arrays_kept_on_two_workers_are_apart(two_routers):
    """A run of arrays kept on two different workers is 422 arrays_apart."""
    (a, _), _ = two_routers
    add = Program.from_function(lambda u, v: u + v, np.float32(0), np.float32(0))
    client = AsyncClient(a.url, busy_timeout=30)
    try:
        one = await client.put(np.float32(1))
        instances = {w["instance"] for w in (await pool_nodes(a))["kept-node"]["workers"]}
        [elsewhere] = instances - {one.id.partition("-")[0]}
        other = RemoteArray(attrs.evolve(one.reference, kept=f"{elsewhere}-{'0' * 16}"), client)
        with pytest.raises(ProgramRejected) as apart:
            await client.run(add, one, other)
        assert apart.value.status == 422 and apart.value.reason == "arrays_apart"
        await client.delete(one)
    finally:
        await client.close()


@pytest_twisted.ensureDeferred
async def test_a_killed_workers_arrays_are_lost_and_named(two_routers):
    """A SIGKILLed worker's arrays are ArrayLost, named, in runs and fetches through either Router."""
    (a, b), node = two_routers
    add = Program.from_function(lambda u, v: u + v, np.zeros(2, np.float32), np.zeros(2, np.float32))
    client = AsyncClient([a.url], busy_timeout=30)
    try:
        u = await client.put(np.ones(2, np.float32))
        v = await client.run(add, u, u, keep=True)
        holder = u.id.partition("-")[0]
        nodes = await pool_nodes(a)
        worker = next(w["name"] for w in nodes["kept-node"]["workers"]
                      if w.get("instance") == holder)
        pid = int(node._last(rf"{worker} started \(pid (\d+)\)").group(1))
        mark = node.process.mark()
        os.kill(pid, signal.SIGKILL)
        await node.process.wait_for_line(rf"{worker} is ready at", 60, since=mark)
        for router in (a, b):
            lost_via = AsyncClient(router.url, busy_timeout=30)
            try:
                with pytest.raises(ArrayLost) as lost:
                    await lost_via.run(add, u, v)
                assert set(lost.value.lost) == {u.id, v.id}
                with pytest.raises(ArrayLost) as lost:
                    await lost_via.fetch(v)
                assert lost.value.lost == [v.id]
            finally:
                await lost_via.close()
    finally:
        await client.close()


@pytest_twisted.ensureDeferred
async def test_the_async_client_keeps_and_fetches(two_routers):
    """AsyncClient's run(keep=True) gives RemoteArrays in the program's structure, fetched as Deferreds."""
    (a, _), _ = two_routers
    pair = Program.from_function(lambda v: {"twice": v * 2, "key": jax.random.key(1)}, np.float32(0))
    client = AsyncClient(a.url, busy_timeout=30)
    try:
        out = await client.run(pair, np.float32(2), keep=True)
        assert isinstance(out["twice"], RemoteArray) and out["twice"].shape == ()
        assert await out["twice"].fetch() == np.float32(4)
        key = await out["key"].fetch()
        assert jax.random.key_data(key).tolist() == jax.random.key_data(jax.random.key(1)).tolist()
        await client.delete(*jax.tree.leaves(out))
    finally:
        await client.close()
