"""Listening endpoints for KCoral services."""

from __future__ import annotations

from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint


def listen_endpoint(reactor, host: str, port: int):
    if ":" in host:
        return TCP6ServerEndpoint(reactor, port, interface=host)
    return TCP4ServerEndpoint(reactor, port, interface=host)


def url_of(host: str, port: int, scheme: str = "http") -> str:
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
