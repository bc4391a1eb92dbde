"""
Where a Router's or a gateway's sequence steps go (L{kcoral.router.sequences}):
the rendezvous hash over the members serving the model, the front's memory
of where it placed each START, and the steps of one sequence in turn; then
a front of fake members (a proxy whose answers the test gives) on a fake
clock: each step to its worker, with its client named, never sent twice,
and a worker's 503 its answer.
"""

from __future__ import annotations

import hashlib
import itertools
import json

import attrs
import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock

from kcoral.common.queue import WaitQueue
from kcoral.common.report import ModelState, parse_report
from kcoral.errors import BadRequest, NodeFailure, SequenceLost, ServerBusy, error_body
from kcoral.inference.front import InferCall
from kcoral.inference.grpcmethods import status_code_of
from kcoral.inference.message import GrpcMessage, RestMessage
from kcoral.protocol.sequence import OWNER_HEADER, SequenceControls
from kcoral.router.forward import Forwarder
from kcoral.router.inference import RouterInference
from kcoral.router.member import READY, Member, Node
from kcoral.router.pool import Pool
from kcoral.router.proxy import Answer, NotSent
from kcoral.router.residency import Demand
from kcoral.router.scheduler import Scheduler
from kcoral.router.sequences import SequenceKey, Sequences, candidates, rendezvous
from kcoral.web.body import MemoryBody
from tests.fakes import node_report
from tests.httputil import RUN_CALL

START = SequenceControls(7, start=True)
STEP = SequenceControls(7)
END = SequenceControls(7, end=True)


def serving(node_id: str, name: str, instance: str, model: str = "seq") -> Member:
    """A healthy member of a ready node that has sequence model C{model} ready."""
    member = Member(Node(node_id, None, state=READY), name, f"http://{node_id}-{name}:8000",
                    capacity=1, healthy=True, instance=instance)
    member.serves((ModelState(model, max_batch_size=8, sequence=True),))
    return member


def fleet(count: int) -> list[Member]:
    return [serving(f"n{i // 2}", f"worker{i % 2}", f"{i:016x}") for i in range(count)]


def key(id: int | str = 7, token: bytes | None = b"Bearer a", model: str = "seq") -> SequenceKey:
    return SequenceKey.of(token, model, SequenceControls(id))


ids = st.one_of(st.integers(1, (1 << 64) - 1), st.text(min_size=1, max_size=16))
tokens = st.one_of(st.none(), st.binary(min_size=1, max_size=16))


# -- the rendezvous hash ---------------------------------------------------------------------------

@given(st.lists(ids, min_size=1, max_size=20), st.integers(1, 12), st.randoms())
def test_the_member_is_the_same_whatever_order_members_are_listed_in(sequence_ids, count, random):
    """Fronts that list the same members in any order pick the same one for every sequence."""
    members = fleet(count)
    shuffled = members[:]
    random.shuffle(shuffled)
    for id in sequence_ids:
        assert rendezvous(key(id), members) is rendezvous(key(id), shuffled)


@given(st.lists(ids, min_size=1, max_size=40, unique=True), st.integers(2, 12), st.data())
def test_a_member_that_leaves_moves_only_its_own_sequences(sequence_ids, count, data):
    """With a member gone, every sequence that was elsewhere stays where it was."""
    members = fleet(count)
    gone = data.draw(st.sampled_from(members))
    rest = [m for m in members if m is not gone]
    for id in sequence_ids:
        before = rendezvous(key(id), members)
        if before is not gone:
            assert rendezvous(key(id), rest) is before


@given(st.lists(ids, min_size=1, max_size=40, unique=True), st.integers(1, 12))
def test_a_member_that_joins_takes_only_the_sequences_it_wins(sequence_ids, count):
    """A new member takes some sequences; none moves between the members already there."""
    members = fleet(count)
    joined = serving("new", "worker0", "f" * 16)
    for id in sequence_ids:
        after = rendezvous(key(id), [*members, joined])
        assert after is joined or after is rendezvous(key(id), members)


def test_a_member_that_joins_takes_about_its_share():
    """Of 2,000 sequences over 4 members, a fifth joining takes about a fifth."""
    members = fleet(4)
    joined = serving("new", "worker0", "f" * 16)
    moved = sum(rendezvous(key(id), [*members, joined]) is joined for id in range(2000))
    assert 300 < moved < 500


@given(ids, tokens, tokens)
def test_ids_are_per_client_token(id, first, second):
    """One id of two tokens is two sequences, hashed apart; an integer id and its digits too."""
    assert (key(id, first).point == key(id, second).point) == (first == second)
    if isinstance(id, int):
        assert key(id, first).point != key(str(id), first).point


def test_the_keys_of_two_tokens_spread_independently():
    """The same ids of two clients land on different members as often as chance has it."""
    members = fleet(4)
    same = sum(rendezvous(key(id, b"Bearer a"), members) is rendezvous(key(id, b"Bearer b"), members)
               for id in range(1000))
    assert 150 < same < 350


def test_only_members_that_serve_the_model_ready_are_candidates():
    """Members of a node that is not ready, of no instance, or without the model (or the
    version asked) ready are left out; one this front suspects is not, nor one reported
    unhealthy that names its instance (alive: it holds its sequences still)."""
    members = fleet(6)
    members[0].healthy = False
    members[1].node.state = "unhealthy"
    members[2].instance = None
    members[3].serves((ModelState("other", sequence=True),))
    members[4].suspect = True
    alive = [members[0], *members[4:]]
    assert candidates(members, "seq", None) == alive
    assert candidates(members, "seq", "1") == alive
    assert candidates(members, "seq", "2") == []


# -- the front's memory of STARTs ------------------------------------------------------------------

def test_every_step_goes_to_the_member_its_start_went_to():
    """START, steps and END of a sequence all go to one member, the hash's."""
    members, sequences = fleet(4), Sequences()
    winner = rendezvous(key(), members)
    assert [sequences.place(key(), c, members) for c in (START, STEP, STEP, END)] == [winner] * 4
    assert len(sequences) == 0  # ended: forgotten


@pytest.mark.parametrize("change", ["restarted", "left", "joined", "exited"])
def test_a_step_whose_start_went_to_a_member_that_no_longer_holds_it_is_lost(change):
    """A worker restarted (a new instance), gone, outbid by a new member, or exited (reported
    with no instance): the sequence's next steps are 410 sequence_lost, until a START starts
    it again."""
    members, sequences = fleet(4), Sequences()
    holder = sequences.place(key(), START, members)
    assert holder is not None
    if change == "restarted":
        holder.instance = "e" * 16
    elif change == "left":
        members.remove(holder)
    elif change == "exited":
        holder.healthy, holder.instance = False, None
    else:
        # A member of a name that outbids the holder for this sequence.
        members.append(next(m for i in range(1000)
                            if rendezvous(key(), [holder, m := serving("new", f"w{i}", "d" * 16)])
                            is m))
    now = candidates(members, "seq", None)
    for controls in (STEP, STEP):
        with pytest.raises(SequenceLost) as lost:
            sequences.place(key(), controls, now)
        assert lost.value.status == 410 and lost.value.reason == "sequence_lost"
        assert "sequence_lost" in lost.value.message and "sequence 7 of model 'seq'" in lost.value.message
    assert sequences.place(key(), START, now) is rendezvous(key(), now)
    assert sequences.place(key(), STEP, now) is rendezvous(key(), now)


def test_an_end_of_a_lost_sequence_is_lost_and_forgets_it():
    """The END of a lost sequence is 410 too; after it the id is unknown here, and the hash's
    member answers for it (Triton's 400 for a step without START)."""
    members, sequences = fleet(2), Sequences()
    holder = sequences.place(key(), START, members)
    members.remove(holder)
    with pytest.raises(SequenceLost):
        sequences.place(key(), END, members)
    assert sequences.place(key(), STEP, members) is members[0]


def test_a_sequence_this_front_did_not_start_goes_where_the_hash_says():
    """Another front's sequence, or another client's of the same id, is not this front's to
    call lost: its step goes to the hash's member, whose worker knows or refuses it."""
    members, sequences = fleet(4), Sequences()
    holder = sequences.place(key(token=b"Bearer a"), START, members)
    members.remove(holder)
    other = key(token=b"Bearer b")
    assert sequences.place(other, STEP, members) is rendezvous(other, members)


def test_the_memory_is_bounded_least_recently_stepped_first():
    """Past its bound the front forgets the sequence stepped longest ago, and only it."""
    members, sequences = fleet(2), Sequences(most=2)
    for id in (1, 2):
        sequences.place(key(id), SequenceControls(id, start=True), members)
    sequences.place(key(1), SequenceControls(1), members)  # 1 stepped since 2 was
    sequences.place(key(3), SequenceControls(3, start=True), members)
    assert len(sequences) == 2
    for member in members:
        member.instance = "c" * 16  # every worker restarted
    with pytest.raises(SequenceLost):
        sequences.place(key(1), SequenceControls(1), members)
    # Forgotten: this front no longer knows it started it.
    assert sequences.place(key(2), SequenceControls(2), members) is rendezvous(key(2), members)


operations = st.lists(st.one_of(
    st.tuples(st.sampled_from(["start", "step", "end"]), st.integers(1, 6)),
    st.tuples(st.sampled_from(["leave", "join", "restart"]), st.integers(0, 7))), max_size=60)


@given(operations)
def test_no_step_of_a_sequence_it_started_goes_to_another_worker(schedule):
    """Whatever the starts, steps and ends of several sequences, and members leaving, joining
    and restarting between them: a step of a sequence this front started goes to the worker
    instance its START went to, or is refused 410; a START goes where the hash says."""
    members, sequences, started = fleet(4), Sequences(), {}
    joined = itertools.count()
    for action, n in schedule:
        if action == "leave" and len(members) > 1:
            members.pop(n % len(members))
        elif action == "join":
            members.append(serving("new", f"w{next(joined)}", "d" * 16))
        elif action == "restart" and members:
            members[n % len(members)].instance = f"{next(joined):016x}"
        elif action in ("start", "step", "end"):
            controls = SequenceControls(n, start=action == "start", end=action == "end")
            try:
                member = sequences.place(key(n), controls, members)
            except SequenceLost:
                assert n in started and started[n] != (rendezvous(key(n), members),
                                                        rendezvous(key(n), members).instance)
                if action == "end":
                    del started[n]
                continue
            assert member is rendezvous(key(n), members)
            if action == "start":
                started[n] = (member, member.instance)
            elif n in started:
                assert started[n] == (member, member.instance)
                if action == "end":
                    del started[n]


def test_a_sequence_with_no_member_now_is_placed_nowhere_or_lost():
    """With no candidate a START goes nowhere (the front answers busy); a step of a
    sequence it started is lost."""
    members, sequences = fleet(2), Sequences()
    assert sequences.place(key(1), SequenceControls(1, start=True), []) is None
    sequences.place(key(), START, members)
    with pytest.raises(SequenceLost, match="no member serves it now"):
        sequences.place(key(), STEP, [])


# -- one step at a time ------------------------------------------------------------------------------

def test_the_steps_of_a_sequence_are_sent_one_at_a_time():
    """A sequence's second step is sent once its first is answered; another sequence's at once;
    the turns kept are only those of sequences with steps in flight."""
    sequences, sent, answers = Sequences(), [], {}

    def step(name):
        def send():
            sent.append(name)
            answers[name] = Deferred()
            return answers[name]
        return send

    first = sequences.in_turn(key(1), step("1a"))
    second = sequences.in_turn(key(1), step("1b"))
    other = sequences.in_turn(key(2), step("2a"))
    assert sent == ["1a", "2a"]
    answers["1a"].callback("one")
    assert sent == ["1a", "2a", "1b"] and first.result == "one"
    answers["1b"].errback(BadRequest("refused"))
    assert second.result.check(BadRequest)
    second.addErrback(lambda _: None)
    answers["2a"].callback("two")
    assert other.result == "two"
    assert sequences._turns == {}


def test_a_step_cancelled_while_it_waits_its_turn_is_never_sent():
    """The client of a waiting step went away: it is not sent, and the next step still is."""
    sequences, sent = Sequences(), []
    running: Deferred = Deferred()
    sequences.in_turn(key(), lambda: running)
    gone = sequences.in_turn(key(), lambda: sent.append("gone") or succeed(None))
    after = sequences.in_turn(key(), lambda: sent.append("after") or succeed("ok"))
    gone.cancel()
    assert gone.result.check(CancelledError)
    gone.addErrback(lambda _: None)
    running.callback(None)
    assert sent == ["after"] and after.result == "ok"


# -- a front of fake members -----------------------------------------------------------------------

class HeldProxy:
    """A proxy whose forwards the test answers: each (url, call, body, Deferred) in order."""

    def __init__(self):
        self.forwards: list = []

    def forward(self, url, call, body, traceparent=None):
        d: Deferred = Deferred()
        self.forwards.append((url, call, body, d))
        return d

    def urls(self) -> list[str]:
        """Where each forward went: its member's URL and path."""
        return [url + call.path.decode() for url, call, *_ in self.forwards]


def front(workers: int = 4, model: dict | None = None):
    """A front of one node of C{workers} one-slot workers that have sequence model seq ready."""
    clock = Clock()
    pool = Pool(clock, max_status_age_seconds=5.0, unhealthy_threshold=3, recovery_threshold=1)
    body = node_report(capacities=(1,) * workers)
    for i, worker in enumerate(body["workers"]):
        worker["instance"] = f"{i:016x}"
        worker["models"] = [model or {"name": "seq", "version": "1", "state": "READY",
                                      "max_batch_size": 8, "sequence": True}]
    pool.report("n", parse_report(body))
    pool.observe()
    proxy = HeldProxy()
    forwarder = Forwarder(Scheduler(pool, WaitQueue(clock, 16, 30.0)), proxy, clock)
    inference = RouterInference(pool=pool, forwarder=forwarder, get=None, post=None,
                                is_ready=lambda: True, clock=clock, most_waiting=8)
    return inference, pool, proxy


def rest_step(id, *, start=False, end=False, token: bytes | None = b"Bearer a") -> InferCall:
    body = json.dumps({"inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32",
                                   "data": [1]}],
                       "parameters": {"sequence_id": id, "sequence_start": start,
                                      "sequence_end": end}}).encode()
    return InferCall(RestMessage(body, None), "r1", token=token)


def ok() -> Answer:
    return Answer(200, {}, b'{"outputs": []}')


def test_each_step_goes_to_its_worker_with_its_client_named():
    """A REST sequence's steps all go to the hash's worker, one after the other, naming the
    client by a digest of its token; another client's sequence of the same id is its own."""
    inference, pool, proxy = front()
    members = candidates(pool.ring.members, "seq", None)
    first = inference.infer("seq", None, rest_step(7, start=True))
    second = inference.infer("seq", None, rest_step(7, end=True))
    assert len(proxy.forwards) == 1  # the second waits for the first's answer
    proxy.forwards[0][3].callback(ok())
    assert first.result.body == b'{"outputs": []}'
    proxy.forwards[1][3].callback(ok())
    assert second.result.body == b'{"outputs": []}'
    holder = rendezvous(key(7, b"Bearer a"), members)
    assert proxy.urls() == [holder.url + "/v2/models/seq/infer"] * 2
    headers = dict(proxy.forwards[0][1].headers)
    assert headers[OWNER_HEADER] == hashlib.sha256(b"Bearer a").hexdigest().encode()
    assert b"Bearer a" not in b"".join(value for _, value in proxy.forwards[0][1].headers)
    other = inference.infer("seq", "1", rest_step(7, start=True, token=b"Bearer b"))
    assert proxy.urls()[2] == rendezvous(key(7, b"Bearer b"), members).url \
        + "/v2/models/seq/versions/1/infer"
    proxy.forwards[2][3].callback(ok())
    assert other.called


def test_a_grpc_step_is_placed_as_a_rest_one():
    """A gRPC step names its sequence in its typed parameters: the same worker as over REST."""
    inference, pool, proxy = front()
    pb = service_pb2.ModelInferRequest(model_name="seq")
    pb.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
    pb.raw_input_contents.append(b"\1\0\0\0")
    pb.parameters["sequence_id"].string_param = "abc"
    pb.parameters["sequence_start"].bool_param = True
    inference.infer("seq", None, InferCall(GrpcMessage(pb, pb.ByteSize()), "r1", token=None))
    members = candidates(pool.ring.members, "seq", None)
    assert proxy.urls() == [rendezvous(key("abc", None), members).url + "/v2/models/seq/infer"]
    assert OWNER_HEADER not in dict(proxy.forwards[0][1].headers)  # no token: none named


def test_a_step_lost_on_its_way_is_never_sent_again():
    """The connection to the worker lost after a step was sent: 502, tried nowhere else, even
    where the client allows re-dispatch."""
    inference, pool, proxy = front()
    inference._batcher._forwarder.max_redispatches = 5
    answer = inference.infer("seq", None, rest_step(7, start=True))
    proxy.forwards[0][3].errback(NodeFailure("lost the connection"))
    assert answer.result.check(NodeFailure)
    answer.addErrback(lambda _: None)
    assert len(proxy.forwards) == 1


def test_a_runs_forwarder_sends_a_sequence_demand_once_whatever_its_client_allows():
    """Even a call that consents to a second run is not re-dispatched when its demand is a
    sequence's: its state is on one worker."""
    inference, pool, proxy = front()
    member = candidates(pool.ring.members, "seq", None)[0]
    forwarder = inference._batcher._forwarder
    demand = Demand(Demand.of_model("seq").program, model="seq", kept=member.instance,
                    sequence="sequence 7 of model 'seq'")
    answer = forwarder.forward(attrs.evolve(RUN_CALL, redispatch=True), MemoryBody(b"x"), demand)
    proxy.forwards[0][3].errback(NodeFailure("lost"))
    assert answer.result.check(NodeFailure)
    answer.addErrback(lambda _: None)
    assert len(proxy.forwards) == 1


def test_a_workers_503_is_the_steps_answer_and_the_worker_stays_in_rotation():
    """sequences_full from the sequence's worker reaches the client as it is: no other worker
    may take the step, and the worker is fine."""
    inference, pool, proxy = front()
    answer = inference.infer("seq", None, rest_step(7, start=True))
    url, *_ , d = proxy.forwards[0]
    full = ServerBusy("3 sequences of seq are live", reason="sequences_full")
    d.errback(NotSent(f"{url} turned it away with 503", full))
    assert answer.result.value is full
    answer.addErrback(lambda _: None)
    assert len(proxy.forwards) == 1
    assert all(member.usable for member in pool.ring.members)


def test_a_step_of_a_sequence_whose_worker_restarted_is_lost_through_the_front():
    """The worker a sequence started on reports a new instance: its next step is 410, gRPC
    ABORTED, and nothing is sent."""
    inference, pool, proxy = front()
    inference.infer("seq", None, rest_step(7, start=True))
    proxy.forwards[0][3].callback(ok())
    holder = next(m for m in pool.ring.members if proxy.forwards[0][0] == m.url)
    holder.instance = "a" * 16
    answer = inference.infer("seq", None, rest_step(7))
    lost = answer.result.value
    answer.addErrback(lambda _: None)
    assert isinstance(lost, SequenceLost) and len(proxy.forwards) == 1
    assert status_code_of(lost) == grpc.StatusCode.ABORTED
    assert error_body(lost, "r1")["error"]["type"] == "sequence_lost"


ONE_ROW = {"name": "seq", "version": "1", "state": "READY", "max_batch_size": 1,
           "sequence": True}


def waiting_behind_a_restart():
    """A front of two one-slot workers of a sequence model of one row a batch (a slot a
    step) where sequence 7 started on one: its worker, and another sequence's id there."""
    inference, pool, proxy = front(workers=2, model=ONE_ROW)
    started = inference.infer("seq", None, rest_step(7, start=True))
    proxy.forwards[0][3].callback(ok())
    assert started.called
    holder = next(m for m in pool.ring.members if proxy.forwards[0][0] == m.url)
    other = next(i for i in range(100, 1000)
                 if rendezvous(key(i), candidates(pool.ring.members, "seq", None)) is holder)
    return inference, pool, proxy, holder, other


def restart(pool, holder) -> None:
    body = node_report(capacities=(1, 1))
    for i, worker in enumerate(body["workers"]):
        worker["instance"] = "b" * 16 if worker["name"] == holder.name else f"{i:016x}"
        worker["models"] = [{"name": "seq", "state": "READY", "sequence": True}]
    pool.report("n", parse_report(body))


def test_a_step_waiting_for_a_worker_that_restarts_is_lost():
    """A step waits for its worker's one slot, and the worker restarts: 410, never sent to
    that worker's new instance nor to another."""
    inference, pool, proxy, holder, other = waiting_behind_a_restart()
    busy = inference.infer("seq", None, rest_step(other, start=True))
    waiting = inference.infer("seq", None, rest_step(7))
    assert len(proxy.forwards) == 2
    restart(pool, holder)
    assert waiting.result.check(SequenceLost)
    waiting.addErrback(lambda _: None)
    busy.addErrback(lambda _: None)
    assert len(proxy.forwards) == 2


def test_a_start_waiting_for_a_worker_that_restarts_starts_where_it_now_belongs():
    """A START that waited for a worker that restarted ran nowhere: it is placed again (on
    the new instance, which the hash still picks), not refused."""
    inference, pool, proxy, holder, other = waiting_behind_a_restart()
    busy = inference.infer("seq", None, rest_step(7))
    waiting = inference.infer("seq", None, rest_step(other, start=True))
    assert len(proxy.forwards) == 2
    restart(pool, holder)
    assert len(proxy.forwards) == 2
    proxy.forwards[1][3].callback(ok())  # the slot frees
    assert len(proxy.forwards) == 3 and proxy.forwards[2][0] == holder.url
    assert dict(proxy.forwards[2][1].headers)[OWNER_HEADER]
    proxy.forwards[2][3].callback(ok())
    assert waiting.result.body == busy.result.body == b'{"outputs": []}'


def report_health(pool, unhealthy: str | None) -> None:
    """The node reports its two workers, their instances the same, the one named
    C{unhealthy} unhealthy and without its models, as its supervisor does."""
    body = node_report(capacities=(1, 1))
    for i, worker in enumerate(body["workers"]):
        worker["instance"] = f"{i:016x}"
        worker["healthy"] = worker["name"] != unhealthy
        worker["models"] = [ONE_ROW] if worker["healthy"] else []
    pool.report("n", parse_report(body))


def test_a_start_waits_for_its_worker_while_it_is_reported_unhealthy():
    """A sequence's worker reported unhealthy, its instance the same (it missed probes),
    holds the sequence still: a START of it waits for that worker, not placed on the other
    (which would leave the older state there, for a front that did not see this START to
    step), and goes to it once it is reported healthy again."""
    inference, pool, proxy, holder, _ = waiting_behind_a_restart()
    report_health(pool, unhealthy=holder.name)
    answers: list = []
    inference.infer("seq", None, rest_step(7, start=True)).addBoth(answers.append)
    assert len(proxy.forwards) == 1 and answers == []
    report_health(pool, unhealthy=None)
    assert len(proxy.forwards) == 2 and proxy.forwards[1][0] == holder.url
    proxy.forwards[1][3].callback(ok())
    assert [answer.body for answer in answers] == [b'{"outputs": []}']


def test_a_step_waiting_for_its_unhealthy_worker_is_busy_past_the_queues_wait():
    """A sequence's worker reported unhealthy for good (alive, its instance the same) holds
    its steps no longer than the front's queue wait (30 s here): each is then a 503 saying
    so, never sent, and the front's wait for that worker is let go, so that the worker's
    next step is taken as it comes."""
    inference, pool, proxy, holder, _ = waiting_behind_a_restart()
    clock = inference._clock
    report_health(pool, unhealthy=holder.name)
    answers: list = []
    inference.infer("seq", None, rest_step(7)).addBoth(answers.append)
    for _ in range(7):  # reported as its supervisor does, every 4 s
        report_health(pool, unhealthy=holder.name)
        clock.advance(4)
    assert answers == []
    report_health(pool, unhealthy=holder.name)
    clock.advance(4)
    assert len(answers) == 1 and isinstance(answers[0].value, ServerBusy), answers
    assert answers[0].value.status == 503 and len(proxy.forwards) == 1
    report_health(pool, unhealthy=None)
    again = inference.infer("seq", None, rest_step(7))
    assert len(proxy.forwards) == 2 and proxy.forwards[1][0] == holder.url
    proxy.forwards[1][3].callback(ok())
    assert again.result.body == b'{"outputs": []}'


def test_the_steps_on_one_worker_share_its_slot_up_to_a_batch():
    """Steps of different sequences on one worker ride one slot of it, as many as a batch of
    the model's holds, all forwarded at once (the worker runs them as one execution); one more
    waits for a slot; once they are answered the slot is free."""
    inference, pool, proxy = front(workers=1, model={**ONE_ROW, "max_batch_size": 3})
    [member] = pool.ring.members
    answers = [inference.infer("seq", None, rest_step(id, start=True)) for id in range(1, 5)]
    assert len(proxy.forwards) == 3 and member.active == 1
    for forward in proxy.forwards[:3]:
        forward[3].callback(ok())
    assert len(proxy.forwards) == 4 and member.active == 1
    proxy.forwards[3][3].callback(ok())
    assert member.active == 0 and all(a.result.body == b'{"outputs": []}' for a in answers)
    assert inference._batcher._lanes == {}


def test_a_step_that_goes_away_while_its_lane_waits_frees_its_place():
    """The client of a step waiting for its lane's slot went away: never sent, and the slot,
    once granted to no one, is let go."""
    inference, pool, proxy = front(workers=1, model=ONE_ROW)
    [member] = pool.ring.members
    first = inference.infer("seq", None, rest_step(1, start=True))
    gone = inference.infer("seq", None, rest_step(2, start=True))
    gone.cancel()
    assert gone.result.check(CancelledError)
    gone.addErrback(lambda _: None)
    proxy.forwards[0][3].callback(ok())
    assert first.called and len(proxy.forwards) == 1 and member.active == 0


def test_a_request_that_names_no_sequence_is_refused_in_tritons_words():
    """A sequence model's request without an id: 400 as its worker would say, nothing sent."""
    inference, pool, proxy = front()
    answer = inference.infer("seq", None, rest_step(0, start=True))
    assert "must specify a non-zero or non-empty correlation ID" in answer.result.value.message
    answer.addErrback(lambda _: None)
    assert proxy.forwards == []


def test_malformed_controls_are_a_bad_request():
    """A sequence_start that is no boolean, or a body that is no JSON: 400, nothing sent."""
    inference, pool, proxy = front()
    for message in (RestMessage(b'{"parameters": {"sequence_id": 1, "sequence_start": 1}}', None),
                    RestMessage(b"{nope", None)):
        answer = inference.infer("seq", None, InferCall(message, "r1"))
        assert answer.result.check(BadRequest)
        answer.addErrback(lambda _: None)
    assert proxy.forwards == []


def test_a_model_without_sequence_batching_is_placed_as_before():
    """An id sent to a model that keeps no state is placed as any inference: the queue's
    batch, not the hash (a worker with a free slot takes it)."""
    inference, pool, proxy = front(model={"name": "mlp", "version": "1", "state": "READY",
                                          "max_batch_size": 0})
    answer = inference.infer("mlp", None, rest_step(7, start=True))
    inference._clock.advance(0)
    assert len(proxy.forwards) == 1
    assert OWNER_HEADER not in dict(proxy.forwards[0][1].headers)
    proxy.forwards[0][3].callback(ok())
    assert answer.called


def test_sequence_controls_of_each_message_form():
    """A REST body (JSON or with binary tensors) and a gRPC message give the same controls."""
    header = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "INT32",
                                     "parameters": {"binary_data_size": 4}}],
                         "parameters": {"sequence_id": "s", "sequence_end": True}}).encode()
    binary = RestMessage(header + b"\0" * 4, len(header))
    pb = service_pb2.ModelInferRequest()
    pb.parameters["sequence_id"].string_param = "s"
    pb.parameters["sequence_end"].bool_param = True
    controls = [m.sequence().result for m in (binary, GrpcMessage(pb, pb.ByteSize()))]
    assert controls == [SequenceControls("s", end=True)] * 2
