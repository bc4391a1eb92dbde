"""
API families: each protocol a KCoral front serves, declared once.

A family is its path prefix and its routes; each route its path (a
template, C{{name}} standing for one segment), the methods it takes, the
token it needs, and whether a Router forwards its body while it arrives.
A family also says which request headers a Router passes on to the member
it forwards to, which of the member's answer headers come back, and the
form of its errors. The routes' templates are the metrics' labels (a
bounded set, whatever the clients send).

A service mounts the families it serves on its L{kcoral.web.front.Front},
one handler per route; the guard, the site's early refusals, the Router's
streaming, its proxy and the metrics all read these declarations. Nothing
else in KCoral names a family's paths: clients and the Router build them
with L{Route.path}. Paths are matched as the request's canonical path
(L{kcoral.web.path}) spells them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import attrs

from kcoral.protocol.wire import KEPT_HEADER, PROGRAM_HEADER
from kcoral.tracing import TRACEPARENT

#: The trace context a request carries on, whichever front it reached and
#: however it travels from there (a Router's forward, gRPC's metadata).
TRACE_HEADERS = (TRACEPARENT,)
#: The header the inference protocol's binary extension sizes its JSON part with.
INFERENCE_HEADER_LENGTH = b"Inference-Header-Content-Length"
#: Set (C{true}) by a Router's or a gateway's front batcher on what it
#: forwards: a batch it formed and sent because a worker was free, which the
#: worker runs as soon as it holds a slot, without waiting for more rows.
FORMED_BATCH_HEADER = b"X-KCoral-Formed-Batch"

#: What a route needs: nothing, a client token (where the service has any),
#: or the node token (checked by the Router's handler, after the node id).
OPEN, CLIENT, NODE = "open", "client token", "node token"

_SEGMENT = re.compile(r"{([a-z_]+)}")


def _pattern(label: str) -> re.Pattern[bytes]:
    parts = _SEGMENT.split(label)
    # Literal text and segment names alternate.
    return re.compile("".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>[^/]+)"
                              for i, part in enumerate(parts)).encode())


@attrs.frozen(eq=False)
class Route:
    """
    One route: its C{label} (the template of its paths, and its metrics
    label), the C{methods} it takes (C{GET} ones take C{HEAD} too), the
    token it needs (C{guard}), and whether a Router forwards its body while
    it arrives (C{streams}, L{kcoral.web.request}).
    """

    label: str
    methods: frozenset[bytes] = attrs.field(converter=lambda methods: frozenset(
        {*methods, b"HEAD"} if b"GET" in methods else methods))
    guard: str = CLIENT
    streams: bool = False
    pattern: re.Pattern[bytes] = attrs.field(init=False)
    #: C{Allow}'s value, for a 405.
    allow: bytes = attrs.field(init=False)

    def __attrs_post_init__(self):
        object.__setattr__(self, "pattern", _pattern(self.label))
        object.__setattr__(self, "allow", b", ".join(sorted(self.methods)))

    @property
    def fixed(self) -> bool:
        """Whether it is one path alone (no segment stands for a name)."""
        return "{" not in self.label

    def path(self, **segments: str) -> str:
        """Its path with C{segments} (already checked names) in their places."""
        return _SEGMENT.sub(lambda m: segments[m.group(1)], self.label)


def _routes(prefix: str, *routes: tuple[str, tuple[bytes, ...], str]) -> tuple[Route, ...]:
    return tuple(Route(prefix + tail, methods, guard) for tail, methods, guard in routes)


@attrs.frozen(eq=False)
class Family:
    """
    One API family: its paths start with C{prefix}, and are its C{routes}'.
    C{forwarded}: the request headers a Router passes on; C{returned}: the
    member's answer headers it passes back. C{flat_errors}: its errors are
    the message alone (C{{"error": "message"}}, the inference protocol's
    form, which its clients read) rather than KCoral's object.
    """

    name: str
    prefix: bytes
    routes: tuple[Route, ...]
    forwarded: tuple[bytes, ...] = ()
    returned: tuple[bytes, ...] = ()
    flat_errors: bool = False

    def __attrs_post_init__(self):
        assert all(r.label.encode().startswith(self.prefix) for r in self.routes), self.name

    def under(self, path: bytes) -> bool:
        """Whether C{path} (a route's, or not) is under its prefix."""
        return path == self.prefix or path.startswith(self.prefix + b"/")


GET, POST, DELETE, PUT = (b"GET",), (b"POST",), (b"DELETE",), (b"PUT",)
#: The methods whose requests carry a body a route reads.
_BODY_METHODS = frozenset(POST + PUT)

_RUN = "/v1/run"
#: C{POST /v1/run}: a program and its inputs in, its outputs out; a Router
#: forwards its body while it arrives.
RUN_ROUTE = Route(_RUN, POST, streams=True)
RUN = Family("run", _RUN.encode(), (RUN_ROUTE,),
             forwarded=(b"Content-Type", PROGRAM_HEADER.encode(), KEPT_HEADER.encode(),
                        *TRACE_HEADERS),
             returned=(b"Content-Type", b"Retry-After"))

_ARRAYS = "/v1/arrays"
#: C{GET} and C{DELETE /v1/arrays/{kept}}: a kept array's bytes, or its end;
#: C{DELETE /v1/arrays}: the end of those the kept header names.
ARRAY, ARRAYS_NAMED = _routes(_ARRAYS, ("/{kept}", GET + DELETE, CLIENT), ("", DELETE, CLIENT))
ARRAYS = Family("arrays", _ARRAYS.encode(), (ARRAY, ARRAYS_NAMED),
                forwarded=(KEPT_HEADER.encode(), TRACEPARENT),
                returned=(b"Content-Type", b"Retry-After"))

_NODES = "/v1/nodes"
#: The pool's members and where they listen (a Router's, a gateway's), for
#: clients; a node's registration, heartbeats and leaving, for its supervisor.
NODE_LIST, NODE_CONTROL = _routes(_NODES, ("", GET, CLIENT), ("/{node_id}", PUT + DELETE, NODE))
NODES = Family("nodes", _NODES.encode(), (NODE_LIST, NODE_CONTROL))

_V2 = "/v2"
_MODEL = _V2 + "/models/{model}"
_VERSION = _MODEL + "/versions/{version}"
#: The Open Inference Protocol (KServe v2, as Triton serves it): health
#: and server metadata stay open, like C{/health}.
(SERVER_METADATA, LIVE, READY, REPOSITORY_INDEX,
 MODEL_METADATA, MODEL_READY, MODEL_CONFIG, MODEL_INFER,
 VERSION_METADATA, VERSION_READY, VERSION_CONFIG, VERSION_INFER) = _routes(
    "", (_V2, GET, OPEN), (_V2 + "/health/live", GET, OPEN), (_V2 + "/health/ready", GET, OPEN),
    (_V2 + "/repository/index", POST, CLIENT),
    *((base + tail, methods, CLIENT) for base in (_MODEL, _VERSION)
      for tail, methods in (("", GET), ("/ready", GET), ("/config", GET), ("/infer", POST))))
#: The statistics extension: every model's, one model's, one version's.
STATISTICS, MODEL_STATISTICS, VERSION_STATISTICS = _routes(
    "", (_V2 + "/models/stats", GET, CLIENT), (_MODEL + "/stats", GET, CLIENT),
    (_VERSION + "/stats", GET, CLIENT))
#: The model repository extension's control: a model loaded, or unloaded.
MODEL_LOAD, MODEL_UNLOAD = _routes(_V2 + "/repository/models/{model}",
                                   ("/load", POST, CLIENT), ("/unload", POST, CLIENT))
#: The shared-memory extensions, system and CUDA: every region's status or
#: unregistration, one region's, and a region's registration.
(SHM_STATUS, SHM_UNREGISTER, SHM_REGION_STATUS, SHM_REGION_UNREGISTER,
 SHM_REGISTER) = _routes(_V2 + "/systemsharedmemory", ("/status", GET, CLIENT),
                         ("/unregister", POST, CLIENT), ("/region/{region}/status", GET, CLIENT),
                         ("/region/{region}/unregister", POST, CLIENT),
                         ("/region/{region}/register", POST, CLIENT))
(CUDA_STATUS, CUDA_UNREGISTER, CUDA_REGION_STATUS, CUDA_REGION_UNREGISTER,
 CUDA_REGISTER) = _routes(_V2 + "/cudasharedmemory", ("/status", GET, CLIENT),
                          ("/unregister", POST, CLIENT), ("/region/{region}/status", GET, CLIENT),
                          ("/region/{region}/unregister", POST, CLIENT),
                          ("/region/{region}/register", POST, CLIENT))
INFERENCE = Family(
    "inference", _V2.encode(),
    (SERVER_METADATA, LIVE, READY, REPOSITORY_INDEX, MODEL_METADATA, MODEL_READY, MODEL_CONFIG,
     MODEL_INFER, VERSION_METADATA, VERSION_READY, VERSION_CONFIG, VERSION_INFER,
     STATISTICS, MODEL_STATISTICS, VERSION_STATISTICS, MODEL_LOAD, MODEL_UNLOAD,
     SHM_STATUS, SHM_UNREGISTER, SHM_REGION_STATUS, SHM_REGION_UNREGISTER, SHM_REGISTER,
     CUDA_STATUS, CUDA_UNREGISTER, CUDA_REGION_STATUS, CUDA_REGION_UNREGISTER, CUDA_REGISTER),
    forwarded=(b"Content-Type", INFERENCE_HEADER_LENGTH, *TRACE_HEADERS),
    returned=(b"Content-Type", b"Retry-After", INFERENCE_HEADER_LENGTH), flat_errors=True)

FAMILIES = (RUN, ARRAYS, NODES, INFERENCE)


class Routes:
    """
    Routes to find by a request's path: one dictionary lookup for the
    fixed ones (C{/v1/run}, the hottest), then the others in turn.
    """

    def __init__(self, routes: Iterable[Route]):
        routes = tuple(routes)
        self._fixed = {r.label.encode(): r for r in routes if r.fixed}
        self._named = tuple(r for r in routes if not r.fixed)

    def find(self, path: bytes) -> tuple[Route, dict[str, str]] | None:
        """The route of C{path} (a canonical path, without its query) and
        the names its segments give; None when it is no route's."""
        route = self._fixed.get(path)
        if route is not None:
            return route, {}
        for route in self._named:
            match = route.pattern.fullmatch(path)
            if match is not None:
                return route, {k: v.decode("ascii") for k, v in match.groupdict().items()}
        return None


#: Every family's routes, whichever a service mounts.
ALL = Routes(r for family in FAMILIES for r in family.routes)


def route_of(path: bytes) -> Route | None:
    """The route of any family that C{path} (canonical) is; None when it is none's."""
    found = ALL.find(path)
    return None if found is None else found[0]


def guarded(path: bytes) -> bool:
    """Whether C{path} (canonical) is a route that needs the client token."""
    route = route_of(path)
    return route is not None and route.guard == CLIENT


def streamed(method: bytes, path: bytes) -> bool:
    """Whether a request is one whose body a Router forwards while it arrives."""
    route = route_of(path)
    return route is not None and route.streams and method in route.methods


def takes_body(method: bytes, path: bytes) -> bool:
    """Whether a request's body is read by the route it goes to: a C{POST}
    or C{PUT} to a route that takes it. Every other body is dropped as it
    arrives (L{kcoral.web.request})."""
    if method not in _BODY_METHODS:
        return False
    route = route_of(path)
    return route is not None and method in route.methods


def flat_errors(path: bytes) -> bool:
    """Whether errors on C{path} take the message-alone form: any path under
    a family that says so, its routes or not (an unknown one's 404 too)."""
    path = path.split(b"?", 1)[0]
    return any(f.flat_errors and f.under(path) for f in FAMILIES)
