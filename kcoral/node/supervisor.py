"""
The node supervisor: one server process per device, each probed and
restarted on its own; under a Router it reports every worker, and standalone
with two or more workers it puts an embedded gateway (the Router's own pool,
scheduler and proxy, with static members) on the public port.

Its children start in this order and stop one at a time in the reverse one:
the reporter (under a Router), the workers, the gateway (standalone) and its
front processes (L{FrontProcesses}). So the front processes and then the
gateway stop taking work and drain first, then the workers drain and exit,
and last the reporter deregisters from the Router.
"""

from __future__ import annotations

import os
import sys

from prometheus_client import Counter
from twisted.application import service
from twisted.internet.defer import inlineCallbacks
from twisted.logger import Logger

from kcoral.common.report import WorkerReport
from kcoral.common.serverconfig import ServerConfig
from kcoral.heap import SettledHeap
from kcoral.inference.cudasharedmemory import IDeviceMemoryOpener
from kcoral.node.config import NodeConfig
from kcoral.node.devices import WorkerSpec, detect_gpus, plan_workers
from kcoral.node.environment import SECURED_ENV, WorkerEnvironment
from kcoral.node.front import FrontProcesses
from kcoral.node.gateway import Gateway, gateway_config
from kcoral.node.reporter import Reporters
from kcoral.node.restart import RestartPolicy
from kcoral.node.worker import Worker
from kcoral.node.wrapper import wrapper_argv
from kcoral.options import options_of
from kcoral.web.endpoint import url_of
from kcoral.web.outgoing import Outgoing

log = Logger()


#: The server settings a worker is started with, as they are on the node.
WORKER_SETTINGS = ("devices_per_worker", "capacity", "max_queued_requests", "queue_wait_timeout_seconds",
                   "max_request_bytes", "cache_memory_bytes", "cache_disk_bytes",
                   "compile_cache_entries", "device_cache_bytes", "kept_bytes",
                   "kept_idle_seconds", "compilation_cache_dir",
                   "model_repository", "model_control_mode", "repository_poll_seconds",
                   "max_batch_delay_microseconds", "max_sequences", "batch_invariant",
                   "tls_cert", "tls_key", "log_format", "tracing", "max_run_seconds",
                   "sandbox")


def worker_argv(server: ServerConfig, spec: WorkerSpec, port: int,
                grpc_port: int | None = None) -> list[str]:
    """The command line of the worker C{spec} of a node whose servers have
    C{server}, serving HTTP on C{port} and gRPC on C{grpc_port} (None: none)."""
    argv = [sys.executable, "-m", "kcoral", "server", "--host", server.host, "--port", str(port),
            "--gpus", spec.gpus_argument]
    if grpc_port is not None:
        argv += ["--grpc-port", str(grpc_port)]
    argv += options_of(server, WORKER_SETTINGS)
    for name in server.load_model:
        argv += ["--load-model", name]
    for target in server.allow_custom_calls:
        argv += ["--allow-custom-call", target]
    if server.cache_dir:
        # One directory per worker: each keeps its own LRU accounting.
        argv += ["--cache-dir", os.path.join(server.cache_dir, spec.name)]
    return argv


def worker_port(options, index: int) -> int:
    """
    The port of worker C{index}: C{--metrics-base-port} + index when given;
    else C{--port} + index under a Router, and after the gateway's own
    C{--port} (+ 1 + index) on a node without one. Ephemeral (0) with a base
    port 0, and when the gateway listens on C{--listen} and no C{--port} was
    given (its default could be the very port of --listen).
    """
    if options["metrics-base-port"] is not None:
        return _offset(options["metrics-base-port"], index)
    base = options["port"]
    if not base or (options["listen"] and not options.given("port")):
        return 0
    return base + index + (0 if options["router"] else 1)


def worker_grpc_port(options, index: int) -> int | None:
    """The gRPC port of worker C{index}: C{--base-port} + index (None: no gRPC)."""
    base = options["base-port"]
    return None if base is None else _offset(base, index)


def _offset(base: int, index: int) -> int:
    # Base 0 keeps every worker's port ephemeral.
    return base + index if base else 0


class SupervisorService(service.MultiService):
    """
    The node with the settings C{node}, whose workers run with C{server}'s:
    one per C{specs}, worker i on C{ports[i]} (and gRPC on C{grpc_ports[i]}
    when given); the reporter (with a Router) or the gateway (without),
    which opens its clients' CUDA regions with C{device_memory}.
    """

    exit_status = 0

    def __init__(self, node: NodeConfig, server: ServerConfig, reactor, specs: list[WorkerSpec],
                 ports: list[int], account: str, *, outgoing: Outgoing | None = None,
                 grpc_ports: list[int | None] | None = None,
                 device_memory: IDeviceMemoryOpener | None = None):
        super().__init__()
        self._account = account
        self._advertise = node.advertise_host or server.host
        self._scheme = "https" if server.tls_cert else "http"
        settings = node.restart
        #: The HTTP client of the probes and the reports; it presents the
        #: node's certificate to a Router that asks for one (--tls-client-ca).
        self.outgoing = outgoing or Outgoing(reactor, ca_path=node.tls_ca, cert=server.tls_cert,
                                             key=server.tls_key)
        self.reporter: Reporters | None = None
        self.gateway: Gateway | None = None
        self.fronts: FrontProcesses | None = None
        if node.routers and node.node_id:
            self.reporter = Reporters(self.outgoing.client, node.routers, node.node_id,
                                      node.node_token, self.report,
                                      timeout=settings.health_interval_seconds, reactor=reactor)
            self.reporter.setServiceParent(self)
        else:
            self.gateway = Gateway(gateway_config(node, server), reactor, server.allow_client_shm,
                                   on_gpu=any(spec.gpus is not None for spec in specs),
                                   device_memory=device_memory)
        restarts = Counter("kcoral_worker_restarts", "Worker restarts by the supervisor", ["worker"],
                           registry=self.gateway.registry if self.gateway else None)
        self.workers = service.MultiService()
        # Each worker gets the allow-list's part of this environment, never
        # the node's token, and the mark that says its node has one.
        inherit = WorkerEnvironment(node.worker_env).of
        env = {SECURED_ENV: "1"} if node.node_token else {}
        wrapper = wrapper_argv(node.worker_wrapper)
        for spec, port, grpc_port in zip(specs, ports, grpc_ports or [None] * len(specs),
                                         strict=True):
            Worker(spec, worker_argv(server, spec, port, grpc_port), RestartPolicy(settings), reactor,
                   self.outgoing.client, on_change=self._changed, restarts=restarts, env=env,
                   inherit=inherit, wrapper=wrapper).setServiceParent(self.workers)
        self.workers.setServiceParent(self)
        if self.gateway is not None:
            self.gateway.setServiceParent(self)
            config = self.gateway.config
            if config.front_processes > 1:
                self.fronts = FrontProcesses(config, self.gateway.grpc_port, settings, reactor,
                                             self.outgoing.client, self.report,
                                             self.gateway.app.client_guard)
                self.fronts.setServiceParent(self)
                self.gateway.fronts = self.fronts.urls
        SettledHeap().setServiceParent(self)

    def _advertised(self, worker: Worker) -> str:
        if not worker.url:
            return "http://unknown:1"
        return url_of(self._advertise, int(worker.url.rsplit(":", 1)[1]), self._scheme)

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
        the Routers without waiting for the next heartbeat."""
        if self.gateway is not None:
            gpu_target, runtime = self._target()
            self.gateway.update(self.worker_reports(), gpu_target=gpu_target, runtime=runtime)
        if self.fronts is not None and self.fronts.running:
            self.fronts.send()
        if self.reporter is not None and self.reporter.running:
            self.reporter.send()

    def startService(self):
        log.info("kcoral node starting: {account}", account=self._account)
        super().startService()

    @inlineCallbacks
    def stopService(self):
        log.info("node stopping: draining {n} worker(s)", n=len(list(self.workers)))
        if self.reporter is not None:
            # Tell the Routers first, so no new work arrives while we drain;
            # heartbeats go on (saying draining) until the workers are done.
            yield self.reporter.drain()
        # One child at a time, the last started first: each waits for the
        # ones that send it work to have drained.
        service.Service.stopService(self)
        for child in reversed(list(self)):
            yield child.stopService()
        yield self.outgoing.close()
        log.info("kcoral node stopped")


def make_supervisor_service(options, reactor, device_memory: IDeviceMemoryOpener | None = None
                            ) -> SupervisorService:
    """The supervisor of the node that the options C{options} describe (its
    gateway opens CUDA regions with C{device_memory})."""
    specs, account = plan_workers(options["gpus"], options["cpu-workers"], detect_gpus(),
                                  options["devices-per-worker"])
    ports = [worker_port(options, spec.index) for spec in specs]
    grpc_ports = [worker_grpc_port(options, spec.index) for spec in specs]
    check_distinct_ports(options, ports, grpc_ports)
    return SupervisorService(options.node_config(), options.server_config(), reactor, specs,
                             ports, account, grpc_ports=grpc_ports, device_memory=device_memory)


def check_distinct_ports(options, ports: list[int], grpc_ports: list[int | None]) -> None:
    """
    A ValueError naming a port that two of the node's listeners would take
    (its gateway's, without C{--router}, and its workers' C{ports} and
    C{grpc_ports}): the later one could never listen, and a worker that
    cannot is restarted again and again. Ephemeral ports (0) never clash.
    """
    listeners: list[tuple[str, int | None]] = []
    if not options["router"]:
        if not options["listen"]:
            listeners.append(("the gateway", options["port"]))
        listeners.append(("the gateway's gRPC", options["grpc-port"]))
    listeners += [(f"worker{i}", port) for i, port in enumerate(ports)]
    listeners += [(f"worker{i}'s gRPC", port) for i, port in enumerate(grpc_ports)]
    taken: dict[int, str] = {}
    for name, port in listeners:
        if not port:
            continue
        if port in taken:
            raise ValueError(f"{taken[port]} and {name} would both listen on port {port}: "
                             "give --port, --grpc-port, --base-port and --metrics-base-port "
                             "ranges that do not meet")
        taken[port] = name
