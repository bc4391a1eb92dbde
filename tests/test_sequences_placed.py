"""
Sequences through the fronts that pick a worker, with real processes and
tritonclient: a node's gateway before two workers (REST, gRPC and gRPC's
stream, two client tokens), and two Routers before one node of two workers.
Every step of a sequence reaches the worker that holds it, sequences spread
over the workers, ids are per client token, a sequence whose worker died is
410 sequence_lost (gRPC ABORTED) and starts again, and a sequence started
through one Router goes on through the other.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import pytest_twisted
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException
from twisted.internet import threads
from twisted.internet.defer import Deferred, gatherResults

from tests.conftest import server_args
from tests.harness import until
from tests.httputil import request
from tests.test_models import start_grpc_front
from tests.test_routed import start_node, start_router, until_ready
from tests.test_sequences import EXAMPLES, SEQUENCE_MODELS, _mixed_stream

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TOKENS = ("alpha-token", "beta-token")
SUMS = "simple_string_dyna_sequence"


def _auth(token: str) -> dict:
    # Lower case, as gRPC's metadata keys must be.
    return {"authorization": f"Bearer {token}"}


async def _repository(tmp_path_factory) -> str:
    """The sequence clients' models, SUMS's sequences kept ten minutes idle: a slow shared
    machine never frees one between two steps."""
    root = tmp_path_factory.mktemp("sequences") / "repo"
    await threads.deferToThread(subprocess.run, [sys.executable, str(EXAMPLES), str(root),
                                                 "--sequences"], check=True, timeout=300)
    (root / SUMS / "config.json").write_text(json.dumps(
        {"sequence_batching": {"max_sequence_idle_microseconds": 600_000_000}}))
    return str(root)


def _loads() -> list[str]:
    return ["--model-control-mode", "explicit",
            *(arg for name in SEQUENCE_MODELS for arg in ("--load-model", name))]


@pytest_twisted.async_fixture(scope="module")
async def gateway(module_processes, tmp_path_factory):
    """A node's gateway before two CPU workers serving the sequence models to
    the clients of TOKENS: its REST host:port, gRPC address, URL and process."""
    root = await _repository(tmp_path_factory)
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text("".join(f"{token}\n" for token in TOKENS))
    args = server_args("--model-repository", root, "--grpc-port", "0", *_loads(),
                       "--client-tokens-file", str(tokens))
    address, url, child = await start_grpc_front(module_processes, "gateway", args)
    await until(lambda: _workers_ready(url), "both workers ready", 120)
    return url.removeprefix("http://"), address, url, child


async def _workers(url: str) -> list[dict]:
    answer = await request("GET", url + "/v1/nodes", headers=_auth(TOKENS[0]))
    assert answer.code == 200, answer
    return [worker for node in answer.json["nodes"] for worker in node["workers"]]


async def _workers_ready(url: str) -> bool | None:
    workers = await _workers(url)
    return len(workers) == 2 and all(
        w["healthy"] and {m["name"] for m in w["models"] if m.get("sequence")}
        == set(SEQUENCE_MODELS) for w in workers) or None


async def _live(worker_url: str) -> int:
    """How many sequences of SUMS the worker at C{worker_url} holds."""
    metrics = (await request("GET", worker_url + "/metrics")).body.decode()
    found = re.search(rf'kcoral_sequences_live{{model="{SUMS}"}} (\S+)', metrics)
    return int(float(found.group(1))) if found else 0


def _input(module, value: int):
    tensor = module.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.full((1, 1), value, np.int32))
    return [tensor]


def _step(client, module, id, value: int, token: str | None = None, **controls) -> int:
    headers = _auth(token) if token else None
    result = client.infer(SUMS, _input(module, value), sequence_id=id, headers=headers, **controls)
    return int(result.as_numpy("OUTPUT")[0, 0])


def _started(module, address: str, token: str, firsts: dict) -> list[int]:
    """Start each sequence of C{firsts} (id: first value): each first output."""
    client = module.InferenceServerClient(address)
    try:
        return [_step(client, module, id, first, token, sequence_start=True)
                for id, first in firsts.items()]
    finally:
        client.close()


def _ended(module, address: str, token: str, lasts: dict) -> dict:
    """Step each sequence of C{lasts} (id: value) once more, then end it with 0:
    each one's (step output, last output)."""
    client = module.InferenceServerClient(address)
    try:
        stepped = {id: _step(client, module, id, value, token) for id, value in lasts.items()}
        return {id: (stepped[id], _step(client, module, id, 0, token, sequence_end=True))
                for id in lasts}
    finally:
        client.close()


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["rest", "grpc"])
@pytest_twisted.ensureDeferred
async def test_sequences_spread_over_the_workers_and_each_keeps_its_state(gateway, module):
    """Twelve live sequences through the gateway are held by both workers between them, and
    each one's running sum is its own; ended, none is left."""
    rest, grpc_address, url, _ = gateway
    address = rest if module is httpclient else grpc_address
    ids = {1000 + i: 10 * i for i in range(12)}
    firsts = await threads.deferToThread(_started, module, address, TOKENS[0], ids)
    assert firsts == list(ids.values())
    held = [await _live(worker["url"]) for worker in await _workers(url)]
    assert sum(held) == 12 and min(held) >= 1, held
    got = await threads.deferToThread(_ended, module, address, TOKENS[0],
                                      dict.fromkeys(ids, 1))
    assert got == {id: (first + 1, first + 1 + id) for id, first in ids.items()}
    assert [await _live(worker["url"]) for worker in await _workers(url)] == [0, 0]


def _streamed(address: str, token: str) -> list:
    """Three sequences of SUMS sent at once on one gRPC stream, their steps interleaved:
    each answer's (request id, output) in order."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(address)
    values = [5, 1, 2, 3, 0]
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result),
                            headers=_auth(token))
        for i, value in enumerate(values):
            for id in (21, 22, "s23"):
                client.async_stream_infer(SUMS, _input(grpcclient, value), request_id=f"{id}_{i}",
                                          sequence_id=id, sequence_start=i == 0,
                                          sequence_end=i == len(values) - 1)
        got = [answers.get(timeout=120) for _ in range(3 * len(values))]
    finally:
        client.stop_stream()
        client.close()
    assert not [r for r in got if isinstance(r, InferenceServerException)], got
    return [(r.get_response().id, int(r.as_numpy("OUTPUT")[0, 0])) for r in got]


@pytest_twisted.ensureDeferred
async def test_a_streams_steps_reach_their_workers_in_order(gateway):
    """Steps sent at once on a stream each reach their sequence's worker in the order sent:
    every running sum is right, and answers come in order."""
    got = await threads.deferToThread(_streamed, gateway[1], TOKENS[0])
    sums = {21: 0, 22: 0, "s23": 0}
    want = []
    for i, value in enumerate([5, 1, 2, 3, 0]):
        for id in sums:
            sums[id] += value
            # The last step adds the correlation id (a string's: its FNV-1a hash, low 32 bits
            # of an int32 output; only the integer ids' are checked here).
            want.append((f"{id}_{i}", sums[id] + (id if i == 4 and isinstance(id, int) else 0)))
    assert [g for g in got if not g[0].startswith("s23_4")] == \
        [w for w in want if not w[0].startswith("s23_4")]


@pytest_twisted.ensureDeferred
async def test_large_and_small_steps_keep_their_order_through_a_gateway(gateway):
    """Through a node's gateway, a stream's small step sent after a large
    one (over 64 KiB, read in a thread) does not overtake it: every step is
    answered, in order, with the running sum up to it."""
    values = list(range(1, 11))
    got = await threads.deferToThread(_mixed_stream, gateway[1], values, _auth(TOKENS[0]))
    assert got == [sum(values[:i + 1]) for i in range(len(values) - 1)] + [sum(values) + 21]


def _two_clients(address: str, module) -> tuple[list[int], list[int]]:
    """Sequence 5 of each token, stepped in turn: each one's outputs."""
    client = module.InferenceServerClient(address)
    try:
        outputs: tuple[list[int], list[int]] = ([], [])
        for i, (a, b) in enumerate([(1, 100), (2, 200), (3, 300)]):
            for token, value, out in ((TOKENS[0], a, outputs[0]), (TOKENS[1], b, outputs[1])):
                out.append(_step(client, module, 5, value, token, sequence_start=i == 0,
                                 sequence_end=i == 2))
        return outputs
    finally:
        client.close()


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["rest", "grpc"])
@pytest_twisted.ensureDeferred
async def test_ids_are_per_client_token(gateway, module):
    """Two clients' sequences of one id are two sequences, each with its own sum."""
    address = gateway[0] if module is httpclient else gateway[1]
    first, second = await threads.deferToThread(_two_clients, address, module)
    assert first == [1, 3, 6 + 5]
    assert second == [100, 300, 600 + 5]


def _claimed(address: str) -> str:
    """The first token's client starts sequence 6 naming the second's as its owner; the
    second's client then steps its own sequence 6: what it is told."""
    client = httpclient.InferenceServerClient(address)
    try:
        client.infer(SUMS, _input(httpclient, 1), sequence_id=6, sequence_start=True,
                     headers={**_auth(TOKENS[0]),
                              "x-kcoral-sequence-owner": f"Bearer {TOKENS[1]}"})
        with pytest.raises(InferenceServerException) as refused:
            _step(client, httpclient, 6, 1, TOKENS[1])
        _step(client, httpclient, 6, 0, TOKENS[0], sequence_end=True)
        return refused.value.message()
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_a_client_cannot_name_another_as_its_sequences_owner(gateway):
    """A gateway keys a client's sequences by the token it authenticated with, whatever owner
    the request names: another client's sequence of the same id is not it."""
    message = await threads.deferToThread(_claimed, gateway[0])
    assert "must specify the START flag" in message


def _refused(module, address: str, token: str, id) -> InferenceServerException:
    client = module.InferenceServerClient(address)
    try:
        with pytest.raises(InferenceServerException) as refused:
            _step(client, module, id, 1, token)
        return refused.value
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_a_sequence_whose_worker_died_is_lost_and_starts_again(gateway):
    """The worker holding a live sequence is killed: the sequence's next steps are 410
    sequence_lost (gRPC ABORTED), never a sum from an empty state; a START starts it again."""
    rest, grpc_address, url, child = gateway
    id = 4242
    await threads.deferToThread(_started, httpclient, rest, TOKENS[1], {id: 7})
    workers = await _workers(url)
    [holder] = [w for w in workers if await _live(w["url"]) >= 1]
    started = child.matching(rf"{holder['name']} started \(pid \d+\)")[-1]
    pid = int(re.search(r"\(pid (\d+)\)", started).group(1))
    os.kill(pid, signal.SIGKILL)

    async def moved():
        now = {w["name"]: w for w in await _workers(url)}[holder["name"]]
        return (not now["healthy"] or now["instance"] != holder["instance"]) or None
    await until(moved, "the killed worker reported down or restarted", 60)
    refused = await threads.deferToThread(_refused, httpclient, rest, TOKENS[1], id)
    assert refused.status() == "410" and "sequence_lost" in refused.message()
    refused = await threads.deferToThread(_refused, grpcclient, grpc_address, TOKENS[1], id)
    assert refused.status() == "StatusCode.ABORTED" and "sequence_lost" in refused.message()
    await until(lambda: _workers_ready(url), "both workers ready again", 120)
    again = await threads.deferToThread(_started, httpclient, rest, TOKENS[1], {id: 9})
    assert again == [9]
    assert await threads.deferToThread(_ended, httpclient, rest, TOKENS[1], {id: 1}) == \
        {id: (10, 10 + id)}


@pytest_twisted.async_fixture(scope="module")
async def routers(module_processes, tmp_path_factory):
    """Routers A and B, and one node of two CPU workers serving the sequence models that
    reports to both: the Routers' URLs."""
    root = await _repository(tmp_path_factory)
    both = [await start_router(module_processes, name=f"seq-router-{n}") for n in "ab"]
    await start_node(module_processes, ",".join(r.url for r in both), "seq-node",
                     "--cpu-workers", "2", "--model-repository", root, *_loads())
    for router in both:
        await until_ready(router, "seq-node")
        await until(lambda r=router: _sequences_served(r.url), "the models served", 120)
    return [router.url for router in both]


async def _sequences_served(url: str) -> bool | None:
    answer = await request("GET", url + "/v1/nodes")
    workers = [w for node in answer.json["nodes"] for w in node["workers"]]
    return len(workers) == 2 and all(
        w["healthy"] and any(m["name"] == SUMS and m.get("sequence") for m in w["models"])
        for w in workers) or None


def _across(addresses: list[str], ids: list[int]) -> dict:
    """Each of C{ids} started through the first Router, stepped through the second, ended
    through the first: each one's outputs."""
    clients = [httpclient.InferenceServerClient(a) for a in addresses]
    try:
        outputs: dict = {id: [] for id in ids}
        for client, controls, value in ((clients[0], {"sequence_start": True}, 3),
                                        (clients[1], {}, 4),
                                        (clients[0], {"sequence_end": True}, 5)):
            for id in ids:
                outputs[id].append(_step(client, httpclient, id, value, **controls))
        return outputs
    finally:
        for client in clients:
            client.close()


@pytest_twisted.ensureDeferred
async def test_a_sequence_goes_on_through_another_router(routers):
    """With no store the Routers share, each derives the same worker for a sequence: steps
    through A, then B, then A all find their state."""
    addresses = [url.removeprefix("http://") for url in routers]
    got = await threads.deferToThread(_across, addresses, list(range(300, 308)))
    assert got == {id: [3, 7, 12 + id] for id in range(300, 308)}


@pytest_twisted.ensureDeferred
async def test_two_clients_use_both_routers_at_once(routers):
    """Two clients at once, each with eight sequences started through one Router and stepped
    through the other (in opposite orders): every sum is right."""
    addresses = [url.removeprefix("http://") for url in routers]
    results = await gatherResults([
        Deferred.fromCoroutine(_in_thread(_across, addresses[::step], list(range(base, base + 8))))
        for step, base in ((1, 400), (-1, 500))], consumeErrors=True)
    for base, got in zip((400, 500), results, strict=True):
        assert got == {id: [3, 7, 12 + id] for id in range(base, base + 8)}


async def _in_thread(f, *args):
    return await threads.deferToThread(f, *args)


#: One request of a schedule: which sequence, through which Router, what it
#: says (a START, a step, an END, or a START that is also the END), its value.
requests = st.tuples(st.integers(0, 5), st.integers(0, 1),
                     st.sampled_from(["start", "step", "end", "once"]), st.integers(0, 100))


@pytest_twisted.ensureDeferred
async def test_interleavings_through_two_routers_equal_each_sequence_alone(routers):
    """Any interleaving of starts, steps and ends of six sequences, each request through
    either Router, answers what each sequence alone would: its running sum (plus its id on
    its END), or Triton's 400 for a step of a sequence not live."""
    clients = [httpclient.InferenceServerClient(url.removeprefix("http://")) for url in routers]
    bases = itertools.count(10_000, 10)

    @settings(max_examples=40, deadline=None, database=None)
    @given(st.lists(requests, min_size=1, max_size=24))
    def check(schedule):
        base, live = next(bases), {}
        got, want = [], []

        def send(id: int, router: int, start: bool, end: bool, value: int) -> None:
            if not start and id not in live:
                want.append("400")
            else:
                live[id] = value + (0 if start else live[id])
                want.append(live[id] + (id if end else 0))
                if end:
                    del live[id]
            try:
                got.append(_step(clients[router], httpclient, id, value, sequence_start=start,
                                 sequence_end=end))
            except InferenceServerException as e:
                got.append(e.status())

        for seq, router, kind, value in schedule:
            send(base + seq, router, kind in ("start", "once"), kind in ("end", "once"), value)
        for id in list(live):
            send(id, 1, False, True, 0)
        assert got == want

    try:
        await threads.deferToThread(check)
    finally:
        for client in clients:
            client.close()
