"""
Real child processes for integration tests, in the style of Tahoe-LAFS's
C{integration/conftest.py}: each child is started with C{reactor.spawnProcess}
and a L{LineCollector} that keeps every output line, so a test can wait for
"a line matching this regex appeared" (with a timeout) instead of sleeping,
and read the child's log afterwards.

The harness is generic (any command plus a ready regex): L{start_service}
starts any C{kcoral} service that logs C{kcoral NAME listening on URL}, and
tests of the Router and the supervisor reuse it with their own ready lines.
Every child belongs to a L{ProcessGroup}, whose L{ProcessGroup.stop_all}
stops each one (SIGTERM, then SIGKILL after a grace period), awaiting its
exit: fixtures call it in their teardown, so no child outlives a test, failed
or not. The parts that need no reactor (command line, environment, output
lines, ready lines) are the benchmarks' own, from C{bench.support.child}.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable
from re import Pattern

import attrs
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater

# What the benchmarks' children share with these.
from bench.support.child import (
    LISTENING,
    SERVER_READY,
    STOP_GRACE,
    OutputLines,
    as_pattern,
    child_environment,
    describe_exit,
    kcoral_argv,
)

__all__ = ["LISTENING", "SERVER_READY", "START_TIMEOUT", "STOP_GRACE", "ChildExited", "ChildProcess",
           "LineCollector", "LineTimeout", "ProcessGroup", "RunningService", "child_environment",
           "kcoral_argv", "until"]

#: Seconds a child gets to log its ready line: importing JAX and initialising
#: a device on a busy 2-core CI machine can take a while.
START_TIMEOUT = 90.0


class ChildExited(Exception):
    """The child ended while a test was waiting for one of its lines."""


class LineTimeout(Exception):
    """No line matched within the timeout."""


@attrs.define(eq=False)
class _Watcher:
    pattern: Pattern[str]
    deferred: Deferred
    timer: object = None


class LineCollector(ProcessProtocol):
    """
    Collects a child's stdout and stderr as text lines, in arrival order,
    and fires Deferreds when a line matches or when the child ends.
    """

    def __init__(self, name: str, clock, echo: Callable[[str], object] | None = None):
        self.name = name
        self._clock = clock
        self._output = OutputLines(name, clock.seconds, echo)
        self.lines = self._output.lines
        self._watchers: list[_Watcher] = []
        self._ended: list[Deferred] = []
        self.exit_code: int | None = None
        self.exit_signal: int | None = None
        self.ended = False

    # -- process events ---------------------------------------------------

    def connectionMade(self):
        self.transport.closeStdin()

    def childDataReceived(self, fd: int, data: bytes):
        self._notify(self._output.feed(fd, data))

    def _notify(self, lines: list[str]) -> None:
        for text in lines:
            for watcher in list(self._watchers):
                match = watcher.pattern.search(text)
                if match is not None:
                    self._settle(watcher)
                    watcher.deferred.callback(match)

    def processEnded(self, reason):
        self._notify(self._output.flush())
        self.ended = True
        self.exit_code = getattr(reason.value, "exitCode", None)
        self.exit_signal = getattr(reason.value, "signal", None)
        for watcher in list(self._watchers):
            self._settle(watcher)
            watcher.deferred.errback(ChildExited(
                f"{self.name} exited ({self.describe_exit()}) before a line matched "
                f"{watcher.pattern.pattern!r}\n{self.tail()}"))
        ended, self._ended = self._ended, []
        for d in ended:
            d.callback(self.exit_code)

    # -- waiting ----------------------------------------------------------

    def _settle(self, watcher: _Watcher) -> None:
        self._watchers.remove(watcher)
        if watcher.timer.active():
            watcher.timer.cancel()

    def wait_for_line(self, pattern: str | Pattern, timeout: float, since: int = 0) -> Deferred:
        """
        A Deferred that fires with the C{re.Match} of the first line from
        index C{since} on that matches C{pattern}: one already collected, or
        the next one to arrive. Fails with L{LineTimeout} after C{timeout}
        seconds, or L{ChildExited} if the child ends first.
        """
        pattern = as_pattern(pattern)
        found = self._output.first(pattern, since)
        if found is not None:
            d: Deferred = Deferred()
            d.callback(found[1])
            return d
        if self.ended:
            d = Deferred()
            d.errback(ChildExited(f"{self.name} has exited ({self.describe_exit()}); no line "
                                  f"matched {pattern.pattern!r}\n{self.tail()}"))
            return d
        watcher = _Watcher(pattern, Deferred(lambda d: self._settle(watcher)))
        watcher.timer = self._clock.callLater(timeout, self._timed_out, watcher, timeout)
        self._watchers.append(watcher)
        return watcher.deferred

    def _timed_out(self, watcher: _Watcher, timeout: float) -> None:
        self._watchers.remove(watcher)
        watcher.deferred.errback(LineTimeout(
            f"no line of {self.name} matched {watcher.pattern.pattern!r} within {timeout} s\n"
            f"{self.tail()}"))

    def when_ended(self) -> Deferred:
        """A Deferred that fires with the exit code once the child has ended."""
        d: Deferred = Deferred(lambda d: self._ended.remove(d) if d in self._ended else None)
        if self.ended:
            d.callback(self.exit_code)
        else:
            self._ended.append(d)
        return d

    # -- reading ------------------------------------------------------------

    def matching(self, pattern: str | Pattern, since: int = 0) -> list[str]:
        return self._output.matching(pattern, since)

    def describe_exit(self) -> str:
        if not self.ended:
            return "running"
        return describe_exit(-self.exit_signal if self.exit_signal is not None else self.exit_code)

    def tail(self, count: int = 40) -> str:
        return self._output.tail(count)


class ChildProcess:
    """One spawned child and its L{LineCollector}."""

    def __init__(self, reactor, argv: list[str], *, name: str, env: dict | None = None,
                 cwd: str | None = None, echo=None):
        self.reactor = reactor
        self.argv = list(argv)
        self.name = name
        self.output = LineCollector(name, reactor, echo)
        self.transport = reactor.spawnProcess(
            self.output, self.argv[0], self.argv, env=child_environment(env), path=cwd,
            childFDs={0: "w", 1: "r", 2: "r"})

    @property
    def pid(self) -> int | None:
        return self.transport.pid

    @property
    def running(self) -> bool:
        return not self.output.ended

    def mark(self) -> int:
        """The index of the next line, for L{wait_for_line}'s C{since}."""
        return len(self.output.lines)

    def wait_for_line(self, pattern, timeout: float = 30.0, since: int = 0) -> Deferred:
        return self.output.wait_for_line(pattern, timeout, since)

    def matching(self, pattern, since: int = 0) -> list[str]:
        return self.output.matching(pattern, since)

    def signal(self, name: str) -> None:
        """Send C{name} ("TERM", "INT", "KILL") unless the child has ended."""
        try:
            self.transport.signalProcess(name)
        except ProcessExitedAlready:
            pass

    def exited(self, timeout: float | None = None) -> Deferred:
        """The exit code, once the child ends (fails after C{timeout})."""
        d = self.output.when_ended()
        if timeout is not None:
            d.addTimeout(timeout, self.reactor)
        return d

    @inlineCallbacks
    def stop(self, grace: float = STOP_GRACE):
        """SIGTERM, then SIGKILL if the child still runs after C{grace}
        seconds; fires with the exit code (None when killed by a signal)."""
        if self.running:
            self.signal("TERM")
            try:
                yield self.exited(grace)
            except Exception:
                self.signal("KILL")
                yield self.exited()
        return self.output.exit_code

    def tail(self, count: int = 40) -> str:
        return self.output.tail(count)


@attrs.define
class RunningService:
    """A kcoral service that logged its listening and ready lines."""

    process: ChildProcess
    url: str
    port: int
    ready: re.Match | None = None

    def stop(self, grace: float = STOP_GRACE) -> Deferred:
        return self.process.stop(grace)


class ProcessGroup:
    """
    The children one fixture started. L{stop_all} ends every one still
    running, so teardown never leaves a process behind.
    """

    #: Every group whose children may still run, for failure reports.
    live: list[ProcessGroup] = []

    def __init__(self, reactor, echo=None):
        self.reactor = reactor
        self.echo = echo
        self.children: list[ChildProcess] = []
        ProcessGroup.live.append(self)

    def spawn(self, argv: list[str], *, name: str, env: dict | None = None,
              cwd: str | None = None) -> ChildProcess:
        child = ChildProcess(self.reactor, argv, name=name, env=env, cwd=cwd, echo=self.echo)
        self.children.append(child)
        return child

    @inlineCallbacks
    def start_service(self, args: Iterable[str], *, name: str,
                      ready: str | Pattern | None = None, env: dict | None = None,
                      timeout: float = START_TIMEOUT, argv=kcoral_argv):
        """
        Start C{kcoral ARGS} (the command line C{argv(*ARGS)}), wait for its
        listening line (the URL, whose port may be ephemeral) and then for
        C{ready} if given. A child that exits or stays silent fails the
        call, and is stopped.
        """
        child = self.spawn(argv(*args), name=name, env=env)
        try:
            listening = yield child.wait_for_line(LISTENING, timeout)
            matched = (yield child.wait_for_line(ready, timeout)) if ready is not None else None
        except Exception:
            yield child.stop()
            raise
        url = listening.group("url")
        return RunningService(child, url, int(url.rsplit(":", 1)[1]), matched)

    @inlineCallbacks
    def stop_all(self, grace: float = STOP_GRACE):
        try:
            for child in self.children:
                yield child.stop(grace)
        finally:
            if self in ProcessGroup.live:
                ProcessGroup.live.remove(self)

    def report(self) -> str:
        return "\n".join(f"{child.name} (pid {child.pid}, {child.output.describe_exit()}):\n"
                         f"{child.tail(60)}" for child in self.children)


async def until(check, what: str, timeout: float = 30.0, interval: float = 0.05):
    """
    Poll C{check} (real processes and sockets: no event to wait on) until it
    returns something true, which is returned; fail after C{timeout}
    seconds. C{check} returns the value, or an awaitable of it.
    """
    from twisted.internet import reactor

    deadline = reactor.seconds() + timeout
    while True:
        last = check()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        assert reactor.seconds() < deadline, f"{what}: not within {timeout} s (last: {last!r})"
        await deferLater(reactor, interval, lambda: None)
