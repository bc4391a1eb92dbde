"""
Outgoing HTTP for every KCoral service: treq over one persistent connection
pool, verifying https peers (certificate chain and host name, through
service-identity) against the platform's roots or a given CA file.
"""

from __future__ import annotations

from treq.client import HTTPClient
from twisted.internet.ssl import trustRootFromCertificates
from twisted.web.client import Agent, BrowserLikePolicyForHTTPS, HTTPConnectionPool

from kcoral.web.endpoint import pem_certificates


def tls_problem(error: BaseException) -> str | None:
    """
    What TLS refused, when that is why an outgoing request failed: a peer
    certificate that no trusted CA signed, or one that does not name the host
    in the URL (service-identity). Both happen in the handshake, before any
    byte of the request is sent. None when the failure was something else.
    """
    from OpenSSL import SSL
    from service_identity import VerificationError

    for value in [error] + [getattr(r, "value", r) for r in getattr(error, "reasons", None) or ()]:
        if isinstance(value, VerificationError):
            names = []
            for mismatch in value.errors:
                wanted = getattr(mismatch, "mismatched_id", None)
                name = getattr(wanted, "ip", None) or getattr(wanted, "hostname", None)
                if isinstance(name, bytes):
                    name = name.decode("ascii", "replace")
                names.append(str(name or type(mismatch).__name__))
            return f"the peer's TLS certificate is not valid for {', '.join(names)}"
        if isinstance(value, SSL.Error):
            reasons = [part[-1] for part in (value.args[0] if value.args else ())
                       if isinstance(part, tuple) and part and part[-1]]
            why = ", ".join(reasons) or str(value)
            if "certificate verify failed" in why:
                why += " (the peer's certificate is not signed by a trusted CA: see --tls-ca)"
            return f"TLS handshake failed: {why}"
    return None


def describe_failure(error: BaseException) -> str:
    """A short reason for a failed outgoing request, for a log line."""
    return tls_problem(error) or error.__class__.__name__


def tls_policy(ca_path: str | None) -> BrowserLikePolicyForHTTPS:
    if ca_path is None:
        return BrowserLikePolicyForHTTPS()
    # Every CA in the file is trusted (Certificate.loadPEM took only the first).
    return BrowserLikePolicyForHTTPS(trustRoot=trustRootFromCertificates(pem_certificates(ca_path)))


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
