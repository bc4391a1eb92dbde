"""
Kept arrays with real processes: a training loop whose parameters stay on
the worker, equal bit for bit to the same loop in process; a decoding loop
of one request a step (its token back, its cache kept, the old cache freed),
through a server and through two Routers; deletes of many arrays in one
request; the bound on kept bytes; one kept array used through two Routers in
front of one node, with no state shared between them; and a worker killed
under its kept arrays.
"""

from __future__ import annotations

import os
import signal

import attrs
import jax
import numpy as np
import pytest
import pytest_twisted
from twisted.internet.defer import gatherResults
from twisted.internet.threads import deferToThread

from kcoral import ArrayLost, AsyncClient, Client, Program, ProgramRejected, RemoteArray
from kcoral.errors import KeptMemoryFull
from kcoral.protocol.wire import REQUEST_CONTENT_TYPE, decode_result, encode_request, wire_array
from tests.conftest import TEST_GPUS
from tests.httputil import request
from tests.test_routed import pool_nodes, start_node, start_router, until_ready
from tests.test_server import metrics, sample

pytestmark = pytest.mark.integration

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
        # The losses stay referenced, and kept past the client's end.
        with Client(server.url, keep_on_close=True) as client:
            remote = jax.tree.map(client.put, params)
            client.run(step, remote, x, y)  # sends the program, once
            sent = client.bytes_sent
            losses, kept_losses = [], []
            for _ in range(STEPS):
                new, loss = client.run(step, remote, x, y, keep=True)
                client.delete(*jax.tree.leaves(remote))
                remote = new
                kept_losses.append(loss)
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


TOKENS = 12
ROWS = 16


def decode_step(cache, token, pos):
    """A decoder's step in small: (the next token, the cache with row C{pos} filled)."""
    row = jnp.tanh(cache.sum(axis=0) * np.float32(0.5) + token.astype(jnp.float32)
                   + jnp.arange(8, dtype=jnp.float32) * pos.astype(jnp.float32))
    cache = jax.lax.dynamic_update_slice(cache, row[None], (pos, 0))
    return jnp.argmax(jnp.sin(row * np.float32(3.7))).astype(jnp.int32), cache


def decode_program():
    return Program.from_function(decode_step, np.zeros((ROWS, 8), np.float32), np.int32(0),
                                 np.int32(0))


def decoded_in_process() -> tuple[list[int], np.ndarray]:
    step, cache, token, tokens = jax.jit(decode_step), np.zeros((ROWS, 8), np.float32), np.int32(1), []
    for pos in range(TOKENS):
        token, cache = step(cache, token, np.int32(pos))
        tokens.append(int(token))
    return tokens, np.asarray(cache)


async def requests_answered(service) -> float:
    """The runs, fetches and deletes C{service} answered (not its nodes' reports, nor scrapes)."""
    samples = await metrics(service)
    return sum(value for (name, labels), value in samples.items()
               if name == "kcoral_http_requests_total"
               and dict(labels)["route"] in ("/v1/run", "/v1/arrays", "/v1/arrays/{id}"))


@pytest_twisted.ensureDeferred
async def test_a_decoding_step_is_one_request(start_server):
    """keep=(False, True), free=cache: one request a token; tokens and cache equal in-process, bit for bit."""
    server = await start_server()
    program = decode_program()

    def decode():
        client = Client(server.url)
        cache = client.put(np.zeros((ROWS, 8), np.float32))
        first = cache
        token, tokens = np.int32(1), []
        client.run(program, cache, token, np.int32(0))  # sends the program, once
        return client, first, cache, token, tokens

    client, first, cache, token, tokens = await deferToThread(decode)
    before = await requests_answered(server)

    def steps():
        nonlocal cache, token
        for pos in range(TOKENS):
            token, cache = client.run(program, cache, token, np.int32(pos), keep=(False, True),
                                      free=cache)
            tokens.append(int(token))

    try:
        await deferToThread(steps)
        assert await requests_answered(server) - before == TOKENS
        expected_tokens, expected_cache = decoded_in_process()
        assert tokens == expected_tokens
        assert_same(await deferToThread(cache.fetch), expected_cache)
        samples = await metrics(server)
        assert sample(samples, "kcoral_kept_arrays") == 1
        with pytest.raises(ArrayLost) as lost:
            await deferToThread(first.fetch)
        assert lost.value.lost == [first.id]
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_a_failed_run_frees_nothing(start_server):
    """A run refused before it runs (507), or naming a lost array, frees none of what it was to free."""
    server = await start_server("--kept-bytes", "1024")
    program = decode_program()

    def runs():
        with Client(server.url, keep_on_close=True) as client:
            cache = client.put(np.ones((ROWS, 8), np.float32))  # 512 B
            with pytest.raises(KeptMemoryFull):
                client.run(program, cache, np.int32(1), np.int32(0), keep=True, free=cache)
            gone = client.put(np.float32(0))
            client.delete(gone)
            with pytest.raises(ArrayLost) as lost:
                client.run(program, cache, np.int32(1), np.int32(0), free=(cache, gone))
            return cache.fetch(), lost.value.lost

    kept_cache, lost = await deferToThread(runs)
    assert kept_cache.tolist() == np.ones((ROWS, 8), np.float32).tolist()
    assert len(lost) == 1
    assert sample(await metrics(server), "kcoral_kept_arrays") == 1


@pytest_twisted.ensureDeferred
async def test_one_delete_frees_many_arrays_in_one_request(start_server):
    """Client.delete of several arrays is one request; each is then 410 in a fetch, a run and a delete."""
    server = await start_server()
    double = Program.from_function(lambda v: v * 2, np.float32(0))

    def put():
        client = Client(server.url)
        return client, [client.put(np.float32(n)) for n in range(3)]

    client, arrays = await deferToThread(put)
    try:
        before = await requests_answered(server)
        await deferToThread(client.delete, *arrays)
        assert await requests_answered(server) - before == 1
        assert sample(await metrics(server), "kcoral_kept_arrays") == 0
        for use in (arrays[0].fetch, lambda: client.run(double, arrays[1]), arrays[2].delete):
            with pytest.raises(ArrayLost) as lost:
                await deferToThread(use)
            assert lost.value.status == 410
    finally:
        client.close()


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


def frame_of(program: Program, *inputs) -> bytes:
    """The body of a run of C{program} on C{inputs}, as L{encode_request} takes them."""
    parts, _ = encode_request(program.digest, program.serialized, inputs)
    return b"".join(bytes(part) for part in parts)


@pytest_twisted.ensureDeferred
async def test_a_run_named_by_its_kept_header_alone_reaches_its_array(two_routers):
    """A run with the kept header and no program header runs on its array's worker, every time;
    one with kept inputs and no kept header is a bad request, never told its array is lost."""
    (a, _), _ = two_routers
    double = Program.from_function(lambda v: v * 2, np.zeros(3, np.float32))
    client = AsyncClient(a.url, busy_timeout=30)
    try:
        kept = await client.put(np.arange(3, dtype=np.float32))
        body = frame_of(double, kept.reference)
        # Two workers: a run placed by load alone would miss it about half the time.
        for _ in range(8):
            ran = await request("POST", a.url + "/v1/run", body=body, headers={
                "Content-Type": REQUEST_CONTENT_TYPE, "X-KCoral-Kept": kept.id})
            assert ran.code == 200, ran
            assert decode_result(ran.body)[0].tolist() == [0, 2, 4]
        # Without the header it cannot be routed: refused as such wherever it lands, never a 410.
        for _ in range(8):
            unrouted = await request("POST", a.url + "/v1/run", body=body, headers={
                "Content-Type": REQUEST_CONTENT_TYPE, "X-KCoral-Program": double.digest})
            assert unrouted.code == 400 and "X-KCoral-Kept must list" in unrouted.error()["message"]
        await client.delete(kept)
    finally:
        await client.close()


@pytest_twisted.ensureDeferred
async def test_kept_ids_are_checked_alike_on_every_route(two_routers):
    """A malformed kept id is 400 in a run's header, a path or a delete's header, at a Router and a worker."""
    (a, _), _ = two_routers
    double = Program.from_function(lambda v: v * 2, np.float32(0))
    worker = (await pool_nodes(a))["kept-node"]["workers"][0]["url"]
    body = frame_of(double, (wire_array(np.float32(1)), None, True))
    for base in (a.url, worker):
        for program in ({}, {"X-KCoral-Program": double.digest}):
            refused = await request("POST", base + "/v1/run", body=body, headers={
                "Content-Type": REQUEST_CONTENT_TYPE, "X-KCoral-Kept": "../../x", **program})
            assert refused.code == 400 and refused.error()["type"] == "bad_request", refused
        for method in ("GET", "DELETE"):
            refused = await request(method, base + "/v1/arrays/zzzz")
            assert refused.code == 400 and refused.error()["type"] == "bad_request", refused
        refused = await request("DELETE", base + "/v1/arrays", headers={"X-KCoral-Kept": "zzzz"})
        assert refused.code == 400 and refused.error()["type"] == "bad_request", refused
        assert (await request("GET", base + "/health")).code == 200


@pytest_twisted.ensureDeferred
async def test_a_decoding_loop_runs_through_either_router(two_routers):
    """Decoding steps through Routers A and B in turn: one request each, equal in-process; old caches 410."""
    (a, b), _ = two_routers
    program = decode_program()
    via = [AsyncClient(a.url, busy_timeout=30), AsyncClient(b.url, busy_timeout=30)]
    try:
        cache = first = await via[0].put(np.zeros((ROWS, 8), np.float32))
        token, tokens = np.int32(1), []
        await via[1].run(program, cache, token, np.int32(0))  # the program, once
        before = [await requests_answered(r) for r in (a, b)]
        for pos in range(TOKENS):
            token, cache = await via[pos % 2].run(program, cache, token, np.int32(pos),
                                                  keep=(False, True), free=cache)
            tokens.append(int(token))
        after = [await requests_answered(r) for r in (a, b)]
        assert [n - m for n, m in zip(after, before)] == [TOKENS // 2, TOKENS // 2]
        expected_tokens, expected_cache = decoded_in_process()
        assert tokens == expected_tokens
        assert_same(await cache.fetch(), expected_cache)
        with pytest.raises(ArrayLost):
            await via[1].run(program, first, token, np.int32(0))
        await via[0].delete(cache)
    finally:
        await gatherResults([c.close() for c in via])


@pytest_twisted.ensureDeferred
async def test_arrays_kept_on_two_workers_are_apart(two_routers):
    """A run, or one delete, of arrays kept on two different workers is 422 arrays_apart."""
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
        # One delete naming both is refused whole at the Router; the client sends one to each.
        refused = await request("DELETE", a.url + "/v1/arrays",
                                headers={"X-KCoral-Kept": f"{one.id},{other.id}"})
        assert refused.code == 422 and refused.json["error"]["reason"] == "arrays_apart"
        with pytest.raises(ArrayLost) as lost:
            await client.delete(other, one)  # the one gone first: the other is freed all the same
        assert lost.value.lost == [other.id]
        with pytest.raises(ArrayLost):
            await client.fetch(one)
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
