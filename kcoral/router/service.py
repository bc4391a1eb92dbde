"""
The Router as a Twisted service: pool, queue, scheduler and proxy behind one
listening port, with a periodic status check of every node.
"""

from __future__ import annotations

import attrs
from prometheus_client import CollectorRegistry
from twisted.application import service
from twisted.application.internet import TimerService
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.logger import Logger

from kcoral.common.announce import announce
from kcoral.common.keepalive import COUNT, IDLE_SECONDS, INTERVAL_SECONDS, Keepalive
from kcoral.common.queue import WaitQueue
from kcoral.heap import SettledHeap
from kcoral.inference.cudasharedmemory import CudaSharedMemory
from kcoral.inference.h2front import GrpcFront
from kcoral.inference.sharedmemory import SharedMemory
from kcoral.metrics import HttpMetrics
from kcoral.router.app import RouterApp
from kcoral.router.forward import MAX_REDISPATCHES
from kcoral.router.pool import SILENT_NODE_SECONDS, Pool
from kcoral.router.scheduler import Scheduler
from kcoral.tracing import tracing_for
from kcoral.web.auth import client_guard, watch
from kcoral.web.endpoint import ListenAddress
from kcoral.web.family import streamed
from kcoral.web.fdlimit import connection_limit
from kcoral.web.listener import DrainingListener
from kcoral.web.outgoing import Outgoing
from kcoral.web.site import KCoralSite
from kcoral.web.spool import Spool

log = Logger()

#: The routes outside every API family that the metrics label by their paths.
ROUTES = frozenset({"/health", "/readyz", "/metrics", "/", "/v1/dashboard"})


@attrs.frozen
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 9000
    status_check_interval_seconds: float = 1.0
    max_status_age_seconds: float = 5.0
    unhealthy_threshold: int = 3
    recovery_threshold: int = 2
    queue_wait_timeout_seconds: float = 1800.0
    max_queued_requests: int = 1024
    node_retention_seconds: float = 600.0
    max_request_bytes: int = 268435456
    #: Runs again of a run whose client allows it, after its node was lost.
    max_redispatches: int = MAX_REDISPATCHES
    node_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: CA file to verify https nodes with (default: the platform's roots).
    tls_ca: str | None = None
    #: A Twisted server endpoint string, in place of host, port and TLS files.
    listen: str | None = None
    #: The placement rule (L{kcoral.router.placement.ROUTINGS}).
    routing: str = "affinity"
    #: Bearer tokens runs and the node list need (kcoral.web.auth).
    client_token: str | None = None
    client_tokens_file: str | None = None
    #: CA file client certificates must be signed by (mutual TLS).
    tls_client_ca: str | None = None
    log_format: str = "text"
    tracing: str = "none"
    #: The port of the inference protocol over gRPC (None: gRPC off).
    grpc_port: int | None = None
    #: The processes that serve that port, this one among them (a node's
    #: gateway and its front processes, L{kcoral.node.front}); more than
    #: one: each listens with C{SO_REUSEPORT}.
    front_processes: int = 1
    #: The service name its traces carry.
    service_name: str = "kcoral-router"
    #: Whether /health lists each member (a gateway's own workers; a
    #: Router's pool is listed by /v1/nodes instead).
    health_lists_workers: bool = False
    #: TCP keepalive of its connections, to clients and to workers.
    keepalive_idle_seconds: int = IDLE_SECONDS
    keepalive_interval_seconds: int = INTERVAL_SECONDS
    keepalive_count: int = COUNT
    #: Runs in flight on a node whose reports stopped this long ago end with 502.
    silent_node_seconds: float = SILENT_NODE_SECONDS

    @property
    def keepalive(self) -> Keepalive:
        return Keepalive(self.keepalive_idle_seconds, self.keepalive_interval_seconds,
                         self.keepalive_count)


def build_router(config: RouterConfig, reactor, shared_memory: SharedMemory | None = None,
                 cuda_memory: CudaSharedMemory | None = None):
    """The pool, scheduler and app of a Router; the gateway builds the same,
    with its C{shared_memory} and C{cuda_memory}."""
    pool = Pool(reactor, max_status_age_seconds=config.max_status_age_seconds,
                unhealthy_threshold=config.unhealthy_threshold,
                recovery_threshold=config.recovery_threshold,
                node_retention_seconds=config.node_retention_seconds, routing=config.routing,
                silent_node_seconds=config.silent_node_seconds)
    scheduler = Scheduler(pool, WaitQueue(reactor, config.max_queued_requests,
                                          config.queue_wait_timeout_seconds))
    registry = CollectorRegistry()
    app = RouterApp(pool=pool, scheduler=scheduler, outgoing=Outgoing(reactor, ca_path=config.tls_ca,
                                                                     keepalive=config.keepalive),
                    reactor=reactor, registry=registry, node_token=config.node_token,
                    client_guard=client_guard(config, reactor),
                    shared_memory=shared_memory, cuda_memory=cuda_memory,
                    health_lists_workers=config.health_lists_workers,
                    status_check_interval=config.status_check_interval_seconds,
                    tracing=tracing_for(config.tracing, config.service_name),
                    max_redispatches=config.max_redispatches)
    site = KCoralSite(app.resource(), metrics=HttpMetrics(registry, ROUTES),
                      max_request_bytes=config.max_request_bytes, log=log, clock=reactor,
                      max_connections=_client_connections(connection_limit(
                          shared_memory.descriptors if shared_memory else 0), pool),
                      # It only forwards bodies: a large one need not stay in memory.
                      spool=Spool(reactor), client_guard=app.client_guard, streams=streamed,
                      keepalive=config.keepalive)
    return app, site


def grpc_front(config: RouterConfig, app: RouterApp, reactor) -> service.IService:
    """The inference protocol over gRPC on C{config.grpc_port}; a service
    that does nothing without one."""
    if config.grpc_port is None:
        return service.Service()
    return GrpcFront(app.inference, reactor=reactor, host=config.host, port=config.grpc_port,
                     max_message_bytes=config.max_request_bytes, guard=app.client_guard,
                     tls=(config.tls_cert, config.tls_key) if config.tls_cert and config.tls_key
                     else None, client_ca=config.tls_client_ca,
                     share_port=config.front_processes > 1, shared_memory=app.shared_memory,
                     cuda_memory=app.cuda_memory)


def _client_connections(limit: int, pool: Pool):
    """How many client connections a Router takes: its descriptors less one
    for each run it may have in flight to its workers (each on a connection
    of its own, kept open afterwards for the next run)."""
    return lambda: max(limit - pool.member_capacity(), 1)


class RouterService(service.MultiService):
    exit_status = 0

    def __init__(self, config: RouterConfig, reactor, *, name: str = "kcoral router"):
        super().__init__()
        self._reactor = reactor
        self.app, site = build_router(config, reactor)
        TimerService(config.status_check_interval_seconds, self.app.pool.observe).setServiceParent(self)
        self.app.history.setServiceParent(self)
        watch(self.app.client_guard, self)
        address = ListenAddress.of(config)
        secured = self.app.client_guard is not None or address.verifies_clients
        self.listener = DrainingListener(name, address, reactor, site, self._drain, secured,
                                         close_port_first=True)
        self.listener.setServiceParent(self)
        grpc_front(config, self.app, reactor).setServiceParent(self)
        SettledHeap().setServiceParent(self)

    def privilegedStartService(self):
        super().privilegedStartService()
        # A supervised Router (a node's front process) tells its supervisor
        # where its HTTP port is; otherwise this does nothing.
        if self.listener.url is not None:
            announce(self.listener.url)

    def _drain(self) -> Deferred:
        scheduler, pool = self.app.scheduler, self.app.pool
        log.info("draining: {active} running, {queued} waiting", active=pool.active(),
                 queued=len(scheduler.queue))
        # The port is closed already: what still arrives on open connections
        # was sent before the Router stopped accepting, and is served.
        return scheduler.drain(refuse=False)

    @inlineCallbacks
    def stopService(self):
        yield super().stopService()
        yield self.app.outgoing.close()
        log.info("kcoral router stopped")
