"""
C{twistd kcoral-router} and C{kcoral router}: one C{usage.Options}, one
C{makeService}.
"""

from __future__ import annotations

from typing import Any

from kcoral.options import (
    CLIENT_TOKEN,
    CLIENT_TOKENS_FILE,
    KEEPALIVE,
    LISTEN,
    OBSERVING,
    ROUTING,
    TLS_CA,
    TLS_CERT,
    TLS_CLIENT_CA,
    TLS_KEY,
    KCoralOptions,
    OneOf,
    check_listen,
    config_from,
    non_negative,
    parameter,
    port,
    positive,
)
from kcoral.router.placement import ROUTINGS
from kcoral.router.service import RouterConfig, RouterService
from kcoral.web.auth import CLIENT_TOKEN_ENV

#: Each option: its RouterConfig field, help text and value check.
_OPTIONS: list[tuple[Any, ...]] = [
    ("host", "Interface to listen on."),
    ("port", "Port to listen on.", port),
    ("status_check_interval_seconds", "Interval for checking status freshness.", positive(float)),
    ("max_status_age_seconds", "Maximum age of a node health report.", positive(float)),
    ("unhealthy_threshold", "Failed observations before removing a ready node.", positive(int)),
    ("recovery_threshold", "Successful observations before a failed node returns.",
     positive(int)),
    ("queue_wait_timeout_seconds", "Maximum wait for capacity.", non_negative(float)),
    ("max_queued_requests", "Bound on requests waiting for capacity.", non_negative(int)),
    ("node_retention_seconds", "Retention of disconnected, unused node records.",
     non_negative(float)),
    ("max_request_bytes", "Maximum accepted request body size, in bytes.", positive(int)),
    ("max_redispatches", "Runs again of a run lost with its node, where its client allows it.",
     non_negative(int)),
    ("node_token", "Token nodes must present [env: KCORAL_NODE_TOKEN]."),
    ("tls_cert", TLS_CERT),
    ("tls_key", TLS_KEY),
    ("tls_ca", TLS_CA),
    ("listen", LISTEN),
    ("routing", ROUTING, OneOf(tuple(ROUTINGS))),
    ("client_token", CLIENT_TOKEN),
    ("client_tokens_file", CLIENT_TOKENS_FILE),
    ("tls_client_ca", TLS_CLIENT_CA),
    ("grpc_port", "Port of the inference protocol over gRPC (default: gRPC off).", port),
    *KEEPALIVE,
    ("silent_node_seconds", ("Runs in flight on a node whose reports stopped this long ago "
                             "end with 502 (its host may be frozen)."), positive(float)),
    *OBSERVING,
    # A node's front processes serve its gateway's gRPC port with it, each
    # started with the count (L{kcoral.node.front}); nothing else sets it.
    ("front_processes",
     "Processes serving --grpc-port, this one among them, each listening with SO_REUSEPORT.",
     positive(int)),
]


class RouterOptions(KCoralOptions):
    synopsis = "[options]"
    longdesc = ("Run a KCoral Router: one stable address that sends each program to a "
                "healthy node with free capacity, queueing when none is free.")

    optParameters = [parameter(RouterConfig, *row) for row in _OPTIONS]
    environment = {"node-token": "KCORAL_NODE_TOKEN", "client-token": CLIENT_TOKEN_ENV}
    hidden = frozenset({"front-processes"})

    def postOptions(self):
        super().postOptions()
        check_listen(self)

    def router_config(self) -> RouterConfig:
        return config_from(RouterConfig, self)


#: The name twistd's C{ServiceMaker} looks up in a plugin's module.
Options = RouterOptions


def makeService(options: RouterOptions, reactor=None):
    if reactor is None:
        from twisted.internet import reactor
    return RouterService(options.router_config(), reactor)
