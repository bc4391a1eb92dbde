"""
Logging for the KCoral services: one line per event, as text (the default)
or, with C{--log-format json}, as one JSON object a line in twisted.logger's
own JSON encoding (L{twisted.logger.eventAsJSON}), which keeps every field of
the event (C{request_id}, C{node_id}, C{worker}...) and reads back with
L{twisted.logger.eventFromJSON}.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from twisted.logger import (
    FileLogObserver,
    FilteringLogObserver,
    ILogFilterPredicate,
    ILogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    PredicateResult,
    eventAsJSON,
    eventAsText,
    eventFromJSON,
    formatEvent,
    globalLogBeginner,
)
from twisted.python.logfile import LogFile
from zope.interface import provider

#: Set by the supervisor for its children, whose lines it prefixes and stamps.
CHILD_ENV = "KCORAL_SUPERVISED"
#: The values of C{--log-format}.
LOG_FORMATS = ("text", "json")

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
    text = eventAsText(event, includeTraceback=False, includeTimestamp=True, includeSystem=False)
    namespace = event.get("log_namespace", "-")
    level = event.get("log_level", LogLevel.info).name
    stamp, _, message = text.partition(" ")
    # What a client chose (a model's name in a gRPC message, a key) may
    # hold a line break: escaped, it stays in its event's line instead of
    # making one of its own that reads as the service's.
    message = message.replace("\r", "\\r").replace("\n", "\\n")
    failure = event.get("log_failure")
    if failure is not None:
        message = f"{message}\n{failure.getTraceback().rstrip()}"
    if os.environ.get(CHILD_ENV):
        return f"{level:<5} [{namespace}] {message}\n"
    return f"{stamp} {level:<5} [{namespace}] {message}\n"


def _json_line(event: dict, node_id: str | None = None) -> str:
    """
    C{event} as one line of JSON: its fields as twisted.logger encodes them,
    plus C{message} (the text line's message, traceback included) and
    C{level}, which a log shipper can read without knowing Twisted's format,
    and C{node_id} where the process has one.
    """
    record = dict(event, level=event.get("log_level", LogLevel.info).name,
                  message=eventAsText(event, includeTimestamp=False, includeSystem=False))
    if node_id is not None:
        record.setdefault("node_id", node_id)
    # A copy: eventAsJSON flattens the event it is given in place, and other
    # observers see the original.
    return eventAsJSON(record) + "\n"


def relayed_event(line: bytes) -> dict | None:
    """The event a supervised worker logged as the JSON line C{line}; None
    for any other line (text, or what a library printed on its own)."""
    if not line.startswith(b"{"):
        return None
    try:
        event = eventFromJSON(line.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        return None
    return event if isinstance(event, dict) and "log_namespace" in event else None


@provider(ILogFilterPredicate)
def _not_noise(event: dict) -> PredicateResult:
    # Twisted announces every client connection factory and listening port at
    # info level; they would drown the one line per event we promise.
    text = formatEvent(event)
    if text.startswith(("Starting factory", "Stopping factory")) or " starting on " in text:
        return PredicateResult.no
    return PredicateResult.maybe


def log_observer(stream, level: LogLevel = LogLevel.info, *, log_format: str = "text",
                 node_id: str | None = None) -> ILogObserver:
    """The observer writing C{log_format} lines of the events at C{level} and up to C{stream}."""
    if log_format == "json":
        observer = FileLogObserver(stream, lambda event: _json_line(event, node_id))
    else:
        observer = FileLogObserver(stream, _format)
    predicates: list[ILogFilterPredicate] = [LogLevelFilterPredicate(defaultLogLevel=level), _not_noise]
    return FilteringLogObserver(observer, predicates)


def start_console_logging(stream=None, level: LogLevel = LogLevel.info, *, log_format: str = "text",
                          node_id: str | None = None) -> None:
    """Log to C{stream} (standard output), as the C{kcoral} command does."""
    global _debug
    _debug = level == LogLevel.debug
    observer = log_observer(stream or sys.stdout, level, log_format=log_format, node_id=node_id)
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)


#: The options of the twistd plugin run with --log-format json (see L{log_under_twistd}).
_twistd_plugin: dict[str, Any] = {}


def log_under_twistd(options) -> None:
    """
    Have twistd log JSON when its plugin's C{options} say C{--log-format
    json}. twistd begins logging after the plugin's makeService, with the
    observer of its own C{--logger} option (a factory it calls without
    arguments): so the plugin names L{twistd_json_observer} there, while
    twistd's options are still being parsed. A C{--logger} given to twistd
    wins, and text stays twistd's own.
    """
    twistd = getattr(options, "parent", None)
    # Under the kcoral command the parent has no --logger.
    if options["log-format"] != "json" or twistd is None or "logger" not in twistd \
            or twistd["logger"] is not None:
        return
    _twistd_plugin["options"] = options
    twistd["logger"] = f"{__name__}.{twistd_json_observer.__name__}"


def twistd_json_observer() -> ILogObserver:
    """
    The JSON observer twistd starts with (its C{--logger}), writing where its
    own would: standard output with C{--nodaemon} and no C{--logfile} (or
    C{--logfile -}), else the C{--logfile} (default C{twistd.log}), rotated
    as twistd rotates it.
    """
    global _debug
    options = _twistd_plugin["options"]
    twistd = options.parent
    logfile, nodaemon = twistd["logfile"], twistd["nodaemon"] or twistd.get("debug")
    if logfile == "-" or (nodaemon and not logfile):
        stream = sys.stdout
    else:
        stream = LogFile.fromFullPath(logfile or "twistd.log")
    _debug = False
    return log_observer(stream, log_format="json", node_id=options.get("node-id"))
