"""
Calls run in threads one after another: the writes and reads of one
spooled body keep their order, whichever thread runs each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred, succeed

InThread = Callable[..., Deferred]


class Serial:
    """Runs calls with C{in_thread}, each once the one before has ended."""

    def __init__(self, in_thread: InThread):
        self._in_thread = in_thread
        self._last: Deferred[None] = succeed(None)

    def call(self, f: Callable[..., Any], *args: Any) -> Deferred:
        """The result of C{f(*args)}, run in a thread after every earlier call."""
        result: Deferred = Deferred()

        def run(_):
            # A thread pool already stopped raises at once: that too is
            # this call's result, and the calls after it still run.
            d = maybeDeferred(self._in_thread, f, *args)
            d.chainDeferred(result)
            return d  # the next call waits for this one, failed or not

        self._last.addCallback(run)
        return result
