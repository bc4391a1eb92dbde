"""
The recent history of a Router's traffic, for the dashboard's plots: every
L{SAMPLE_INTERVAL_SECONDS} a L{Sample} of the run rate, its latency, the
queue depth and the placements' cache hits, kept in a ring over the last
L{WINDOW_SECONDS}. The process keeps it, so a page that has just opened
plots minutes of history at once.

Every figure is read from the service's own Prometheus registry, the same
series C{/metrics} shows: the history adds no bookkeeping to the path of a
run, and it cannot disagree with what Prometheus scrapes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import attrs
from prometheus_client import CollectorRegistry
from twisted.application.internet import TimerService

from kcoral.web.family import RUN_ROUTE

SAMPLE_INTERVAL_SECONDS = 2.0
WINDOW_SECONDS = 600.0



@attrs.frozen
class Totals:
    """The cumulative counters of a registry at one moment."""

    time: float
    runs: float = 0.0
    #: Cumulative (upper bound, count) pairs of the runs' duration histogram.
    buckets: tuple[tuple[float, float], ...] = ()
    cache_hits: float = 0.0
    cache_misses: float = 0.0
    queued: float = 0.0
    active: float = 0.0

    @classmethod
    def read(cls, registry: CollectorRegistry, time: float) -> Totals:
        runs = hits = misses = queued = active = 0.0
        buckets: dict[float, float] = {}
        # The series of answered runs, with their durations from arrival to
        # answer (a wait in the queue included, as a client sees it).
        for family in registry.collect():
            for s in family.samples:
                if s.name == "kcoral_http_requests_total" and s.labels.get("route") == RUN_ROUTE.label:
                    runs += s.value
                elif (s.name == "kcoral_http_request_duration_seconds_bucket"
                      and s.labels.get("route") == RUN_ROUTE.label):
                    bound = float(s.labels["le"])
                    buckets[bound] = buckets.get(bound, 0.0) + s.value
                elif s.name == "kcoral_placements_total":
                    if s.labels.get("cache") == "hit":
                        hits += s.value
                    else:
                        misses += s.value
                elif s.name == "kcoral_queued_requests":
                    queued += s.value
                elif s.name == "kcoral_node_active_requests":
                    active += s.value
        return cls(time, runs, tuple(sorted(buckets.items())), hits, misses, queued, active)


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """
    The C{q} quantile of a histogram of cumulative C{(upper bound, count)}
    buckets, interpolated within its bucket as Prometheus's
    C{histogram_quantile} does; None for an empty histogram. A quantile in
    the last, unbounded bucket is the largest finite bound.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _rounded(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


@attrs.frozen
class Sample:
    """What happened between two readings, and the gauges at the second."""

    time: float
    #: Runs answered per second.
    rate: float
    #: Median and 99th percentile of their durations (seconds); None without runs.
    p50: float | None
    p99: float | None
    queued: float
    active: float
    #: Runs per second placed where their program and inputs were cached.
    cache_hits: float
    #: That share of all placements; None without placements.
    cache_hit_ratio: float | None

    @classmethod
    def between(cls, before: Totals, after: Totals) -> Sample:
        elapsed = max(after.time - before.time, 1e-9)
        earlier = dict(before.buckets)
        delta = [(bound, count - earlier.get(bound, 0.0)) for bound, count in after.buckets]
        hits = after.cache_hits - before.cache_hits
        placed = hits + after.cache_misses - before.cache_misses
        return cls(time=after.time, rate=(after.runs - before.runs) / elapsed,
                   p50=quantile(0.5, delta), p99=quantile(0.99, delta),
                   queued=after.queued, active=after.active, cache_hits=hits / elapsed,
                   cache_hit_ratio=hits / placed if placed > 0 else None)

    def to_json(self) -> dict:
        return {"time": round(self.time, 3), "rate": round(self.rate, 3),
                "p50": _rounded(self.p50), "p99": _rounded(self.p99),
                "queued": self.queued, "active": self.active,
                "cache_hits": round(self.cache_hits, 3),
                "cache_hit_ratio": _rounded(self.cache_hit_ratio, 4)}


class History(TimerService):
    """
    A ring of L{Sample}s of C{registry}, one every C{interval} seconds of
    C{clock} while the service runs, the oldest dropped past C{window}
    seconds.
    """

    def __init__(self, registry: CollectorRegistry, clock, *,
                 interval: float = SAMPLE_INTERVAL_SECONDS, window: float = WINDOW_SECONDS):
        super().__init__(interval, self.sample)
        # TimerService's loop runs on its clock attribute (declared Optional there).
        self.clock = self._clock = clock
        self.interval = interval
        self._registry = registry
        self._last: Totals | None = None
        self.samples: deque[Sample] = deque(maxlen=max(1, round(window / interval)))

    def sample(self) -> None:
        """Read the registry; from the second reading on, keep what changed."""
        totals = Totals.read(self._registry, self._clock.seconds())
        if self._last is not None:
            self.samples.append(Sample.between(self._last, totals))
        self._last = totals

    def to_json(self) -> dict:
        return {"interval_seconds": self.interval, "samples": [s.to_json() for s in self.samples]}
