"""
The compile cache: one loaded executable per (program digest, concrete input
avals, device), LRU by entry count. Evicting an entry drops the only reference
to its executable, so XLA frees it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import TypeVar

from kcoral.server.upload_cache import CacheMetrics, EvictingLRU

T = TypeVar("T")


class CompileCache:
    name = "compile"

    def __init__(self, entries: int, metrics: CacheMetrics):
        self._metrics = metrics
        # Bound once: every run looks up its executable here.
        self._memory_hits = metrics.hits.labels(self.name, "memory")
        self._lru = EvictingLRU(entries, lambda v: 1, self._evicted)
        self._lock = threading.Lock()
        # Compiling holds this lock per key, so two requests for the same new
        # program compile it once, while other programs still run.
        self._compiling: dict[Hashable, threading.Lock] = {}

    def _evicted(self, key, value) -> None:
        self._metrics.evictions.labels(self.name, "memory").inc()

    def __len__(self) -> int:
        return len(self._lru)

    def programs(self, limit: int) -> list[str]:
        """The digests of up to C{limit} programs compiled here, the latest
        compiled first (a key's first part is its program's digest)."""
        with self._lock:
            keys = list(self._lru)
        seen: dict[str, None] = {}
        for key in reversed(keys):
            seen.setdefault(key[0], None)
            if len(seen) == limit:
                break
        return list(seen)

    def get_or_compile(self, key: Hashable, compile: Callable[[], T]) -> tuple[T, bool]:
        """What C{compile} gives for C{key} (held since an earlier call, or
        compiled now), and whether this call compiled it."""
        m = self._metrics
        with self._lock:
            found = self._lru.get(key)
            if found is None:
                gate = self._compiling.setdefault(key, threading.Lock())
        if found is not None:
            self._memory_hits.inc()
            return found, False
        with gate:
            with self._lock:
                found = self._lru.get(key)
            if found is not None:
                m.hits.labels(self.name, "memory").inc()
                return found, False
            m.misses.labels(self.name).inc()
            try:
                executable = compile()
            except BaseException:
                with self._lock:
                    self._compiling.pop(key, None)
                raise
            with self._lock:
                self._lru[key] = executable
                self._compiling.pop(key, None)
                m.entries.labels(self.name, "memory").set(len(self._lru))
            return executable, True
