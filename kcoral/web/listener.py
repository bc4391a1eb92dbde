"""
A listening HTTP service that drains before it stops listening.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from twisted.application import service
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.web.endpoint import ListenAddress, is_loopback

log = Logger()

#: After draining, how long connections get to deliver their last response
#: before they are aborted.
CLOSE_TIMEOUT_SECONDS = 10.0


class DrainingListener(service.Service):
    """
    Listens on C{endpoint} with C{factory}. Stopping first waits for
    C{drain()} (running requests to finish) and only then closes the port, so
    health checks and in-flight answers keep flowing while the service drains
    (a server, whose supervisor probes it while it drains). With
    C{close_port_first} (the Router) the port closes first and open
    connections stop being kept alive; then it drains.
    """

    def __init__(self, name: str, address: ListenAddress, reactor, factory,
                 drain: Callable[[], Deferred], secured: bool = False,
                 close_port_first: bool = False):
        self.name = name
        self._address = address
        self._endpoint = address.endpoint(reactor)
        self._factory = factory
        self._drain = drain
        self._secured = secured
        self._close_port_first = close_port_first
        self.port: IListeningPort | None = None
        self.url: str | None = None

    def privilegedStartService(self):
        # Listening here, synchronously, lets a command report "port in use"
        # and exit 1 before the reactor runs (TCP endpoints fire at once).
        failures: list[Failure] = []
        d = self._endpoint.listen(self._factory)
        d.addCallbacks(self._listening, failures.append)
        if failures:
            failures[0].raiseException()
        super().privilegedStartService()

    def _listening(self, port):
        self.port = port
        address = port.getHost()
        self.url = self._address.url(address)
        log.info("{name} listening on {url}", name=self.name, url=self.url)
        host = getattr(address, "host", None)
        if host is not None and not is_loopback(host) and not self._secured:
            log.warn("{name} listens on {host}, beyond this machine, without client "
                     "authentication: anyone who reaches it can run programs", name=self.name,
                     host=host)

    @inlineCallbacks
    def stopService(self):
        super().stopService()
        if self._close_port_first and self.port is not None:
            # The Router stops accepting before it drains: a new connection is
            # refused (a client retries it, or a load balancer moves on)
            # instead of being answered 503, while requests on connections
            # already open are served, each answer closing its connection.
            port, self.port = self.port, None
            yield port.stopListening()
            stop_keep_alive = getattr(self._factory, "stop_keep_alive", None)
            if stop_keep_alive is not None:
                stop_keep_alive()
        yield self._drain()
        yield self.close(CLOSE_TIMEOUT_SECONDS)

    @inlineCallbacks
    def close(self, timeout: float):
        """
        Stop listening, and close each open connection once the answer to
        its request in progress, if any, is written; fires once all are
        closed, those still open after C{timeout} seconds aborted. It does
        not drain: a process that must end whatever its requests do calls
        it alone.
        """
        if self.port is not None:
            port, self.port = self.port, None
            try:
                yield port.stopListening()
            except PermissionError as e:
                # A UNIX socket's file is removed as its port closes, which
                # a confined server may not do (kcoral.sandbox): the next
                # start on the same path replaces it.
                log.warn("{name} left {path} behind: {why}", name=self.name,
                         path=os.fsdecode(e.filename), why=e.strerror)
        # The last answers may still sit in their connections' buffers: the
        # reactor's shutdown would drop them, so close connections gracefully.
        close = getattr(self._factory, "close_connections", None)
        if close is not None:
            yield close(timeout)
