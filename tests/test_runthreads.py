"""L{kcoral.server.runthreads.RunThreads}: the server's run threads."""

from __future__ import annotations

import threading

import pytest
import pytest_twisted
from twisted.internet.threads import deferToThreadPool

from kcoral.server.runthreads import RunThreads

WAIT = 10.0


@pytest.fixture
def threads():
    pool = RunThreads(2, "test-run")
    pool.start()
    yield pool
    pool.stop()


def results_of(pool: RunThreads, func, *args) -> tuple[bool, object, str]:
    """What C{onResult} was called with, and the name of the thread it ran in."""
    done = threading.Event()
    got: list = []

    def on_result(ok, result):
        got.extend([ok, result, threading.current_thread().name])
        done.set()

    pool.callInThreadWithCallback(on_result, func, *args)
    assert done.wait(WAIT)
    return got[0], got[1], got[2]


def test_result_in_a_run_thread(threads):
    """A task's result goes to its onResult, called in the run thread that ran it."""
    ok, result, name = results_of(threads, lambda a, b: a + b, 2, 3)
    assert (ok, result) == (True, 5)
    assert name.startswith("test-run-")


def test_failure(threads):
    """A task that raises gives its onResult False and a Failure of the exception."""
    def fails():
        raise ValueError("no")

    ok, failure, _ = results_of(threads, fails)
    assert ok is False
    assert failure.check(ValueError) and str(failure.value) == "no"


def test_failing_handler_leaves_thread_working():
    """An onResult that raises is logged, and its thread takes the next task."""
    pool = RunThreads(1, "test-run")
    pool.start()
    try:
        pool.callInThreadWithCallback(lambda ok, result: 1 / 0, lambda: None)
        assert results_of(pool, lambda: "next")[:2] == (True, "next")
    finally:
        pool.stop()


def test_tasks_run_side_by_side(threads):
    """Two threads run two tasks at once: each waits for the other to have begun."""
    barrier = threading.Barrier(2, timeout=WAIT)
    done = threading.Semaphore(0)
    for _ in range(2):
        threads.callInThreadWithCallback(lambda ok, result: done.release(), barrier.wait)
    assert done.acquire(timeout=WAIT) and done.acquire(timeout=WAIT)
    assert not barrier.broken


def test_stop_finishes_given_tasks():
    """stop() returns once the tasks given before it have run, its threads ended."""
    pool = RunThreads(2, "test-run")
    pool.start()
    ran = []
    for i in range(5):
        pool.callInThreadWithCallback(None, ran.append, i)
    running = [t for t in threading.enumerate() if t.name.startswith("test-run-")]
    pool.stop()
    assert sorted(ran) == list(range(5))
    assert not any(t.is_alive() for t in running)


@pytest_twisted.inlineCallbacks
def test_defer_to_it(threads):
    """deferToThreadPool takes it as it takes a Twisted ThreadPool: the
    Deferred fires in the reactor with the task's result."""
    from twisted.internet import reactor

    result = yield deferToThreadPool(reactor, threads, lambda: threading.current_thread().name)
    assert result.startswith("test-run-")


def test_tasks_wait_for_a_free_thread():
    """With every thread busy, tasks wait, and run in the order given once one is free."""
    pool = RunThreads(1, "test-run")
    pool.start()
    try:
        release = threading.Event()
        ran: list[int] = []
        pool.callInThreadWithCallback(None, release.wait, WAIT)
        for i in range(4):
            pool.callInThreadWithCallback(None, ran.append, i)
        assert ran == []
        release.set()
        assert results_of(pool, lambda: list(ran))[1] == [0, 1, 2, 3]
    finally:
        pool.stop()
