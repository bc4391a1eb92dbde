"""
The proxy: forwards one C{POST /v1/run} to the member a lease names, with
treq over a persistent connection pool.

What a failure means depends on whether the node may have started the work
(seed 000, "Recover from failures"): a connection that could not be made, or
a 503 from the node (its own queue, or draining), means the request never ran
and may go to another member; a connection lost after the request was sent
means it may have run, and is a 502 that is never retried.
"""

from __future__ import annotations

import treq
from twisted.internet import error as netError
from twisted.internet.defer import CancelledError, inlineCallbacks
from twisted.web.client import HTTPConnectionPool, ResponseFailed, ResponseNeverReceived
from twisted.web.http_headers import Headers

from kcoral.errors import NodeFailure
from kcoral.protocol.wire import PROGRAM_HEADER, REQUEST_CONTENT_TYPE

_FORWARDED = (b"Content-Type", PROGRAM_HEADER.encode())
_RETURNED = (b"Content-Type", b"Retry-After")


class NotSent(Exception):
    """The member did not take the request; another member may."""


class Answer:
    __slots__ = ("code", "headers", "body")

    def __init__(self, code: int, headers: dict, body: bytes):
        self.code, self.headers, self.body = code, headers, body


class Proxy:
    def __init__(self, reactor, *, tls_policy=None):
        self._reactor = reactor
        self.connections = HTTPConnectionPool(reactor, persistent=True)
        self.connections.maxPersistentPerHost = 64
        self.connections.cachedConnectionTimeout = 60
        # POSTs are not idempotent: never let the pool resend one by itself.
        self.connections.retryAutomatically = False
        self._agent_kwargs = {"pool": self.connections, "reactor": reactor}
        if tls_policy is not None:
            from twisted.web.client import Agent
            self._agent = Agent(reactor, contextFactory=tls_policy, pool=self.connections)
            self._agent_kwargs = {"agent": self._agent}

    @inlineCallbacks
    def forward(self, url: str, request, body: bytes):
        headers = Headers({b"X-Request-ID": [request.request_id.encode()]})
        for name in _FORWARDED:
            value = request.requestHeaders.getRawHeaders(name)
            if value:
                headers.setRawHeaders(name, value[:1])
        if not headers.hasHeader(b"Content-Type"):
            headers.setRawHeaders(b"Content-Type", [REQUEST_CONTENT_TYPE.encode()])
        outgoing = treq.post(url + "/v1/run", data=body, headers=headers, **self._agent_kwargs)
        # A client that goes away cancels the outgoing request.
        request.notifyFinish().addErrback(lambda _: outgoing.cancel())
        try:
            response = yield outgoing
            content = yield treq.content(response)
        except CancelledError:
            raise
        except netError.ConnectError as e:
            raise NotSent(f"could not connect to {url}: {e.__class__.__name__}") from None
        except (ResponseFailed, ResponseNeverReceived, netError.ConnectionLost) as e:
            raise NodeFailure(f"lost the connection to the node at {url} after the request "
                              f"was sent; it may have run") from e
        if response.code == 503:
            raise NotSent(f"{url} answered 503")
        returned = {name: response.headers.getRawHeaders(name)[0]
                    for name in _RETURNED if response.headers.hasHeader(name)}
        return Answer(response.code, returned, content)
