"""
The device cache: large content-addressed inputs (weights, above all) kept
on the server's device between runs, by digest, LRU and bounded in bytes.

Why: the upload cache spares the network, but a run given host arrays still
copies each of them to the device, every time: for 64 MiB of weights that
copy was ~40 ms of a ~44 ms run on the CPU, and on a GPU it is a transfer
over PCIe on every call. Content-addressed arrays cannot change, so the copy
made for one run serves every later run with the same digest, dtype and
shape. Programs are compiled without buffer donation, so a cached array is
never consumed by a run.
"""

from __future__ import annotations

import threading

import numpy as np

from kcoral.server.upload_cache import CacheMetrics, EvictingLRU


class DeviceCache:
    name = "device"

    def __init__(self, max_bytes: int, metrics: CacheMetrics):
        self._metrics = metrics
        self._hits = metrics.hits.labels(self.name, "device")
        self._misses = metrics.misses.labels(self.name)
        self._lru = EvictingLRU(max_bytes, lambda array: array.nbytes,
                                 lambda key, array: metrics.evictions.labels(self.name, "device").inc())
        self._lock = threading.Lock()
        self._publish()

    def _publish(self) -> None:
        self._metrics.bytes.labels(self.name, "device").set(self._lru.currsize)
        self._metrics.entries.labels(self.name, "device").set(len(self._lru))

    def get(self, digest: str, host: np.ndarray, placement):
        """The array at C{placement} (a device, or a sharding over several)
        for content C{digest} viewed as C{host}; copied there now unless an
        earlier run left it. A failed copy (a device is out of memory) raises."""
        import jax

        # The dtype itself, not its .str: most float8 types share '<V1', and
        # the same bytes (zeros, say) can be sent as two of them.
        key = (digest, host.dtype, host.shape, placement)
        with self._lock:
            found = self._lru.get(key)
        if found is not None:
            self._hits.inc()
            return found
        self._misses.inc()
        placed = jax.device_put(host, placement)
        if host.nbytes <= self._lru.maxsize:
            with self._lock:
                self._lru[key] = placed
                self._publish()
        return placed

    def clear(self) -> int:
        """Drop every array (their device memory goes when no run uses them
        any more); how many there were."""
        with self._lock:
            count = len(self._lru)
            # Not clear(): it bypasses popitem, and each array dropped here
            # is an eviction in the metrics.
            while self._lru:
                self._lru.popitem()
            self._publish()
        return count
