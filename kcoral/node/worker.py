"""
One supervised server process: started through C{ProcessProtocol}, probed,
restarted with the L{RestartPolicy}, and stopped with SIGTERM, then SIGKILL
when it does not go.
"""

from __future__ import annotations

import json
import os
import re
import sys

from twisted.internet import error, protocol
from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from kcoral.logs import CHILD_ENV, SUPERVISOR_PID_ENV
from kcoral.node.devices import WorkerSpec
from kcoral.node.restart import RestartPolicy
from kcoral.web.outgoing import describe_failure, tls_problem

log = Logger()

_LISTENING = re.compile(rb"kcoral server listening on (\S+)")
#: A child line longer than this is cut, so a runaway child cannot grow the
#: supervisor's memory.
MAX_LINE = 64 * 1024


class LineProtocol(protocol.ProcessProtocol):
    """Relays a child's output line by line (never a partial line)."""

    def __init__(self, on_line, on_end):
        self._on_line = on_line
        self._on_end = on_end
        self._partial = {1: b"", 2: b""}

    def childDataReceived(self, fd, data):
        lines = (self._partial.get(fd, b"") + data).split(b"\n")
        self._partial[fd] = lines.pop()[:MAX_LINE]
        for line in lines:
            self._on_line(line[:MAX_LINE])

    def processEnded(self, reason):
        for fd, rest in self._partial.items():
            if rest:
                self._on_line(rest)
        self._on_end(reason.value)


class Worker:
    STOPPED, STARTING, RUNNING, STOPPING = "stopped", "starting", "running", "stopping"
    #: The TLS problem of the last failed probe, logged once when it appears.
    _tls_refused = None

    def __init__(self, spec: WorkerSpec, argv: list[str], policy: RestartPolicy, reactor, http,
                 *, on_change=lambda: None, metrics=None):
        self.spec = spec
        self.name = spec.name
        self._argv = argv
        self.policy = policy
        self._reactor = reactor
        self._on_change = on_change
        self._metrics = metrics
        self.state = self.STOPPED
        self.url: str | None = None
        self.healthy = False
        self.health: dict = {}
        self._process = None
        self._exited: Deferred | None = None
        self._kill = None
        self._pending_start = None
        self._wanted = False
        self._probes = LoopingCall(self._probe)
        self._probes.clock = reactor
        self._http = http

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        self._wanted = True
        self._spawn()

    def _spawn(self) -> None:
        self._pending_start = None
        if not self._wanted:
            return
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.spec.env)
        env[CHILD_ENV] = "1"
        env[SUPERVISOR_PID_ENV] = str(os.getpid())
        self.url, self.healthy, self.health = None, False, {}
        self._exited = Deferred()
        self._process = self._reactor.spawnProcess(
            LineProtocol(self._line, self._ended), sys.executable, self._argv, env=env)
        self.state = self.STARTING
        self.policy.started(self._reactor.seconds())
        log.info("{worker} started (pid {pid})", worker=self.name, pid=self._process.pid)
        if not self._probes.running:
            self._probes.start(self.policy.settings.health_interval_seconds, now=False)
        self._on_change()

    def _line(self, line: bytes) -> None:
        if self.url is None:
            found = _LISTENING.search(line)
            if found:
                self.url = found.group(1).decode("ascii", "replace")
        log.info("[{worker}] {line}", worker=self.name, line=line.decode("utf-8", "replace"))

    def _ended(self, reason) -> None:
        code = getattr(reason, "exitCode", None)
        signal = getattr(reason, "signal", None)
        how = f"signal {signal}" if signal else f"status {code}"
        self._process = None
        if self._kill is not None and self._kill.active():
            self._kill.cancel()
        self._kill = None
        self.healthy = False
        exited, self._exited = self._exited, None
        if self._wanted and self.state != self.STOPPING:
            delay = self.policy.next_delay()
            log.warn("{worker} exited with {how}; restarting in {delay:.1f}s",
                     worker=self.name, how=how, delay=delay)
            if self._metrics is not None:
                self._metrics.labels(self.name).inc()
            self.state = self.STOPPED
            self._pending_start = self._reactor.callLater(delay, self._spawn)
        else:
            log.info("{worker} stopped ({how})", worker=self.name, how=how)
            self.state = self.STOPPED
            if self._probes.running:
                self._probes.stop()
        self._on_change()
        if exited is not None:
            exited.callback(code)

    def _signal(self, name: str) -> None:
        if self._process is not None:
            try:
                self._process.signalProcess(name)
            except error.ProcessExitedAlready:
                pass

    def _terminate(self, grace: float | None) -> Deferred:
        """SIGTERM now; SIGKILL after C{grace} seconds (never when None)."""
        exited = self._exited if self._exited is not None else Deferred()
        if self._process is None:
            exited.callback(None)
            return exited
        self._signal("TERM")
        if grace is not None and self._kill is None:
            self._kill = self._reactor.callLater(grace, self._force_kill)
        return exited

    def _force_kill(self) -> None:
        # self._kill stays set (fired) until the process ends, so the failed
        # probes that follow do not start a second restart of the same worker.
        log.warn("{worker} did not stop within {grace}s: SIGKILL", worker=self.name,
                 grace=self.policy.settings.termination_grace_seconds)
        self._signal("KILL")

    def restart(self, why: str) -> Deferred:
        """Replace an unresponsive worker: TERM, KILL after the grace, start
        again after the backoff delay."""
        log.warn("{worker} is being restarted: {why}", worker=self.name, why=why)
        self.healthy = False
        self._on_change()
        return self._terminate(self.policy.settings.termination_grace_seconds)

    def stop(self) -> Deferred:
        """Drain and stop: SIGTERM, then wait while the worker finishes its
        requests; it is killed only if it stops answering probes."""
        self._wanted = False
        if self._pending_start is not None and self._pending_start.active():
            self._pending_start.cancel()
        self._pending_start = None
        if self._process is None:
            if self._probes.running:
                self._probes.stop()
            self.state = self.STOPPED
            return succeed(None)
        self.state = self.STOPPING
        return self._terminate(None)

    # -- probing ------------------------------------------------------------

    @inlineCallbacks
    def _probe(self):
        if self._process is None or self.url is None:
            if self.state == self.STARTING and self._process is not None:
                self._judge(False, "it has not started listening")
            return
        settings = self.policy.settings
        ok, why = False, ""
        try:
            response = yield self._http.get(self.url + "/health",
                                            timeout=settings.health_timeout_seconds)
            body = yield response.content()
            health = json.loads(body)
            self.health = health if isinstance(health, dict) else {}
            ok = response.code == 200 or (self.state == self.STOPPING and response.code == 503)
            why = f"/health answered {response.code} ({self.health.get('status')})"
            self._tls_refused = None
        except Exception as e:
            why = f"health probe failed: {describe_failure(e)}"
            tls = tls_problem(e)
            if tls is not None and tls != self._tls_refused:
                # A configuration error, not a slow start: say so at once,
                # not only when the failures finally restart the worker.
                log.error("{worker} at {url}: {why}", worker=self.name, url=self.url, why=tls)
            self._tls_refused = tls
        self._judge(ok, why)

    def _judge(self, ok: bool, why: str) -> None:
        was = self.healthy
        self.healthy = ok and self.state != self.STOPPING
        if ok and self.state == self.STARTING:
            self.state = self.RUNNING
            log.info("{worker} is ready at {url}", worker=self.name, url=self.url)
        if self.policy.probe(ok, self._reactor.seconds()) and self._process is not None:
            if self.state == self.STOPPING:
                # A draining worker closes its port before it exits (and
                # JAX's teardown takes a while): give it the grace first.
                if self._kill is None:
                    self._kill = self._reactor.callLater(
                        self.policy.settings.termination_grace_seconds, self._force_kill)
            elif self._kill is None:
                self.restart(f"{self.policy.failures} failed health probes in a row; {why}")
        if was != self.healthy:
            self._on_change()

    def report(self) -> dict:
        return {"name": self.name, "url": self.url or "", "healthy": self.healthy and self.url is not None,
                "capacity": int(self.health.get("capacity", 0)) if self.healthy else 0,
                "active": int(self.health.get("active", 0)) if self.healthy else 0}
