"""
One supervised server process, as a service: started through a
C{ProcessProtocol}, probed, replaced by its L{RestartPolicy} when it stops
answering or exits, and stopped with SIGTERM (then SIGKILL, when it hangs);
under a wrapper, TERM is the end of its input pipe (L{_Core.terminate}).

Its life is an explicit state machine::

    Idle --start--> Starting --answered--> Running
    Starting, Running --unresponsive--> Replacing (TERM now, KILL after the grace)
    Starting, Running, Replacing --ended--> Waiting (the restart timer) --restart--> Starting
    Starting, Running, Replacing --stop--> Stopping (TERM; KILL only when it hangs) --ended--> Idle
    Waiting --stop--> Idle
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
from automat import TypeMachineBuilder, pep614
from twisted.application import service
from twisted.internet import error, protocol
from twisted.internet.base import DelayedCall
from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.task import LoopingCall
from twisted.logger import Logger, globalLogPublisher

from kcoral.common.announce import URL_FD, URL_FD_ENV
from kcoral.common.cached import parse_cached
from kcoral.common.report import (
    InvalidReport,
    WorkerReport,
    parse_instance,
    parse_models,
    parse_sandbox,
)
from kcoral.common.serverconfig import RUN_TIMEOUT_EXIT_STATUS
from kcoral.logs import CHILD_ENV, relayed_event
from kcoral.node.devices import NODE_DEVICES_ENV, WorkerSpec
from kcoral.node.restart import RestartPolicy
from kcoral.web.auth import CLIENT_TOKEN_ENV
from kcoral.web.outgoing import describe_failure, tls_problem

log = Logger()

#: A child line longer than this is cut, so a runaway child cannot grow the
#: supervisor's memory.
MAX_LINE = 64 * 1024
#: The child's descriptors: its output (relayed line by line) and its URL pipe.
CHILD_FDS = {0: "w", 1: "r", 2: "r", URL_FD: "r"}


class LineProtocol(protocol.ProcessProtocol):
    """Relays a child's output line by line (never a partial line), and the
    first line of its URL pipe."""

    def __init__(self, on_line: Callable[[bytes], None], on_url: Callable[[str], None],
                 on_end: Callable[[Any], None]):
        self._on_line = on_line
        self._on_url = on_url
        self._on_end = on_end
        self._partial: dict[int, bytes] = {}

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        lines = (self._partial.get(childFD, b"") + data).split(b"\n")
        self._partial[childFD] = lines.pop()[:MAX_LINE]
        for line in lines:
            self._line(childFD, line[:MAX_LINE])

    def _line(self, fd: int, line: bytes) -> None:
        if fd == URL_FD:
            self._on_url(line.decode("ascii", "replace"))
        else:
            self._on_line(line)

    def processEnded(self, reason) -> None:
        for fd, rest in self._partial.items():
            if rest:
                self._line(fd, rest)
        self._partial.clear()
        self._on_end(reason.value)


def describe_exit(reason) -> str:
    signal = getattr(reason, "signal", None)
    if signal:
        return f"signal {signal}"
    status = exit_status(reason)
    if status == RUN_TIMEOUT_EXIT_STATUS:
        return f"status {status} (a run passed --max-run-seconds)"
    return f"status {status}"


def exit_status(reason) -> int | None:
    """The status a child exited with (None: a signal ended it)."""
    return getattr(reason, "exitCode", None)


class _Inputs(Protocol):
    def start(self) -> None:
        """The service starts: spawn the child."""

    def stop(self) -> Deferred[Any]:
        """The service stops: drain the child; fires with its exit status."""

    def answered(self) -> None:
        """A health probe found the child serving."""

    def unresponsive(self, why: str) -> None:
        """The restart policy condemned the child."""

    def ended(self, reason: Any) -> None:
        """The child exited (C{reason}: Twisted's ProcessDone or ProcessTerminated)."""

    def restart(self) -> None:
        """The restart delay is over."""


@attrs.define(eq=False)
class _Core:
    """What the worker's states share: the child, its URL and health, and
    the one timer that outlives a state (C{murder}: SIGKILL after the grace)."""

    spec: WorkerSpec
    argv: list[str]
    policy: RestartPolicy
    reactor: Any
    on_change: Callable[[], None]
    restarts: Any  # a prometheus Counter labelled by worker, or None
    probes: LoopingCall
    #: Set in the child's environment after everything else.
    env: dict[str, str] = attrs.Factory(dict)
    #: The part of the supervisor's environment the child gets.
    inherit: Callable[[Mapping[str, str]], Mapping[str, str]] = dict
    #: A command line the child's own is run under (L{kcoral.node.wrapper}).
    wrapper: tuple[str, ...] = ()
    #: The child (an IProcessTransport), while there is one.
    process: Any = None
    url: str | None = None
    healthy: bool = False
    health: dict = attrs.Factory(dict)
    murder: DelayedCall | None = None
    #: Restarts since the supervisor started, for its reports.
    restart_count: int = 0
    stopped: list[Deferred[Any]] = attrs.Factory(list)

    @property
    def name(self) -> str:
        return self.spec.name

    def spawn(self, inputs: _Inputs) -> None:
        env = dict(self.inherit(os.environ), PYTHONUNBUFFERED="1", **self.spec.env)
        env[CHILD_ENV] = "1"
        env[URL_FD_ENV] = str(URL_FD)
        # Only the node reaches its workers, and it sends no client token.
        env.pop(CLIENT_TOKEN_ENV, None)
        for variable in NODE_DEVICES_ENV.values():
            env.pop(variable, None)
        env.update(self.env)
        self.url, self.healthy, self.health = None, False, {}
        argv = [*self.wrapper, *self.argv]
        self.process = self.reactor.spawnProcess(
            LineProtocol(self.relay, self.listening, inputs.ended), argv[0], argv,
            env=env, childFDs=CHILD_FDS)
        self.policy.started(self.reactor.seconds())
        log.info("{worker} started (pid {pid})", worker=self.name, pid=self.process.pid)
        self.on_change()

    def relay(self, line: bytes) -> None:
        event = relayed_event(line)
        if event is None:
            log.info("[{worker}] {line}", worker=self.name, line=line.decode("utf-8", "replace"))
        else:
            # A JSON line (--log-format json): the worker's own event, as
            # this process's, with the worker it came from.
            event["worker"] = self.name
            globalLogPublisher(event)

    def listening(self, url: str) -> None:
        if self.url is None:
            self.url = url
            self.on_change()

    def signal(self, name: str) -> None:
        if self.process is not None:
            try:
                self.process.signalProcess(name)
            except error.ProcessExitedAlready:
                pass

    def terminate(self) -> None:
        """Ask the child to drain and exit: SIGTERM, or under a wrapper the
        end of the pipe on its standard input (L{kcoral.cli}), since the
        wrapper would take the signal itself: bubblewrap dies of it, taking
        the worker and its runs in flight along, and passes none on."""
        if self.process is None:
            return
        if self.wrapper:
            self.process.closeStdin()
        else:
            self.signal("TERM")

    def condemn(self) -> None:
        """Arm C{murder}, once: SIGKILL unless the child exits within the grace."""
        if self.murder is None:
            self.murder = self.reactor.callLater(self.policy.termination_grace, self.kill)

    def kill(self) -> None:
        log.warn("{worker} did not stop within {grace}s: SIGKILL", worker=self.name,
                 grace=self.policy.termination_grace)
        self.signal("KILL")

    def gone(self) -> None:
        """The child exited: forget it, what it said of itself (its instance
        with it: it holds nothing now) and its murder."""
        self.process, self.healthy, self.health = None, False, {}
        if self.murder is not None and self.murder.active():
            self.murder.cancel()
        self.murder = None

    def serving(self) -> None:
        if not self.healthy:
            self.healthy = True
            self.on_change()

    def unhealthy(self) -> None:
        if self.healthy:
            self.healthy = False
            self.on_change()

    def stop_probing(self) -> None:
        if self.probes.running:
            self.probes.stop()

    def wait_for_stop(self) -> Deferred[Any]:
        self.stopped.append(Deferred())
        return self.stopped[-1]


def _machine() -> Callable[[_Core], _Inputs]:
    machine = TypeMachineBuilder(_Inputs, _Core)

    def restart_later(inputs: _Inputs, core: _Core, reason: Any) -> DelayedCall:
        """The C{restart} timer: a new start after the policy's backoff."""
        delay = core.policy.next_delay(exit_status(reason))
        log.warn("{worker} exited with {how}; restarting in {delay:.1f}s",
                 worker=core.name, how=describe_exit(reason), delay=delay)
        core.restart_count += 1
        if core.restarts is not None:
            core.restarts.labels(core.name).inc()
        return core.reactor.callLater(delay, inputs.restart)

    idle = machine.state("Idle")
    starting = machine.state("Starting")
    running = machine.state("Running")
    replacing = machine.state("Replacing")
    waiting = machine.state("Waiting", restart_later)
    stopping = machine.state("Stopping")

    @pep614(idle.upon(_Inputs.start).to(starting))
    def spawn(inputs: _Inputs, core: _Core) -> None:
        core.spawn(inputs)

    @pep614(waiting.upon(_Inputs.restart).to(starting))
    def respawn(inputs: _Inputs, core: _Core, restart: DelayedCall) -> None:
        core.spawn(inputs)

    @pep614(starting.upon(_Inputs.answered).to(running))
    def ready(inputs: _Inputs, core: _Core) -> None:
        log.info("{worker} is ready at {url}", worker=core.name, url=core.url)
        core.serving()

    @pep614(running.upon(_Inputs.answered).loop())
    def serving(inputs: _Inputs, core: _Core) -> None:
        core.serving()

    # Answers to a child on its way out change nothing (a probe sent before
    # its TERM must not make it healthy again), nor does a second
    # verdict on a child being replaced: it is never restarted twice.
    replacing.upon(_Inputs.answered).loop().returns(None)
    replacing.upon(_Inputs.unresponsive).loop().returns(None)
    stopping.upon(_Inputs.answered).loop().returns(None)

    @pep614(starting.upon(_Inputs.unresponsive).to(replacing))
    @pep614(running.upon(_Inputs.unresponsive).to(replacing))
    def replace(inputs: _Inputs, core: _Core, why: str) -> None:
        log.warn("{worker} is being restarted: {why}", worker=core.name, why=why)
        core.unhealthy()
        core.terminate()
        core.condemn()

    @pep614(stopping.upon(_Inputs.unresponsive).loop())
    def hung(inputs: _Inputs, core: _Core, why: str) -> None:
        # A draining worker closes its port before it exits (and JAX's
        # teardown takes a while): the grace first, then SIGKILL.
        core.condemn()

    @pep614(starting.upon(_Inputs.ended).to(waiting))
    @pep614(running.upon(_Inputs.ended).to(waiting))
    @pep614(replacing.upon(_Inputs.ended).to(waiting))
    def exited(inputs: _Inputs, core: _Core, reason: Any) -> None:
        core.gone()
        core.on_change()

    @pep614(starting.upon(_Inputs.stop).to(stopping))
    @pep614(running.upon(_Inputs.stop).to(stopping))
    def drain(inputs: _Inputs, core: _Core) -> Deferred[Any]:
        core.unhealthy()
        core.terminate()
        return core.wait_for_stop()

    @pep614(replacing.upon(_Inputs.stop).to(stopping))
    @pep614(stopping.upon(_Inputs.stop).loop())
    def already_terminated(inputs: _Inputs, core: _Core) -> Deferred[Any]:
        return core.wait_for_stop()

    @pep614(stopping.upon(_Inputs.ended).to(idle))
    def stopped(inputs: _Inputs, core: _Core, reason: Any) -> None:
        log.info("{worker} stopped ({how})", worker=core.name, how=describe_exit(reason))
        core.gone()
        core.stop_probing()
        core.on_change()
        waiting_for_stop, core.stopped = core.stopped, []
        for d in waiting_for_stop:
            d.callback(exit_status(reason))

    @pep614(waiting.upon(_Inputs.stop).to(idle))
    def cancel_restart(inputs: _Inputs, core: _Core, restart: DelayedCall) -> Deferred[Any]:
        restart.cancel()
        core.stop_probing()
        return succeed(None)

    @pep614(idle.upon(_Inputs.stop).loop())
    def not_started(inputs: _Inputs, core: _Core) -> Deferred[Any]:
        return succeed(None)

    return machine.build()


_build = _machine()


class Worker(service.Service):
    """
    One server process under supervision: a child service of the
    supervisor, running C{argv} (its executable first). C{reactor} provides
    C{IReactorProcess} and C{IReactorTime}; C{http} is a treq-like client
    for the health probes; C{inherit}, the part of the supervisor's
    environment its child gets (a node's workers get an allow-list's,
    L{kcoral.node.environment.WorkerEnvironment}; by default, all of it);
    C{env}, variables it gets on top of those; C{wrapper}, a command line its
    own runs under. A node's front processes are run this way too
    (L{kcoral.node.front}).
    """

    #: The TLS problem of the last failed probe, logged once when it appears.
    _tls_refused: str | None = None

    def __init__(self, spec: WorkerSpec, argv: list[str], policy: RestartPolicy, reactor, http,
                 *, on_change: Callable[[], None] = lambda: None, restarts=None,
                 env: dict[str, str] | None = None,
                 inherit: Callable[[Mapping[str, str]], Mapping[str, str]] = dict,
                 wrapper: tuple[str, ...] = ()):
        self.spec = spec
        self.setName(spec.name)
        self.policy = policy
        self._reactor = reactor
        self._http = http
        probes = LoopingCall(self._probe)
        probes.clock = reactor
        self._core = _Core(spec, argv, policy, reactor, on_change, restarts, probes, env=env or {},
                           inherit=inherit, wrapper=wrapper)
        self._machine = _build(self._core)

    @property
    def url(self) -> str | None:
        return self._core.url

    @property
    def healthy(self) -> bool:
        return self._core.healthy

    @property
    def health(self) -> dict:
        return self._core.health

    def startService(self) -> None:
        super().startService()
        self._machine.start()
        if not self._core.probes.running:
            self._core.probes.start(self.policy.settings.health_interval_seconds, now=False)

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        return self._machine.stop()

    def signal(self, name: str) -> None:
        """Send the child the signal C{name} ("HUP"), when there is one."""
        self._core.signal(name)

    # -- probing ------------------------------------------------------------

    @inlineCallbacks
    def _probe(self):
        core = self._core
        if core.process is None:
            return
        if core.url is None:
            self._judge(False, "it has not started listening")
            return
        settings = self.policy.settings
        ok, serving, why = False, False, ""
        try:
            response = yield self._http.get(core.url + "/health",
                                            timeout=settings.health_timeout_seconds)
            body = yield response.content()
            health = json.loads(body)
            models = core.health.get("models")
            core.health = health if isinstance(health, dict) else {}
            if core.healthy and core.health.get("models") != models:
                # A model loaded, unloaded or of a new version: the gateway
                # (or the Router) routes by models, so it hears of it now.
                core.on_change()
            serving = response.code == 200
            # A draining worker answers 503 while it finishes its runs, and a
            # starting one while it compiles its models (minutes, on a GPU,
            # for a large repository), as does a front process while none of
            # the node's workers can take work: each is alive, though it
            # takes no new work.
            ok = serving or (response.code == 503 and core.health.get("status")
                             in ("draining", "starting", "unavailable"))
            why = f"/health answered {response.code} ({core.health.get('status')})"
            self._tls_refused = None
        except Exception as e:
            why = f"health probe failed: {describe_failure(e)}"
            tls = tls_problem(e)
            if tls is not None and tls != self._tls_refused:
                # A configuration error, not a slow start: say so at once,
                # not only when the failures finally restart the worker.
                log.error("{worker} at {url}: {why}", worker=self.name, url=core.url, why=tls)
            self._tls_refused = tls
        if core.process is not None:  # it may have exited during the probe
            self._judge(ok, why, serving)

    def _judge(self, ok: bool, why: str, serving: bool = False) -> None:
        if serving and self.running:
            self._machine.answered()
        else:
            self._core.unhealthy()
        if self.policy.probe(ok, self._reactor.seconds()):
            self._machine.unresponsive(
                f"{self.policy.failures} failed health probes in a row; {why}")

    def report(self, url: str) -> WorkerReport:
        """This worker as a node reports it, reached at C{url}."""
        healthy = self.healthy and self.url is not None
        try:
            cache = parse_cached(self.health["cache"]) if healthy and "cache" in self.health else None
        except ValueError:
            cache = None  # a server of another version: the Router learns on its own
        try:
            models = parse_models(self.health.get("models", []), "models") if healthy else ()
        except InvalidReport:
            models = ()
        try:
            sandbox = parse_sandbox(self.health.get("sandbox"), "sandbox")
        except InvalidReport:
            sandbox = None  # left out, as a Router would refuse the whole report
        return WorkerReport(self.spec.name, url, healthy,
                            int(self.health.get("capacity", 0)) if healthy else 0,
                            int(self.health.get("active", 0)) if healthy else 0,
                            # What it owns, as it lists them; what it was started with
                            # until it does.
                            devices=len(self.health.get("devices") or ()) or self.spec.devices,
                            restarts=self._core.restart_count, cache=cache, models=models,
                            # Also while unhealthy: a live worker that missed a
                            # probe still holds its kept arrays (a restart
                            # forgets its health, and the id with it).
                            instance=parse_instance(self.health.get("instance")),
                            # How it confined itself does not change while it lives.
                            sandbox=sandbox)
