"""
The standalone server as a Twisted service: its devices (one, or
C{--devices-per-worker}), one HTTP port.
"""

from __future__ import annotations

import os
from typing import cast

from prometheus_client import CollectorRegistry
from twisted.application import service
from twisted.application.internet import TimerService
from twisted.internet.defer import DeferredList, inlineCallbacks
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

from kcoral.common.announce import announce
from kcoral.common.queue import WaitQueue
from kcoral.common.serverconfig import RUN_TIMEOUT_EXIT_STATUS, ServerConfig
from kcoral.heap import settle
from kcoral.inference.cudasharedmemory import (
    CudaSharedMemory,
    IDeviceMemoryOpener,
    refusal,
)
from kcoral.inference.h2front import GrpcFront
from kcoral.inference.sharedmemory import OFF, SharedMemory
from kcoral.metrics import HttpMetrics
from kcoral.sandbox.confinement import SandboxMissing, confine
from kcoral.server.admission import Admission
from kcoral.server.app import DRAINING, FAILED, OK, ServerApp
from kcoral.server.compile_cache import CompileCache
from kcoral.server.control import ModelControl
from kcoral.server.device_cache import DeviceCache
from kcoral.server.executor import Executor, ExecutorMetrics
from kcoral.server.inference import InferenceMetrics, ServerInference, Slots
from kcoral.server.invariant import deterministic_flags
from kcoral.server.kept import KeptStore, kept_metrics
from kcoral.server.models import ModelRepository, RepositoryError
from kcoral.server.programcheck import ProgramCheck
from kcoral.server.runlimit import RunLimit
from kcoral.server.runthreads import RunThreads
from kcoral.server.upload_cache import UploadCache
from kcoral.tracing import tracing_maker
from kcoral.web.auth import client_guard, watch
from kcoral.web.endpoint import ListenAddress
from kcoral.web.fdlimit import connection_limit
from kcoral.web.listener import DrainingListener
from kcoral.web.site import KCoralSite

log = Logger()

#: The routes outside every API family that the metrics label by their paths.
ROUTES = frozenset({"/health", "/readyz", "/metrics"})
#: Once drained, a server closes its port only after this long without a new run.
DRAIN_QUIET_SECONDS = 0.5
#: Once a run passed --max-run-seconds, how long the answers already written
#: (its 504 first) get to leave before the process exits.
EXIT_GRACE_SECONDS = 1.0


class ServerService(service.MultiService):
    """
    Loads the device off the reactor, serves, and drains on stop. Its
    clients' CUDA shared-memory regions are opened with C{device_memory}
    where given, else with CUDA's once the device it loaded is a GPU.
    """

    exit_status = 0

    def __init__(self, config: ServerConfig, reactor, *,
                 device_memory: IDeviceMemoryOpener | None = None):
        super().__init__()
        self.config = config
        self._reactor = reactor
        if config.batch_invariant:
            # Read when JAX starts its backend, in the load, after this.
            os.environ["XLA_FLAGS"] = deterministic_flags(os.environ.get("XLA_FLAGS", ""))
        registry = CollectorRegistry()
        metrics = ExecutorMetrics(registry)
        check = ProgramCheck.with_additions(config.allow_custom_calls, metrics.rejected)
        if config.allow_custom_calls:
            log.warn("programs may also call the custom-call targets {targets} "
                     "(--allow-custom-call)", targets=", ".join(config.allow_custom_calls))
        self._threadpool = RunThreads(config.capacity, "kcoral-run")
        self._timed_out = metrics.executions.labels("timeout")
        #: Whether a run passed the limit: the process is ending.
        self._ending = False
        uploads = UploadCache(config.cache_memory_bytes, metrics.caches,
                              config.cache_dir, config.cache_disk_bytes)
        kept = KeptStore(config.kept_bytes, config.kept_idle_seconds, now=reactor.seconds)
        kept_metrics(kept, registry)
        sweep = TimerService(kept.sweep_seconds, kept.expire)
        sweep.clock = reactor
        sweep.setServiceParent(self)
        self.executor = Executor(uploads=uploads, kept=kept,
                                 compiled=CompileCache(config.compile_cache_entries, metrics.caches),
                                 placed=DeviceCache(config.device_cache_bytes, metrics.caches),
                                 metrics=metrics, gpus=config.gpus,
                                 devices=config.devices_per_worker,
                                 compilation_cache_dir=config.compilation_cache_dir, check=check,
                                 timed=config.max_run_seconds > 0)
        admission = Admission(config.capacity, WaitQueue(
            reactor, config.max_queued_requests, config.queue_wait_timeout_seconds))
        guard = client_guard(config, reactor)
        #: The models every worker loads before it is ready (None: no repository).
        self.repository = None if config.model_repository is None else ModelRepository(
            config.model_repository, observe_compile=metrics.compile_seconds.observe,
            batch_invariant=config.batch_invariant, check=check)
        #: Which of them it serves, and how that changes (None: no repository).
        self.control = None if self.repository is None else ModelControl(
            self.repository, mode=config.model_control_mode, load_models=config.load_model,
            poll_seconds=config.repository_poll_seconds, device=lambda: self.executor.device,
            reactor=reactor, files_dir=config.cache_dir)
        if self.control is not None:
            self.control.setServiceParent(self)
        inference_metrics = InferenceMetrics(registry)

        def inference(app: ServerApp) -> ServerInference:
            return ServerInference(
                self.repository, is_ready=lambda: app.status == OK, busy=app.arrived,
                slots=Slots(admitted=app.admitted, release=app.admission.release,
                            in_thread=app.in_thread),
                clock=reactor, metrics=inference_metrics,
                batch_delay=config.max_batch_delay_microseconds / 1e6,
                # As many batches as runs may hold or wait for its slots.
                most_waiting=config.capacity + config.max_queued_requests, control=self.control,
                max_sequences=config.max_sequences)

        # Made once confined: otlp's exporter starts a thread.
        self._tracing = tracing_maker(config.tracing, "kcoral-server")
        shared_memory = SharedMemory(refused=None if config.allow_client_shm else OFF,
                                     max_bytes=config.max_request_bytes, namespaced=guard is not None)
        self.cuda_memory = CudaSharedMemory(
            shared_memory, refused=refusal(device_memory is not None, config.allow_client_shm),
            opener=device_memory, max_bytes=config.max_request_bytes)
        self.app = ServerApp(executor=self.executor, admission=admission,
                             threadpool=self._threadpool, reactor=reactor, registry=registry,
                             client_guard=guard, inference=inference,
                             run_limit=RunLimit(config.max_run_seconds, reactor, self._ran_too_long),
                             shared_memory=shared_memory, cuda_memory=self.cuda_memory)
        watch(guard, self)
        site = KCoralSite(self.app.resource(), metrics=HttpMetrics(registry, ROUTES),
                          max_request_bytes=config.max_request_bytes, log=log, clock=reactor,
                          max_connections=connection_limit(shared_memory.descriptors),
                          client_guard=guard)
        address = ListenAddress.of(config)
        # A worker of a node with a token counts as secured: only its node
        # should reach it (doc/security.rst).
        secured = config.secured or guard is not None or address.verifies_clients
        self.listener = DrainingListener("kcoral server", address, reactor, site, self._drain,
                                         secured)
        self.listener.setServiceParent(self)
        self.grpc: GrpcFront | None = None
        if config.grpc_port is not None:
            assert self.app.inference is not None  # a server always serves the protocol
            self.grpc = GrpcFront(
                self.app.inference, reactor=reactor, host=config.host, port=config.grpc_port,
                max_message_bytes=config.max_request_bytes, guard=guard,
                tls=(config.tls_cert, config.tls_key) if config.tls_cert and config.tls_key
                else None, client_ca=config.tls_client_ca, shared_memory=self.app.shared_memory,
                cuda_memory=self.cuda_memory)
            self.grpc.setServiceParent(self)

    def privilegedStartService(self):
        super().privilegedStartService()
        # A supervised server tells its supervisor where it listens (the
        # endpoints KCoral builds all listen at once, so the URL is known).
        if self.listener.url is not None:
            announce(self.listener.url)

    def startService(self):
        # Confined here, after privilegedStartService listened (and twistd
        # gave up its user), before any thread starts: the runs', the model
        # control's, the tracing exporter's.
        try:
            self.app.sandbox = confine(self.config)
        except SandboxMissing as e:
            log.critical("{why}", why=e)
            self.exit_status = 2
            self._reactor.stop()
            return
        self.app.tracing = self._tracing()
        self._threadpool.start()
        super().startService()
        self._load()

    @inlineCallbacks
    def _load(self):
        # deferToThreadPool calls no more of a pool than RunThreads has.
        threads = cast(ThreadPool, self._threadpool)
        try:
            info = yield deferToThreadPool(self._reactor, threads, self.executor.load)
            if info.platform == "cuda":
                self.cuda_memory.refused = refusal(True, self.config.allow_client_shm)
            if self.control is not None:
                # Every model compiled before the server says it is ready.
                yield deferToThreadPool(self._reactor, threads,
                                        self.control.load_at_start, self.executor.device)
                self.control.started()
        except RepositoryError as e:
            self.app.status = FAILED
            log.error("the server could not read its model repository: {why}", why=e)
            self.exit_status = 1
            self._reactor.stop()
            return
        except Exception:
            self.app.status = FAILED
            log.failure("the server could not initialise its device")
            self.exit_status = 1
            self._reactor.stop()
            return
        if self.app.status != DRAINING:
            settle()
            self.app.status = OK
            log.info("kcoral server ready on {target} (capacity {capacity})",
                     target=info.gpu_target, capacity=self.config.capacity)

    @inlineCallbacks
    def _drain(self):
        self.app.status = DRAINING
        log.info("draining: {active} running, {queued} waiting", active=self.app.admission.active,
                 queued=len(self.app.admission.queue))
        yield self.app.admission.idle()
        # A Router that has not heard of the drain yet (the supervisor died,
        # or its draining report is on its way) may have runs on the wire to
        # this worker, above all right after the last answers freed its
        # slots: closing the connections under them would make them 502s
        # (tests/test_graceful.py). Keep answering 503 draining, which a
        # Router retries elsewhere, until runs stop arriving for a moment.
        idle = self._reactor.seconds()
        while True:
            quiet = max(idle, self.app.last_run_at or idle) + DRAIN_QUIET_SECONDS \
                - self._reactor.seconds()
            if quiet <= 0:
                break
            yield deferLater(self._reactor, quiet, lambda: None)

    @inlineCallbacks
    def stopService(self):
        yield super().stopService()
        self._threadpool.stop()
        log.info("kcoral server stopped")

    def _ran_too_long(self, rid: str) -> None:
        """The run C{rid} passed the run limit, and is answered: the
        process ends, its ports closed first (answers already written
        leave), for its supervisor to start a fresh one."""
        self._timed_out.inc()
        if self._ending:
            return
        self._ending = True
        self.app.status = DRAINING
        closing = [self.listener.close(EXIT_GRACE_SECONDS)]
        if self.grpc is not None:
            closing.append(self.grpc.stopService(EXIT_GRACE_SECONDS))
        DeferredList(closing, consumeErrors=True).addCallback(lambda _: self._exit())
        # The grace bounds the exit whatever else happens meanwhile: a
        # SIGTERM would start a drain that waits for the run still running.
        self._reactor.callLater(EXIT_GRACE_SECONDS, self._exit)

    def _exit(self) -> None:
        log.warn("kcoral server exiting with status {status}: a run passed --max-run-seconds",
                 status=RUN_TIMEOUT_EXIT_STATUS)
        # Not the reactor's stop: its shutdown joins the worker threads (the
        # service's and the reactor's), and the one still inside XLA never
        # returns. Nothing is left to flush: the answers are out (or their
        # clients gave up reading them) and each log line was flushed as it
        # was written (twisted.logger's file observers flush every event).
        os._exit(RUN_TIMEOUT_EXIT_STATUS)
