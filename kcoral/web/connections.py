"""
The open connections of a site: a cap on how many it takes, so that a
service keeps the file descriptors it needs for its own work
(L{kcoral.web.fdlimit}), and a graceful close of them all when it stops.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from twisted.internet import protocol
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime, ITCPTransport
from twisted.logger import Logger

if TYPE_CHECKING:
    from kcoral.web.channel import KCoralChannel


class Refused(protocol.Protocol):
    """A connection beyond the cap: aborted as soon as it is made."""

    transport: ITCPTransport | None

    def connectionMade(self):
        assert self.transport is not None  # set by makeConnection
        self.transport.abortConnection()


class Connections:
    """
    The channels open on a site, at most C{limit} of them: an int, a
    callable that says how many now (a Router's own connections to its
    workers grow with its pool), or None for no cap.
    """

    def __init__(self, clock: IReactorTime, log: Logger, limit: int | Callable[[], int] | None = None):
        self.channels: set[KCoralChannel] = set()
        self._clock = clock
        self._log = log
        self._limit = limit
        #: Connections refused since the cap was last reached.
        self._refused = 0
        self._closing: list[Deferred[None]] = []

    @property
    def limit(self) -> int:
        """How many connections may be open now."""
        limit = self._limit
        if limit is None:
            return sys.maxsize
        return limit() if callable(limit) else limit

    def admit(self) -> bool:
        """Whether to take one more connection; the first one refused at the
        cap says so in the log, and so does the first close below it."""
        if len(self.channels) < self.limit:
            return True
        if not self._refused:
            self._log.warn("{open} connections are open, the most this service takes: "
                           "closing new ones until some close", open=len(self.channels))
        self._refused += 1
        return False

    def add(self, channel: KCoralChannel) -> None:
        self.channels.add(channel)

    def discard(self, channel: KCoralChannel) -> None:
        self.channels.discard(channel)
        if self._refused and len(self.channels) < self.limit:
            self._log.info("taking connections again; {refused} were closed at the limit",
                           refused=self._refused)
            self._refused = 0
        if not self.channels:
            closing, self._closing = self._closing, []
            for d in closing:
                if not d.called:
                    d.callback(None)

    def close(self, timeout: float) -> Deferred[None]:
        """
        Close every connection once its response in progress (if any) has
        been written; fires when all are closed. Connections still open after
        C{timeout} seconds (a client that does not read) are aborted.
        """
        if not self.channels:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._closing.append(d)
        for channel in list(self.channels):
            channel.close_when_idle()

        def abort():
            for channel in list(self.channels):
                if channel.transport is not None:
                    channel.transport.abortConnection()

        timer = self._clock.callLater(timeout, abort)

        def closed(result: object) -> object:
            if timer.active():
                timer.cancel()
            return result

        d.addBoth(closed)
        return d
