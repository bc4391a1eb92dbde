"""
The reporter: registers the node with its Router and sends a heartbeat (the
same idempotent C{PUT}) every health interval, so a Router that restarts
learns the node again by itself, and a Router that is away is retried. As a
service it beats while it runs and deregisters when it stops; it is the
supervisor's first child, so it stops last, after the workers have drained.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from urllib.parse import urlsplit

from twisted.application import service
from twisted.internet.defer import inlineCallbacks
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from kcoral.errors import error_from_answer
from kcoral.web.endpoint import is_loopback
from kcoral.web.outgoing import describe_failure

log = Logger()


class Reporter(service.Service):
    """
    Tells one Router about this node. C{report()} gives the node's workers,
    target and runtime; C{timeout} bounds each request and, with the clock
    C{reactor}, C{interval} spaces the heartbeats.
    """

    def __init__(self, http, router: str, node_id: str, token: str | None,
                 report: Callable[[], dict], timeout: float, *, interval: float | None = None,
                 reactor=None):
        self._http = http
        self._url = f"{router.rstrip('/')}/v1/nodes/{node_id}"
        self.node_id = node_id
        self.session = uuid.uuid4().hex
        self._headers = {b"Content-Type": [b"application/json"]}
        if token:
            self._headers[b"Authorization"] = [b"Bearer " + token.encode()]
            parts = urlsplit(router)
            if parts.scheme == "http" and not is_loopback(parts.hostname or ""):
                log.warn("the node token is sent over plain HTTP to {router}; use an https:// Router "
                         "URL on untrusted networks", router=router)
        self._report = report
        self._timeout = timeout
        self.connected: bool | None = None
        self.state: str | None = None
        self._last_problem: str | None = None
        #: Whether the node is draining (it says so in every report).
        self.draining = False
        self._beats = LoopingCall(self.send)
        if reactor is not None:
            self._beats.clock = reactor
        self._interval = timeout if interval is None else interval

    def startService(self):
        super().startService()
        self._beats.start(self._interval)

    @inlineCallbacks
    def drain(self):
        """Say the node is draining, now and in every report after."""
        self.draining = True
        yield self.send()

    @inlineCallbacks
    def stopService(self):
        super().stopService()
        if self._beats.running:
            self._beats.stop()
        yield self.leave()

    def body(self) -> bytes:
        report = dict(self._report(), session=self.session, draining=self.draining)
        return json.dumps(report).encode()

    @inlineCallbacks
    def send(self):
        """One heartbeat; never fails (problems are logged once each)."""
        try:
            response = yield self._http.put(self._url, data=self.body(),
                                            headers=self._headers, timeout=self._timeout)
            content = yield response.content()
        except Exception as e:
            self._problem(f"the Router is unreachable ({describe_failure(e)}); retrying")
            return False
        if response.code != 200:
            message = error_from_answer(response.code, content).message
            self._problem(f"the Router refused node {self.node_id} with {response.code}: {message}")
            return False
        state = json.loads(content).get("state")
        if self.connected is not True:
            log.info("registered with the Router as {node_id} (state {state})",
                     node_id=self.node_id, state=state)
        elif state != self.state:
            log.info("the Router reports node {node_id} {state}", node_id=self.node_id, state=state)
        self.connected, self.state, self._last_problem = True, state, None
        return True

    def _problem(self, message: str) -> None:
        if message != self._last_problem:
            log.warn("{message}", message=message)
        self.connected, self._last_problem = False, message

    @inlineCallbacks
    def leave(self):
        try:
            response = yield self._http.delete(self._url, params={"session": self.session},
                                               headers=self._headers, timeout=self._timeout)
            yield response.content()
        except Exception as e:
            log.info("could not deregister from the Router: {e}", e=e.__class__.__name__)
