"""
L{RunThreads}: the threads a server runs programs on, taking work from the
reactor and handing each result back to it.

Twisted's C{ThreadPool} does the same with more Python around each task: a
coordinator that moves workers between its idle and busy sets under a
lock, a context around the call, in the worker before and after the work
and in the reactor when it hands the work over. All of it holds the GIL the
other thread is waiting for at that moment: a hand-off and the result's way
back took 110 to 170 us (median) that way on two busy cores, 60 to 70 us
with a queue the threads wait on. A decoding step is one round trip of
each, and the client waits for both.

Its threads wait on one queue, so that a task goes to whichever thread is
free; there are as many as runs may hold slots at once, all started with
it (a server confines itself before any of its threads starts).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from twisted.logger import Logger
from twisted.python.failure import Failure

log = Logger()

#: Tells a thread to end.
_STOP = None


class RunThreads:
    """C{count} threads named after C{name}; with C{callInThreadWithCallback}
    they take the place of a Twisted C{ThreadPool} where a caller hands it
    work (C{twisted.internet.threads.deferToThreadPool} too)."""

    def __init__(self, count: int, name: str):
        self._count, self._name = count, name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
                         for i in range(self._count)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Ends its threads once the tasks given before are done; returns when they have."""
        for _ in self._threads:
            self._tasks.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def callInThreadWithCallback(self, onResult: Callable[[bool, object], object] | None,
                                 func: Callable, *args, **kwargs) -> None:
        """Calls C{func(*args, **kwargs)} in one of its threads, then, in that
        thread, C{onResult(True, result)} or C{onResult(False, failure)}."""
        self._tasks.put((onResult, func, args, kwargs))

    def _work(self) -> None:
        # Nothing after a task's onResult but the next get(): the reactor
        # that onResult woke finds the GIL free as soon as this thread waits.
        while (task := self._tasks.get()) is not _STOP:
            self._do(*task)
            del task  # its arguments are not kept while the thread waits

    def _do(self, onResult, func: Callable, args: tuple, kwargs: dict) -> None:
        try:
            ok, result = True, func(*args, **kwargs)
        except BaseException:
            ok, result = False, Failure()
        if onResult is None:
            if not ok:
                log.failure("a task of {name} failed", result, name=self._name)
            return
        try:
            onResult(ok, result)
        except BaseException:
            log.failure("the result handler of a task of {name} failed", name=self._name)
