"""
Prometheus metrics. Each service owns a C{CollectorRegistry} (never the global
one), so several services in one process, as in tests, keep their own series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kcoral.web.family import route_of

#: Latency buckets from sub-millisecond proxy hops to multi-minute programs.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 1800.0)


class HttpMetrics:
    """Requests by route and code, and their durations."""

    def __init__(self, registry: CollectorRegistry, routes: frozenset[str]):
        self.registry = registry
        self._routes = routes
        self.requests = Counter("kcoral_http_requests", "HTTP requests answered",
                                ["route", "code"], registry=registry)
        self.duration = Histogram("kcoral_http_request_duration_seconds",
                                  "Time from the request's arrival to its answer",
                                  ["route"], buckets=SECONDS_BUCKETS, registry=registry)
        self._children: dict[tuple[str, int], tuple] = {}

    def route_of(self, path: bytes) -> str:
        # Bounded label values: an API family's paths by their route's
        # template, the service's own routes by their path, and every other
        # path one label.
        path = path.split(b"?", 1)[0]
        route = route_of(path)
        if route is not None:
            return route.label
        text = path.decode("ascii", "replace")
        return text if text in self._routes else "other"

    def observe(self, path: bytes, code: int, seconds: float) -> None:
        route = self.route_of(path)
        # The labelled children, looked up once per (route, code): labels()
        # takes a lock and builds a key on every call, a few microseconds
        # on every request. Both labels are bounded, and so is this dict.
        children = self._children.get((route, code))
        if children is None:
            children = self._children[(route, code)] = (
                self.requests.labels(route, str(code)), self.duration.labels(route))
        children[0].inc()
        children[1].observe(seconds)


def render(request, registry: CollectorRegistry, extra: bytes = b"") -> bytes:
    request.setHeader(b"Content-Type", CONTENT_TYPE_LATEST.encode())
    return generate_latest(registry) + extra
