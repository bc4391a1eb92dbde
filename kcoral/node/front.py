"""
A node's front processes: more processes serving its gateway's gRPC port, so
that reading and writing HTTP/2, which one reactor does for every call,
spreads over the cores of a host with many. Each of them and the gateway
listen on the port with C{SO_REUSEPORT}, and the kernel gives each its share
of the connections (connections, not calls: a client with one connection is
served by one process).

A front process is a Router (C{kcoral router}) on loopback, which the node
tells about its workers as a node tells any Router (L{Reporter}) and which
forwards straight to them; the supervisor runs it as it runs a worker
(L{Worker}: probed, restarted with backoff, stopped with SIGTERM, on which
it drains: GOAWAY, then the calls in flight are answered). Only gRPC is
spread: the node's HTTP port, its metrics and its control routes stay the
gateway's, which scrapes each front process's metrics into its own.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable

import attrs
from twisted.application import service
from twisted.internet.defer import DeferredList, inlineCallbacks

from kcoral.node.devices import WorkerSpec
from kcoral.node.gateway import NODE
from kcoral.node.reporter import Reporter
from kcoral.node.restart import RestartPolicy, RestartSettings
from kcoral.node.worker import Worker
from kcoral.options import options_of
from kcoral.router.service import RouterConfig
from kcoral.web.auth import CLIENT_TOKEN_ENV, IGuard, TokensFile

#: The gateway's settings that its front processes share.
FRONT_SETTINGS = ("unhealthy_threshold", "recovery_threshold", "max_status_age_seconds",
                  "queue_wait_timeout_seconds", "max_queued_requests", "max_request_bytes",
                  "routing", "tls_cert", "tls_key", "tls_ca", "tls_client_ca",
                  "client_tokens_file", "log_format", "tracing")
#: Where a front process's HTTP port is: the supervisor's probes and
#: reports are its only clients.
FRONT_LISTEN = "tcp:0:interface=127.0.0.1"


def front_argv(config: RouterConfig, grpc_port: int) -> list[str]:
    """The command line of a front process of the gateway with C{config},
    whose gRPC front took C{grpc_port}."""
    return [sys.executable, "-m", "kcoral", "router", "--listen", FRONT_LISTEN,
            "--host", config.host, "--grpc-port", str(grpc_port),
            "--front-processes", str(config.front_processes),
            *options_of(config, FRONT_SETTINGS)]


class FrontProcesses(service.MultiService):
    """
    The front processes of the gateway with C{config} (C{front_processes}
    less one: the gateway is the first), run with C{settings} by the clock
    and process spawner C{reactor}, probed and told C{report()} over the
    treq-like C{http}. They start after the gateway, on the port that
    C{grpc_port()} says it took, and stop before it; they read the
    gateway's tokens file again when its C{guard} does.
    """

    def __init__(self, config: RouterConfig, grpc_port: Callable[[], int | None],
                 settings: RestartSettings, reactor, http, report: Callable[[], dict],
                 guard: IGuard | None = None):
        super().__init__()
        self._grpc_port = grpc_port
        self._guard = guard
        self._settings = settings
        self._reactor = reactor
        self._http = http
        self._report = report
        # Heartbeats come every health interval: a few of them missed,
        # and not a slow supervisor, make the node stale.
        self._config = attrs.evolve(config, max_status_age_seconds=max(
            config.max_status_age_seconds, 3 * settings.health_interval_seconds))
        #: The node's token in its front processes, which no one else knows.
        self._token = secrets.token_urlsafe(32)
        self._reporters: dict[str, Reporter] = {}

    def startService(self) -> None:
        port = self._grpc_port()
        assert port is not None, "front processes serve the gateway's gRPC port"
        argv = front_argv(self._config, port)
        env = {"KCORAL_NODE_TOKEN": self._token}
        if self._config.client_token:
            env[CLIENT_TOKEN_ENV] = self._config.client_token
        for index in range(1, self._config.front_processes):
            Worker(WorkerSpec(f"front{index}", index, None), argv, RestartPolicy(self._settings),
                   self._reactor, self._http, on_change=self._changed,
                   env=env).setServiceParent(self)
        super().startService()
        if isinstance(self._guard, TokensFile):
            # When the gateway reads its tokens file again (SIGHUP), so do
            # they: a token goes or comes on every process of the port at once.
            self._guard.followers.append(self._read_again)

    def _read_again(self) -> None:
        for front in self:
            front.signal("HUP")

    def urls(self) -> dict[str, str]:
        """The HTTP address of each front process that has one now."""
        return {front.name: front.url for front in self if front.url}

    def _changed(self) -> None:
        """A front process started, listens, or exited: its reporter follows
        it to its new port."""
        for front in self:
            reporter = self._reporters.get(front.name)
            if reporter is not None and reporter.router != front.url:
                del self._reporters[front.name]
                reporter.stopService()
            if front.url and front.name not in self._reporters and self.running:
                self._reporters[front.name] = reporter = Reporter(
                    self._http, front.url, NODE, self._token, self._report,
                    timeout=self._settings.health_interval_seconds, reactor=self._reactor)
                reporter.startService()

    def send(self):
        """The node's workers, as they are now, to every front process."""
        return DeferredList([reporter.send() for reporter in self._reporters.values()])

    @inlineCallbacks
    def stopService(self):
        if isinstance(self._guard, TokensFile) and self._read_again in self._guard.followers:
            self._guard.followers.remove(self._read_again)
        # The front processes drain first, told of the workers until they
        # have: their calls in flight are still being answered.
        yield super().stopService()
        reporters, self._reporters = list(self._reporters.values()), {}
        yield DeferredList([reporter.stopService() for reporter in reporters])
