"""
The content-addressed upload cache: program bytes and large arrays, by sha256.

Two tiers: memory, bounded in bytes and LRU, cleared by a restart; and an
optional directory that survives restarts, also bounded and LRU. Callers verify
digests before L{UploadCache.put}; the disk tier is read back through
L{UploadCache.get}, which checks the digest again, so a corrupted file is a
miss, never wrong data. Every method may block (disk I/O, hashing): call it
from a worker thread, never the reactor.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import cachetools
from prometheus_client import CollectorRegistry, Counter, Gauge

from kcoral.common.cached import MAX_CONTENTS
from kcoral.protocol.wire import is_digest, sha256


class EvictingLRU(cachetools.LRUCache):
    """An LRU that tells its owner what it evicts."""

    def __init__(self, maxsize, getsizeof, on_evict):
        super().__init__(maxsize=maxsize, getsizeof=getsizeof)
        self._on_evict = on_evict

    def popitem(self):
        key, value = super().popitem()
        self._on_evict(key, value)
        return key, value


class CacheMetrics:
    """The cache metric families, shared by every cache through its C{cache} label."""

    def __init__(self, registry: CollectorRegistry):
        labels = ["cache", "tier"]
        self.hits = Counter("kcoral_cache_hits", "Cache hits", labels, registry=registry)
        self.misses = Counter("kcoral_cache_misses", "Cache misses", ["cache"], registry=registry)
        self.evictions = Counter("kcoral_cache_evictions", "Cache evictions", labels, registry=registry)
        self.bytes = Gauge("kcoral_cache_bytes", "Bytes held by a cache", labels, registry=registry)
        self.entries = Gauge("kcoral_cache_entries", "Entries held by a cache", labels, registry=registry)


class UploadCache:
    name = "upload"

    def __init__(self, memory_bytes: int, metrics: CacheMetrics,
                 directory: str | None = None, disk_bytes: int = 0, recent: int = MAX_CONTENTS):
        self._lock = threading.Lock()
        self._metrics = metrics
        # Bound once: every run looks up its program here (labels() costs a
        # lock and a key per call).
        self._memory_hits = metrics.hits.labels(self.name, "memory")
        self._memory = EvictingLRU(memory_bytes, len, self._evict_memory)
        #: The most recently used entries and their sizes, kept apart so that
        #: reporting them costs nothing per run (the LRU's own order is not
        #: public).
        self._recent: OrderedDict[str, int] = OrderedDict()
        self._recent_size = recent
        self._dir: Path | None = None
        self._disk: EvictingLRU | None = None
        if directory:
            self._dir = Path(directory)
            self._disk = EvictingLRU(disk_bytes, lambda size: size, self._evict_file)
            self._load_disk_index(self._dir, self._disk)
        self._publish()

    def _load_disk_index(self, directory: Path, disk: EvictingLRU) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        files = []
        for entry in os.scandir(directory):
            if entry.is_file() and is_digest(entry.name):
                stat = entry.stat()
                files.append((stat.st_mtime, entry.name, stat.st_size))
            elif entry.name.endswith(".part"):
                os.unlink(entry.path)  # a write that a crash interrupted
        for _, name, size in sorted(files):
            _insert_disk(disk, name, size)
            if name in disk:
                self._touch(name, size)

    def _path(self, digest: str) -> Path:
        # Only ever a validated digest: never a path built from client text.
        assert is_digest(digest) and self._dir is not None
        return self._dir / digest

    def _evict_memory(self, digest: str, data: bytes) -> None:
        self._evicted("memory")
        if self._disk is None or digest not in self._disk:
            self._recent.pop(digest, None)

    def _evict_file(self, digest: str, size: int) -> None:
        self._evicted("disk")
        if digest not in self._memory:
            self._recent.pop(digest, None)
        try:
            os.unlink(self._path(digest))
        except FileNotFoundError:
            pass

    def _evicted(self, tier: str) -> None:
        self._metrics.evictions.labels(self.name, tier).inc()

    def _publish(self) -> None:
        m = self._metrics
        m.bytes.labels(self.name, "memory").set(self._memory.currsize)
        m.entries.labels(self.name, "memory").set(len(self._memory))
        if self._disk is not None:
            m.bytes.labels(self.name, "disk").set(self._disk.currsize)
            m.entries.labels(self.name, "disk").set(len(self._disk))

    def recent(self) -> list[tuple[str, int]]:
        """The most recently used entries held, (digest, bytes), most recent first."""
        with self._lock:
            return list(reversed(self._recent.items()))

    def _touch(self, digest: str, size: int) -> None:
        recent = self._recent
        recent.pop(digest, None)
        recent[digest] = size
        if len(recent) > self._recent_size:
            recent.popitem(last=False)

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest in self._memory or (self._disk is not None and digest in self._disk)

    def get(self, digest: str) -> bytes | None:
        m = self._metrics
        disk = self._disk
        with self._lock:
            data = self._memory.get(digest)
            on_disk = disk is not None and digest in disk
        if data is not None:
            self._memory_hits.inc()
            with self._lock:
                self._touch(digest, len(data))
            return data
        if disk is not None and on_disk:
            try:
                data = self._path(digest).read_bytes()
            except FileNotFoundError:
                data = None
            if data is not None and sha256(data) == digest:
                m.hits.labels(self.name, "disk").inc()
                self._remember(digest, data)
                return data
            with self._lock:
                disk.pop(digest, None)
        m.misses.labels(self.name).inc()
        return None

    def put(self, digest: str, data: bytes) -> None:
        """Store C{data}, whose sha256 the caller has checked is C{digest}."""
        self._remember(digest, data)
        if self._disk is None or len(data) > self._disk.maxsize:
            return
        with self._lock:
            if digest in self._disk:
                return
        path = self._path(digest)
        part = path.with_name(digest + f".{threading.get_ident()}.part")
        part.write_bytes(data)
        os.replace(part, path)
        with self._lock:
            _insert_disk(self._disk, digest, len(data))
            self._publish()

    def _remember(self, digest: str, data: bytes) -> None:
        with self._lock:
            if len(data) <= self._memory.maxsize:
                self._memory[digest] = data
                self._touch(digest, len(data))
            self._publish()


def _insert_disk(disk: EvictingLRU, digest: str, size: int) -> None:
    if size <= disk.maxsize:
        disk[digest] = size
