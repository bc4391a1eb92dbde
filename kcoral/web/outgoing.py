"""
Outgoing HTTP for every KCoral service: treq over one persistent connection
pool, verifying https peers (certificate chain and host name, through
service-identity) against the platform's roots or a given CA file.
"""

from __future__ import annotations

from cachetools import LRUCache
from treq.client import HTTPClient
from treq.cookies import IndexableCookieJar
from twisted.internet.defer import succeed
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.ssl import optionsForClientTLS, platformTrust, trustRootFromCertificates
from twisted.web.client import Agent, BrowserLikePolicyForHTTPS, HTTPConnectionPool
from twisted.web.error import SchemeNotSupported
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer, IPolicyForHTTPS
from zope.interface import implementer

from kcoral.common.keepalive import DEFAULT_KEEPALIVE, Keepalive
from kcoral.web.endpoint import pem_certificates
from kcoral.web.sendnow import SendNowEndpoint

#: Endpoints kept by L{Endpoints}, the least recently used dropped first.
MAX_ENDPOINTS = 1024

#: Persistent connections kept to one peer (a Router's to one worker).
MAX_PER_HOST = 64

#: Request bodies up to this size are written in one piece with the request
#: head (L{BytesProducer}); larger ones stream through treq's default producer.
INLINE_BODY_BYTES = 1 << 20


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


@implementer(IBodyProducer)
class BytesProducer:
    """
    A request body already in memory, written to the connection together with
    the request head. treq's default for bytes, C{FileBodyProducer}, writes
    them in 64 KiB slices from a cooperator task: even a body of a few hundred
    bytes then waits a reactor turn after the head and goes out in a second
    C{send()}, on every forwarded run.
    """

    def __init__(self, data: bytes):
        self._data = data
        self.length = len(data)

    def startProducing(self, consumer):
        data, self._data = self._data, b""
        consumer.write(data)
        return succeed(None)

    def pauseProducing(self):
        pass

    def resumeProducing(self):
        pass

    def stopProducing(self):
        pass


def body_producer(data) -> IBodyProducer:
    """treq's C{data_to_body_producer}: small bytes in one piece, anything
    else (large bodies, files) as treq would."""
    if isinstance(data, bytes) and len(data) <= INLINE_BODY_BYTES:
        return BytesProducer(data)
    return IBodyProducer(data)


@implementer(IPolicyForHTTPS)
class PresentingPolicy:
    """
    C{BrowserLikePolicyForHTTPS}'s checks of the peer (its chain against
    C{trust_root}, its name with service-identity), presenting this side's
    certificate (C{cert}, a PEM chain, and C{key}, default: inside C{cert})
    to a peer that asks for one: a Router with C{--tls-client-ca}.
    """

    def __init__(self, trust_root, cert: str, key: str | None = None):
        from OpenSSL import SSL, crypto
        from twisted.internet.ssl import KeyPair, PrivateCertificate

        chain = pem_certificates(cert)
        try:
            with open(key or cert, "rb") as f:
                pair = KeyPair.load(f.read(), crypto.FILETYPE_PEM)
        except (SSL.Error, crypto.Error) as e:
            raise ValueError(f"no private key in {key or cert}: {e}") from None
        self._trust_root = trust_root
        self._certificate = PrivateCertificate.fromCertificateAndKeyPair(chain[0], pair)
        self._chain = {"extraCertChain": [c.original for c in chain[1:]]} if chain[1:] else {}

    def creatorForNetloc(self, hostname: bytes, port: int):
        return optionsForClientTLS(hostname.decode("ascii"), trustRoot=self._trust_root,
                                   clientCertificate=self._certificate,
                                   extraCertificateOptions=self._chain)


def tls_policy(ca_path: str | None, cert: str | None = None,
               key: str | None = None) -> IPolicyForHTTPS:
    """How https peers are verified: against the CAs of C{ca_path} (default:
    the platform's roots); with C{cert}, presenting it when asked."""
    # Every CA in the file is trusted (Certificate.loadPEM took only the first).
    trust_root = None if ca_path is None else trustRootFromCertificates(pem_certificates(ca_path))
    if cert is not None:
        return PresentingPolicy(trust_root or platformTrust(), cert, key)
    return BrowserLikePolicyForHTTPS(trustRoot=trust_root)


@implementer(IStreamClientEndpoint)
class KeepaliveEndpoint:
    """Connects as C{endpoint} does, each connection probed by C{keepalive}."""

    def __init__(self, endpoint: IStreamClientEndpoint, keepalive: Keepalive):
        self._endpoint = endpoint
        self._keepalive = keepalive

    def connect(self, protocolFactory):
        return self._endpoint.connect(protocolFactory).addCallback(self._probed)

    def _probed(self, protocol):
        self._keepalive.apply_to(protocol.transport)
        return protocol


@implementer(IAgentEndpointFactory)
class Endpoints:
    """
    The Agent's endpoints, one per (scheme, host, port), made once as Twisted
    makes them: TCP (its writes sent at once, L{kcoral.web.sendnow}, and its
    peer probed by C{keepalive}, L{kcoral.common.keepalive}), wrapped
    in TLS for https with the policy's connection creator for that host and
    port. Twisted's own factory makes a new endpoint (and, for https, new
    TLS options) for every request, even when the pool already has a
    connection to reuse: IDNA-encoding the host that way was about a fifth
    of treq's time per forwarded run in a profile.
    """

    def __init__(self, reactor, policy, keepalive: Keepalive = DEFAULT_KEEPALIVE):
        self._reactor = reactor
        self._policy = policy
        self._keepalive = keepalive
        self._endpoints: LRUCache = LRUCache(MAX_ENDPOINTS)

    def endpointForURI(self, uri):
        key = (uri.scheme, uri.host, uri.port)
        endpoint = self._endpoints.get(key)
        if endpoint is None:
            if uri.scheme not in (b"http", b"https"):
                raise SchemeNotSupported(f"Unsupported scheme: {uri.scheme!r}")
            try:
                host = uri.host.decode("ascii")
            except UnicodeDecodeError:
                raise ValueError(f"the host of {uri.toBytes()!r} is not ASCII") from None
            endpoint = SendNowEndpoint(KeepaliveEndpoint(
                HostnameEndpoint(self._reactor, host, uri.port), self._keepalive))
            if uri.scheme == b"https":
                endpoint = wrapClientTLS(self._policy.creatorForNetloc(uri.host, uri.port), endpoint)
            self._endpoints[key] = endpoint
        return endpoint


class _NoCookies(IndexableCookieJar):
    """
    A cookie jar that keeps nothing: one worker's C{Set-Cookie} must never be
    replayed to another. treq wraps every request in a C{CookieAgent} with its
    jar, and cannot be told not to; this jar does no work there, where one
    that refuses cookies by policy still walked its rules on every request
    and answer (a small saving: within the noise of C{bench/router.py}).
    """

    def add_cookie_header(self, request):
        pass

    def extract_cookies(self, response, request):
        pass

    def set_cookie(self, cookie):
        pass


class Outgoing:
    """
    The outgoing HTTP of a service: https peers verified against C{ca_path}
    (default: the platform's roots); with C{cert} (and C{key}), the service
    presents that certificate to a peer that asks for one. Every connection
    is probed by C{keepalive}, so that one whose peer went silent ends.
    """

    def __init__(self, reactor, *, ca_path: str | None = None, cert: str | None = None,
                 key: str | None = None, max_per_host: int = MAX_PER_HOST, idle_seconds: int = 30,
                 keepalive: Keepalive = DEFAULT_KEEPALIVE):
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = max_per_host
        # Below the servers' 60 s idle timeout, so a pooled connection is
        # never one the server is about to close.
        self.pool.cachedConnectionTimeout = idle_seconds
        # Requests here are not all idempotent: never let the pool resend one.
        self.pool.retryAutomatically = False
        endpoints = Endpoints(reactor, tls_policy(ca_path, cert, key), keepalive)
        agent = Agent.usingEndpointFactory(reactor, endpoints, pool=self.pool)
        self.client = HTTPClient(agent, cookiejar=_NoCookies(), data_to_body_producer=body_producer)

    def close(self):
        return self.pool.closeCachedConnections()
