"""
Tests for L{kcoral.web.spool.serial}: calls in threads, one after another.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, succeed

from kcoral.web.spool import serial


class Refusing:
    """A thread runner whose pool has stopped: it raises on its first call,
    then runs calls at once."""

    def __init__(self):
        self.refused = False

    def __call__(self, f, *args):
        if not self.refused:
            self.refused = True
            raise RuntimeError("the pool is stopped")
        return succeed(f(*args))


def test_a_runner_that_raises_fails_that_call_and_not_the_next():
    """A runner that raises instead of returning a Deferred fails that call's
    result (it does not hang), and the call after it still runs."""
    calls = serial(Refusing())
    first, second = calls(lambda: 1), calls(lambda: 2)
    failures = []
    first.addErrback(failures.append)
    assert failures and failures[0].check(RuntimeError)
    assert second.result == 2


def test_calls_run_in_order():
    """Each call runs once the one before has ended, and gets its own result."""
    ran = []
    calls = serial(lambda f, *args: succeed(f(*args)))
    results = [calls(ran.append, n) for n in range(3)]
    assert ran == [0, 1, 2] and all(r.called for r in results)


def test_a_call_starts_once_the_one_before_has_ended():
    """A call is handed to the runner only once the call before it has ended."""
    pending: list = []

    def later(f, *args):
        d: Deferred = Deferred()
        pending.append((d, f, args))
        return d

    calls = serial(later)
    results: list = []
    for n in (1, 2):
        calls(lambda n=n: n).addCallback(results.append)
    assert len(pending) == 1 and results == []
    d, f, args = pending.pop()
    d.callback(f(*args))
    assert results == [1] and len(pending) == 1
