"""
The dynamic batcher, on a fake clock, with a model whose executions are
recorded: what goes into one batch, in what order, when, and what each
request gets back.
"""

from __future__ import annotations

import attrs
import numpy as np
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from kcoral.errors import ProgramFailed
from kcoral.models.manifest import ModelManifest, ProgramFile, TensorSpec
from kcoral.server.batcher import Batcher


def manifest(most: int = 8) -> ModelManifest:
    return ModelManifest(
        name="m", inputs=(TensorSpec("input", "FP32", (-1, -1)),),
        outputs=(TensorSpec("output", "FP32", (-1, -1)),), max_batch_size=most,
        batch_sizes=(1, most), programs=(ProgramFile("p.jax", "0" * 64, (1, most)),), params=None,
        platforms=("cpu",))


@attrs.define
class RecordingModel:
    """A row-wise model (each row times 2) that keeps the rows of each execution."""

    manifest: ModelManifest = attrs.field(factory=manifest)
    executions: list = attrs.field(factory=list)

    def run_batch(self, inputs, rows):
        self.executions.append(inputs["input"].copy())
        return {"output": inputs["input"][:rows] * 2}


class Server:
    """Admission and worker threads as the batcher sees them: C{slots} slots,
    work run when the test says (L{finish})."""

    def __init__(self, slots: int = 1):
        self.free = slots
        self.waiting: list[Deferred] = []
        self.running: list[tuple[Deferred, object, tuple]] = []

    def admitted(self) -> Deferred:
        if self.free:
            self.free -= 1
            return succeed(None)
        d: Deferred = Deferred()
        self.waiting.append(d)
        return d

    def release(self) -> None:
        if self.waiting:
            self.waiting.pop(0).callback(None)
        else:
            self.free += 1

    def in_thread(self, rid, f, *args) -> Deferred:
        d: Deferred = Deferred()
        self.running.append((d, f, args))
        return d

    def finish(self) -> None:
        """Run the oldest running batch and free its slot."""
        d, f, args = self.running.pop(0)
        try:
            result = f(*args)
        except Exception as e:
            # As the server's worker threads answer a failure: its own error.
            result = ProgramFailed(f"the program failed while running: {e}")
        self.release()
        if isinstance(result, ProgramFailed):
            d.errback(result)
        else:
            d.callback(result)


def batcher(model, server, clock, delay=0.0, observed=None):
    return Batcher(model, admitted=server.admitted, release=server.release,
                   in_thread=server.in_thread, clock=clock, delay=delay,
                   observe=lambda rows, waited: (observed if observed is not None else []).append(rows))


def rows(*values, width: int = 2) -> np.ndarray:
    return np.array([[v] * width for v in values], np.float32)


def results(ds):
    got = []
    for d in ds:
        d.addBoth(got.append)
    return got


def test_requests_queued_behind_a_batch_run_together_each_getting_its_own_rows():
    """While one batch runs, the requests that arrive are run as the next one
    execution, and each gets exactly its own rows back."""
    model, server, clock = RecordingModel(), Server(), Clock()
    b = batcher(model, server, clock)
    first = b.infer({"input": rows(1)}, 1, "r1")
    later = [b.infer({"input": rows(*vs)}, len(vs), f"r{i}") for i, vs in
             enumerate([(2, 3), (4,), (5, 6, 7)])]
    got = results([first, *later])
    server.finish()
    assert len(server.running) == 1 and len(model.executions) == 1
    server.finish()
    assert [e[:, 0].tolist() for e in model.executions] == [[1], [2, 3, 4, 5, 6, 7]]
    assert [g["output"][:, 0].tolist() for g in got] == [[2], [4, 6], [8], [10, 12, 14]]


def test_a_batch_holds_at_most_max_batch_size_rows_and_never_splits_a_request():
    """Requests beyond max_batch_size rows wait for the next batch, whole and in order."""
    model, server, clock = RecordingModel(manifest(most=4)), Server(), Clock()
    b = batcher(model, server, clock)
    b.infer({"input": rows(0)}, 1, "busy")
    for i, count in enumerate([3, 2, 1]):
        b.infer({"input": rows(*[10 * i + k for k in range(count)])}, count, f"r{i}")
    for _ in range(3):
        server.finish()
    assert [len(e) for e in model.executions] == [1, 3, 3]
    assert [e[:, 0].tolist() for e in model.executions][1:] == [[0, 1, 2], [10, 11, 20]]


def test_requests_of_other_dimensions_are_not_batched_with_them_nor_passed():
    """A request whose other dimensions differ ends the batch: it runs in the
    next one, and the requests behind it do not go before it."""
    model, server, clock = RecordingModel(), Server(), Clock()
    b = batcher(model, server, clock)
    b.infer({"input": rows(0)}, 1, "busy")
    b.infer({"input": rows(1)}, 1, "a")
    b.infer({"input": rows(2, width=3)}, 1, "wide")
    b.infer({"input": rows(3)}, 1, "b")
    for _ in range(4):
        server.finish()
    assert [e.shape for e in model.executions] == [(1, 2), (1, 2), (1, 3), (1, 2)]


def test_without_a_delay_a_lone_request_runs_at_once():
    """The default delay, 0: a request that finds a free slot runs alone, without waiting."""
    model, server, clock = RecordingModel(), Server(), Clock()
    batcher(model, server, clock).infer({"input": rows(1)}, 1, "r")
    assert len(server.running) == 1


def test_a_short_batch_waits_for_the_delay_and_a_full_one_goes_at_once():
    """With a delay, a short batch waits until its oldest request has waited
    that long, gathering what arrives; one that fills goes without waiting."""
    model, server, clock = RecordingModel(manifest(most=4)), Server(), Clock()
    b = batcher(model, server, clock, delay=0.002)
    b.infer({"input": rows(1)}, 1, "a")
    clock.advance(0.001)
    b.infer({"input": rows(2)}, 1, "b")
    assert not server.running
    clock.advance(0.001)
    assert len(server.running) == 1
    server.finish()
    assert model.executions[0][:, 0].tolist() == [1, 2]
    b.infer({"input": rows(3)}, 1, "c")
    b.infer({"input": rows(4, 5, 6)}, 3, "d")
    assert len(server.running) == 1  # full: no wait
    server.finish()
    assert model.executions[1][:, 0].tolist() == [3, 4, 5, 6]


def test_a_batch_a_front_formed_goes_at_once_whatever_the_delay():
    """A request a front batcher formed runs as soon as it holds a slot, with
    what is queued: the delay is not paid a second time."""
    model, server, clock = RecordingModel(manifest(most=8)), Server(), Clock()
    b = batcher(model, server, clock, delay=0.5)
    b.infer({"input": rows(1, 2)}, 2, "formed", formed=True)
    assert len(server.running) == 1 and not clock.getDelayedCalls()
    server.finish()
    assert model.executions[0][:, 0].tolist() == [1, 2]


def test_a_batch_a_front_formed_ends_the_wait_of_a_short_batch_before_it():
    """A short batch waiting for its delay goes at once, with it, when a
    batch a front formed arrives behind it."""
    model, server, clock = RecordingModel(manifest(most=8)), Server(), Clock()
    b = batcher(model, server, clock, delay=0.5)
    b.infer({"input": rows(1)}, 1, "direct")
    assert not server.running
    b.infer({"input": rows(2, 3)}, 2, "formed", formed=True)
    assert len(server.running) == 1 and not clock.getDelayedCalls()
    server.finish()
    assert model.executions[0][:, 0].tolist() == [1, 2, 3]


def test_a_formed_request_queued_behind_a_direct_one_ends_their_wait():
    """Queued behind a client's own request while a batch runs, a request a
    front formed makes their batch go as soon as the slot frees."""
    model, server, clock = RecordingModel(manifest(most=8)), Server(), Clock()
    b = batcher(model, server, clock, delay=0.5)
    b.infer({"input": rows(0)}, 1, "busy", formed=True)
    b.infer({"input": rows(1)}, 1, "direct")
    b.infer({"input": rows(2)}, 1, "formed", formed=True)
    server.finish()
    assert len(server.running) == 1 and not clock.getDelayedCalls()
    server.finish()
    assert [e[:, 0].tolist() for e in model.executions] == [[0], [1, 2]]


def test_requests_behind_a_running_batch_join_a_formed_one():
    """While a batch runs, the requests that queue behind it, formed or not,
    go together as the next batch when the slot frees."""
    model, server, clock = RecordingModel(manifest(most=8)), Server(), Clock()
    b = batcher(model, server, clock, delay=0.5)
    b.infer({"input": rows(0)}, 1, "busy", formed=True)
    b.infer({"input": rows(1)}, 1, "first", formed=True)
    b.infer({"input": rows(2)}, 1, "second")
    server.finish()
    assert len(server.running) == 1
    server.finish()
    assert [e[:, 0].tolist() for e in model.executions] == [[0], [1, 2]]


def test_a_client_that_leaves_before_its_batch_runs_is_dropped_from_it():
    """Cancelling a waiting request takes its rows out of the next batch; the others still run."""
    model, server, clock = RecordingModel(), Server(), Clock()
    b = batcher(model, server, clock)
    b.infer({"input": rows(0)}, 1, "busy")
    left = b.infer({"input": rows(1)}, 1, "left")
    stays = b.infer({"input": rows(2)}, 1, "stays")
    got = results([left, stays])
    left.cancel()
    server.finish()
    server.finish()
    assert model.executions[1][:, 0].tolist() == [2]
    assert got[0].check(Exception) and got[1]["output"][:, 0].tolist() == [4]


def test_a_slot_freed_with_nothing_left_to_run_is_given_back():
    """A slot granted after every waiting request left is released at once."""
    model, server, clock = RecordingModel(), Server(slots=1), Clock()
    b = batcher(model, server, clock)
    b.infer({"input": rows(0)}, 1, "busy")
    b.infer({"input": rows(1)}, 1, "left").cancel()
    server.finish()
    assert server.free == 1 and not server.running


def test_a_failed_batch_fails_each_of_its_requests():
    """When the execution fails, every request of the batch gets its error."""
    class Broken(RecordingModel):
        def run_batch(self, inputs, rows):
            raise ValueError("device lost")

    server, clock = Server(), Clock()
    b = batcher(Broken(), server, clock)
    b.infer({"input": rows(0)}, 1, "busy").addErrback(lambda f: None)
    got = results([b.infer({"input": rows(1)}, 1, "a"), b.infer({"input": rows(2)}, 1, "b")])
    server.finish()
    server.finish()
    assert [g.value.message for g in got] == ["the program failed while running: device lost"] * 2


def test_each_batch_is_observed_with_its_rows():
    """The batch sizes metric is told each execution's rows."""
    model, server, clock = RecordingModel(), Server(), Clock()
    observed: list[int] = []
    b = batcher(model, server, clock, observed=observed)
    b.infer({"input": rows(0)}, 1, "busy")
    b.infer({"input": rows(1, 2)}, 2, "a")
    b.infer({"input": rows(3)}, 1, "b")
    server.finish()
    server.finish()
    assert observed == [1, 3]


def test_past_its_bound_a_request_is_refused_at_once():
    """Once most_waiting requests wait, the next gets 503 queue_full without waiting."""
    model, server, clock = RecordingModel(), Server(), Clock()
    b = Batcher(model, admitted=server.admitted, release=server.release,
                in_thread=server.in_thread, clock=clock, most_waiting=2)
    b.infer({"input": rows(0)}, 1, "busy")
    b.infer({"input": rows(1)}, 1, "a")
    b.infer({"input": rows(2)}, 1, "b")
    got = results([b.infer({"input": rows(3)}, 1, "c")])
    assert got[0].value.reason == "queue_full"


def test_a_short_batch_that_cannot_grow_does_not_wait_for_the_delay():
    """With a delay, a batch goes at once when the request behind it could not join it."""
    model, server, clock = RecordingModel(manifest(most=8)), Server(), Clock()
    b = batcher(model, server, clock, delay=0.5)
    b.infer({"input": rows(0)}, 1, "busy")
    clock.advance(0.5)
    b.infer({"input": rows(*range(5))}, 5, "five")
    b.infer({"input": rows(*range(4))}, 4, "four")
    server.finish()
    assert len(server.running) == 1  # the five rows went without waiting
    server.finish()
    assert [len(e) for e in model.executions] == [1, 5]


def test_each_executed_batch_is_told_how_long_it_ran():
    """The statistics are told each execution's rows, requests and time, once it ran (not a failed one)."""
    model, server, clock = RecordingModel(), Server(), Clock()
    executed: list[tuple[int, int, float]] = []
    b = Batcher(model, admitted=server.admitted, release=server.release,
                in_thread=server.in_thread, clock=clock,
                executed=lambda rows, requests, seconds: executed.append((rows, requests, seconds)))
    b.infer({"input": rows(0)}, 1, "alone")
    b.infer({"input": rows(1, 2)}, 2, "a")
    b.infer({"input": rows(3)}, 1, "b")
    clock.advance(0.25)
    server.finish()
    clock.advance(0.5)
    server.finish()
    assert executed == [(1, 1, 0.25), (3, 2, 0.5)]
