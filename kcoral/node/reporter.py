"""
The reporter: registers the node with its Router and sends a heartbeat (the
same idempotent C{PUT}) every health interval, so a Router that restarts
learns the node again by itself, and a Router that is away is retried after
a capped backoff. As a service it beats while it runs and deregisters when it
stops; it is the supervisor's first child, so it stops last, after the
workers have drained. Its deregistration waits for heartbeats still on their
way, and none is sent after it: one that reached the Router after the
C{DELETE} would register the node again.

A node under several Routers has one L{Reporter} for each, in
L{Reporters}: no Router knows of another, and each is reached, retried and
told on its own, so one that is away delays nothing of the others.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from twisted.application import service
from twisted.application.internet import backoffPolicy
from twisted.internet.defer import Deferred, DeferredList, inlineCallbacks, succeed
from twisted.logger import Logger

from kcoral.errors import error_from_answer
from kcoral.web.endpoint import is_loopback
from kcoral.web.outgoing import describe_failure

log = Logger()


class Reporter(service.Service):
    """
    Tells one Router about this node. C{report()} gives the node's workers,
    target and runtime; C{timeout} bounds each request and, with the clock
    C{reactor}, C{interval} spaces the heartbeats. After a failed one, the
    next waits C{retry_delay(failures in a row - 1)} instead (by default
    from C{interval} up to four of them, jittered).
    """

    def __init__(self, http, router: str, node_id: str, token: str | None,
                 report: Callable[[], dict], timeout: float, *, interval: float | None = None,
                 reactor=None, retry_delay: Callable[[int], float] | None = None):
        if reactor is None:
            from twisted.internet import reactor
        self._http = http
        self.router = router
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
        self._clock = reactor
        self._interval = timeout if interval is None else interval
        # Jittered, so the nodes of a Router that comes back do not all
        # knock at once; capped low, so that it learns them within seconds.
        self._retry_delay = retry_delay or backoffPolicy(
            initialDelay=self._interval, maxDelay=4 * self._interval,
            jitter=lambda: random.uniform(0, self._interval / 5))
        self._failures = 0
        self._next = None
        #: Heartbeats on their way, which deregistering waits for.
        self._sending: set[Deferred[bool]] = set()
        self._left = False

    def startService(self):
        super().startService()
        self._beat()

    def _beat(self) -> None:
        self._next = None
        self.send().addCallback(self._schedule)

    def _schedule(self, ok: bool) -> None:
        if not self.running or self._next is not None:
            return
        self._failures = 0 if ok else self._failures + 1
        delay = self._interval if ok else self._retry_delay(self._failures - 1)
        self._next = self._clock.callLater(delay, self._beat)

    @inlineCallbacks
    def drain(self):
        """Say the node is draining, now and in every report after."""
        self.draining = True
        yield self.send()

    @inlineCallbacks
    def stopService(self):
        super().stopService()
        if self._next is not None:
            self._next.cancel()
            self._next = None
        yield self.leave()

    def body(self) -> bytes:
        report = dict(self._report(), session=self.session, draining=self.draining)
        return json.dumps(report).encode()

    def send(self) -> Deferred[bool]:
        """One heartbeat, and whether the Router took it; never fails
        (problems are logged once each). After L{leave}, nothing is sent."""
        if self._left:
            return succeed(False)
        d = self._send()
        self._sending.add(d)

        def sent(ok: bool) -> bool:
            self._sending.discard(d)
            return ok

        return d.addCallback(sent)

    @inlineCallbacks
    def _send(self):
        try:
            response = yield self._http.put(self._url, data=self.body(),
                                            headers=self._headers, timeout=self._timeout)
            content = yield response.content()
        except Exception as e:
            self._problem(f"the Router is unreachable ({describe_failure(e)}); retrying "
                          f"{self.router}")
            return False
        if response.code != 200:
            message = error_from_answer(response.code, content).message
            self._problem(f"the Router refused node {self.node_id} with {response.code}: "
                          f"{message} ({self.router})")
            return False
        state = json.loads(content).get("state")
        if self.connected is not True:
            log.info("registered with the Router as {node_id} (state {state}) at {router}",
                     node_id=self.node_id, state=state, router=self.router)
        elif state != self.state:
            log.info("the Router reports node {node_id} {state} ({router})",
                     node_id=self.node_id, state=state, router=self.router)
        self.connected, self.state, self._last_problem = True, state, None
        return True

    def _problem(self, message: str) -> None:
        if message != self._last_problem:
            log.warn("{message}", message=message)
        self.connected, self._last_problem = False, message

    @inlineCallbacks
    def leave(self):
        self._left = True
        yield DeferredList(list(self._sending))
        try:
            response = yield self._http.delete(self._url, params={"session": self.session},
                                               headers=self._headers, timeout=self._timeout)
            yield response.content()
        except Exception as e:
            log.info("could not deregister from the Router at {router}: {e}", router=self.router,
                     e=e.__class__.__name__)


class Reporters(service.MultiService):
    """
    One L{Reporter} for each of C{routers}, with the other arguments of
    L{Reporter}; they start together and stop (deregister) together.
    """

    def __init__(self, http, routers: Sequence[str], node_id: str, token: str | None,
                 report: Callable[[], dict], timeout: float, **kwargs):
        super().__init__()
        for router in routers:
            Reporter(http, router, node_id, token, report, timeout,
                     **kwargs).setServiceParent(self)

    def send(self):
        """A heartbeat to every Router now."""
        return DeferredList([reporter.send() for reporter in self])

    def drain(self):
        """Tell every Router the node is draining, now and in every report after."""
        return DeferredList([reporter.drain() for reporter in self])

    def stopService(self):
        # Together, not one after the other: a Router that is away must not
        # hold up the others' deregistration by the request's timeout.
        service.Service.stopService(self)
        return DeferredList([reporter.stopService() for reporter in self])
