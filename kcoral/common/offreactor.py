"""
Work on tensors that is quick for small ones and not for large ones (parsing
an inference, encoding an answer, splitting a batch's): on the reactor up to
C{ON_REACTOR_BYTES}, where a thread would cost more than the work, and in a
thread past that, so that the reactor never waits on a large one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.threads import deferToThread

from kcoral.protocol.inference import ON_REACTOR_BYTES


def off_reactor(size: int, f: Callable[..., Any], *args: Any) -> Deferred:
    """What C{f(*args)} returns or raises, for work on C{size} bytes."""
    if size <= ON_REACTOR_BYTES:
        try:
            return succeed(f(*args))
        except Exception:
            return fail()
    return deferToThread(f, *args)
