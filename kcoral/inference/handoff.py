"""
Calls handed from one thread to another's loop, many for one wake-up.

A front's thread (gRPC's event loop) and the reactor's hand each other every
request and every answer. Woken once per call, the receiving thread takes
the calls one turn at a time, each turn contending for the GIL: the
inferences that reach the reactor in a turn are the ones a front batcher
joins, so trickling them in one by one makes batches of one or two. A
L{Handoff} wakes the other thread only for the first call it holds; the
others handed over before that thread runs go with it, in order, in one
turn.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.logger import Logger

log = Logger()


class Handoff:
    """
    Runs the calls handed to it in the thread that C{wake} runs its
    argument in (C{reactor.callFromThread}, C{loop.call_soon_threadsafe}),
    in the order they were handed over.
    """

    def __init__(self, wake: Callable[[Callable[[], None]], Any]):
        self._wake = wake
        self._calls: deque[tuple[Callable[..., Any], tuple]] = deque()

    def __call__(self, f: Callable[..., Any], *args: Any) -> None:
        """Run C{f(*args)} in the other thread (from any thread)."""
        self._calls.append((f, args))
        # Only the call that finds the queue empty wakes the other thread:
        # one already queued means a wake-up is on its way, and the run it
        # wakes takes every call until the queue is empty (deque's append
        # and popleft are atomic).
        if len(self._calls) == 1:
            self._wake(self._run)

    def _run(self) -> None:
        while self._calls:
            f, args = self._calls.popleft()
            try:
                f(*args)
            except Exception:
                log.failure("a call handed over failed")
