"""
Node-wide metrics: one scrape of a gateway holds its own series plus every
worker's, each worker's with a C{worker} label, merged into one family per
metric name (so the text stays valid: no family appears twice).
"""

from __future__ import annotations

from typing import Any

import treq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import DeferredList, inlineCallbacks
from twisted.logger import Logger

log = Logger()


class _Families:
    def __init__(self, families):
        self._families = families

    def collect(self):
        return self._families


def merge(own: bytes, workers: dict[str, str]) -> bytes:
    """C{own} exposition text plus each worker's, relabelled, as one text."""
    merged: dict[str, Any] = {}
    sources = [(None, own.decode())] + sorted(workers.items())
    for worker, text in sources:
        for family in text_string_to_metric_families(text):
            if worker is not None:
                family.samples = [s._replace(labels=dict(s.labels, worker=worker))
                                  for s in family.samples]
            existing = merged.get(family.name)
            if existing is None:
                merged[family.name] = family
            elif existing.type == family.type:
                existing.samples.extend(family.samples)
            else:
                log.warn("metric {name} is a {a} here and a {b} on {worker}; dropped the latter",
                         name=family.name, a=existing.type, b=family.type, worker=worker)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


@inlineCallbacks
def scrape_workers(http, workers: dict[str, str], timeout: float = 2.0):
    """C{{name: metrics text}} of every worker that answered in time."""
    names = list(workers)

    @inlineCallbacks
    def one(url):
        response = yield http.get(url + "/metrics", timeout=timeout)
        body = yield treq.content(response)
        return body.decode("utf-8", "replace")

    results = yield DeferredList([one(workers[n]) for n in names], consumeErrors=True)
    texts = {}
    for name, (ok, value) in zip(names, results):
        if ok:
            texts[name] = value
        else:
            log.info("could not scrape {worker}: {why}", worker=name, why=value.getErrorMessage())
    return texts
