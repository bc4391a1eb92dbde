"""
The run limit's timers (L{kcoral.server.runlimit}) on a fake clock: armed
when a run enters its thread and not before, cancelled when it leaves, and
once the limit passes, the run's answer a 504 C{run_timeout} with its
request id and the process told to end, whether or not its client stayed.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from kcoral.errors import ProgramFailed, RunTimeout
from kcoral.server.runlimit import NO_RUN_LIMIT, RunLimit

LIMIT = 5.0


class Limited:
    """A limit of L{LIMIT} seconds on a fake clock, and the request ids it said passed it."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.passed: list[str] = []
        self.limit = RunLimit(LIMIT, self.clock, self.passed.append)

    def started(self, rid: str = "r-1") -> tuple:
        """A run's answer and its timer, started (the run entered its thread)."""
        answer: Deferred = Deferred()
        timer = self.limit.timer(rid, answer)
        timer.start()
        return answer, timer


def outcome(d: Deferred) -> list:
    got: list = []
    d.addBoth(got.append)
    return got


def test_without_a_limit_a_run_is_not_wrapped():
    """With no limit, the function a thread runs is the run's own: nothing is timed."""
    def f():
        return 1

    assert NO_RUN_LIMIT.timer("r-1", Deferred()).timed(f) is f


def test_a_run_is_answered_until_the_limit_passes():
    """A run still executing just short of the limit is left alone."""
    limited = Limited()
    answer, timer = limited.started()
    limited.clock.advance(LIMIT - 0.001)
    assert not answer.called and not timer.passed and limited.passed == []


def test_a_run_past_the_limit_is_a_504_run_timeout_with_its_request_id():
    """At the limit, the run's answer fails with RunTimeout: 504, run_timeout, its request id."""
    limited = Limited()
    answer, timer = limited.started("slow-1")
    got = outcome(answer)
    limited.clock.advance(LIMIT)
    error = got[0].value
    assert isinstance(error, RunTimeout) and isinstance(error, ProgramFailed)
    assert (error.status, error.type, error.reason, error.request_id) == \
        (504, "run_timeout", "run_timeout", "slow-1")
    assert f"{LIMIT:g} s" in error.message
    assert timer.passed


def test_a_run_past_the_limit_ends_the_process():
    """At the limit, the server is told which run passed it (and ends)."""
    limited = Limited()
    limited.started("slow-1")
    limited.clock.advance(LIMIT)
    assert limited.passed == ["slow-1"]


def test_a_run_that_leaves_its_thread_in_time_disarms_its_timer():
    """Stopping the timer before the limit cancels it: nothing fires afterwards."""
    limited = Limited()
    answer, timer = limited.started()
    limited.clock.advance(LIMIT / 2)
    timer.stop()
    assert limited.clock.getDelayedCalls() == []
    limited.clock.advance(LIMIT)
    assert not answer.called and not timer.passed and limited.passed == []


def test_the_time_before_a_run_enters_its_thread_does_not_count():
    """The limit counts from the timer's start (the run entered its thread), not from its making."""
    limited = Limited()
    answer: Deferred = Deferred()
    timer = limited.limit.timer("queued-1", answer)
    limited.clock.advance(LIMIT * 3)
    assert limited.clock.getDelayedCalls() == []
    timer.start()
    limited.clock.advance(LIMIT - 0.001)
    assert not answer.called
    limited.clock.advance(0.001)
    assert answer.called


def test_a_run_whose_client_left_still_ends_the_process():
    """A run whose answer was cancelled (its client went away) still ends the process at the limit."""
    limited = Limited()
    answer, timer = limited.started("gone-1")
    answer.addErrback(lambda _: None)
    answer.cancel()
    limited.clock.advance(LIMIT)
    assert timer.passed and limited.passed == ["gone-1"]


def test_each_run_past_the_limit_is_answered_and_told():
    """Two runs past the limit are each answered 504 and each told, in the order they passed it."""
    limited = Limited()
    first, _ = limited.started("first")
    limited.clock.advance(1.0)
    second, _ = limited.started("second")
    got = [outcome(first), outcome(second)]
    limited.clock.advance(LIMIT)
    assert [g[0].value.request_id for g in got] == ["first", "second"]
    assert limited.passed == ["first", "second"]
