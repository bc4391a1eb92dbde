"""
The executor: turns a decoded run into output bytes on this server's device.

Everything here blocks (hashing, disk, JAX): the server calls L{Executor.load}
and L{Executor.execute} from worker threads, never from the reactor.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time

import attrs
import cachetools
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram
from twisted.logger import Logger

from kcoral._version import __version__
from kcoral.common.cached import MAX_PROGRAMS
from kcoral.common.hostdevices import HOST_DEVICE_COUNT, host_device_flags
from kcoral.common.report import CPU_TARGET
from kcoral.errors import (
    BadRequest,
    MissingContent,
    NotEnoughDevices,
    ProgramFailed,
    ProgramRejected,
)
from kcoral.metrics import SECONDS_BUCKETS
from kcoral.protocol.dtypes import SUB_BYTE
from kcoral.protocol.wire import (
    ArraySpec,
    Blob,
    KeptInput,
    RunRequest,
    WireError,
    encode_result,
    sha256,
)
from kcoral.server.compile_cache import CompileCache
from kcoral.server.device_cache import DeviceCache
from kcoral.server.kept import Kept, KeptStore
from kcoral.server.programcheck import ProgramCheck
from kcoral.server.upload_cache import CacheMetrics, UploadCache
from kcoral.tracing import NO_SPAN, ISpan

log = Logger()


@attrs.frozen
class DeviceInfo:
    platform: str
    gpu_target: str
    devices: list
    runtime: dict


class ExecutorMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.executions = Counter("kcoral_executions", "Program executions by outcome",
                                  ["outcome"], registry=registry)
        self.compile_seconds = Histogram("kcoral_compile_seconds", "Time spent compiling programs",
                                         buckets=SECONDS_BUCKETS, registry=registry)
        self.execution_seconds = Histogram("kcoral_execution_seconds", "Time spent running programs",
                                           buckets=SECONDS_BUCKETS, registry=registry)
        self.caches = CacheMetrics(registry)
        self.programs_rejected = Counter(
            "kcoral_programs_rejected", "Programs refused before they were compiled, by why: a "
            "custom_call target or an op not allowed, operations nested too deep, or a module "
            "that could not be read",
            ["reason"], registry=registry)

    def rejected(self, why: str) -> None:
        self.programs_rejected.labels(why).inc()


def _select_platform(gpus: str, devices: int) -> None:
    """Pick the backend, and how many devices the host platform has, before
    JAX initialises one."""
    if devices > 1 or HOST_DEVICE_COUNT in os.environ.get("XLA_FLAGS", ""):
        # Exactly this server's count: a count inherited from a parent (a
        # test process that shards programs itself) is not this server's.
        os.environ["XLA_FLAGS"] = host_device_flags(os.environ.get("XLA_FLAGS", ""), devices)
    import jax

    if gpus == "none":
        jax.config.update("jax_platforms", "cpu")
    elif gpus != "all" and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(g.strip() for g in gpus.split(",") if g.strip())
    # Exported programs carry their own types; serve 64-bit ones faithfully,
    # whatever JAX_ENABLE_X64 says. Process-wide and once, before any run:
    # jax.enable_x64 is a thread-local context that every run thread would
    # have to enter. A 32-bit program is unchanged by it, its inputs arriving
    # with their exact dtypes.
    jax.config.update("jax_enable_x64", True)


def gpu_target_of(device) -> str:
    if device.platform == "cpu":
        return CPU_TARGET
    capability = getattr(device, "compute_capability", "")
    return f"{device.platform}:sm_{capability.replace('.', '')}" if capability else device.platform


class Executor:
    def __init__(self, *, uploads: UploadCache, compiled: CompileCache, placed: DeviceCache,
                 metrics: ExecutorMetrics, gpus: str = "0", devices: int = 1,
                 compilation_cache_dir: str | None = None, kept: KeptStore | None = None,
                 check: ProgramCheck | None = None, timed: bool = False):
        self._uploads = uploads
        #: The arrays runs kept on this server's devices.
        self.kept = KeptStore() if kept is None else kept
        self._compiled = compiled
        self._placed = placed
        self._metrics = metrics
        self._gpus = gpus
        self._count = devices
        self._compilation_cache_dir = compilation_cache_dir
        #: Reads each program before it is compiled (once per digest: the
        #: programs it passed are kept below).
        self._check = check or ProgramCheck(rejected=metrics.rejected)
        #: Whether runs are timed (--max-run-seconds): each then waits for
        #: the outputs it keeps, as well as those it sends.
        self._timed = timed
        self._programs: cachetools.LRUCache = cachetools.LRUCache(64)
        self._programs_lock = threading.Lock()
        # Bound once: labels() costs a lock and a dict lookup on every run.
        self._ran_ok = metrics.executions.labels("ok")
        self.info: DeviceInfo | None = None
        self._compiles = 0
        self._compile_seconds = 0.0

    def load(self) -> DeviceInfo:
        _select_platform(self._gpus, self._count)
        import jax
        import jaxlib

        if self._compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", self._compilation_cache_dir)
            # JAX keeps only compiles over a second by default; a server that
            # asks for the cache wants every program back after a restart.
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        found = jax.local_devices()
        if len(found) < self._count:
            raise RuntimeError(f"--devices-per-worker {self._count}, but this server sees "
                               f"{len(found)} {found[0].platform} device(s)")
        #: The devices this server owns; single-device programs run on the first.
        self._devices = found[:self._count]
        device = self._device = self._devices[0]
        if device.platform == "cpu" and self._gpus != "none":
            log.info("no GPU found: serving on the CPU")
        self.info = DeviceInfo(
            platform="cuda" if device.platform == "gpu" else device.platform,
            gpu_target=gpu_target_of(device),
            devices=[{"id": d.id, "platform": d.platform, "kind": d.device_kind}
                     for d in self._devices],
            runtime={"kcoral": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__},
        )
        return self.info

    @property
    def device(self):
        """The device single-device programs and models run on (once loaded)."""
        return self._device

    def cached(self) -> dict:
        """What this worker's caches hold, bounded, for its health report
        (L{kcoral.common.cached.Cached})."""
        return {"programs": self._compiled.programs(MAX_PROGRAMS),
                "contents": [list(entry) for entry in self._uploads.recent()],
                "compile_seconds": round(self._compile_seconds / self._compiles, 4)
                if self._compiles else None}

    def _content(self, blob: Blob, what: str, missing: list[str]):
        if blob.data is None:
            assert blob.digest is not None  # the decoder refuses a blob with neither
            data = self._uploads.get(blob.digest)
            if data is None:
                missing.append(blob.digest)
            return data
        if blob.digest is not None:
            if sha256(blob.data) != blob.digest:
                raise BadRequest(f"{what}: content does not match its digest {blob.digest}")
            data = bytes(blob.data)
            self._uploads.put(blob.digest, data)
            return data
        return blob.data

    def _exported(self, digest: str, serialized):
        with self._programs_lock:
            exported = self._programs.get(digest)
        if exported is None:
            exported = self._check.deserialize(serialized)
            with self._programs_lock:
                self._programs[digest] = exported
        return exported

    def _check_signature(self, exported, specs: list[ArraySpec], arrays: list) -> None:
        assert self.info is not None, "load() comes first"
        platform = self.info.platform
        if platform not in exported.platforms:
            raise ProgramRejected(
                f"the program was exported for {', '.join(exported.platforms)}; "
                f"this server runs {platform}")
        if exported.nr_devices > len(self._devices):
            raise NotEnoughDevices(
                f"the program was exported for {exported.nr_devices} devices; this server "
                f"owns {len(self._devices)} (see --devices-per-worker)")
        if len(arrays) != len(exported.in_avals):
            raise ProgramRejected(f"the program takes {len(exported.in_avals)} inputs, got {len(arrays)}")
        for i, (spec, array, aval) in enumerate(zip(specs, arrays, exported.in_avals)):
            dtype, shape = array.dtype, array.shape
            if spec.key_type is not None:
                try:
                    keys = _keys_of(spec.key_type, shape, dtype)
                except (TypeError, ValueError) as e:
                    raise ProgramRejected(
                        f"input {i}: {list(shape)} {dtype} is not the key data of "
                        f"{spec.key_type!r} keys ({_first_line(e)[:120]})") from None
                dtype, shape = keys.dtype, keys.shape
            if aval.dtype != dtype:
                raise ProgramRejected(f"input {i} has dtype {dtype}, the program expects {aval.dtype}")
            if len(aval.shape) != len(shape) or any(
                    isinstance(d, int) and d != s for d, s in zip(aval.shape, shape)):
                raise ProgramRejected(
                    f"input {i} has shape {list(shape)}, the program expects {aval.shape}")

    def execute(self, run: RunRequest, request_id: str, span: ISpan = NO_SPAN) -> bytes:
        import jax

        digest = run.program.digest
        assert digest is not None  # the decoder requires the program's
        # Lost arrays first: resending content would not bring them back.
        # Those it frees are checked too, and all must be on this worker.
        kept = self.kept.take(run.kept)
        missing: list[str] = []
        serialized = self._content(run.program, "program", missing)
        contents = [None if isinstance(spec, KeptInput) else
                    self._content(spec.blob, f"input {i}", missing)
                    for i, spec in enumerate(run.inputs)]
        if missing:
            raise MissingContent(f"the server does not hold {len(missing)} referenced upload(s)",
                                 details={"missing": missing})
        try:
            specs = [spec if isinstance(spec, ArraySpec) else _kept_spec(spec, kept[spec.kept], i)
                     for i, spec in enumerate(run.inputs)]
            arrays = [kept[spec.kept].array if spec.kept is not None else spec.view(data)
                      for spec, data in zip(specs, contents)]
        except WireError as e:
            raise BadRequest(str(e)) from None
        exported = self._exported(digest, serialized)
        self._check_signature(exported, specs, arrays)
        try:
            keeps = run.keeps(len(exported.out_avals))
        except WireError as e:
            # The frame is well formed: it does not fit this program's outputs.
            raise ProgramRejected(str(e)) from None
        key_types = tuple([spec.key_type for spec in specs])

        # The dtype itself: .str is "<V1" for most float8 types (the signature
        # check above already told them apart; this key must too).
        key = (digest, tuple((a.shape, a.dtype) for a in arrays), key_types, self._device.id)

        def compile():
            started = time.perf_counter()
            out_key_types: list[str | None] = []

            def call(*flat):
                # Typed PRNG keys travel as their key data: inputs become keys
                # again inside the compiled program, at no cost on each run,
                # and key outputs leave it as key data, their key types noted
                # as it is traced.
                flat = tuple(a if k is None else jax.random.wrap_key_data(a, impl=k)
                             for a, k in zip(flat, key_types))
                args, kwargs = jax.tree.unflatten(exported.in_tree, flat)
                outputs = jax.tree.leaves(exported.call(*args, **kwargs))
                out_key_types[:] = [str(jax.random.key_impl(o)) if _is_key(o) else None
                                    for o in outputs]
                return [jax.random.key_data(o) if _is_key(o) else o for o in outputs]

            with span.child("kcoral.compile", program=digest[:12]):
                try:
                    placements = self._placements(exported)
                    jitted = jax.jit(call) if placements is None else jax.jit(
                        call, in_shardings=placements)
                    compiled = jitted.lower(
                        *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]).compile()
                except Exception as e:
                    raise ProgramRejected(f"the program failed to compile: {_first_line(e)}") from None
            seconds = time.perf_counter() - started
            self._metrics.compile_seconds.observe(seconds)
            self._compiles += 1
            self._compile_seconds += seconds
            return compiled, tuple(out_key_types), placements, _output_sizes(compiled)

        try:
            (executable, result_key_types, placements, sizes), fresh = self._compiled.get_or_compile(
                key, compile)
        except ProgramRejected:
            self._metrics.executions.labels("rejected").inc()
            raise
        if fresh:
            log.info("{request_id} compiled program {digest}", request_id=request_id,
                     digest=digest[:12])
        # Refused before it runs: the compiled program says what it returns.
        reservation = self.kept.reserve(
            sum(size for size, k in zip(sizes, keeps) if k)) if any(keeps) else None
        started = time.perf_counter()
        try:
            try:
                outputs = self._call(executable, specs, keeps, self._timed or bool(run.free), arrays,
                                     placements, span)
            except Exception as e:
                # The device cache may hold the memory this run needed: give
                # it back and run once more.
                dropped = self._placed.clear() if _out_of_memory(e) else 0
                if not dropped:
                    raise
                log.info("{request_id} ran out of device memory: dropped {count} cached "
                         "input(s), running once more", request_id=request_id, count=dropped)
                outputs = self._call(executable, specs, keeps, self._timed or bool(run.free), arrays,
                                     placements, span)
        except Exception as e:
            if reservation is not None:
                self.kept.release(reservation)
            self._metrics.executions.labels("failed").inc()
            raise ProgramFailed(f"the program failed while running: {_first_line(e)}") from None
        self._metrics.execution_seconds.observe(time.perf_counter() - started)
        self._ran_ok.inc()
        if reservation is not None:
            references = iter(self.kept.keep(
                reservation, [o for o, k in zip(outputs, keeps) if k],
                [t for t, k in zip(result_key_types, keeps) if k]))
            outputs = [next(references) if k else o for o, k in zip(outputs, keeps)]
        parts, _ = encode_result(outputs, result_key_types)
        # Only now, the run done: a run that failed frees nothing.
        self.kept.delete(run.free)
        return b"".join(parts)


    def _placements(self, exported):
        """
        Where the program's inputs go: None (this server's first device) for
        a program exported for one device; for several, its own input
        shardings over a mesh of as many of this server's devices. An input
        it left unspecified goes whole to each of them, and the program
        reshards it as it was exported to.
        """
        if exported.nr_devices == 1:
            return None
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        devices = self._devices[:exported.nr_devices]
        mesh = _mesh(exported, devices)
        whole = NamedSharding(jax.sharding.Mesh(np.array(devices), ("devices",))
                              if mesh is None else mesh, PartitionSpec())
        if mesh is None:
            # Its inputs name no mesh: it shards them inside.
            return (whole,) * len(exported.in_avals)
        return tuple(whole if s is None else s for s in exported.in_shardings_jax(mesh))

    def fetch(self, kept: str) -> bytes:
        """The result frame of kept array C{kept}, copied from its device."""
        entry = self.kept.take([kept])[kept]
        parts, _ = encode_result([np.asarray(entry.array)], [entry.key_type])
        return b"".join(parts)

    def _call(self, executable, specs: list[ArraySpec], keeps: tuple[bool, ...], wait: bool,
              arrays: list, placements, span: ISpan) -> list:
        """The outputs of one run: as device arrays where it keeps them,
        else as host arrays (a sharded output gathered whole). A device runs
        a program after the call that starts it returns, so a run whose
        outputs all stay on the worker would be answered while its program
        still runs, and the next run on those arrays overlaps its own
        round trip with it. With C{wait} it is answered once all are
        computed: a run that frees arrays must fail on a failure of the
        device before anything is freed, and a timed run must not leave its
        thread, and its limit, while its program runs on (for ever perhaps:
        the limit would strike the next run, and a read of what it kept
        would wait on a thread no limit times)."""
        import jax

        # Small numpy inputs go straight to the compiled executable: its C++
        # call path moves them to its device far faster than jax.device_put
        # (measured: ~10 us against ~100 us for a scalar). Content-addressed
        # ones come from the device cache, copied there once; not types
        # narrower than a byte, which device_put lays out unpacked while the
        # executable wants them packed. A failed transfer (device out of
        # memory) is a failed run.
        # Kept inputs are device arrays already, and have no digest.
        arrays = [array if spec.blob.digest is None or array.dtype in SUB_BYTE
                  else self._placed.get(spec.blob.digest, array,
                                        self._device if placements is None else placements[i])
                  for i, (spec, array) in enumerate(zip(specs, arrays))]
        with span.child("kcoral.execute"):
            outputs = executable(*arrays)
            if wait:
                jax.block_until_ready(outputs)
            back = [o for o, k in zip(outputs, keeps) if not k]
            # jax.device_get overlaps the copies of several outputs; for the
            # common single one that goes back (a loss, a decoded token),
            # np.asarray is the same copy without its tree walk.
            copied = iter([np.asarray(back[0])] if len(back) == 1 else jax.device_get(back))
            return [o if k else next(copied) for o, k in zip(outputs, keeps)]


def _kept_spec(named: KeptInput, kept: Kept, index: int) -> ArraySpec:
    """Kept input C{index} as its worker holds it; a L{WireError} where its
    entry described it otherwise."""
    array = kept.array
    spec = ArraySpec(array.dtype, tuple(array.shape), Blob(None), kept.key_type, named.kept)
    given = named.described
    if given is not None and (given.dtype, given.shape, given.key_type) != (
            spec.dtype, spec.shape, spec.key_type):
        raise WireError(f"input {index}: kept array {named.kept} is "
                        f"{list(spec.shape)} {spec.dtype}, not {list(given.shape)} {given.dtype}")
    return spec


def _output_sizes(executable) -> tuple[int, ...]:
    """The bytes of each output of a compiled program (key data, for keys),
    read once: its C{out_info} costs a tenth of a millisecond or more."""
    import jax

    return tuple(math.prod(o.shape) * o.dtype.itemsize for o in jax.tree.leaves(executable.out_info))


def _mesh(exported, devices: list):
    """
    A mesh of C{devices} (as many as the program was exported for) that the
    program's shardings fit: the axes of the mesh it was exported with, which
    its input and output types name; None when they name none (its inputs
    were left unspecified, and it shards inside).
    """
    import jax

    meshes = {aval.sharding.mesh for aval in (*exported.in_avals, *exported.out_avals)
              if getattr(aval, "sharding", None) is not None and not aval.sharding.mesh.empty}
    if not meshes:
        return None
    if len(meshes) > 1:
        raise ValueError(f"its shardings name {len(meshes)} meshes; KCoral runs programs of one")
    (mesh,) = meshes
    return jax.sharding.Mesh(np.array(devices).reshape(mesh.axis_sizes), mesh.axis_names,
                             axis_types=mesh.axis_types)


def _is_key(value) -> bool:
    import jax

    return jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


@functools.lru_cache(maxsize=256)
def _keys_of(key_type: str, shape: tuple[int, ...], dtype: np.dtype):
    """The abstract typed keys of C{key_type} over key data of this shape and
    dtype; a ValueError or TypeError when there are none."""
    import jax

    return jax.eval_shape(functools.partial(jax.random.wrap_key_data, impl=key_type),
                          jax.ShapeDtypeStruct(shape, dtype))


def _out_of_memory(error: Exception) -> bool:
    # XLA's status code, as every backend words it ("RESOURCE_EXHAUSTED: Out
    # of memory ..."): jaxlib has no exception class of its own for it.
    return "RESOURCE_EXHAUSTED" in str(error)


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:500]
