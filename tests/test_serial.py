"""
Tests for L{kcoral.web.serial}: calls in threads, one after another.
"""

from __future__ import annotations

from twisted.internet.defer import succeed

from kcoral.web.serial import Serial


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
    serial = Serial(Refusing())
    first, second = serial.call(lambda: 1), serial.call(lambda: 2)
    failures = []
    first.addErrback(failures.append)
    assert failures and failures[0].check(RuntimeError)
    assert second.result == 2


def test_calls_run_in_order():
    """Each call runs once the one before has ended, and gets its own result."""
    ran = []
    serial = Serial(lambda f, *args: succeed(f(*args)))
    results = [serial.call(ran.append, n) for n in range(3)]
    assert ran == [0, 1, 2] and all(r.called for r in results)
