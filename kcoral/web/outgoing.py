"""
Outgoing HTTP for every KCoral service: treq over one persistent connection
pool, verifying https peers (certificate chain and host name, through
service-identity) against the platform's roots or a given CA file.
"""

from __future__ import annotations

from treq.client import HTTPClient
from twisted.internet.ssl import Certificate
from twisted.web.client import Agent, BrowserLikePolicyForHTTPS, HTTPConnectionPool


def tls_policy(ca_path: str | None) -> BrowserLikePolicyForHTTPS:
    if ca_path is None:
        return BrowserLikePolicyForHTTPS()
    with open(ca_path, "rb") as f:
        return BrowserLikePolicyForHTTPS(trustRoot=Certificate.loadPEM(f.read()))


class Outgoing:
    def __init__(self, reactor, *, ca_path: str | None = None, max_per_host: int = 64,
                 idle_seconds: float = 30.0):
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = max_per_host
        # Below the servers' 60 s idle timeout, so a pooled connection is
        # never one the server is about to close.
        self.pool.cachedConnectionTimeout = idle_seconds
        # Requests here are not all idempotent: never let the pool resend one.
        self.pool.retryAutomatically = False
        self.client = HTTPClient(Agent(reactor, contextFactory=tls_policy(ca_path), pool=self.pool))

    def close(self):
        return self.pool.closeCachedConnections()
