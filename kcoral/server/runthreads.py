"""
L{RunThreads}: the threads a server runs programs on, taking work from the
reactor and handing each result back to it.

Twisted's C{ThreadPool} does the same with more Python around each task: a
coordinator that moves workers between its idle and busy sets under a
lock, a context around the call, in the worker before and after the work
and in the reactor when it hands the work over. All of it holds the GIL the
other thread is waiting for at that moment. A decoding step is one round
trip of each, and its client waits for both.

Each thread waits on a queue of its own: two threads sharing one
C{queue.SimpleQueue} each woke about twice a run in a server, against
once for both together here (a get releases the lock the other waits on,
which wakes it to find the queue empty). A task
goes to the thread that went idle last, whose memory is the warmest; where
none is idle it waits for the first to finish. There are as many threads
as runs may hold slots at once, all started with it (a server confines
itself before any of its threads starts).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable

from twisted.logger import Logger
from twisted.python.failure import Failure

log = Logger()


def _STOP() -> None:
    """The task that tells a thread to end."""


class RunThreads:
    """C{count} threads named after C{name}; with C{callInThreadWithCallback}
    they take the place of a Twisted C{ThreadPool} where a caller hands it
    work (C{twisted.internet.threads.deferToThreadPool} too)."""

    def __init__(self, count: int, name: str):
        self._count, self._name = count, name
        self._lock = threading.Lock()
        #: The queues of the idle threads, the one idle last at the end.
        self._idle: list[queue.SimpleQueue] = []
        #: Tasks given while no thread was idle, the first first.
        self._waiting: deque = deque()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(self._count)]
        self._threads = [threading.Thread(target=self._work, args=(tasks,), daemon=True,
                                          name=f"{self._name}-{i}")
                         for i, tasks in enumerate(queues)]
        self._idle = queues[::-1]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Ends its threads once the tasks given before are done; returns when they have."""
        for _ in self._threads:
            self.callInThreadWithCallback(None, _STOP)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def callInThreadWithCallback(self, onResult: Callable[[bool, object], object] | None,
                                 func: Callable, *args, **kwargs) -> None:
        """Calls C{func(*args, **kwargs)} in one of its threads, then, in that
        thread, C{onResult(True, result)} or C{onResult(False, failure)}."""
        task = (onResult, func, args, kwargs)
        with self._lock:
            if not self._idle:
                self._waiting.append(task)
                return
            tasks = self._idle.pop()
        tasks.put(task)

    def _work(self, tasks: queue.SimpleQueue) -> None:
        while True:
            task = tasks.get()
            while task is not None:
                if task[1] is _STOP:
                    return
                self._do(*task)
                with self._lock:
                    if self._waiting:
                        task = self._waiting.popleft()
                    else:
                        # Nothing between a task's onResult and the wait but
                        # this: the reactor that onResult woke finds the GIL
                        # free as soon as this thread waits (and no task's
                        # arguments are held meanwhile).
                        task = None
                        self._idle.append(tasks)

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
