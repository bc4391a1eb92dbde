"""
The upload cache (memory LRU in bytes, a disk tier that survives restarts)
and the compile cache (LRU, one compile per key).
"""

from __future__ import annotations

import os
import threading

import pytest
from prometheus_client import CollectorRegistry

from kcoral.protocol.wire import sha256
from kcoral.server.compile_cache import CompileCache
from kcoral.server.upload_cache import CacheMetrics, UploadCache


def blob(n: int, fill: int = 0) -> tuple[str, bytes]:
    data = bytes([fill % 256]) * n
    return sha256(data), data


class Metrics:
    """Reads the cache series back from a registry."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.caches = CacheMetrics(self.registry)

    def value(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def metrics():
    return Metrics()


# -- upload cache: memory ---------------------------------------------------

def test_memory_hit_and_miss(metrics):
    """A blob put in memory is held and returned; hits, misses, bytes and entries are counted."""
    cache = UploadCache(1000, metrics.caches)
    digest, data = blob(100)
    assert cache.get(digest) is None
    cache.put(digest, data)
    assert digest in cache
    assert cache.get(digest) == data
    assert metrics.value("kcoral_cache_hits_total", cache="upload", tier="memory") == 1
    assert metrics.value("kcoral_cache_misses_total", cache="upload") == 1
    assert metrics.value("kcoral_cache_bytes", cache="upload", tier="memory") == 100
    assert metrics.value("kcoral_cache_entries", cache="upload", tier="memory") == 1


def test_memory_is_bounded_in_bytes_and_evicts_least_recently_used(metrics):
    """Past its byte limit, the memory tier evicts the least recently used blob and counts the eviction."""
    cache = UploadCache(1000, metrics.caches)
    a, b, c = blob(400, 1), blob(400, 2), blob(400, 3)
    cache.put(*a)
    cache.put(*b)
    assert cache.get(a[0]) == a[1]  # a is now the most recently used
    cache.put(*c)  # 1200 bytes > 1000: b goes
    assert b[0] not in cache
    assert a[0] in cache and c[0] in cache
    assert metrics.value("kcoral_cache_evictions_total", cache="upload", tier="memory") == 1
    assert metrics.value("kcoral_cache_bytes", cache="upload", tier="memory") == 800


def test_memory_skips_what_can_never_fit(metrics):
    """A blob larger than the memory tier is not stored and evicts nothing."""
    cache = UploadCache(100, metrics.caches)
    small = blob(60, 1)
    cache.put(*small)
    big = blob(101, 2)
    cache.put(*big)
    assert big[0] not in cache
    assert small[0] in cache  # not evicted for something that would not fit
    assert metrics.value("kcoral_cache_evictions_total", cache="upload", tier="memory") == 0


def test_zero_sized_memory_cache_holds_nothing(metrics):
    """A memory tier of zero bytes holds nothing."""
    cache = UploadCache(0, metrics.caches)
    digest, data = blob(10)
    cache.put(digest, data)
    assert cache.get(digest) is None


# -- upload cache: disk -------------------------------------------------------

def test_disk_tier_survives_a_new_instance(tmp_path, metrics):
    """A blob on disk is found by a new cache on the same folder, then served from memory."""
    first = UploadCache(1000, metrics.caches, str(tmp_path), 10_000)
    digest, data = blob(500, 7)
    first.put(digest, data)
    assert (tmp_path / digest).read_bytes() == data

    again = Metrics()
    second = UploadCache(1000, again.caches, str(tmp_path), 10_000)  # a restart
    assert digest in second
    assert again.value("kcoral_cache_entries", cache="upload", tier="disk") == 1
    assert second.get(digest) == data
    assert again.value("kcoral_cache_hits_total", cache="upload", tier="disk") == 1
    # Read back into memory: the next hit does not touch the disk.
    assert second.get(digest) == data
    assert again.value("kcoral_cache_hits_total", cache="upload", tier="memory") == 1


def test_disk_tier_is_bounded_and_deletes_evicted_files(tmp_path, metrics):
    """Past its byte limit, the disk tier evicts the oldest blob and deletes its file."""
    cache = UploadCache(0, metrics.caches, str(tmp_path), 1000)
    items = [blob(400, i) for i in range(3)]
    for item in items:
        cache.put(*item)
    assert not (tmp_path / items[0][0]).exists()
    assert {p.name for p in tmp_path.iterdir()} == {items[1][0], items[2][0]}
    assert cache.get(items[0][0]) is None
    assert cache.get(items[2][0]) == items[2][1]
    assert metrics.value("kcoral_cache_evictions_total", cache="upload", tier="disk") == 1
    assert metrics.value("kcoral_cache_bytes", cache="upload", tier="disk") == 800


def test_disk_index_keeps_the_newest_files_on_restart(tmp_path, metrics):
    """On restart, files beyond the disk limit are removed oldest first; the newest stay readable."""
    items = [blob(400, i) for i in range(3)]
    for age, (digest, data) in enumerate(items):
        (tmp_path / digest).write_bytes(data)
        os.utime(tmp_path / digest, (1000 + age, 1000 + age))
    cache = UploadCache(0, metrics.caches, str(tmp_path), 1000)
    # The oldest file does not fit any more and is removed.
    assert items[0][0] not in cache
    assert not (tmp_path / items[0][0]).exists()
    assert cache.get(items[1][0]) == items[1][1]
    assert cache.get(items[2][0]) == items[2][1]


def test_corrupted_disk_file_is_a_miss(tmp_path, metrics):
    """A disk file whose bytes no longer match its digest is a miss, and a fresh copy can be stored."""
    digest, data = blob(300, 9)
    UploadCache(0, metrics.caches, str(tmp_path), 10_000).put(digest, data)
    (tmp_path / digest).write_bytes(b"\x01" + data[1:])
    again = Metrics()
    cache = UploadCache(0, again.caches, str(tmp_path), 10_000)
    assert cache.get(digest) is None
    assert digest not in cache
    assert again.value("kcoral_cache_misses_total", cache="upload") == 1
    # A fresh, verified copy is stored again.
    cache.put(digest, data)
    assert cache.get(digest) == data


def test_vanished_disk_file_is_a_miss(tmp_path, metrics):
    """A disk file deleted behind the cache's back is a miss and leaves the index."""
    cache = UploadCache(0, metrics.caches, str(tmp_path), 10_000)
    digest, data = blob(300, 4)
    cache.put(digest, data)
    os.unlink(tmp_path / digest)
    assert cache.get(digest) is None
    assert digest not in cache


def test_interrupted_writes_and_foreign_files_are_ignored(tmp_path, metrics):
    """On start, partial writes are deleted; foreign files and folders are left alone and not indexed."""
    digest, data = blob(50, 5)
    (tmp_path / (digest + ".123.part")).write_bytes(data[:10])
    (tmp_path / "notes.txt").write_text("not a cache entry")
    (tmp_path / "subdir").mkdir()
    cache = UploadCache(1000, metrics.caches, str(tmp_path), 10_000)
    assert not (tmp_path / (digest + ".123.part")).exists()
    assert (tmp_path / "notes.txt").exists()
    assert len(list(tmp_path.iterdir())) == 2
    assert digest not in cache


def test_disk_tier_skips_what_can_never_fit(tmp_path, metrics):
    """A blob larger than the disk tier is not written, but is kept in memory."""
    cache = UploadCache(1000, metrics.caches, str(tmp_path), 100)
    digest, data = blob(200)
    cache.put(digest, data)
    assert list(tmp_path.iterdir()) == []
    assert cache.get(digest) == data  # still in memory


def test_concurrent_puts_of_the_same_content(tmp_path, metrics):
    """Threads putting the same blobs at once leave one intact file per digest."""
    cache = UploadCache(10_000, metrics.caches, str(tmp_path), 100_000)
    items = [blob(1000, i % 4) for i in range(32)]
    threads = [threading.Thread(target=cache.put, args=item) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({d for d, _ in items})
    for digest, data in items:
        assert cache.get(digest) == data


# -- compile cache --------------------------------------------------------------

def test_compile_cache_compiles_once_and_is_lru(metrics):
    """The compile cache compiles a key once, evicts the least recently used, and counts both."""
    cache = CompileCache(2, metrics.caches)
    compiled = []

    def compile_(name):
        def compile():
            compiled.append(name)
            return object()
        return compile

    a, fresh = cache.get_or_compile("a", compile_("a"))
    assert fresh
    again, fresh = cache.get_or_compile("a", compile_("a"))
    assert again is a and not fresh
    cache.get_or_compile("b", compile_("b"))
    cache.get_or_compile("a", compile_("a"))  # a is the most recently used
    cache.get_or_compile("c", compile_("c"))  # evicts b
    assert len(cache) == 2
    _, fresh = cache.get_or_compile("b", compile_("b"))
    assert fresh
    assert compiled == ["a", "b", "c", "b"]
    assert metrics.value("kcoral_cache_misses_total", cache="compile") == 4
    assert metrics.value("kcoral_cache_hits_total", cache="compile", tier="memory") == 2
    assert metrics.value("kcoral_cache_evictions_total", cache="compile", tier="memory") == 2
    assert metrics.value("kcoral_cache_entries", cache="compile", tier="memory") == 2


def test_eviction_drops_the_last_reference(metrics):
    """An evicted executable is not kept alive by the compile cache."""
    import gc
    import weakref

    class Executable:
        pass

    cache = CompileCache(1, metrics.caches)
    first, _ = cache.get_or_compile("a", Executable)
    ref = weakref.ref(first)
    del first
    cache.get_or_compile("b", Executable)
    gc.collect()
    assert ref() is None


def test_concurrent_requests_for_a_new_program_compile_it_once(metrics):
    """Concurrent requests for one key compile it once, without holding up other keys."""
    cache = CompileCache(4, metrics.caches)
    started = threading.Event()
    release = threading.Event()
    calls = []

    def slow_compile():
        calls.append(1)
        started.set()
        assert release.wait(10)
        return "executable"

    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get_or_compile("k", slow_compile)))
               for _ in range(4)]
    threads[0].start()
    assert started.wait(10)
    for t in threads[1:]:
        t.start()
    # Another program is not held up by the compile in progress.
    assert cache.get_or_compile("other", lambda: "other")[0] == "other"
    release.set()
    for t in threads:
        t.join(10)
    assert len(calls) == 1
    assert sorted(fresh for _, fresh in results) == [False, False, False, True]
    assert {executable for executable, _ in results} == {"executable"}


def test_a_failed_compile_is_not_cached(metrics):
    """A compile that raises is not cached: the next request compiles again."""
    cache = CompileCache(4, metrics.caches)

    def broken():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        cache.get_or_compile("k", broken)
    assert len(cache) == 0
    assert cache.get_or_compile("k", lambda: "fixed") == ("fixed", True)


# -- the device cache (real JAX, on the CPU) -------------------------------------------------

def _device_cache(metrics, max_bytes: int):
    from kcoral.server.device_cache import DeviceCache

    return DeviceCache(max_bytes, metrics.caches)


def test_a_content_addressed_input_is_copied_to_the_device_once(metrics):
    """An input is copied to the device once per digest, dtype and shape; repeats get that array."""
    jax = pytest.importorskip("jax")
    import numpy as np

    cache, device = _device_cache(metrics, 1 << 20), jax.devices()[0]
    host = np.arange(1024, dtype=np.float32)
    first = cache.get("a" * 64, host, device)
    assert isinstance(first, jax.Array) and first.devices() == {device}
    np.testing.assert_array_equal(np.asarray(first), host)
    assert cache.get("a" * 64, host, device) is first
    # The same bytes seen as another dtype or shape are another entry.
    assert cache.get("a" * 64, host.view(np.int32), device) is not first
    assert metrics.value("kcoral_cache_hits_total", cache="device", tier="device") == 1
    assert metrics.value("kcoral_cache_misses_total", cache="device") == 2
    assert metrics.value("kcoral_cache_bytes", cache="device", tier="device") == 2 * host.nbytes


def test_the_device_cache_is_bounded_in_bytes(metrics):
    """Past its byte limit the device cache evicts the oldest array; one larger than it is never kept."""
    jax = pytest.importorskip("jax")
    import numpy as np

    cache, device = _device_cache(metrics, 8192), jax.devices()[0]
    arrays = {d * 64: np.full(1024, i, np.float32) for i, d in enumerate("abc")}  # 4 KiB each
    placed = {digest: cache.get(digest, host, device) for digest, host in arrays.items()}
    # Two fit: the first went; asking again copies it anew.
    assert metrics.value("kcoral_cache_evictions_total", cache="device", tier="device") == 1
    assert cache.get("a" * 64, arrays["a" * 64], device) is not placed["a" * 64]
    assert cache.get("c" * 64, arrays["c" * 64], device) is placed["c" * 64]
    # Larger than the whole cache: placed for this run, never kept.
    big = np.zeros(4096, np.float32)
    assert cache.get("d" * 64, big, device) is not cache.get("d" * 64, big, device)
    assert metrics.value("kcoral_cache_bytes", cache="device", tier="device") <= 8192


def test_the_device_cache_can_be_emptied(metrics):
    """clear() drops every device array and says how many it dropped."""
    jax = pytest.importorskip("jax")
    import numpy as np

    cache, device = _device_cache(metrics, 1 << 20), jax.devices()[0]
    for d in "ab":
        cache.get(d * 64, np.ones(256, np.float32), device)
    assert cache.clear() == 2 and cache.clear() == 0
    assert metrics.value("kcoral_cache_entries", cache="device", tier="device") == 0
    assert metrics.value("kcoral_cache_bytes", cache="device", tier="device") == 0
