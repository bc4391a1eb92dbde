"""Console logging for the C{kcoral} command: one line per event."""

from __future__ import annotations

import os
import sys

from twisted.logger import (
    FileLogObserver,
    FilteringLogObserver,
    ILogFilterPredicate,
    LogLevel,
    LogLevelFilterPredicate,
    PredicateResult,
    eventAsText,
    formatEvent,
    globalLogBeginner,
)
from zope.interface import provider

#: Set by the supervisor for its children, whose lines it prefixes and stamps.
CHILD_ENV = "KCORAL_SUPERVISED"
#: Also set for them: the supervisor's pid, so that a worker can tell when its
#: supervisor is gone (kcoral.cli).
SUPERVISOR_PID_ENV = "KCORAL_SUPERVISOR_PID"

#: Whether debug events may reach an observer: not on the kcoral command's
#: console (info and up), but perhaps elsewhere (twistd logs every level).
_debug = True


def debug_enabled() -> bool:
    """
    Whether a debug event would be seen. A per-request debug line asks first:
    a Logger event costs its whole emission (about 10 us) even when the
    observer at the end drops it.
    """
    return _debug


def _format(event: dict) -> str:
    text = eventAsText(event, includeTraceback=True, includeTimestamp=True, includeSystem=False)
    namespace = event.get("log_namespace", "-")
    level = event.get("log_level", LogLevel.info).name
    stamp, _, message = text.partition(" ")
    if os.environ.get(CHILD_ENV):
        return f"{level:<5} [{namespace}] {message}\n"
    return f"{stamp} {level:<5} [{namespace}] {message}\n"


@provider(ILogFilterPredicate)
def _not_noise(event: dict) -> PredicateResult:
    # Twisted announces every client connection factory and listening port at
    # info level; they would drown the one line per event we promise.
    text = formatEvent(event)
    if text.startswith(("Starting factory", "Stopping factory")) or " starting on " in text:
        return PredicateResult.no
    return PredicateResult.maybe


def start_console_logging(stream=None, level: LogLevel = LogLevel.info) -> None:
    global _debug
    _debug = level == LogLevel.debug
    observer = FileLogObserver(stream or sys.stdout, _format)
    predicates: list[ILogFilterPredicate] = [LogLevelFilterPredicate(defaultLogLevel=level), _not_noise]
    globalLogBeginner.beginLoggingTo([FilteringLogObserver(observer, predicates)],
                                     redirectStandardIO=False)
