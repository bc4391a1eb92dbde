"""
The node supervisor: one server process per device, each probed and
restarted on its own; under a Router it reports every worker, and standalone
with two or more workers it puts an embedded gateway (the Router's own pool,
scheduler and proxy, with static members) on the public port.

Its children start in this order and stop one at a time in the reverse one:
the reporter (under a Router), the workers, the gateway (standalone). So the
gateway stops taking work and drains first, then the workers drain and exit,
and last the reporter deregisters from the Router.
"""

from __future__ import annotations

import os
import sys

import attrs
from prometheus_client import Counter
from twisted.application import service
from twisted.internet.defer import inlineCallbacks
from twisted.logger import Logger

from kcoral.node.devices import WorkerSpec, detect_gpus, plan_workers
from kcoral.node.gateway import Gateway, gateway_config
from kcoral.node.reporter import Reporter
from kcoral.node.restart import RestartPolicy, RestartSettings
from kcoral.node.worker import Worker
from kcoral.router.report import WorkerReport
from kcoral.web.endpoint import url_of
from kcoral.web.outgoing import Outgoing

log = Logger()


@attrs.frozen
class NodeConfig:
    """A node's own settings (its workers take a L{ServerConfig}'s)."""

    cpu_workers: int = 1
    router: str | None = None
    node_id: str | None = None
    node_token: str | None = None
    advertise_host: str | None = None
    #: CA file to verify https Routers and workers with (default: the platform's roots).
    tls_ca: str | None = None
    restart: RestartSettings = attrs.Factory(RestartSettings)


def worker_argv(options, spec: WorkerSpec, port: int) -> list[str]:
    argv = [sys.executable, "-m", "kcoral", "server", "--host", options["host"], "--port", str(port),
            "--gpus", spec.gpus_argument]
    for name in ("capacity", "max-queued-requests", "queue-wait-timeout-seconds",
                 "max-request-bytes", "cache-memory-bytes", "cache-disk-bytes",
                 "compile-cache-entries", "device-cache-bytes", "compilation-cache-dir",
                 "tls-cert", "tls-key"):
        if options[name] is not None:
            argv += [f"--{name}", str(options[name])]
    if options["cache-dir"]:
        # One directory per worker: each keeps its own LRU accounting.
        argv += ["--cache-dir", os.path.join(options["cache-dir"], spec.name)]
    return argv


def worker_port(options, index: int) -> int:
    """
    The port of worker C{index}: C{--port} + index under a Router; after the
    gateway's own C{--port} (+ 1 + index) on a node without one. Ephemeral
    (0) with C{--port 0}, and when the gateway listens on C{--listen} and no
    C{--port} was given (its default could be the very port of --listen).
    """
    base = options["port"]
    if not base or (options["listen"] and not options.given("port")):
        return 0
    return base + index + (0 if options["router"] else 1)


class SupervisorService(service.MultiService):
    """The node: its workers, and the reporter or the gateway."""

    exit_status = 0

    def __init__(self, options, reactor, specs: list[WorkerSpec], account: str,
                 settings: RestartSettings, *, outgoing: Outgoing | None = None):
        super().__init__()
        self._options = options
        self._account = account
        self._advertise = options["advertise-host"] or options["host"]
        #: The HTTP client of the probes and the reports.
        self.outgoing = outgoing or Outgoing(reactor, ca_path=options["tls-ca"])
        self.reporter: Reporter | None = None
        self.gateway: Gateway | None = None
        if options["router"]:
            self.reporter = Reporter(self.outgoing.client, options["router"], options["node-id"],
                                     options["node-token"], self.report,
                                     timeout=settings.health_interval_seconds, reactor=reactor)
            self.reporter.setServiceParent(self)
        else:
            self.gateway = Gateway(gateway_config(options), reactor,
                                   secured=bool(options["node-token"]))
        restarts = Counter("kcoral_worker_restarts", "Worker restarts by the supervisor", ["worker"],
                           registry=self.gateway.registry if self.gateway else None)
        self.workers = service.MultiService()
        for spec in specs:
            Worker(spec, worker_argv(options, spec, worker_port(options, spec.index)),
                   RestartPolicy(settings), reactor, self.outgoing.client,
                   on_change=self._changed, restarts=restarts).setServiceParent(self.workers)
        self.workers.setServiceParent(self)
        if self.gateway is not None:
            self.gateway.setServiceParent(self)

    def _advertised(self, worker: Worker) -> str:
        if not worker.url:
            return "http://unknown:1"
        scheme = "https" if self._options["tls-cert"] else "http"
        return url_of(self._advertise, int(worker.url.rsplit(":", 1)[1]), scheme)

    def worker_reports(self) -> tuple[WorkerReport, ...]:
        return tuple(w.report(self._advertised(w)) for w in self.workers)

    def _target(self) -> tuple[str | None, dict]:
        """The GPU target and runtime of the node: its healthy workers'."""
        health: dict = next((w.health for w in self.workers if w.healthy), {})
        return health.get("gpu_target"), health.get("runtime") or {}

    def report(self) -> dict:
        """The node as its reporter tells the Router."""
        gpu_target, runtime = self._target()
        return {"workers": [w.to_json() for w in self.worker_reports()],
                "gpu_target": gpu_target, "runtime": runtime}

    def _changed(self) -> None:
        """A worker started, stopped or changed health: tell the gateway, or
        the Router without waiting for the next heartbeat."""
        if self.gateway is not None:
            gpu_target, runtime = self._target()
            self.gateway.update(self.worker_reports(), gpu_target=gpu_target, runtime=runtime)
        if self.reporter is not None and self.reporter.running:
            self.reporter.send()

    def startService(self):
        log.info("kcoral node starting: {account}", account=self._account)
        super().startService()

    @inlineCallbacks
    def stopService(self):
        log.info("node stopping: draining {n} worker(s)", n=len(list(self.workers)))
        if self.reporter is not None:
            # Tell the Router first, so no new work arrives while we drain;
            # heartbeats go on (saying draining) until the workers are done.
            yield self.reporter.drain()
        # One child at a time, the last started first: each waits for the
        # ones that send it work to have drained.
        service.Service.stopService(self)
        for child in reversed(list(self)):
            yield child.stopService()
        yield self.outgoing.close()
        log.info("kcoral node stopped")


def makeSupervisorService(options, reactor):
    specs, account = plan_workers(options["gpus"], options["cpu-workers"], detect_gpus())
    return SupervisorService(options, reactor, specs, account, options.node_config().restart)
