"""
The wait queue (FIFO, bounded in length and in waiting time, cancellable) and
the server's admission on top of it, on a fake clock: no sleeps; and the
batch queue both batchers take their batches from.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock

from kcoral.common.queue import BatchQueue, QueueFull, QueueTimeout, WaitQueue
from kcoral.server.admission import Admission


class Outcome:
    """What a Deferred fired with, or None while it has not."""

    def __init__(self, d):
        self.result = None
        self.failure = None
        d.addCallbacks(self._ok, self._failed)

    def _ok(self, value):
        self.result = ("ok", value)

    def _failed(self, failure):
        self.failure = failure
        self.result = ("failed", failure.type)

    @property
    def fired(self) -> bool:
        return self.result is not None


@pytest.fixture
def clock():
    return Clock()


def test_fifo_order(clock):
    """Waiters are granted in the order they came, each once, and no timer is left behind."""
    queue = WaitQueue(clock, 10, 60)
    waiters = [Outcome(queue.wait()) for _ in range(3)]
    assert len(queue) == 3
    for i in range(3):
        assert queue.grant_next(f"slot {i}")
    assert [w.result for w in waiters] == [("ok", "slot 0"), ("ok", "slot 1"), ("ok", "slot 2")]
    assert len(queue) == 0
    assert not queue.grant_next("nobody")
    assert clock.getDelayedCalls() == []


def test_full_queue_refuses_at_once(clock):
    """A waiter beyond the queue's length fails at once with QueueFull."""
    queue = WaitQueue(clock, 2, 60)
    queue.wait()
    queue.wait()
    third = Outcome(queue.wait())
    assert third.result == ("failed", QueueFull)
    assert len(queue) == 2


def test_zero_length_queue_refuses_everyone(clock):
    """A queue of length 0 refuses every waiter with QueueFull."""
    queue = WaitQueue(clock, 0, 60)
    assert Outcome(queue.wait()).result == ("failed", QueueFull)
    assert len(queue) == 0


def test_waiters_time_out_in_order(clock):
    """Each waiter fails with QueueTimeout its own timeout after it came, not before."""
    queue = WaitQueue(clock, 10, 5)
    first = Outcome(queue.wait())
    clock.advance(2)
    second = Outcome(queue.wait())
    clock.advance(2.9)
    assert not first.fired
    clock.advance(0.2)
    assert first.result == ("failed", QueueTimeout)
    assert not second.fired
    assert len(queue) == 1
    clock.advance(2)
    assert second.result == ("failed", QueueTimeout)
    assert len(queue) == 0
    assert clock.getDelayedCalls() == []


def test_a_granted_waiter_never_times_out(clock):
    """A granted waiter keeps its grant however long the clock runs on."""
    queue = WaitQueue(clock, 10, 5)
    waiter = Outcome(queue.wait())
    queue.grant_next(1)
    clock.advance(100)
    assert waiter.result == ("ok", 1)


def test_cancelled_waiter_leaves_the_queue(clock):
    """Cancelling a wait frees its place and timer, and the next grant skips it."""
    queue = WaitQueue(clock, 2, 5)
    first = queue.wait()
    second = Outcome(queue.wait())
    cancelled = Outcome(first)
    first.cancel()
    assert cancelled.result == ("failed", CancelledError)
    assert len(queue) == 1
    assert len(clock.getDelayedCalls()) == 1  # only the second waiter's timer
    # Its place is free again, and the next grant goes to the second waiter.
    third = Outcome(queue.wait())
    assert not third.fired
    queue.grant_next("slot")
    assert second.result == ("ok", "slot")
    assert not third.fired


def test_fail_all(clock):
    """fail_all fails every waiter with the given error and leaves no timer."""
    queue = WaitQueue(clock, 10, 5)
    waiters = [Outcome(queue.wait()) for _ in range(3)]
    queue.fail_all(RuntimeError("shutting down"))
    assert [w.result for w in waiters] == [("failed", RuntimeError)] * 3
    assert len(queue) == 0
    assert clock.getDelayedCalls() == []


# -- admission ---------------------------------------------------------------

def admission(clock, capacity=2, waiting=2, timeout=10):
    return Admission(capacity, WaitQueue(clock, waiting, timeout))


def test_admission_runs_up_to_capacity_then_queues(clock):
    """Admission lets capacity runs in, queues the next, refuses beyond; a release admits the oldest."""
    gate = admission(clock)
    first, second = Outcome(gate.acquire()), Outcome(gate.acquire())
    assert first.fired and second.fired
    assert gate.active == 2
    third, fourth = Outcome(gate.acquire()), Outcome(gate.acquire())
    assert not third.fired and not fourth.fired
    assert Outcome(gate.acquire()).result == ("failed", QueueFull)
    gate.release()  # the slot passes to the oldest waiter
    assert third.fired and not fourth.fired
    assert gate.active == 2
    gate.release()
    assert fourth.fired
    gate.release()
    gate.release()
    assert gate.active == 0


def test_admission_queue_timeout(clock):
    """A run waiting for a slot fails with QueueTimeout and takes no slot."""
    gate = admission(clock, capacity=1, timeout=3)
    gate.acquire()
    waiting = Outcome(gate.acquire())
    clock.advance(3)
    assert waiting.result == ("failed", QueueTimeout)
    assert gate.active == 1
    gate.release()
    assert gate.active == 0


def test_a_newcomer_does_not_overtake_waiters(clock):
    """A released slot goes to a waiter (a cancelled one skipped), not to a later arrival."""
    gate = admission(clock, capacity=1)
    gate.acquire()
    waiter = Outcome(gate.acquire())
    cancelled = gate.acquire()
    Outcome(cancelled)
    cancelled.cancel()
    gate.release()
    assert waiter.fired
    assert gate.active == 1
    late = Outcome(gate.acquire())
    assert not late.fired


def test_idle_fires_when_nothing_runs_or_waits(clock):
    """idle() fires once no run holds a slot and none waits, not before."""
    gate = admission(clock, capacity=1)
    assert Outcome(gate.idle()).fired
    gate.acquire()
    queued = Outcome(gate.acquire())
    idle = Outcome(gate.idle())
    gate.release()
    assert queued.fired and not idle.fired
    gate.release()
    assert idle.result == ("ok", None)


@attrs.define(eq=False)
class Request:
    kind: tuple | None
    rows: int


@given(requests=st.lists(st.tuples(st.sampled_from([("a",), ("b",), None]), st.integers(1, 8)),
                         max_size=30),
       most=st.integers(1, 8))
@settings(max_examples=300, deadline=None)
def test_batches_are_the_heads_that_share_a_kind_and_fit(requests, most):
    """Batches taken until the queue is empty keep arrival order; each is the oldest and
    those behind it of its kind, within the rows, and stops only where the next differs or
    would not fit; a request of no kind goes alone."""
    queue: BatchQueue[Request] = BatchQueue(len(requests) + 1)
    arrived = [Request(kind, rows) for kind, rows in requests]
    for request in arrived:
        queue.append(request)
    taken = []
    while queue:
        batch = queue.take(most)
        first = batch[0]
        assert all(r.kind == first.kind for r in batch)
        assert len(batch) == 1 or (first.kind is not None and sum(r.rows for r in batch) <= most)
        if queue and first.kind is not None:
            following = queue.oldest
            assert following.kind != first.kind or sum(r.rows for r in batch) + following.rows > most
        taken.extend(batch)
    assert taken == arrived


def test_a_batch_queue_is_bounded_and_its_requests_leave():
    """It is full at its bound; a request removed leaves (once); drained, it is empty."""
    queue: BatchQueue[Request] = BatchQueue(2)
    one, two = Request(("a",), 1), Request(("a",), 1)
    queue.append(one)
    assert not queue.full
    queue.append(two)
    assert queue.full and queue.head(8) == [one, two]
    assert queue.remove(one) and not queue.remove(one)
    assert queue.drain() == [two] and len(queue) == 0 and not queue.full
