"""
Node-wide metrics: one scrape of a gateway holds its own series plus every
worker's, each worker's with a C{worker} label, and every front process's,
each with a C{front} label, merged into one family per metric name (so the
text stays valid: no family appears twice).
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


def merge(own: bytes, sources: dict[tuple[str, str], str]) -> bytes:
    """C{own} exposition text plus each of C{sources}' texts, each with its
    key's label (name, value) added, as one text."""
    merged: dict[str, Any] = {}
    texts: list[tuple[tuple[str, str] | None, str]] = [(None, own.decode())]
    texts += sorted(sources.items())
    for label, text in texts:
        for family in text_string_to_metric_families(text):
            if label is not None:
                family.samples = [s._replace(labels=dict(s.labels, **{label[0]: label[1]}))
                                  for s in family.samples]
            existing = merged.get(family.name)
            if existing is None:
                merged[family.name] = family
            elif existing.type == family.type:
                existing.samples.extend(family.samples)
            else:
                log.warn("metric {name} is a {a} here and a {b} on {source}; dropped the latter",
                         name=family.name, a=existing.type, b=family.type,
                         source=label[1] if label else "this process")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


@inlineCallbacks
def scrape(http, urls: dict, timeout: float = 2.0):
    """C{{key: metrics text}} of every one of C{urls} ({key: URL}) that
    answered in time."""
    names = list(urls)

    @inlineCallbacks
    def one(url):
        response = yield http.get(url + "/metrics", timeout=timeout)
        body = yield treq.content(response)
        return body.decode("utf-8", "replace")

    results = yield DeferredList([one(urls[n]) for n in names], consumeErrors=True)
    texts = {}
    for name, (ok, value) in zip(names, results):
        if ok:
            texts[name] = value
        else:
            log.info("could not scrape {source}: {why}", source=name, why=value.getErrorMessage())
    return texts
