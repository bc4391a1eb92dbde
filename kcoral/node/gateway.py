"""
The embedded gateway of a standalone node with two or more workers: the
Router's own pool, scheduler and proxy (L{build_router}) with the node's
workers as static members, on the node's public port.
"""

from __future__ import annotations

from twisted.application import service
from prometheus_client import generate_latest
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.logger import Logger

from kcoral.node.metrics import merge, scrape_workers
from kcoral.router.report import NodeReport
from kcoral.router.service import RouterConfig, build_router
from kcoral.web.endpoint import ListenAddress
from kcoral.web.listener import DrainingListener

log = Logger()

NODE = "local"


class Gateway(service.Service):
    def __init__(self, options, reactor):
        self._reactor = reactor
        config = RouterConfig(
            host=options["host"], port=options["port"],
            # The supervisor probes the workers itself: the pool follows
            # its verdicts at once instead of re-counting observations.
            unhealthy_threshold=1, recovery_threshold=1,
            queue_wait_timeout_seconds=options["queue-wait-timeout-seconds"],
            max_queued_requests=max(options["max-queued-requests"], 1024),
            max_request_bytes=options["max-request-bytes"],
            tls_cert=options["tls-cert"], tls_key=options["tls-key"], tls_ca=options["tls-ca"],
            listen=options["listen"])
        self.app, site = build_router(config, reactor, name="gateway")
        self.registry = self.app.registry
        self.app.metrics_source = self._metrics
        address = ListenAddress.of(config)
        self.listener = DrainingListener("kcoral gateway", address, reactor, site, self._drain,
                                         bool(options["node-token"]))

    def update(self, report: NodeReport) -> None:
        self.app.pool.report(NODE, report, static=True)
        self.app.pool.observe()

    @inlineCallbacks
    def _metrics(self):
        workers = {m.name: m.url for n in self.app.pool.nodes.values()
                   for m in n.members.values() if m.healthy}
        texts = yield scrape_workers(self.app.outgoing.client, workers)
        return merge(generate_latest(self.registry), texts)

    def privilegedStartService(self):
        self.listener.privilegedStartService()
        super().privilegedStartService()

    def startService(self):
        super().startService()
        self.listener.startService()

    def _drain(self) -> Deferred:
        return self.app.scheduler.drain()

    def stopService(self):
        super().stopService()
        return self.listener.stopService()
