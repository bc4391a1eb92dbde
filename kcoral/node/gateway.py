"""
The embedded gateway of a standalone node with two or more workers: the
Router's own pool, scheduler and proxy (L{build_router}) with the node's
workers as static members, on the node's public port.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import generate_latest
from twisted.application import service
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.logger import Logger

from kcoral.common.report import WorkerReport
from kcoral.common.serverconfig import ServerConfig
from kcoral.inference.cudasharedmemory import CudaSharedMemory, IDeviceMemoryOpener, refusal
from kcoral.inference.h2front import GrpcFront
from kcoral.inference.sharedmemory import OFF, SharedMemory
from kcoral.node.config import NodeConfig
from kcoral.node.metrics import merge, scrape
from kcoral.router.service import RouterConfig, build_router, grpc_front
from kcoral.web.auth import watch
from kcoral.web.endpoint import ListenAddress
from kcoral.web.listener import DrainingListener

log = Logger()

#: The gateway's one node: this one, whose workers its supervisor probes.
NODE = "local"


def gateway_config(node: NodeConfig, server: ServerConfig) -> RouterConfig:
    """The Router settings of the gateway of a node, on the node's public address."""
    return RouterConfig(
        host=server.host, port=server.port,
        # The supervisor probes the workers itself: the pool follows its
        # verdicts at once instead of re-counting observations.
        unhealthy_threshold=1, recovery_threshold=1,
        queue_wait_timeout_seconds=server.queue_wait_timeout_seconds,
        max_queued_requests=max(server.max_queued_requests, RouterConfig().max_queued_requests),
        max_request_bytes=server.max_request_bytes,
        tls_cert=server.tls_cert, tls_key=server.tls_key, tls_ca=node.tls_ca,
        listen=server.listen, client_token=server.client_token,
        client_tokens_file=server.client_tokens_file, tls_client_ca=server.tls_client_ca,
        tracing=server.tracing, routing=node.routing,
        service_name="kcoral-gateway", health_lists_workers=True, grpc_port=server.grpc_port,
        front_processes=node.front_processes if server.grpc_port is not None else 1,
        log_format=server.log_format)


class Gateway(service.MultiService):
    """
    Serves the node's public port; stopping drains its runs, then closes it.
    With C{allow_client_shm}, it serves its clients' system shared memory,
    and their CUDA regions where the node has GPUs (C{on_gpu}), opened with
    C{device_memory} (by default, CUDA's IPC).
    """

    def __init__(self, config: RouterConfig, reactor, allow_client_shm: bool = False, *,
                 on_gpu: bool = False, device_memory: IDeviceMemoryOpener | None = None):
        super().__init__()
        self.config = config
        shared_memory = SharedMemory(
            refused=None if allow_client_shm else OFF, max_bytes=config.max_request_bytes,
            namespaced=bool(config.client_token or config.client_tokens_file))
        cuda_memory = CudaSharedMemory(
            shared_memory, refused=refusal(on_gpu or device_memory is not None, allow_client_shm),
            opener=device_memory, max_bytes=config.max_request_bytes)
        self.app, site = build_router(config, reactor, shared_memory, cuda_memory)
        self.registry = self.app.registry
        self.app.metrics_source = self._metrics
        self.app.history.setServiceParent(self)
        watch(self.app.client_guard, self)
        address = ListenAddress.of(config)
        secured = self.app.client_guard is not None or address.verifies_clients
        self.listener = DrainingListener("kcoral gateway", address, reactor, site, self._drain,
                                         secured)
        self.listener.setServiceParent(self)
        self.grpc = grpc_front(config, self.app, reactor)
        self.grpc.setServiceParent(self)
        #: The node's front processes, by name, at their HTTP addresses
        #: (L{kcoral.node.front}): their metrics are the node's too.
        self.fronts: Callable[[], dict[str, str]] = dict

    def grpc_port(self) -> int | None:
        """The port its gRPC front took (None: gRPC is off)."""
        return self.grpc.port if isinstance(self.grpc, GrpcFront) else None

    def update(self, workers: Sequence[WorkerReport], *, gpu_target: str | None,
               runtime: dict) -> None:
        """The workers as their supervisor sees them now."""
        self.app.pool.set_static(NODE, workers, gpu_target=gpu_target, runtime=runtime)
        self.app.pool.observe()

    @inlineCallbacks
    def _metrics(self):
        sources = {("worker", m.name): m.url for n in self.app.pool.nodes.values()
                   for m in n.members.values() if m.healthy}
        sources.update({("front", name): url for name, url in self.fronts().items()})
        texts = yield scrape(self.app.outgoing.client, sources)
        return merge(generate_latest(self.registry), texts)

    def _drain(self) -> Deferred:
        return self.app.scheduler.drain()
