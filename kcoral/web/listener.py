"""
A listening HTTP service that drains before it stops listening.
"""

from __future__ import annotations

from typing import Callable

from twisted.application import service
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.logger import Logger

from kcoral.web.endpoint import ListenAddress, is_loopback

log = Logger()

#: After draining, how long connections get to deliver their last response
#: before they are aborted.
CLOSE_TIMEOUT_SECONDS = 10.0


class DrainingListener(service.Service):
    """
    Listens on C{endpoint} with C{factory}. Stopping first waits for
    C{drain()} (running requests to finish) and only then closes the port, so
    health checks and in-flight answers keep flowing while the service drains.
    """

    def __init__(self, name: str, address: ListenAddress, reactor, factory,
                 drain: Callable[[], Deferred], secured: bool = False):
        self.name = name
        self._address = address
        self._endpoint = address.endpoint(reactor)
        self._factory = factory
        self._drain = drain
        self._secured = secured
        self.port = None
        self.url = None

    def privilegedStartService(self):
        # Listening here, synchronously, lets a command report "port in use"
        # and exit 1 before the reactor runs (TCP endpoints fire at once).
        failures = []
        d = self._endpoint.listen(self._factory)
        d.addCallbacks(self._listening, failures.append)
        if failures:
            failures[0].raiseException()
        super().privilegedStartService()

    def _listening(self, port):
        self.port = port
        self.url = self._address.url(port.getHost().port)
        log.info("{name} listening on {url}", name=self.name, url=self.url)
        if not is_loopback(self._address.host) and not self._secured:
            log.warn("{name} listens on {host}, beyond this machine, without a node token: "
                     "anyone who reaches it can run programs", name=self.name, host=self._address.host)

    @inlineCallbacks
    def stopService(self):
        super().stopService()
        yield self._drain()
        if self.port is not None:
            yield self.port.stopListening()
        # The last answers may still sit in their connections' buffers: the
        # reactor's shutdown would drop them, so close connections gracefully.
        close = getattr(self._factory, "closeConnections", None)
        if close is not None:
            yield close(CLOSE_TIMEOUT_SECONDS)
