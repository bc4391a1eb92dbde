"""
Kept arrays placed and freed for the user, with real processes on three
shapes of service: a standalone server, a node of two CPU workers behind its
gateway, and a Router over two nodes. doc/kept.rst's two loops, read from
the page and run as they are written, equal the same loops in process bit
for bit; a tree is put in one request, on one worker, beside the client's
other arrays or beside a given one; arrays no longer referenced are freed on
their workers, and a client's close frees the rest unless told to keep them.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import attrs
import jax
import numpy as np
import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread

from kcoral import ArrayLost, AsyncClient, Client, Program, RemoteArray
from kcoral.protocol.wire import holder_of
from tests.conftest import _echo, server_args, server_env
from tests.harness import SERVER_READY, ProcessGroup, until
from tests.test_kept import assert_same, mlp_data, mlp_step, requests_answered
from tests.test_node_multi import node_args
from tests.test_node_multi import start_node as start_gateway_node
from tests.test_routed import start_node, start_router, until_ready
from tests.test_server import metrics, sample

pytestmark = pytest.mark.integration

jnp = jax.numpy

DOC = Path(__file__).resolve().parent.parent / "doc" / "kept.rst"


def documented_loops() -> list[str]:
    """The code of doc/kept.rst's first two literal blocks, as written there."""
    text = DOC.read_text()
    blocks = re.findall(r"::\n\n((?:   .*\n|\n)+)", text)
    return [re.sub(r"^   ", "", block, flags=re.MULTILINE) for block in blocks[:2]]


@attrs.define
class Shape:
    """A service under test: its URL, and where its workers' /metrics are."""

    name: str
    url: str
    workers: list[str]

    async def kept_arrays(self) -> float:
        """The kept arrays of all its workers, from each one's /metrics."""
        return sum([sample(await metrics(_Url(url)), "kcoral_kept_arrays") for url in self.workers])

    async def requests(self) -> float:
        """The runs, fetches and deletes all its workers answered."""
        return sum([await requests_answered(_Url(url)) for url in self.workers])


@attrs.frozen
class _Url:
    url: str


async def _start(group: ProcessGroup, name: str) -> Shape:
    if name == "server":
        server = await group.start_service(server_args(), name="kept-server", ready=SERVER_READY,
                                           env=server_env())
        return Shape(name, server.url, [server.url])
    if name == "node":
        node = await start_gateway_node(group, node_args(), name="kept-node", workers=2)
        return Shape(name, node.url, list((await node.worker_urls()).values()))
    router = await start_router(group, name="kept-router")
    for node_id in ("kept-a", "kept-b"):
        await start_node(group, router.url, node_id, "--startup-grace-seconds", "10")
    nodes = await until_ready(router, "kept-a", "kept-b")
    return Shape(name, router.url, [w["url"] for n in nodes.values() for w in n["workers"]])


@pytest_twisted.async_yield_fixture(scope="module", params=["server", "node", "router"])
async def shape(request):
    """Each shape of service in turn, started once for the tests that use it."""
    group = ProcessGroup(reactor, _echo())
    try:
        yield await _start(group, request.param)
    finally:
        await group.stop_all()


def train_step(params, x, y):
    return mlp_step(params, x, y)


def decode_step(params, cache, token, pos):
    """A decoder's step in small: (the cache with row C{pos} filled, the next token)."""
    row = jnp.tanh(cache.sum(axis=0) @ params["w"] + params["b"] * token.astype(jnp.float32)
                   + pos.astype(jnp.float32))
    cache = jax.lax.dynamic_update_slice(cache, row[None], (pos, 0))
    return cache, jnp.argmax(jnp.sin(row * np.float32(3.7))).astype(jnp.int32)


def decode_data():
    rng = np.random.default_rng(3)
    params = {"w": rng.normal(0, 0.3, (8, 8)).astype(np.float32),
              "b": rng.normal(0, 0.3, 8).astype(np.float32)}
    return params, np.zeros((16, 8), np.float32), np.int32(1), np.int32(0)


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_the_documented_training_loop_runs_as_written(shape):
    """doc/kept.rst's training loop, as written, equals the loop in process bit for bit."""
    params, _, _ = mlp_data()
    rng = np.random.default_rng(11)
    batches = [(rng.normal(size=(8, 64)).astype(np.float32),
                rng.normal(size=(8, 1)).astype(np.float32)) for _ in range(5)]
    x, y = batches[0]
    names = {"url": shape.url, "train_step": train_step, "params": params, "x": x, "y": y,
             "batches": batches, "jax": jax, "numpy": np}
    training, _ = documented_loops()
    await deferToThread(exec, training, names)

    local, jitted = params, jax.jit(train_step)
    for x, y in batches:
        local, loss = jitted(local, x, y)
    for name in params:
        assert_same(names["params"][name], np.asarray(local[name]))
    assert_same(np.asarray(names["loss"]), np.asarray(loss))
    # The client's close freed what it kept.
    assert await shape.kept_arrays() == 0


@pytest_twisted.ensureDeferred
async def test_the_documented_decoding_loop_runs_as_written(shape):
    """doc/kept.rst's decoding loop as written: a request a token, equal to the loop in process bitwise."""
    params, cache, token, pos = decode_data()
    _, decoding = documented_loops()
    step = Program.from_function(decode_step, params, cache, token, pos)
    client = Client(shape.url)
    names = {"client": client, "Program": Program, "decode_step": decode_step, "params": params,
             "cache": cache, "token": token, "pos": pos, "length": 12}
    try:
        # The program, compiled once before the loop is counted.
        await deferToThread(client.run, step, params, cache, token, pos)
        before = await shape.requests()
        await deferToThread(exec, decoding, names)
        # Two puts, then one request a token; behind a Router, the first
        # step may find the program not yet on the worker of the arrays:
        # sent again with it, once.
        assert await shape.requests() - before <= 2 + 12 + (shape.name != "server")
        local, jitted = cache, jax.jit(decode_step)
        for at in range(12):
            local, token = jitted(params, local, token, np.int32(at))
        assert_same(await deferToThread(names["cache"].fetch), np.asarray(local))
        assert int(names["token"]) == int(token)
        assert holder_of(names["cache"].id) == holder_of(names["params"]["w"].id)
        assert await shape.kept_arrays() == 3  # the weights and the last cache
    finally:
        await deferToThread(client.close)
    assert await shape.kept_arrays() == 0


@pytest_twisted.ensureDeferred
async def test_a_tree_is_put_in_one_request_on_one_worker(shape):
    """put(tree): one request, the tree's structure of RemoteArrays, all on one worker; near= keeps beside."""
    params, _, _ = mlp_data()
    client = Client(shape.url)
    try:
        before = await shape.requests()
        remote = await deferToThread(client.put, params)
        assert await shape.requests() - before == 1
        assert jax.tree.structure(remote) == jax.tree.structure(params)
        assert all(isinstance(leaf, RemoteArray) for leaf in jax.tree.leaves(remote))
        assert len({holder_of(leaf.id) for leaf in jax.tree.leaves(remote)}) == 1
        fetched = await deferToThread(jax.tree.map, np.asarray, remote)
        for name in params:
            assert np.array_equal(fetched[name], params[name])
        # Beside a given array, from another client that holds nothing.
        with Client(shape.url) as other:
            beside = await deferToThread(lambda: other.put(np.arange(5), near=remote["b1"]))
            assert holder_of(beside.id) == holder_of(remote["b1"].id)
            assert (await deferToThread(beside.fetch)).tolist() == list(range(5))
    finally:
        await deferToThread(client.close)


@pytest_twisted.ensureDeferred
async def test_a_fresh_run_keeps_its_outputs_beside_the_clients_arrays(shape):
    """A run naming no kept array keeps its outputs on the worker of the client's arrays, every time."""
    double = Program.from_function(lambda v: v * 2, np.zeros(3, np.float32))
    with Client(shape.url) as client:
        first = await deferToThread(client.put, np.ones(3, np.float32))
        outputs = [await deferToThread(client.run, double, np.full(3, n, np.float32), keep=True)
                   for n in range(6)]
        assert {holder_of(o.id) for o in outputs} == {holder_of(first.id)}
        assert (await deferToThread(outputs[-1].fetch)).tolist() == [10.0] * 3


@pytest_twisted.ensureDeferred
async def test_arrays_no_longer_referenced_are_freed(shape):
    """A loop with no delete leaves only the arrays still referenced; the last reference frees the rest."""
    params, x, y = mlp_data()
    step = Program.from_function(mlp_step, params, x, y)
    client = Client(shape.url)
    leaves = len(params)

    def loop():
        remote = client.put(params)
        losses = []
        for _ in range(50):
            remote, loss = client.run(step, remote, x, y, keep=True)
            losses.append(loss)  # referenced: kept
        return remote, losses[-3:]

    try:
        remote, losses = await deferToThread(loop)
        gc.collect()
        await until(lambda: _equal(shape.kept_arrays(), leaves + 3),
                    "only the referenced arrays kept", 30)
        del remote, losses
        gc.collect()
        await until(lambda: _equal(shape.kept_arrays(), 0), "every array freed", 30)
    finally:
        await deferToThread(client.close)


@inlineCallbacks
def _equal(count, expected: int):
    return (yield count) == expected


@pytest_twisted.ensureDeferred
async def test_close_frees_what_the_client_holds_unless_told_to_keep(shape):
    """Client.close() frees its arrays, referenced or not; with keep_on_close=True they stay, still usable."""
    freed, kept = Client(shape.url), Client(shape.url, keep_on_close=True)
    gone = await deferToThread(freed.put, {"a": np.ones(3, np.float32), "b": np.int32(2)})
    stays = await deferToThread(kept.put, np.arange(4, dtype=np.float32))
    await deferToThread(freed.close)
    await deferToThread(kept.close)
    assert await shape.kept_arrays() == 1
    with pytest.raises(ArrayLost):
        await deferToThread(gone["a"].fetch)
    with Client(shape.url) as reader:
        assert (await deferToThread(reader.fetch, stays)).tolist() == [0, 1, 2, 3]
        await deferToThread(reader.delete, stays)
    assert await shape.kept_arrays() == 0


@pytest_twisted.ensureDeferred
async def test_the_async_client_puts_together_and_frees(shape):
    """AsyncClient: puts together, beside its arrays; unreferenced arrays freed, close frees the rest."""
    params, _, _ = mlp_data()
    client = AsyncClient(shape.url, busy_timeout=30)
    try:
        remote = await client.put(params)
        one = await client.put(np.float32(1))
        beside = await client.put(np.float32(2), near=remote["w1"])
        assert len({holder_of(a.id) for a in [*jax.tree.leaves(remote), one, beside]}) == 1
        assert (await beside.fetch()) == np.float32(2)
        del remote, beside
        gc.collect()
        await until(lambda: _equal(shape.kept_arrays(), 1), "the unreferenced arrays freed", 30)
    finally:
        await client.close()
    assert await shape.kept_arrays() == 0
    reader = AsyncClient(shape.url)
    try:
        with pytest.raises(ArrayLost):
            await reader.fetch(one)
    finally:
        await reader.close()
