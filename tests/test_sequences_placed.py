"""
Sequences through the fronts that pick a worker, with real processes and
tritonclient: a node's gateway before two workers (REST, gRPC and gRPC's
stream, two client tokens), and two Routers before one node of two workers.
Every step of a sequence reaches the worker that holds it, sequences spread
over the workers, ids are per client token, a sequence whose worker died is
410 sequence_lost (gRPC ABORTED) and starts again, a sequence started
through one Router goes on through the other, and drawn interleavings of
sequences' requests and worker losses through two Routers answer as each
sequence alone, or as lost.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import attrs
import numpy as np
import pytest
import pytest_twisted
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException
from twisted.internet import reactor, threads
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.threads import blockingCallFromThread

from kcoral.router.member import Member
from kcoral.router.member import Node as PoolNode
from kcoral.router.sequences import SequenceKey, rendezvous
from tests.conftest import server_args
from tests.harness import until
from tests.httputil import request
from tests.test_models import start_grpc_front
from tests.test_routed import Node, start_node, start_router, until_ready
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


def _loads(names=SEQUENCE_MODELS) -> list[str]:
    return ["--model-control-mode", "explicit",
            *(arg for name in names for arg in ("--load-model", name))]


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


def _pid(supervisor, worker: str) -> int:
    """The pid of C{worker}'s latest process, as its C{supervisor} logged it."""
    [pid] = re.findall(r"\(pid (\d+)\)", supervisor.matching(rf"\b{worker} started \(pid \d+\)")[-1])
    return int(pid)


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
    os.kill(_pid(child, holder["name"]), signal.SIGKILL)

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
async def routed(module_processes, tmp_path_factory):
    """Routers A and B, and one node of two CPU workers serving SUMS with
    --batch-invariant (only SUMS: a lost worker starts again sooner) that reports to
    both: the Routers' URLs and the node. A worker is replaced only after 20 failed
    probes in a row, so that one the tests stop for a while is not."""
    root = await _repository(tmp_path_factory)
    both = [await start_router(module_processes, name=f"seq-router-{n}") for n in "ab"]
    node = await start_node(module_processes, ",".join(r.url for r in both), "seq-node",
                            "--cpu-workers", "2", "--model-repository", root, "--batch-invariant",
                            "--failure-threshold", "20", *_loads([SUMS]))
    for router in both:
        await until_ready(router, "seq-node")
        await until(lambda r=router: _sequences_served(r.url), "the models served", 120)
    for worker in (await _nodes(both[0].url))[0]["workers"]:
        health = (await request("GET", worker["url"] + "/health")).json
        assert [m["batch_invariant"] for m in health["models"] if m["name"] == SUMS] == [True]
    return [router.url for router in both], node


@pytest.fixture(scope="module")
def routers(routed):
    """The URLs of L{routed}'s two Routers."""
    return routed[0]


async def _nodes(url: str) -> list[dict]:
    answer = await request("GET", url + "/v1/nodes")
    assert answer.code == 200, answer
    return answer.json["nodes"]


async def _sequences_served(url: str) -> bool | None:
    workers = [w for node in await _nodes(url) for w in node["workers"]]
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
#: A worker's loss in a schedule: which of the two, and the requests sent
#: while it goes, at once (at most one a sequence: two steps of one sequence
#: sent at once through two Routers would race each other to its worker).
losses = st.tuples(st.just("lost"), st.integers(0, 1),
                   st.lists(requests, max_size=6, unique_by=lambda r: r[0]))
#: Seconds a request may take: a step that would hang fails its test instead.
STEP_SECONDS = 30


#: The first id of each schedule's sequences, none used twice in this module: a
#: Router remembers a START it placed whose END went through the other one.
_bases = itertools.count(10_000, 10)


@attrs.define
class Alone:
    """
    What each request of a schedule answers when every sequence's answers
    are those it gets run alone: its running sum (plus its id on its END),
    or Triton's 400 for a step of a sequence its worker does not hold. Once
    a worker is lost, a step through a Router that placed the sequence's
    START on it is 410 C{sequence_lost}, with nothing sent, until that
    Router places a START of it again or forgets it with its END; a step
    sent to the worker as it goes is 502, and is not sent again.
    """

    #: Each sequence's worker, where the rendezvous of its key places it.
    holder: Callable[[int], str]
    #: Each worker's lives: a START is placed on one of them.
    lives: dict[str, int]
    #: The running sums of the sequences their workers hold.
    sums: dict[int, int] = attrs.Factory(dict)
    #: Each Router's placed STARTs: the life of the worker each went to.
    placed: tuple[dict[int, int], dict[int, int]] = attrs.Factory(lambda: ({}, {}))
    #: A worker being lost: its steps are in flight when it dies.
    going: str | None = None

    def answer(self, id: int, router: int, start: bool, end: bool, value: int) -> int | str:
        worker, placed = self.holder(id), self.placed[router]
        if start:
            placed.pop(id, None)
            if not end:
                placed[id] = self.lives[worker]
        elif (placed.pop(id, None) if end else placed.get(id)) not in (None, self.lives[worker]):
            return "410"
        if worker == self.going:
            return "502"
        if not start and id not in self.sums:
            return "400"
        total = value + (0 if start else self.sums[id])
        if end:
            self.sums.pop(id, None)
        else:
            self.sums[id] = total
        return total + (id if end else 0)

    def lose(self, worker: str) -> None:
        """C{worker} died and started again, holding no sequence."""
        self.lives[worker] += 1
        self.going = None
        for id in [id for id in self.sums if self.holder(id) == worker]:
            del self.sums[id]

    def ending(self) -> list[tuple[int, int, bool, bool, int]]:
        """The ENDs of the sequences still held, each through a Router that
        did not place its START on a lost worker."""
        return [(id, 1 if self.placed[1].get(id) in (None, self.lives[self.holder(id)]) else 0,
                 False, True, 0) for id in self.sums]


def _client(url: str) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(url.removeprefix("http://"),
                                            connection_timeout=STEP_SECONDS,
                                            network_timeout=STEP_SECONDS)


def _answer(client, id: int, start: bool, end: bool, value: int) -> int | str:
    """A step's output, or its refusal's status (a 410 only as sequence_lost)."""
    try:
        return _step(client, httpclient, id, value, sequence_start=start, sequence_end=end)
    except InferenceServerException as e:
        return e.message() if e.status() == "410" and "sequence_lost" not in e.message() \
            else e.status()


def _answer_alone(url: str, id: int, start: bool, end: bool, value: int) -> int | str:
    """L{_answer} on a client of its own, for requests sent at once."""
    client = _client(url)
    try:
        return _answer(client, id, start, end, value)
    finally:
        client.close()


async def _members(url: str) -> list[Member]:
    """The workers of the one node the Router at C{url} knows, by name, as members."""
    [reported] = await _nodes(url)
    return sorted((Member(PoolNode(reported["node_id"], None), w["name"], w["url"])
                   for w in reported["workers"]), key=lambda m: m.name)


def _holder(members: list[Member], id: int) -> str:
    """The name of the worker of C{members} that holds sequence C{id} of SUMS."""
    member = rendezvous(SequenceKey(None, SUMS, id), members)
    assert member is not None
    return member.name


@attrs.define
class Interleavings:
    """Schedules of requests and worker losses, sent through L{routed}'s two
    Routers, from a thread: each request's answer against L{Alone}'s."""

    urls: list[str]
    node: Node
    #: The node's workers, by name: each sequence's is the rendezvous of its key over them.
    members: list[Member]
    clients: list = attrs.Factory(list)

    @classmethod
    async def of(cls, routed) -> Interleavings:
        urls, node = routed
        return cls(urls, node, await _members(urls[0]), [_client(url) for url in urls])

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def holder(self, id: int) -> str:
        return _holder(self.members, id)

    def run(self, schedule) -> None:
        base = next(_bases)
        alone = Alone(self.holder, {m.name: 0 for m in self.members})
        got: list[int | str] = []
        want: list[int | str] = []
        for item in schedule:
            if item[0] == "lost":
                self._lose(alone, self.members[item[1]].name,
                           [(base + seq, *rest) for seq, *rest in item[2]], got, want)
            else:
                seq, router, kind, value = item
                self._send(alone, (base + seq, router, kind in ("start", "once"),
                                   kind in ("end", "once"), value), got, want)
        for ended in alone.ending():
            self._send(alone, ended, got, want)
        assert got == want

    def _send(self, alone: Alone, request, got: list, want: list) -> None:
        id, router, start, end, value = request
        want.append(alone.answer(*request))
        got.append(_answer(self.clients[router], id, start, end, value))

    def _lose(self, alone: Alone, worker: str, during: list, got: list, want: list) -> None:
        """
        Lose C{worker} with the requests C{during} sent at once: stopped
        (SIGSTOP), so that those sent to it are still in flight there, and
        killed (SIGKILL) once both Routers report it unhealthy, which they
        learn only after a health probe of it has timed out, long after
        they forwarded its steps. Then its supervisor starts it again, and
        both Routers report its new instance.
        """
        before = blockingCallFromThread(reactor, lambda: Deferred.fromCoroutine(
            _worker_reported(self.urls[0], worker)))
        pid = _pid(self.node.process, worker)
        os.kill(pid, signal.SIGSTOP)
        alone.going = worker
        sent = [(id, router, kind in ("start", "once"), kind in ("end", "once"), value)
                for id, router, kind, value in during]
        wanted = [alone.answer(*request) for request in sent]
        want.extend(wanted)
        # The Routers that forward steps to the stopped worker hold a slot of it.
        holding = {request[1] for request, answer in zip(sent, wanted, strict=True)
                   if answer == "502"}
        with ThreadPoolExecutor(max(len(sent), 1)) as pool:
            answers = [pool.submit(_answer_alone, self.urls[router], id, start, end, value)
                       for id, router, start, end, value in sent]
            self._until(lambda router, r: not r["healthy"] and (r["active"] or router not in holding),
                        worker, "reported unhealthy")
            os.kill(pid, signal.SIGKILL)
            got.extend(answer.result() for answer in answers)
        alone.lose(worker)
        self._until(lambda router, r: r["healthy"]
                    and r["instance"] not in (None, before["instance"])
                    and any(m["name"] == SUMS and m.get("sequence") for m in r["models"]),
                    worker, "started again, serving SUMS")

    def _until(self, condition: Callable[[int, dict], bool], worker: str, what: str) -> None:
        blockingCallFromThread(reactor, lambda: Deferred.fromCoroutine(
            _until_reported(self.urls, worker, condition, what)))


async def _until_reported(urls: list[str], worker: str, condition: Callable[[int, dict], bool],
                          what: str) -> None:
    """Poll until each Router of C{urls} (its index) reports C{worker} as C{condition}
    holds."""
    async def each():
        return all([condition(router, await _worker_reported(url, worker))
                    for router, url in enumerate(urls)])
    await until(each, f"{worker} {what} on both Routers", 120)


async def _worker_reported(url: str, worker: str) -> dict:
    """What the Router at C{url} reports of C{worker}."""
    [reported] = [w for node in await _nodes(url) for w in node["workers"] if w["name"] == worker]
    return reported


async def _interleavings(routed, schedules, examples: int) -> None:
    """Check L{Interleavings} of up to C{examples} of C{schedules}."""
    interleavings = await Interleavings.of(routed)

    @settings(max_examples=examples, deadline=None, database=None)
    @given(schedules)
    def check(schedule):
        interleavings.run(schedule)

    try:
        await threads.deferToThread(check)
    finally:
        interleavings.close()


@pytest_twisted.ensureDeferred
async def test_interleavings_through_two_routers_equal_each_sequence_alone(routed):
    """Any interleaving of starts, steps and ends of six sequences, each request through
    either Router, answers what each sequence alone would: its running sum (plus its id on
    its END), or Triton's 400 for a step of a sequence not live."""
    await _interleavings(routed, st.lists(requests, min_size=1, max_size=24), 40)


#: A step of every sequence through each Router: after a loss, what each says of each.
probes = [(seq, router, "step", 1) for seq in range(6) for router in (0, 1)]
#: Schedules with one or two worker losses, each with requests before it and,
#: after it, L{probes} and more requests.
with_losses = st.tuples(
    st.lists(requests, min_size=1, max_size=10),
    st.lists(st.tuples(losses, st.lists(requests, max_size=10)), min_size=1, max_size=2),
).map(lambda drawn: [*drawn[0], *(item for loss, after in drawn[1]
                                  for item in (loss, *probes, *after))])


@pytest_twisted.ensureDeferred
async def test_interleavings_with_worker_losses_equal_each_sequence_alone_or_are_lost(routed):
    """Interleavings with worker losses (the worker stopped, steps sent to it, killed, started
    again by its supervisor), other sequences' steps in flight meanwhile: a sequence whose
    worker was not lost since its START answers what it would alone; a step of one whose worker
    was, through a Router that placed its START there, is 410 sequence_lost until that Router
    sees its START or END again, and through the other Triton's 400, never an answer from an
    empty state; after a new START through a Router it answers there as alone; a step in
    flight on the lost worker is 502, never sent again; nothing else fails."""
    await _interleavings(routed, with_losses, 4)


async def _queued(url: str) -> int:
    """The requests waiting for capacity on the Router at C{url}."""
    metrics = (await request("GET", url + "/metrics")).body.decode()
    return int(float(re.search(r"^kcoral_queued_requests (\S+)$", metrics, re.M).group(1)))


@pytest_twisted.ensureDeferred
async def test_a_start_waits_for_its_worker_while_it_misses_probes(routed):
    """A worker stopped until both Routers report it unhealthy, then continued (its
    instance the same), holds its sequences still: a START of one of them through A
    meanwhile waits for it (queued on A), not started on the other worker, so that both
    Routers' steps then find the state of that START, never the one before it."""
    urls, node = routed
    id = next(_bases)
    worker = _holder(await _members(urls[0]), id)
    assert await threads.deferToThread(_answer_alone, urls[0], id, True, False, 5) == 5
    before = await _worker_reported(urls[0], worker)
    pid = _pid(node.process, worker)
    os.kill(pid, signal.SIGSTOP)
    try:
        await _until_reported(urls, worker, lambda _, r: not r["healthy"], "reported unhealthy")
        again = threads.deferToThread(_answer_alone, urls[0], id, True, False, 7)
        await until(lambda: again.called or _queued(urls[0]), "the START answered or queued", 30)
    finally:
        os.kill(pid, signal.SIGCONT)
    await _until_reported(urls, worker, lambda _, r: r["healthy"], "reported healthy again")
    assert (await _worker_reported(urls[0], worker))["instance"] == before["instance"]
    assert await again == 7
    assert await threads.deferToThread(_answer_alone, urls[1], id, False, False, 1) == 8
    assert await threads.deferToThread(_answer_alone, urls[0], id, False, True, 1) == 9 + id
