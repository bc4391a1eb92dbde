"""Where a KCoral service listens: host, port and, optionally, TLS; or a
Twisted server endpoint string (C{--listen})."""

from __future__ import annotations

import os
import re
import socket
from typing import Any

import attrs
from twisted.internet.defer import fail, succeed
from twisted.internet.endpoints import (
    SSL4ServerEndpoint,
    TCP4ServerEndpoint,
    TCP6ServerEndpoint,
    serverFromString,
)
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IStreamServerEndpoint
from twisted.protocols.tls import TLSMemoryBIOFactory
from zope.interface import implementer


def url_of(host: str, port: int, scheme: str = "http") -> str:
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)


def pem_certificates(path: str) -> list:
    """Every certificate in a PEM file, in order (Twisted's C{loadPEM} reads
    only the first one)."""
    from twisted.internet.ssl import Certificate

    with open(path, "rb") as f:
        blocks = _PEM_CERTIFICATE.findall(f.read())
    if not blocks:
        raise ValueError(f"{path} holds no PEM certificate")
    return [Certificate.loadPEM(block) for block in blocks]


@attrs.frozen
class ListenAddress:
    host: str = "127.0.0.1"
    port: int = 0
    #: PEM files of the certificate (chain) and its key: listen with TLS.
    tls_cert: str | None = None
    tls_key: str | None = None
    #: A Twisted server endpoint string, in place of all of the above (e.g.
    #: C{ssl:9443:interface=0.0.0.0:privateKey=key.pem:certKey=cert.pem}).
    description: str | None = None
    #: PEM file of the CA(s) whose certificates clients must present (mutual TLS).
    tls_client_ca: str | None = None

    @classmethod
    def of(cls, config) -> ListenAddress:
        """Where a service with C{config} (a Router's, a server's) listens."""
        return cls(config.host, config.port, config.tls_cert, config.tls_key, config.listen,
                   getattr(config, "tls_client_ca", None))

    @property
    def verifies_clients(self) -> bool:
        return self.tls_client_ca is not None

    @property
    def scheme(self) -> str:
        if self.description is not None:
            return "https" if self.description.split(":", 1)[0] == "ssl" else "http"
        return "https" if self.tls_cert else "http"

    def url(self, address) -> str:
        """The URL of this service, listening on C{address} (a port's
        C{getHost()})."""
        host, port = getattr(address, "host", None), getattr(address, "port", None)
        if host is None or port is None:  # a UNIX socket, say
            name = getattr(address, "name", None)
            return f"{self.scheme}+unix://{os.fsdecode(name) if name else address}"
        return url_of(host, port, self.scheme)

    def endpoint(self, reactor):
        if self.description is not None:
            try:
                return serverFromString(reactor, self.description)
            except Exception as e:  # parsers raise anything: ValueError, KeyError, SSL.Error
                raise ValueError(f"--listen {self.description}: {type(e).__name__}: {e}") from None
        if self.tls_cert:
            return SSL4ServerEndpoint(reactor, self.port,
                                       tls_options(self.tls_cert, self.tls_key, self.tls_client_ca),
                                       interface=self.host)
        if ":" in self.host:
            return TCP6ServerEndpoint(reactor, self.port, interface=self.host)
        return TCP4ServerEndpoint(reactor, self.port, interface=self.host)


def tls_options(cert: str, key: str | None = None, client_ca: str | None = None,
                protocols: tuple[bytes, ...] = ()):
    """
    The server side of TLS: the first certificate of C{cert} is this
    service's, the ones after it (intermediate CAs) are sent with it as its
    chain, and C{key} (default: inside C{cert}) must match (checked now, so
    that a wrong key is a one-line error at start and not a failed handshake
    later). With C{client_ca}, a client must present a certificate that one
    of its CAs signed, or the handshake fails (mutual TLS). C{protocols}:
    those offered by ALPN (gRPC's clients ask for C{h2}).
    """
    from OpenSSL import SSL, crypto
    from twisted.internet.error import VerifyError
    from twisted.internet.ssl import CertificateOptions, KeyPair, trustRootFromCertificates

    # A trust root turns on CertificateOptions' verification of the peer,
    # and with it requireCertificate: a client that presents none is refused.
    trust = {} if client_ca is None else {
        "trustRoot": trustRootFromCertificates(pem_certificates(client_ca))}
    try:
        chain = pem_certificates(cert)
        with open(key or cert, "rb") as f:
            pair = KeyPair.load(f.read(), crypto.FILETYPE_PEM)
        options = CertificateOptions(privateKey=pair.original, certificate=chain[0].original,
                                     extraCertChain=[c.original for c in chain[1:]],
                                     acceptableProtocols=list(protocols) or None, **trust)
        options.getContext()
    except (SSL.Error, crypto.Error, VerifyError) as e:
        raise ValueError(f"--tls-cert {cert} with --tls-key {key or cert}: {e}") from None
    return options


@implementer(IStreamServerEndpoint)
@attrs.frozen
class SharedPortEndpoint:
    """
    A TCP port that other processes of the same user listen on too
    (C{SO_REUSEPORT}): the kernel spreads the connections among them, each
    process taking its own. Twisted's endpoints set no such option, so the
    socket is made here and handed to the reactor (C{adoptStreamPort}); with
    C{tls} (a context factory), connections speak TLS as on an SSL endpoint.
    """

    reactor: Any
    port: int
    interface: str = "127.0.0.1"
    tls: Any = None
    backlog: int = 50

    def listen(self, factory):
        family = socket.AF_INET6 if ":" in self.interface else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                sock.bind((self.interface, self.port))
                sock.listen(self.backlog)
                sock.setblocking(False)
                if self.tls is not None:
                    factory = TLSMemoryBIOFactory(self.tls, False, factory)
                # The reactor takes a copy of the descriptor; this one closes here.
                return succeed(self.reactor.adoptStreamPort(sock.fileno(), family, factory))
        except OSError as e:
            return fail(CannotListenError(self.interface, self.port, e))
