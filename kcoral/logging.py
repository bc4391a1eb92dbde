"""Console logging for the C{kcoral} command: one line per event."""

from __future__ import annotations

import sys

from twisted.logger import FileLogObserver, LogLevel, eventAsText, globalLogBeginner, \
    LogLevelFilterPredicate, FilteringLogObserver


def _format(event: dict) -> str:
    text = eventAsText(event, includeTraceback=True, includeTimestamp=True, includeSystem=False)
    namespace = event.get("log_namespace", "-")
    level = event.get("log_level", LogLevel.info).name
    stamp, _, message = text.partition(" ")
    return f"{stamp} {level:<5} [{namespace}] {message}\n"


def start_console_logging(stream=None, level: LogLevel = LogLevel.info) -> None:
    observer = FileLogObserver(stream or sys.stdout, _format)
    predicate = LogLevelFilterPredicate(defaultLogLevel=level)
    globalLogBeginner.beginLoggingTo([FilteringLogObserver(observer, [predicate])],
                                     redirectStandardIO=False)
