"""
Sequence batching on one worker (L{kcoral.server.sequencer}), driven on a
fake reactor (L{Clock}) with a real sequence model compiled by JAX: each
execution is held until the test runs it, as a worker thread would, so
that what waits, what runs together and what is freed are all seen.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure

import kcoral
from kcoral.errors import BadRequest, ServerBusy
from kcoral.models.config import ModelConfig
from kcoral.protocol.sequence import SequenceControls
from kcoral.server.models import ModelRepository
from kcoral.server.sequencer import Arrivals, Sequencer

IDLE = 1.0


def accumulate(total, start, end, corrid, x):
    """The running sum of a sequence's inputs; its last step adds its id."""
    total = total + x
    return total, total + end * corrid.astype(jnp.int32)


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """The accumulating model, compiled for batches of 1, 2 and 4, by its
    strategy (a sequencer's slots are its own: a model's table serves one
    sequencer after another, as a START writes its slot's state)."""
    folder = tmp_path_factory.mktemp("sequences")
    kcoral.export_bundle(accumulate, None, np.zeros((1, 1), np.int32), dir=folder / "acc",
                         name="acc", batch_sizes=[1, 2, 4], input_names=["INPUT"],
                         output_names=["OUTPUT"], state=np.zeros((1, 1), np.int32),
                         controls=("START", "END", "CORRID"), sequence_batching="oldest",
                         max_sequence_idle_seconds=IDLE)
    models = {}
    for batching in ("oldest", "direct"):
        repository = ModelRepository(folder)
        repository.load_model("acc", jax.devices()[0], ModelConfig(sequence_batching=batching))
        models[batching] = repository.get("acc")
    return models


class Device:
    """A worker thread that runs each execution when told to (in_thread's
    form), recording the rows of each."""

    def __init__(self):
        self.held: list[tuple[Deferred, object, tuple]] = []
        self.rows: list[int] = []

    def in_thread(self, request_id, f, *args) -> Deferred:
        answer: Deferred = Deferred()
        self.held.append((answer, f, args))
        return answer

    def run_one(self) -> None:
        answer, f, args = self.held.pop(0)
        self.rows.append(len(args[1]))
        answer.callback(f(*args))

    def run_all(self) -> None:
        while self.held:
            self.run_one()


def sequencer(repository, *, batching="oldest", most_live=16, clock=None, device=None,
              live=None):
    return Sequencer(repository[batching], admitted=lambda: succeed(None), release=lambda: None,
                     in_thread=(device or Device()).in_thread, clock=clock or Clock(),
                     most_live=most_live, live=live or (lambda change: None))


def step(sequencer, id, x, *, start=False, end=False, token=None) -> list:
    """One step of sequence C{id} with input C{x}: a list its outcome lands in."""
    outcome: list = []
    sequencer.step(token, SequenceControls(id, start, end), {"INPUT": np.array([[x]], np.int32)},
                   1, "r").addBoth(outcome.append)
    return outcome


def value(outcome: list):
    (result,) = outcome
    if isinstance(result, Failure):
        return result.value
    return int(result["OUTPUT"][0, 0])


def test_oldest_runs_waiting_sequences_together(repository):
    """With oldest, the steps that wait while an execution runs go as one
    execution, a row a sequence (a sequence's second step after its first
    has run),
    each with its own state."""
    device = Device()
    s = sequencer(repository, device=device)
    first = step(s, 1, 10, start=True)
    others = [step(s, id, id, start=True) for id in (2, 3, 4)]
    again = step(s, 1, 5)
    device.run_one()
    assert device.rows == [1] and value(first) == 10
    device.run_all()
    assert device.rows == [1, 4]
    assert [value(o) for o in others] == [2, 3, 4]
    assert value(again) == 15


def test_direct_runs_one_step_an_execution(repository):
    """With direct, every execution is one step."""
    device = Device()
    s = sequencer(repository, batching="direct", device=device)
    outcomes = [step(s, id, id, start=True) for id in (1, 2, 3)]
    device.run_all()
    assert device.rows == [1, 1, 1]
    assert [value(o) for o in outcomes] == [1, 2, 3]


#: One step: the sequence (of three), its input, START, END, whether the
#: device then runs what is held.
STEPS = st.lists(st.tuples(st.integers(1, 3), st.integers(-100, 100), st.booleans(),
                           st.booleans(), st.booleans()), max_size=24)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(STEPS)
def test_interleavings_equal_each_sequence_alone(repository, steps):
    """Whatever the interleaving of steps, starts and ends, and however they
    are batched, every answer is the one of its sequence run alone (and a
    step of a sequence not live is refused in Triton's words)."""
    device = Device()
    s = sequencer(repository, device=device)
    totals: dict[int, int] = {}
    expected, outcomes = [], []
    for id, x, start, end, run in steps:
        if not start and id not in totals:
            expected.append("START flag")
        else:
            total = totals[id] = (0 if start else totals[id]) + x
            expected.append(total + end * id)
            if end:
                del totals[id]
        outcomes.append(step(s, id, x, start=start, end=end))
        if run:
            device.run_all()
    device.run_all()
    for want, outcome in zip(expected, outcomes):
        got = value(outcome)
        if isinstance(want, str):
            assert isinstance(got, BadRequest) and want in got.message
        else:
            assert got == want
    assert s.live == len(totals)


def test_idle_sequences_are_freed(repository):
    """A sequence idle for its model's bound is freed (its next step without
    START refused); a step that waits or runs keeps it."""
    clock, device, live = Clock(), Device(), []
    s = sequencer(repository, clock=clock, device=device, live=live.append)
    step(s, 1, 1, start=True)
    clock.advance(IDLE * 2)  # its step is still held: not idle
    device.run_all()
    clock.advance(IDLE * 0.99)
    assert s.live == 1
    second = step(s, 1, 2)
    device.run_all()
    assert value(second) == 3
    clock.advance(IDLE)
    assert s.live == 0 and live == [1, -1]
    refused = value(step(s, 1, 3))
    assert isinstance(refused, BadRequest)
    assert "must specify the START flag on the first request of the sequence" in refused.message


def test_end_frees_and_start_restarts(repository):
    """END frees the sequence after its step (a later step needs START); a
    START of a live id starts it again from the initial state."""
    device = Device()
    s = sequencer(repository, device=device)
    outcomes = [step(s, 7, 5, start=True), step(s, 7, 6), step(s, 7, 1, start=True),
                step(s, 7, 2, end=True)]
    refused = step(s, 7, 3)
    device.run_all()
    assert [value(o) for o in outcomes] == [5, 11, 1, 3 + 7]
    assert isinstance(value(refused), BadRequest)
    assert s.live == 0


def test_sequences_full(repository):
    """Past most_live sequences a new one is refused with 503
    sequences_full; one ended makes room."""
    device = Device()
    s = sequencer(repository, most_live=2, device=device)
    step(s, 1, 1, start=True)
    step(s, 2, 1, start=True)
    full = value(step(s, 3, 1, start=True))
    assert isinstance(full, ServerBusy) and full.reason == "sequences_full"
    step(s, 1, 1, end=True)
    device.run_all()
    later = step(s, 3, 4, start=True)
    device.run_all()
    assert value(later) == 4 and s.live == 2


def test_ids_are_per_token(repository):
    """The same id under two client tokens is two sequences."""
    device = Device()
    s = sequencer(repository, device=device)
    a = [step(s, 9, 1, start=True, token=b"a"), step(s, 9, 1, token=b"a")]
    b = [step(s, 9, 100, start=True, token=b"b")]
    device.run_all()
    assert [value(o) for o in a + b] == [1, 2, 100]
    assert s.live == 2


def test_triton_words(repository):
    """No id, and a batch of more than one row, are refused in Triton's words."""
    s = sequencer(repository)
    answers: list = []
    s.step(None, SequenceControls(None), {"INPUT": np.zeros((1, 1), np.int32)}, 1,
           "r").addErrback(answers.append)
    s.step(None, SequenceControls(1, True), {"INPUT": np.zeros((2, 1), np.int32)}, 2,
           "r").addErrback(answers.append)
    assert "must specify a non-zero or non-empty correlation ID" in answers[0].value.message
    assert "must specify batch-size 1" in answers[1].value.message
    assert s.live == 0


def test_a_cancelled_step_still_runs(repository):
    """A step whose client went away still runs: its sequence's next step
    sees the state it left."""
    device = Device()
    s = sequencer(repository, device=device)
    first = s.step(None, SequenceControls(5, True), {"INPUT": np.array([[4]], np.int32)}, 1, "r")
    first.addErrback(lambda failure: None)
    first.cancel()
    second = step(s, 5, 1)
    device.run_all()
    assert value(second) == 5


def test_batch_invariant_steps_are_the_same_bytes(tmp_path):
    """With batch invariance, a float sequence's outputs are the same bytes
    whether its steps ran with other sequences' or alone (at this width,
    XLA's CPU kernels round a batch of 8 otherwise than a row alone)."""
    rng = np.random.default_rng(3)
    weights = rng.standard_normal((256, 256)).astype(np.float32) / 16

    def mix(w, state, x):
        state = jnp.tanh(state @ w + x)
        return state, state.sum(axis=1, keepdims=True)

    kcoral.export_bundle(mix, weights, np.zeros((1, 256), np.float32), dir=tmp_path / "mix",
                         name="mix", batch_sizes=[1, 8], state=np.zeros((1, 256), np.float32),
                         sequence_batching="oldest")
    repository = ModelRepository(tmp_path, batch_invariant=True)
    repository.load(jax.devices()[0])
    inputs = rng.standard_normal((6, 4, 256)).astype(np.float32)

    def outputs(together: bool) -> list[list[bytes]]:
        device = Device()
        s = Sequencer(repository.get("mix"), admitted=lambda: succeed(None),
                      release=lambda: None, in_thread=device.in_thread, clock=Clock())
        got: list[list] = [[] for _ in inputs]
        for i in range(inputs.shape[1]):
            for id, rows in enumerate(inputs, start=1):
                s.step(None, SequenceControls(id, i == 0), {"input": rows[i:i + 1]}, 1,
                       "r").addCallback(lambda out, id=id: got[id - 1].append(
                           out["output"].tobytes()))
                if not together:
                    device.run_all()
            device.run_all()
        assert (max(device.rows) > 1) == together
        return got

    assert outputs(together=True) == outputs(together=False)


def test_arrivals_keep_their_order(repository):
    """A request's turn comes once every earlier one of its model is done
    (handed on, failed or cancelled), whatever order they are read in."""
    arrivals = Arrivals()
    model = repository["oldest"]
    first, second, third = (arrivals.arrive(model) for _ in range(3))
    assert arrivals.arrive(repository["direct"]).turn.called
    assert first.turn.called and not second.turn.called and not third.turn.called
    third.done()  # failed as it was read: it gives up its place, not its turn
    fourth = arrivals.arrive(model)
    first.done()
    assert second.turn.called and not third.turn.called and not fourth.turn.called
    second.done()
    second.done()
    assert third.turn.called and fourth.turn.called
    fourth.done()
    assert arrivals.arrive(model).turn.called


def test_an_arrival_cancelled_before_its_turn(repository):
    """A request whose client went away while it waited for its turn gives
    up its place when done, and the order goes on."""
    arrivals = Arrivals()
    first, second, third = (arrivals.arrive(repository["oldest"]) for _ in range(3))
    second.turn.addErrback(lambda failure: None)
    second.turn.cancel()
    second.done()
    first.done()
    assert third.turn.called
