"""
The node supervisor: one server process per device, each probed and
restarted on its own; under a Router it reports every worker, and standalone
with two or more workers it puts an embedded gateway (the Router's own pool,
scheduler and proxy, with static members) on the public port.
"""

from __future__ import annotations

import os
import sys

from prometheus_client import Counter
from twisted.application import service
from twisted.application.internet import TimerService
from twisted.internet.defer import DeferredList, inlineCallbacks
from twisted.logger import Logger

from kcoral.node.devices import WorkerSpec, detect_gpus, plan_workers
from kcoral.node.reporter import Reporter
from kcoral.node.restart import RestartPolicy, RestartSettings
from kcoral.node.worker import Worker
from kcoral.router.report import NodeReport, WorkerReport
from kcoral.web.endpoint import url_of
from kcoral.web.outgoing import Outgoing

log = Logger()

GATEWAY_NODE = "local"


def restart_settings(options) -> RestartSettings:
    return RestartSettings(**{name.replace("-", "_"): options[name] for name in (
        "failure-threshold", "startup-grace-seconds", "stable-reset-seconds",
        "termination-grace-seconds", "restart-min-delay-seconds", "restart-max-delay-seconds",
        "restart-jitter", "health-interval-seconds", "health-timeout-seconds")})


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
    exit_status = 0

    def __init__(self, options, reactor, specs: list[WorkerSpec], account: str):
        super().__init__()
        self._reactor = reactor
        self._options = options
        self._account = account
        self._advertise = options["advertise-host"] or options["host"]
        settings = restart_settings(options)
        self.gateway = None
        self.reporter = None
        if not options["router"]:
            from kcoral.node.gateway import Gateway

            self.gateway = Gateway(options, reactor)
        restarts = Counter("kcoral_worker_restarts", "Worker restarts by the supervisor", ["worker"],
                           registry=self.gateway.registry if self.gateway else None)
        self.outgoing = Outgoing(reactor, ca_path=options["tls-ca"])
        self.workers = [
            Worker(spec, worker_argv(options, spec, worker_port(options, spec.index)),
                   RestartPolicy(settings), reactor, self.outgoing.client,
                   on_change=self._changed, metrics=restarts)
            for spec in specs]
        if options["router"]:
            self.reporter = Reporter(self.outgoing.client, options["router"], options["node-id"],
                                     options["node-token"], self.report,
                                     timeout=settings.health_interval_seconds)
            TimerService(settings.health_interval_seconds, self._heartbeat).setServiceParent(self)
        self.draining = False

    def _heartbeat(self):
        return self.reporter.send(draining=self.draining)

    def _advertised(self, worker: Worker) -> str:
        if not worker.url:
            return ""
        scheme = "https" if self._options["tls-cert"] else "http"
        return url_of(self._advertise, int(worker.url.rsplit(":", 1)[1]), scheme)

    def report(self) -> dict:
        workers = [dict(w.report(), url=self._advertised(w) or "http://unknown:1") for w in self.workers]
        health = next((w.health for w in self.workers if w.healthy), {})
        return {"workers": workers, "gpu_target": health.get("gpu_target"),
                "runtime": health.get("runtime") or {}}

    def _changed(self) -> None:
        """A worker started, stopped or changed health: tell the gateway, or
        the Router without waiting for the next heartbeat."""
        if self.gateway is not None:
            self.gateway.update(self.node_report())
        if self.reporter is not None and self.running:
            self._heartbeat()

    def node_report(self) -> NodeReport:
        body = self.report()
        return NodeReport(session="gateway", workers=tuple(
            WorkerReport(w["name"], w["url"], w["healthy"], w["capacity"], w["active"])
            for w in body["workers"]), gpu_target=body["gpu_target"], runtime=body["runtime"])

    def privilegedStartService(self):
        if self.gateway is not None:
            self.gateway.privilegedStartService()
        super().privilegedStartService()

    def startService(self):
        log.info("kcoral node starting: {account}", account=self._account)
        super().startService()
        if self.gateway is not None:
            self.gateway.startService()
        for worker in self.workers:
            worker.start()

    @inlineCallbacks
    def stopService(self):
        log.info("node stopping: draining {n} worker(s)", n=len(self.workers))
        self.draining = True
        if self.reporter is not None:
            # Tell the Router first, so no new work arrives while we drain;
            # heartbeats go on (saying draining) until the workers are done.
            yield self.reporter.send(draining=True)
        if self.gateway is not None:
            yield self.gateway.stopService()
        yield DeferredList([w.stop() for w in self.workers])
        yield super().stopService()
        if self.reporter is not None:
            yield self.reporter.leave()
        yield self.outgoing.close()
        log.info("kcoral node stopped")


def makeSupervisorService(options, reactor):
    specs, account = plan_workers(options["gpus"], options["cpu-workers"], detect_gpus())
    return SupervisorService(options, reactor, specs, account)
