"""
The client's side of a run (kcoral.client.exchange), driven step by step with
the answers a server gives: what goes inline and what by reference (large
content by reference first), the one resend after 409, retries of 503 within
the busy timeout (honouring Retry-After), and errors that are never retried.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("jax")

from kcoral import BadRequest, NodeFailure, Program, ProgramFailed, ProgramRejected, ServerBusy
from kcoral.client.exchange import REFERENCE_FIRST_BYTES, Response, RunCall, Send, Sleep, exchange
from kcoral.errors import MissingContent, error_body
from kcoral.protocol.wire import (
    CACHE_THRESHOLD_BYTES,
    PROGRAM_HEADER,
    decode_request,
    encode_result,
    sha256,
    wire_array,
)
from tests.programs import references


@pytest.fixture(scope="module")
def program():
    weights = np.zeros(CACHE_THRESHOLD_BYTES // 4, np.float32)  # large: content-addressed
    return Program.from_function(lambda w, x: (w.sum() + x, x), weights, np.float32(1))


@pytest.fixture
def inputs():
    return np.arange(CACHE_THRESHOLD_BYTES // 4, dtype=np.float32), np.float32(2)


class FakeTime:
    """The exchange's clock; Sleep steps advance it."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def ok(outputs) -> Response:
    parts, _ = encode_result(outputs)
    return Response(200, b"".join(bytes(p) for p in parts))


def error(status: int, exception, retry_after=None) -> Response:
    return Response(status, json.dumps(error_body(exception, "rid")).encode(), retry_after)


class Driver:
    """Runs an exchange, answering each Send from a script."""

    def __init__(self, program, args, held=None, busy_timeout=10.0, request_id=None):
        self.clock = FakeTime()
        self.held = set() if held is None else held
        self.call = RunCall.prepare(program, args, {})
        self.steps = exchange(self.call, self.held, busy_timeout=busy_timeout,
                              request_id=request_id, clock=self.clock)
        self.sent: list = []
        self.lengths: list[int] = []
        self.slept: list[float] = []

    def run(self, *answers):
        answers = list(answers)
        answer = None
        while True:
            try:
                step = self.steps.send(answer)
            except StopIteration as done:
                return done.value
            if isinstance(step, Send):
                self.sent.append(decode_request(b"".join(bytes(p) for p in step.parts)))
                self.lengths.append(step.length)
                self.headers = step.headers
                answer = answers.pop(0)
            else:
                assert isinstance(step, Sleep)
                self.slept.append(step.seconds)
                self.clock.now += step.seconds
                answer = None


def test_first_call_sends_everything_then_references(program, inputs):
    """A first run sends the program and large inputs inline; a second, knowing them held, sends digests."""
    w, x = inputs
    outputs = [np.float32(3), np.float32(2)]
    first = Driver(program, inputs, request_id="r-1")
    result = first.run(ok(outputs))
    assert isinstance(result, tuple) and result[1] == 2
    [sent] = first.sent
    assert sent.program.data is not None and sent.program.digest == program.digest
    assert sent.inputs[0].blob.digest == sha256(wire_array(w)) and sent.inputs[0].blob.data is not None
    assert sent.inputs[1].blob.digest is None  # small: always inline, never hashed
    assert first.held == {program.digest, sha256(wire_array(w))}
    assert first.headers[PROGRAM_HEADER] == program.digest
    assert first.headers["X-Request-ID"] == "r-1"

    second = Driver(program, inputs, held=first.held)
    second.run(ok(outputs))
    [sent] = second.sent
    assert references(sent) == [program.digest, sha256(wire_array(w))]
    assert sent.inputs[1].blob.data is not None


def test_a_409_is_answered_by_resending_inline_once(program, inputs):
    """After a 409 the run is sent again once, with all its content inline: behind
    a Router the resend may reach a worker that lacks what the first one held."""
    w, _ = inputs
    held = {program.digest, sha256(wire_array(w))}
    driver = Driver(program, inputs, held=held)
    missing = MissingContent("gone", details={"missing": [sha256(wire_array(w))]})
    driver.run(error(409, missing), ok([np.float32(3), np.float32(2)]))
    first, second = driver.sent
    assert len(references(first)) == 2
    assert references(second) == []
    assert second.program.data is not None and second.inputs[0].blob.data is not None
    assert driver.held == held  # the answer's 200 says the server holds them again


@pytest.fixture(scope="module")
def large():
    """A program whose weights are large enough to go by reference first, and its inputs."""
    weights = np.ones(REFERENCE_FIRST_BYTES // 4, np.float32)
    program = Program.from_function(lambda w, x: (w.sum() + x, x), weights, np.float32(1))
    return program, (weights, np.float32(2))


def test_large_content_goes_by_reference_before_it_is_known_held(large):
    """A fresh client sends content of REFERENCE_FIRST_BYTES or more by reference, smaller content inline."""
    program, (w, x) = large
    driver = Driver(program, (w, x))
    driver.run(ok([np.float32(3), np.float32(2)]))
    [sent] = driver.sent
    assert references(sent) == [sha256(wire_array(w))]
    assert sent.program.data is not None and sent.inputs[1].blob.data is not None
    assert driver.held == {program.digest, sha256(wire_array(w))}


def test_a_lone_server_lacking_large_content_costs_one_small_round_trip(large):
    """Where the server lacks what went by reference first, its 409 is answered by
    one resend with everything inline: one extra request, of a small body."""
    program, (w, x) = large
    driver = Driver(program, (w, x))
    missing = MissingContent("not held", details={"missing": [sha256(wire_array(w))]})
    driver.run(error(409, missing), ok([np.float32(3), np.float32(2)]))
    first, second = driver.sent
    assert references(first) == [sha256(wire_array(w))]
    assert references(second) == [] and bytes(second.inputs[0].blob.data) == w.tobytes()
    assert driver.lengths[0] < REFERENCE_FIRST_BYTES // 16 < driver.lengths[1]


def test_a_second_409_is_an_error(program, inputs):
    """A 409 to the resend raises MissingContent: there is no third try."""
    driver = Driver(program, inputs, held={program.digest})
    missing = MissingContent("gone", details={"missing": [program.digest]})
    with pytest.raises(MissingContent):
        driver.run(error(409, missing), error(409, missing))
    assert len(driver.sent) == 2


def test_busy_answers_are_retried_honouring_retry_after(program, inputs):
    """A 503 is retried after at least its Retry-After delay."""
    driver = Driver(program, inputs, busy_timeout=10)
    busy = ServerBusy("full", reason="queue_full")
    driver.run(error(503, busy, retry_after=2.0), error(503, busy, retry_after=1.0),
               ok([np.float32(3), np.float32(2)]))
    assert len(driver.sent) == 3
    assert driver.slept[0] >= 2.0 and driver.slept[1] >= 1.0


def test_backoff_grows_without_retry_after(program, inputs):
    """Without Retry-After, the delay between 503 retries grows, capped near six seconds."""
    driver = Driver(program, inputs, busy_timeout=1000)
    busy = ServerBusy("full", reason="queue_full")
    driver.run(*[error(503, busy)] * 8, ok([np.float32(3), np.float32(2)]))
    assert len(driver.slept) == 8
    assert all(s > 0 for s in driver.slept)
    assert driver.slept[-1] > driver.slept[0]
    assert max(driver.slept) <= 6.0  # capped (plus jitter)


def test_busy_until_the_deadline_raises_server_busy(program, inputs):
    """When 503s last past the busy timeout, ServerBusy is raised with the server's reason."""
    driver = Driver(program, inputs, busy_timeout=5)
    busy = ServerBusy("draining", reason="draining")
    with pytest.raises(ServerBusy) as info:
        driver.run(*[error(503, busy, retry_after=1.0)] * 20)
    assert info.value.reason == "draining"
    assert sum(driver.slept) <= 5
    assert 2 <= len(driver.sent) <= 6


def test_zero_busy_timeout_never_retries(program, inputs):
    """With a busy timeout of zero, the first 503 raises ServerBusy without a sleep."""
    driver = Driver(program, inputs, busy_timeout=0)
    with pytest.raises(ServerBusy):
        driver.run(error(503, ServerBusy("full", reason="queue_full"), retry_after=1.0))
    assert len(driver.sent) == 1 and driver.slept == []


def test_unreachable_server_is_retried_like_a_busy_one(program, inputs):
    """A refused connection is retried within the busy timeout, then raises ServerBusy 'unreachable'."""
    driver = Driver(program, inputs, busy_timeout=3)
    with pytest.raises(ServerBusy) as info:
        driver.run(*[Response(None, problem="connection refused")] * 50)
    assert info.value.reason == "unreachable"
    assert len(driver.sent) > 1


@pytest.mark.parametrize("status, exception, expected", [
    (400, BadRequest("bad frame"), BadRequest),
    (413, BadRequest("too big"), BadRequest),
    (422, ProgramRejected("wrong shapes"), ProgramRejected),
    (500, ProgramFailed("boom"), ProgramFailed),
    (502, NodeFailure("node lost"), NodeFailure),
])
def test_other_errors_are_never_retried(program, inputs, status, exception, expected):
    """A 400, 413, 422, 500 or 502 raises its error at once, with the request id, and marks nothing held."""
    driver = Driver(program, inputs, busy_timeout=100)
    with pytest.raises(expected) as info:
        driver.run(error(status, exception))
    assert len(driver.sent) == 1
    assert info.value.request_id == "rid"
    assert driver.held == set()  # nothing is assumed held after a failure


def test_non_json_error_bodies(program, inputs):
    """A 502 whose body is not JSON raises NodeFailure naming the HTTP status."""
    driver = Driver(program, inputs)
    with pytest.raises(NodeFailure, match="HTTP 502"):
        driver.run(Response(502, b"<html>Bad Gateway</html>"))


# -- kept arrays ------------------------------------------------------------------------------

class Owner:
    """A client that owns remote arrays and is never asked anything."""


def remote(kept: str, shape=(), dtype=np.float32):
    from kcoral.client.remote import RemoteArray
    from kcoral.protocol.wire import Reference

    return RemoteArray(Reference(kept, np.dtype(dtype), shape), Owner())


A, B = "0123456789abcdef", "fedcba9876543210"


@pytest.mark.parametrize("keep, flags", [
    (False, (False, False)), (True, (True, True)), ((False, True), (False, True)),
    ((True, False), (True, False)), (np.bool_(True), (True, True)),
])
def test_keep_is_a_bool_or_a_prefix_of_the_outputs(program, inputs, keep, flags):
    """keep flags each flat output: one bool for all, or a prefix of the outputs' structure of bools."""
    call = RunCall.prepare(program, inputs, {}, keep=keep, owner=Owner())
    assert call.keep == flags
    head = decode_request(b"".join(bytes(p) for p in call.send(set(), None).parts))
    assert head.keep == {(False, False): False, (True, True): True}.get(flags, flags)


@pytest.mark.parametrize("keep, error", [
    ((True,), ValueError), ((True, False, True), ValueError), ([False, True], ValueError),
    ({"a": True}, ValueError), (None, ValueError), ((1, 0), TypeError), ("yes", TypeError),
])
def test_a_keep_that_does_not_fit_is_a_clear_client_error(program, inputs, keep, error):
    """A keep that is no prefix of the outputs (or holds a non-bool) is refused before any request."""
    with pytest.raises(error, match="keep"):
        RunCall.prepare(program, inputs, {}, keep=keep, owner=Owner())


def test_a_run_names_what_it_frees_in_its_frame_and_kept_header(program, inputs):
    """free= (a structure of RemoteArrays) goes in the frame and, with the kept inputs, in the kept header."""
    from kcoral.protocol.wire import KEPT_HEADER, KeptInput

    weights = remote(f"{A}-{'1' * 16}", (CACHE_THRESHOLD_BYTES // 4,))
    old = {"k": remote(f"{A}-{'2' * 16}"), "v": remote(f"{A}-{'3' * 16}")}
    call = RunCall.prepare(program, (weights, inputs[1]), {}, keep=(False, True), free=old,
                           owner=Owner())
    send = call.send(set(), None)
    run = decode_request(b"".join(bytes(p) for p in send.parts))
    assert run.free == (old["k"].id, old["v"].id) and run.inputs[0] == KeptInput(weights.id)
    assert send.headers[KEPT_HEADER] == ",".join(sorted([weights.id, old["k"].id, old["v"].id]))
    with pytest.raises(TypeError, match="free takes kept arrays"):
        RunCall.prepare(program, inputs, {}, free=[inputs[1]])


def test_a_run_that_keeps_or_frees_is_never_run_again(program, inputs):
    """A run that keeps outputs or frees arrays is not repeatable and asks no
    second run, whatever its client allows; a plain run does."""
    from kcoral.protocol.wire import REDISPATCH_HEADER

    plain = RunCall.prepare(program, inputs, {}, owner=Owner()).send(set(), None, redispatch=True)
    assert plain.repeatable and plain.headers[REDISPATCH_HEADER] == "true"
    for options in ({"keep": True}, {"keep": (False, True)},
                    {"free": remote(f"{A}-{'4' * 16}")}):
        send = RunCall.prepare(program, inputs, {}, owner=Owner(), **options).send(
            set(), None, redispatch=True)
        assert not send.repeatable and REDISPATCH_HEADER not in send.headers


def test_the_kept_header_of_a_run_lists_at_most_its_bound(program, inputs):
    """A run that frees more arrays than the kept header may list names them
    all in its frame and only the first MAX_KEPT_LISTED in its head."""
    from kcoral.protocol.wire import KEPT_HEADER, MAX_KEPT_LISTED

    freed = [remote(f"{A}-{n:016x}") for n in range(MAX_KEPT_LISTED + 5)]
    send = RunCall.prepare(program, inputs, {}, free=freed, owner=Owner()).send(set(), None)
    assert len(decode_request(b"".join(bytes(p) for p in send.parts)).free) == len(freed)
    assert send.headers[KEPT_HEADER].split(",") == sorted(a.id for a in freed)[:MAX_KEPT_LISTED]


def test_arrays_kept_on_two_workers_are_refused_before_sending(program, inputs):
    """Kept arrays of two workers in one run: ArraysApart (422) before any request."""
    from kcoral.errors import ArraysApart

    with pytest.raises(ArraysApart) as apart:
        RunCall.prepare(program, (remote(f"{A}-{'1' * 16}", inputs[0].shape), inputs[1]), {},
                        free=remote(f"{B}-{'2' * 16}"), owner=Owner())
    # It says which arrays are where, and what to do.
    assert apart.value.details["workers"] == {A: [f"{A}-{'1' * 16}"], B: [f"{B}-{'2' * 16}"]}
    assert f"{A}-{'1' * 16} on worker {A}" in str(apart.value)
    assert "client.put(x, near=array)" in str(apart.value)


def test_orphans_found_gone_are_left_out_and_the_run_sent_again(program, inputs):
    """Arrays freed in passing that the worker no longer holds: the run goes again without them, once each."""
    from kcoral.errors import ArrayLost

    kept, gone, there = f"{A}-{'1' * 16}", f"{A}-{'2' * 16}", f"{A}-{'3' * 16}"
    driver = Driver(program, (remote(kept, inputs[0].shape), inputs[1]))
    driver.call.orphans = (gone, there)
    lost = error(410, ArrayLost("gone", details={"lost": [gone]}))
    driver.run(lost, ok([np.float32(3), np.float32(2)]))
    assert [run.free for run in driver.sent] == [(gone, there), (there,)]
    # A lost input of the run itself is the caller's error, never resent.
    driver = Driver(program, (remote(kept, inputs[0].shape), inputs[1]))
    driver.call.orphans = (gone,)
    with pytest.raises(ArrayLost):
        driver.run(error(410, ArrayLost("gone", details={"lost": [kept, gone]})))
    assert len(driver.sent) == 1


def test_a_deletion_is_one_request_per_worker():
    """Client.delete sends one DELETE /v1/arrays per worker, its ids in the kept header, never resent."""
    from kcoral.client.exchange import deletions
    from kcoral.protocol.wire import KEPT_HEADER, MAX_KEPT_LISTED

    a1, a2, b1 = remote(f"{A}-{'1' * 16}"), remote(f"{A}-{'2' * 16}"), remote(f"{B}-{'1' * 16}")
    sends = deletions([a1.id, b1.id, a2.id, a1.id])
    assert [(s.path, s.length, s.repeatable) for s in sends] == [("/v1/arrays", 0, False)] * 2
    assert [s.headers[KEPT_HEADER] for s in sends] == [f"{a1.id},{a2.id}", b1.id]
    many = [f"{A}-{i:016x}" for i in range(MAX_KEPT_LISTED + 1)]
    assert [len(s.headers[KEPT_HEADER].split(",")) for s in deletions(many)] == [MAX_KEPT_LISTED, 1]


def test_a_deletion_raises_once_every_request_was_sent():
    """The arrays gone on several workers make one ArrayLost naming them all; another error comes first."""
    from kcoral.client.exchange import deletion_error
    from kcoral.errors import ArrayLost

    lost = deletion_error([ArrayLost("a", details={"lost": ["x"]}), ArrayLost("b", details={"lost": ["y"]})])
    assert isinstance(lost, ArrayLost) and lost.lost == ["x", "y"]
    busy = ServerBusy("busy", reason="queue_full")
    assert deletion_error([ArrayLost("a", details={"lost": ["x"]}), busy]) is busy


def test_a_run_keeping_outputs_beside_arrays_goes_anywhere_where_there_is_no_room(program, inputs):
    """The near header asks for the worker of the client's arrays; 507 there: sent again without it, once."""
    from kcoral.errors import KeptMemoryFull
    from kcoral.protocol.wire import KEPT_HEADER, NEAR_HEADER

    beside = f"{A}-{'1' * 16}"
    call = RunCall.prepare(program, inputs, {}, keep=(False, True), owner=Owner())
    call.near = beside
    sent = []

    def answers():
        steps = exchange(call, set(), busy_timeout=0)
        step = next(steps)
        sent.append(step.headers)
        step = steps.send(error(507, KeptMemoryFull("full")))
        sent.append(step.headers)
        with pytest.raises(KeptMemoryFull):
            steps.send(error(507, KeptMemoryFull("full")))

    answers()
    assert sent[0][NEAR_HEADER] == beside and KEPT_HEADER not in sent[0]
    assert NEAR_HEADER not in sent[1]
