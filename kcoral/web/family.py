"""
API families: each protocol a KCoral front serves, declared once.

A family says which paths are its own, which of them need a client token,
which request headers a Router passes on to the member it forwards to and
which of the member's answer headers come back, and how its paths are
labelled in the metrics (a bounded set, whatever the clients send). The
sites, the fronts' resources, the Router's proxy and the metrics all read
these declarations; nothing else names a family's paths.
"""

from __future__ import annotations

import re

import attrs

from kcoral.protocol.wire import KEPT_HEADER, PROGRAM_HEADER
from kcoral.tracing import TRACEPARENT

#: The trace context a request carries on, whichever front it reached and
#: however it travels from there (a Router's forward, gRPC's metadata).
TRACE_HEADERS = (TRACEPARENT,)
#: The header the inference protocol's binary extension sizes its JSON part with.
INFERENCE_HEADER_LENGTH = b"Inference-Header-Content-Length"


@attrs.frozen
class Family:
    """
    One API family. Its paths start with C{prefix}; all but C{open_paths}
    need the client token where one is set; C{routes} maps a metrics label
    to the pattern of the paths it stands for.
    """

    name: str
    prefix: bytes
    routes: tuple[tuple[str, re.Pattern[bytes]], ...]
    forwarded: tuple[bytes, ...] = ()
    returned: tuple[bytes, ...] = ()
    open_paths: frozenset[bytes] = frozenset()
    #: Whether its errors are the message alone (C{{"error": "message"}}, the
    #: inference protocol's form, which its clients read) rather than KCoral's object.
    flat_errors: bool = False

    def owns(self, path: bytes) -> bool:
        return path.startswith(self.prefix) and self.label(path) is not None

    def guards(self, path: bytes) -> bool:
        """Whether C{path}, one of this family's, needs the client token."""
        return path not in self.open_paths

    def label(self, path: bytes) -> str | None:
        """The metrics label of C{path}, None when no route of the family matches it."""
        for label, pattern in self.routes:
            if pattern.fullmatch(path):
                return label
        return None


def _route(label: str) -> tuple[str, re.Pattern[bytes]]:
    """A route's label and the pattern of its paths: each C{{name}} in the
    label stands for one path segment."""
    pattern = re.escape(label.encode()).replace(rb"\{", b"{").replace(rb"\}", b"}")
    return label, re.compile(re.sub(rb"{[a-z_]+}", rb"[^/]+", pattern))


#: C{POST /v1/run}: a program and its inputs in, its outputs out.
RUN = Family(
    "run", b"/v1/run", routes=(_route("/v1/run"),),
    forwarded=(b"Content-Type", PROGRAM_HEADER.encode(), KEPT_HEADER.encode(), *TRACE_HEADERS),
    returned=(b"Content-Type", b"Retry-After"))

#: C{GET} and C{DELETE /v1/arrays/{id}}: a kept array's bytes, or its end;
#: C{DELETE /v1/arrays}: the end of those the kept header names.
ARRAYS = Family("arrays", b"/v1/arrays", routes=(_route("/v1/arrays/{id}"), _route("/v1/arrays")),
                forwarded=(KEPT_HEADER.encode(), TRACEPARENT),
                returned=(b"Content-Type", b"Retry-After"))

#: The pool's members and where they listen (a Router's, a gateway's).
NODES = Family("nodes", b"/v1/nodes", routes=(_route("/v1/nodes"),))

_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"
#: The routes of an inference: a front sends them straight to their handler.
INFER_ROUTES = (_MODEL + "/infer", _VERSION + "/infer")

#: The Open Inference Protocol (KServe v2, as Triton serves it): health
#: and server metadata stay open, like C{/health}.
INFERENCE = Family(
    "inference", b"/v2",
    routes=tuple(_route(label) for label in (
        "/v2", "/v2/health/live", "/v2/health/ready", "/v2/repository/index", "/v2/models/stats",
        "/v2/repository/models/{model}/load", "/v2/repository/models/{model}/unload",
        *(base + tail for base in (_MODEL, _VERSION)
          for tail in ("", "/ready", "/config", "/infer", "/stats")))),
    forwarded=(b"Content-Type", INFERENCE_HEADER_LENGTH, *TRACE_HEADERS),
    returned=(b"Content-Type", b"Retry-After", INFERENCE_HEADER_LENGTH),
    open_paths=frozenset({b"/v2", b"/v2/health/live", b"/v2/health/ready"}), flat_errors=True)

FAMILIES = (RUN, ARRAYS, NODES, INFERENCE)


def route_of(path: bytes, families: tuple[Family, ...] = FAMILIES) -> tuple[Family, str] | None:
    """The family C{path} belongs to and the label of its route; None when it is none's."""
    for family in families:
        if path.startswith(family.prefix):
            label = family.label(path)
            if label is not None:
                return family, label
    return None


def flat_errors(path: bytes) -> bool:
    """Whether errors on C{path} take the message-alone form: any path under
    a family that says so, its routes or not (an unknown one's 404 too)."""
    path = path.split(b"?", 1)[0]
    return any(f.flat_errors and (path == f.prefix or path.startswith(f.prefix + b"/"))
               for f in FAMILIES)


def family_of(path: bytes, families: tuple[Family, ...] = FAMILIES) -> Family | None:
    found = route_of(path, families)
    return None if found is None else found[0]
