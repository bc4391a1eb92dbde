"""Where a KCoral service listens: host, port and, optionally, TLS."""

from __future__ import annotations

import attrs
from twisted.internet.endpoints import SSL4ServerEndpoint, TCP4ServerEndpoint, TCP6ServerEndpoint


def url_of(host: str, port: int, scheme: str = "http") -> str:
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


@attrs.frozen
class ListenAddress:
    host: str = "127.0.0.1"
    port: int = 0
    #: PEM files of the certificate (chain) and its key: listen with TLS.
    tls_cert: str | None = None
    tls_key: str | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

    def url(self, port: int) -> str:
        return url_of(self.host, port, self.scheme)

    def endpoint(self, reactor):
        if self.tls_cert:
            from twisted.internet.ssl import PrivateCertificate

            with open(self.tls_cert, "rb") as cert, open(self.tls_key or self.tls_cert, "rb") as key:
                options = PrivateCertificate.loadPEM(cert.read() + b"\n" + key.read()).options()
            return SSL4ServerEndpoint(reactor, self.port, options, interface=self.host)
        if ":" in self.host:
            return TCP6ServerEndpoint(reactor, self.port, interface=self.host)
        return TCP4ServerEndpoint(reactor, self.port, interface=self.host)
