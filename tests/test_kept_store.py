"""
Kept arrays without processes: the worker's store (its bound, refused before
a run runs; expiry on a fake clock; delete; lost arrays), the executor's
runs that keep some outputs and free arrays once they succeeded, the frame's
references, the report that carries a worker's instance id, and the Router's
hard constraint (a run of kept arrays goes only to the member that holds
them; 422 arrays_apart; 410 array_lost where no member does).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from twisted.application.internet import TimerService
from twisted.internet.task import Clock

from kcoral.common.queue import WaitQueue
from kcoral.common.report import parse_report
from kcoral.errors import (
    ArrayLost,
    ArraysApart,
    BadRequest,
    KeptMemoryFull,
    ProgramFailed,
    ProgramRejected,
)
from kcoral.protocol.wire import (
    Blob,
    KeptInput,
    Reference,
    RunRequest,
    WireError,
    decode_outputs,
    decode_request,
    encode_request,
    encode_result,
    holder_of,
    sha256,
)
from kcoral.router.pool import READY, Pool
from kcoral.router.residency import Demand
from kcoral.router.scheduler import Scheduler
from kcoral.server.compile_cache import CompileCache
from kcoral.server.device_cache import DeviceCache
from kcoral.server.executor import Executor, ExecutorMetrics
from kcoral.server.kept import KeptStore
from kcoral.server.upload_cache import UploadCache
from tests.fakes import node_report
from tests.test_worker import HEALTHY, URL, Supervised

P = "a" * 64
A, B = "0123456789abcdef", "fedcba9876543210"


class Array:
    """A stand-in for a device array: what the store reads of one."""

    def __init__(self, nbytes: int):
        self.nbytes, self.dtype, self.shape = nbytes, np.dtype(np.uint8), (nbytes,)


def kept(store: KeptStore, *sizes: int) -> list[str]:
    """Ids of arrays of C{sizes} bytes, kept in C{store} as one run's outputs."""
    reservation = store.reserve(sum(sizes))
    return [r.kept for r in store.keep(reservation, [Array(n) for n in sizes], [None] * len(sizes))]


# -- the store -------------------------------------------------------------------------------

def test_a_reservation_past_the_bound_is_refused_with_507():
    """Kept and reserved bytes together never pass --kept-bytes: past it, 507 kept_memory_full."""
    store = KeptStore(100)
    kept(store, 60)
    held = store.reserve(30)
    with pytest.raises(KeptMemoryFull) as refused:
        store.reserve(11)
    assert refused.value.status == 507 and refused.value.reason == "kept_memory_full"
    store.release(held)
    kept(store, 40)
    assert (store.count, store.nbytes) == (2, 100)


def test_ids_name_the_worker_instance():
    """Each kept array's id starts with its store's random instance id; two stores draw two."""
    first, second = KeptStore(), KeptStore()
    assert first.instance != second.instance
    [one] = kept(first, 1)
    assert holder_of(one) == first.instance and holder_of("not-an-id") is None


def test_a_deleted_array_is_lost_and_named():
    """A deleted array is freed, and a run or a second delete of it gets 410 array_lost naming it."""
    store = KeptStore()
    one, two = kept(store, 10, 20)
    assert store.delete([one]) == []
    assert (store.count, store.nbytes) == (1, 20)
    with pytest.raises(ArrayLost) as lost:
        store.take([two, one])
    assert lost.value.status == 410 and lost.value.lost == [one]
    assert store.delete([one]) == [one]


def test_one_delete_frees_many_and_names_those_gone():
    """A delete of several ids frees every one held and names the others; ids of two workers free none."""
    store = KeptStore()
    one, two, three = kept(store, 1, 2, 4)
    [gone] = kept(store, 8)
    store.delete([gone])
    assert store.delete([one, gone, two, one]) == [gone]
    assert (store.count, store.nbytes) == (1, 4)
    [elsewhere] = kept(KeptStore(), 1)
    with pytest.raises(ArraysApart):
        store.delete([three, elsewhere])
    assert store.count == 1


def test_arrays_of_another_instance_are_lost_here():
    """An id of another instance (a restarted worker's) names nothing: lost, never another array."""
    store, before = KeptStore(), KeptStore()
    [old] = kept(before, 8)
    with pytest.raises(ArrayLost) as lost:
        store.take([old])
    assert lost.value.lost == [old]


def test_arrays_of_two_instances_are_apart():
    """A run that names arrays of two instances is refused with 422 arrays_apart."""
    [a], [b] = kept(KeptStore(), 1), kept(KeptStore(), 1)
    with pytest.raises(ArraysApart) as apart:
        KeptStore().take([a, b])
    assert apart.value.status == 422 and apart.value.reason == "arrays_apart"


def test_idle_arrays_expire_on_the_reactors_timer():
    """An array no run or fetch used for --kept-idle-seconds is freed by the sweep; a used one lives on."""
    clock = Clock()
    store = KeptStore(idle_seconds=100, now=clock.seconds)
    sweep = TimerService(store.sweep_seconds, store.expire)
    sweep.clock = clock
    sweep.startService()
    idle, used = kept(store, 5, 7)
    clock.advance(60)
    store.take([used])
    clock.advance(60)
    assert store.count == 1
    with pytest.raises(ArrayLost):
        store.take([idle])
    clock.advance(100)
    assert store.count == 0 and store.nbytes == 0
    sweep.stopService()


# -- the executor -----------------------------------------------------------------------------

@pytest.fixture
def executor():
    """C{executor(kept)}: a loaded executor keeping arrays in C{kept}, and its metrics. Loading
    turns x64 on for the whole process, as a server does: it is turned back after the test."""
    x64 = jax.config.jax_enable_x64

    def make(kept: KeptStore) -> tuple[Executor, ExecutorMetrics]:
        metrics = ExecutorMetrics(CollectorRegistry())
        ex = Executor(uploads=UploadCache(1 << 20, metrics.caches),
                      compiled=CompileCache(4, metrics.caches),
                      placed=DeviceCache(0, metrics.caches), metrics=metrics, gpus="none", kept=kept)
        ex.load()
        return ex, metrics

    yield make
    jax.config.update("jax_enable_x64", x64)


def run_of(program, *inputs, keep: tuple[bool, ...] = (), free: tuple[str, ...] = ()) -> RunRequest:
    """The decoded run of C{program} on C{inputs} (arrays inline, or
    references), keeping the outputs C{keep} flags and freeing C{free}."""
    entries = [i if isinstance(i, Reference) else (np.asarray(i), None, True) for i in inputs]
    parts, _ = encode_request(program.digest, program.serialized, entries, keep=keep, free=free)
    return decode_request(b"".join(parts))


def outputs_of(result: bytes) -> list:
    return decode_outputs(result)[0]


def test_a_run_whose_kept_outputs_pass_the_bound_does_not_run(executor):
    """Kept outputs past --kept-bytes: 507 before the program runs, nothing kept; within it, kept."""
    from kcoral import Program

    program = Program.from_function(lambda x: jax.numpy.zeros(64, np.float32) + x, np.float32(0))
    ex, metrics = executor(KeptStore(255))
    with pytest.raises(KeptMemoryFull):
        ex.execute(run_of(program, np.float32(1), keep=(True,)), "r1")
    assert ex.kept.count == 0 and ex.kept.nbytes == 0
    assert metrics.executions.labels("ok")._value.get() == 0
    ex.kept.limit_bytes = 256
    [ref] = outputs_of(ex.execute(run_of(program, np.float32(1), keep=(True,)), "r2"))
    assert ref.shape == (64,) and ex.kept.nbytes == 256


def test_kept_outputs_feed_a_run_on_the_device(executor):
    """Kept outputs stay device arrays; a run given their references takes them as they are."""
    from kcoral import Program

    double = Program.from_function(lambda x: x * 2, np.zeros(3, np.float32))
    ex, _ = executor(KeptStore())
    [ref] = outputs_of(ex.execute(run_of(double, np.arange(3, dtype=np.float32), keep=(True,)), "r"))
    assert isinstance(ex.kept.take([ref.kept])[ref.kept].array, jax.Array)
    [again] = outputs_of(ex.execute(run_of(double, ref, keep=(True,)), "r"))
    from kcoral.protocol.wire import decode_result

    assert decode_result(ex.fetch(again.kept))[0].tolist() == [0, 4, 8]
    ex.kept.delete([ref.kept])
    with pytest.raises(ArrayLost):
        ex.execute(run_of(double, ref), "r")


def step_program():
    """A decoder's step in small: (the next token, the state with it added)."""
    from kcoral import Program

    return Program.from_function(lambda state, token: (token + 1, state + token),
                                 np.zeros(4, np.float32), np.float32(0))


def test_a_run_keeps_some_outputs_and_answers_the_others(executor):
    """With one flag per output, the kept ones stay (their bytes alone reserved), the others come
    inline; flags of another number than the outputs do not fit the program (422)."""
    ex, _ = executor(KeptStore(16))
    token, state = outputs_of(ex.execute(
        run_of(step_program(), np.ones(4, np.float32), np.float32(2), keep=(False, True)), "r"))
    assert token.tolist() == 3.0 and isinstance(state, Reference) and state.shape == (4,)
    assert ex.kept.nbytes == 16
    with pytest.raises(ProgramRejected, match="'keep' has 3 entries") as rejected:
        ex.execute(run_of(step_program(), state, np.float32(2), keep=(False, True, True)), "r")
    assert rejected.value.status == 422


def test_a_run_frees_arrays_once_it_succeeded(executor, monkeypatch):
    """A run's free list goes once it ran; a run refused, lost or failed on the device frees nothing."""
    ex, _ = executor(KeptStore(32))
    program = step_program()
    [old] = outputs_of(ex.execute(run_of(identity_program(), np.ones(4, np.float32), keep=(True,)), "r"))
    token, new = outputs_of(ex.execute(
        run_of(program, old, np.float32(1), keep=(False, True), free=(old.kept,)), "r"))
    assert ex.kept.delete([old.kept]) == [old.kept] and ex.kept.count == 1
    # Refused before it runs: the kept bound.
    ex.kept.limit_bytes = 16
    with pytest.raises(KeptMemoryFull):
        ex.execute(run_of(program, new, np.float32(1), keep=(False, True), free=(new.kept,)), "r")
    # One of the arrays to free is gone: 410, and the rest stay.
    [gone] = kept(ex.kept, 0)
    ex.kept.delete([gone])
    ex.kept.limit_bytes = 64
    with pytest.raises(ArrayLost):
        ex.execute(run_of(program, new, np.float32(1), free=(new.kept, gone)), "r")
    # Failed on the device.
    def fault(*args):
        raise RuntimeError("device fault")

    monkeypatch.setattr(ex, "_call", fault)
    with pytest.raises(ProgramFailed):
        ex.execute(run_of(program, new, np.float32(1), keep=(False, True), free=(new.kept,)), "r")
    assert ex.kept.take([new.kept]) and (ex.kept.count, ex.kept.nbytes) == (1, 16)


def identity_program():
    from kcoral.client.remote import keeper

    program, _ = keeper(np.zeros(4, np.float32))
    return program


# -- the frame --------------------------------------------------------------------------------

def test_references_travel_in_the_frame():
    """An input names a kept array by its id alone; a result mixes kept ids with inline arrays."""
    ref = Reference(f"{A}-{B}", np.dtype(np.float32), (2, 3))
    parts, _ = encode_request(P, None, [ref, (np.ones(2, np.int8), None, True)], keep=(True, True))
    run = decode_request(b"".join(parts))
    assert run.keep is True and run.inputs[0] == KeptInput(ref.kept) and run.free == ()
    assert run.inputs[1].kept is None
    parts, _ = encode_request(P, None, [ref], keep=(False, True), free=[ref.kept, ref.kept])
    run = decode_request(b"".join(parts))
    assert run.keep == (False, True) and run.keeps(2) == (False, True) and run.free == (ref.kept,)
    with pytest.raises(WireError):
        run.keeps(3)
    parts, _ = encode_request(P, None, [ref])
    assert decode_request(b"".join(parts)).keeps(2) == (False, False)
    outputs, key_types = decode_outputs(b"".join(encode_result([np.int32(7), ref], [None, None])[0]))
    assert outputs[0].tolist() == 7 and outputs[1] == ref and key_types == [None, None]


@pytest.mark.parametrize("entry", [
    {"dtype": "float32", "shape": [1], "kept": "nope"},
    {"dtype": "float32", "shape": [1], "kept": f"{A}-{B}", "digest": sha256(b"x")},
])
def test_a_malformed_reference_is_a_bad_frame(entry):
    """A reference that is no kept array's id, or that also carries content, is refused (400)."""
    from kcoral.protocol.wire import FrameWriter

    parts, _ = FrameWriter().finish({"program": {"digest": P}, "inputs": [entry]})
    with pytest.raises(WireError):
        decode_request(b"".join(parts))


@pytest.mark.parametrize("field", [
    {"keep": [True, 1]}, {"keep": "yes"}, {"keep": [True] * 4097},
    {"free": "nope"}, {"free": ["nope"]}, {"free": [f"{A}-{B}"] * 4097},
])
def test_a_malformed_keep_or_free_is_a_bad_frame(field):
    """'keep' is a bool or a list of them, 'free' a list of kept arrays' ids, each bounded: else 400."""
    from kcoral.protocol.wire import FrameWriter

    parts, _ = FrameWriter().finish({"program": {"digest": P}, "inputs": [], **field})
    with pytest.raises(WireError):
        decode_request(b"".join(parts))


def test_a_kept_input_described_otherwise_is_refused(executor):
    """A kept input named by its id alone runs; one whose entry gives another shape is 400."""
    import attrs

    from kcoral.protocol.wire import ArraySpec, Blob

    ex, _ = executor(KeptStore())
    program = step_program()
    [state] = outputs_of(ex.execute(run_of(identity_program(), np.ones(4, np.float32), keep=(True,)), "r"))
    run = run_of(program, state, np.float32(1))
    token, _ = outputs_of(ex.execute(run, "r"))
    assert token.tolist() == 2.0
    wrong = KeptInput(state.kept, ArraySpec(np.dtype(np.float32), (5,), Blob(None), None, state.kept))
    with pytest.raises(BadRequest, match="not \\[5\\] float32"):
        ex.execute(attrs.evolve(run, inputs=(wrong, *run.inputs[1:])), "r")


# -- the report and the Router ----------------------------------------------------------------

def test_a_supervisor_relays_its_workers_instance():
    """The instance id of a worker's /health is in its node's report; a malformed one is left out."""
    s = Supervised()
    s.worker.startService()
    s.listening()
    s.http.answer(URL + "/health", 200, dict(HEALTHY, instance=A))
    s.reactor.advance(2)
    assert s.worker.report(URL).instance == A
    s.http.answer(URL + "/health", 200, dict(HEALTHY, instance="../x"))
    s.reactor.advance(2)
    assert s.worker.report(URL).instance is None


class Routed:
    """A Router's pool of one node with two workers, instances A and B."""

    def __init__(self):
        self.clock = Clock()
        self.pool = Pool(self.clock, recovery_threshold=1)
        self.scheduler = Scheduler(self.pool, WaitQueue(self.clock, 64, 10.0))
        body = node_report(capacities=(1, 1))
        for worker, instance in zip(body["workers"], (A, B)):
            worker["instance"] = instance
        self.pool.report("n", parse_report(body))
        self.pool.observe()
        assert self.pool.nodes["n"].state == READY
        self.a, self.b = (self.pool.nodes["n"].members[f"worker{i}"] for i in (0, 1))


def demand(*ids: str) -> Demand | None:
    return Demand.of(P.encode(), None, ",".join(ids).encode())


def test_kept_arrays_pin_a_run_to_their_member():
    """A run of kept arrays goes to the member of their instance, never to a freer one."""
    routed = Routed()
    routed.b.held.learn(Demand(P), 0.0)  # a warm member, for affinity's sake
    assert routed.pool.pick(demand(f"{A}-{B}")) is routed.a
    assert routed.b.fits(1, demand(f"{B}-{A}")) and not routed.a.fits(1, demand(f"{B}-{A}"))


def test_a_run_waits_for_the_busy_holder():
    """With its holder full, a run of kept arrays waits for it while the other member stands idle."""
    routed = Routed()
    first = routed.scheduler.acquire(demand(f"{A}-{B}"))
    waiting = routed.scheduler.acquire(demand(f"{A}-{A}"))
    assert first.result.member is routed.a and not waiting.called
    first.result.release()
    assert waiting.result.member is routed.a


def test_arrays_of_no_member_are_lost_at_the_router():
    """A run of arrays of an instance no member reports (restarted, gone) fails at once with 410."""
    routed = Routed()
    lost = routed.scheduler.acquire(demand(f"{'1' * 16}-{B}"))
    assert isinstance(lost.result.value, ArrayLost)
    assert lost.result.value.lost == [f"{'1' * 16}-{B}"]
    lost.addErrback(lambda _: None)


def test_kept_arrays_pin_a_run_that_names_no_program():
    """A run with the kept header but no program header goes to the arrays' member, every time."""
    routed = Routed()
    for _ in range(8):
        for ids, holder in (((f"{A}-{B}",), routed.a), ((f"{B}-{A}", f"{B}-{B}"), routed.b)):
            run = Demand.of(None, None, ",".join(ids).encode())
            assert run is not None and run.arrays == ids
            assert routed.pool.pick(run) is holder


def test_a_bad_kept_header_is_refused_without_a_program_header():
    """A malformed kept header is a bad request whether the program is named or not."""
    for program in (None, b"", b"nope", P.encode()):
        for bad in (b"../../x", b"zzzz", f"{A}-{B},".encode()):
            with pytest.raises(BadRequest):
                Demand.of(program, None, bad)
    assert Demand.of(None, None, None) is None and Demand.of(None, None, b"") is None


def test_a_kept_id_in_a_path_is_checked_as_in_the_header():
    """An id in a path is a kept array's id, or a WireError, like each entry of the header."""
    from kcoral.protocol.wire import kept_id, kept_ids

    assert kept_id(f"{A}-{B}") == f"{A}-{B}"
    for bad in ("zzzz", "../../x", f"{A}-{B}/", "", f"{A}-{B}".upper()):
        with pytest.raises(WireError):
            kept_id(bad)
        with pytest.raises(WireError):
            kept_ids(bad, 1)
    with pytest.raises(WireError):
        kept_id(f"{A}-{B},{A}-{A}")


def test_a_run_of_kept_arrays_lists_their_worker_in_its_header():
    """A run whose kept inputs or frees the header does not name (none, or another worker's)
    is a WireError; listing some of them, of their worker, is enough."""
    run = RunRequest(Blob(P), (KeptInput(f"{A}-{B}"),), free=(f"{A}-{A}",))
    assert run.kept == (f"{A}-{B}", f"{A}-{A}")
    run.routed_by((f"{A}-{A}",))
    for listed in ((), (f"{B}-{A}",)):
        with pytest.raises(WireError, match="must list the kept arrays"):
            run.routed_by(listed)
    with pytest.raises(ArraysApart):
        run.routed_by((f"{A}-{A}", f"{B}-{A}"))
    RunRequest(Blob(P), ()).routed_by(())


def test_the_kept_header_lists_ids_within_bounds():
    """The kept header is 0 to 4,096 kept arrays' ids (at least one for a delete); else a bad request."""
    from kcoral.protocol.wire import kept_ids

    assert kept_ids("") == () and kept_ids(f" {A}-{B},{A}-{A} ") == (f"{A}-{B}", f"{A}-{A}")
    for bad, least in (("junk", 0), (f"{A}-{B},", 0), ("", 1), (",".join([f"{A}-{B}"] * 4097), 0)):
        with pytest.raises(WireError):
            kept_ids(bad, least)


def test_the_router_refuses_arrays_apart_and_bad_ids():
    """The kept header naming two instances is 422 arrays_apart; an id that is none, 400."""
    with pytest.raises(ArraysApart):
        demand(f"{A}-{B}", f"{B}-{A}")
    with pytest.raises(BadRequest):
        demand("junk")
    assert demand() == Demand(P)


def near(instance: str) -> Demand | None:
    return Demand.of(P.encode(), None, None, f"{instance}-{'0' * 16}".encode())


def test_a_run_that_names_no_array_keeps_its_outputs_beside_the_clients():
    """A near id picks its member, warm or not; the run waits for it when full; anywhere once it is gone."""
    routed = Routed()
    routed.a.held.learn(Demand(P), 0.0)  # a warm member, for affinity's sake
    assert routed.pool.pick(near(B)) is routed.b
    first = routed.scheduler.acquire(near(B))
    waiting = routed.scheduler.acquire(near(B))
    assert first.result.member is routed.b and not waiting.called
    first.result.release()
    assert waiting.result.member is routed.b
    waiting.result.release()
    # No member reports the instance (restarted): a preference, never a 410.
    assert routed.pool.pick(near("1" * 16)) in (routed.a, routed.b)
    # Kept arrays named beside it pin the run; a near id that is none is left out.
    assert Demand.of(P.encode(), None, f"{A}-{B}".encode(), f"{B}-{A}".encode()).near is None
    assert Demand.of(P.encode(), None, None, b"../x").near is None
