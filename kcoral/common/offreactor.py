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
from twisted.python.failure import Failure

from kcoral.errors import KCoralError
from kcoral.protocol.inference import ON_REACTOR_BYTES


def off_reactor(size: int, f: Callable[..., Any], *args: Any) -> Deferred:
    """What C{f(*args)} returns or raises, for work on C{size} bytes."""
    if size <= ON_REACTOR_BYTES:
        try:
            return succeed(f(*args))
        except Exception:
            return fail()
    return deferToThread(_refused_without_frames, f, *args)


def _refused_without_frames(f: Callable[..., Any], *args: Any) -> Any:
    """
    What C{f(*args)} returns, or its refusal as a Failure without its frames.
    A Failure made in the thread pool holds the frames of the work, and so
    the bytes it was given (a whole request), in a cycle with the pool's own
    frame that only the cycle collector frees, which runs seldom in a
    process of JAX's many objects: each refused large request stayed in
    memory. A refusal is answered, never logged with its traceback; any
    other error keeps its frames for the log.
    """
    try:
        return f(*args)
    except KCoralError:
        refused = Failure()
        refused.cleanFailure()
        return refused
