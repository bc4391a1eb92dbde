"""
Programs are checked before they compile (L{kcoral.server.programcheck}):
forged modules (tests/forged.py) with custom-call targets outside the
allow-list, or with C{infeed}, C{outfeed}, C{send} or C{recv}, in C{main} or
only in the CUDA branch, claiming their own exemption or not, are refused
with 422 C{program_rejected} naming what was refused, by the check itself and
by a real server and a real node of two workers, whose processes live on and
answer a harmless program after each; whatever JAX itself exports passes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time

import numpy as np
import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.threads import deferToThread

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.export import DisabledSafetyCheck  # noqa: E402

from kcoral import Client, Program, ProgramRejected  # noqa: E402
from kcoral.models.bundle import PROGRAM  # noqa: E402
from kcoral.models.manifest import MANIFEST  # noqa: E402
from kcoral.server.models import UNAVAILABLE, ModelRepository  # noqa: E402
from kcoral.server.programcheck import (  # noqa: E402
    ALLOWED_CUSTOM_CALLS,
    CLIENT_CODE,
    CUSTOM_CALL,
    MAX_DEPTH,
    NESTING,
    OP,
    UNREADABLE,
    ProgramCheck,
    Refused,
)
from tests.forged import (  # noqa: E402
    CALL,
    HARMLESS,
    OPS,
    PLACES,
    RECURSIONS,
    calls,
    custom_call,
    forge,
    forge_mhlo,
    nested,
    recursion,
)
from tests.harness import SERVER_READY  # noqa: E402
from tests.httputil import request  # noqa: E402
from tests.test_bundle import export_mlp  # noqa: E402
from tests.test_node_multi import node_args, start_node  # noqa: E402

X = np.arange(4, dtype=np.float32)

#: Targets a hostile client names: JAX's host callbacks (which read a
#: client-chosen index as a pointer), the kernels that carry client code,
#: and anything else.
CALLBACKS = ("xla_ffi_python_cpu_callback", "xla_ffi_python_gpu_callback",
             "xla_ffi_partial_smap_cpu_callback", "xla_buffer_python_cpu_callback",
             "xla_python_cpu_callback", "xla_python_gpu_callback")
targets = st.one_of(st.sampled_from(CALLBACKS + tuple(sorted(CLIENT_CODE))),
                    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)),
                            min_size=1, max_size=40),
                    # Bytes a target is spelled with, UTF-8 or not.
                    st.binary(min_size=1, max_size=40),
                    ).filter(lambda t: _spelled(t) not in ALLOWED_CUSTOM_CALLS)
#: What a forged program claims of its own checks.
exemptions = st.sampled_from([(), "target", (DisabledSafetyCheck.custom_call("ALL"),),
                              (DisabledSafetyCheck.platform(),)])


def _spelled(target: str | bytes) -> str:
    """A target as a refusal names it: its bytes read as UTF-8, any other byte escaped."""
    return target if isinstance(target, str) else target.decode("utf-8", "backslashreplace")


def _claimed(exempt, target: str | bytes | None) -> tuple:
    if exempt == "target":
        return (DisabledSafetyCheck.custom_call(_spelled(target)),) if target else ()
    return exempt


# The case of a forged program: what it holds (a target, an op, or a
# structure the compiler cannot take, with the private functions beside
# main), where, and its own exemptions; what the refusal must name and its
# metrics label.
forged_targets = st.builds(
    lambda t, i, p, e: (custom_call(t, i), p, _claimed(e, t), repr(_spelled(t)), CUSTOM_CALL, ()),
    targets, st.sampled_from([0, 1, 1 << 40]), st.sampled_from(PLACES), exemptions)
forged_ops = st.builds(lambda op, p, e: (OPS[op], p, _claimed(e, None), repr(op), OP, ()),
                       st.sampled_from(sorted(OPS)), st.sampled_from(PLACES), exemptions)
#: Past what XLA's compiler can take: operations nested past MAX_DEPTH
#: (regions, calls, both), a function that calls itself.
TOO_DEEP = f"more than {MAX_DEPTH} deep"
chain, chained = calls(MAX_DEPTH)
forged_structures = st.sampled_from([
    (nested(MAX_DEPTH + 1), "main", (), TOO_DEEP, NESTING, ()),
    (nested(MAX_DEPTH), "cuda branch", (), TOO_DEEP, NESTING, ()),
    (chain, "main", (), TOO_DEEP, NESTING, chained),
    *((lines, place, (), "'f0'", NESTING, functions)
      for lines, functions in map(recursion, sorted(RECURSIONS)) for place in PLACES)])
forged = st.one_of(forged_targets, forged_ops, forged_structures)


@functools.cache
def _forged(case_key):
    lines, place, exempt, functions = case_key
    return forge(list(lines), place, exempt, functions)


def forged_bytes(case) -> bytes:
    lines, place, exempt, _, _, functions = case
    return _forged((tuple(lines), place, tuple(exempt), tuple(functions)))


# -- the check itself -----------------------------------------------------------------------------

def test_the_allow_list_is_jax_stable_list_less_client_code():
    """
    KCoral's allow-list is JAX's list of custom-call targets guaranteed
    stable, less the three that carry client code: an upgrade of JAX that
    adds or removes a target fails here, to be looked at before it is served.
    """
    # JAX publishes the list only as a private name of its export module;
    # reading it here, in a test, is the point: it pins our copy against it.
    from jax._src.export._export import _CUSTOM_CALL_TARGETS_GUARANTEED_STABLE as stable

    assert ALLOWED_CUSTOM_CALLS | CLIENT_CODE == stable
    assert not ALLOWED_CUSTOM_CALLS & CLIENT_CODE
    assert not ALLOWED_CUSTOM_CALLS & set(CALLBACKS)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(forged)
def test_every_forged_program_is_refused_naming_what(case):
    """A target outside the list or a refused op, in main or only in the CUDA branch, with or
    without its own exemption, is refused (422 program_rejected) naming it, and counted."""
    counted: list[str] = []
    with pytest.raises(Refused) as refused:
        ProgramCheck(rejected=counted.append).deserialize(forged_bytes(case))
    assert refused.value.status == 422 and refused.value.reason == "program_rejected"
    assert case[3] in str(refused.value) and counted == [case[4]]


@pytest.mark.parametrize("place", PLACES)
def test_a_harmless_forged_program_passes_and_runs(place):
    """The same forgery with nothing refused in it passes and computes: the refusals above are
    the check's, not the forgery's."""
    exported = ProgramCheck().deserialize(forge(HARMLESS, place))
    np.testing.assert_array_equal(np.asarray(exported.call(X)), X + X)


def test_the_operator_may_allow_a_target():
    """--allow-custom-call adds a target to the list (the operator's own choice), and only it."""
    check = ProgramCheck.with_additions(["my_kernel"], lambda what: None)
    check.deserialize(forge(custom_call("my_kernel"), "main"))
    with pytest.raises(Refused, match="'my_other_kernel'"):
        check.deserialize(forge(custom_call("my_other_kernel"), "main"))


@pytest.mark.parametrize("target", [b"xla_ffi_python_cpu_callback\xff", b"Sharding\xff",
                                    b"\xc0\xafSharding", b"\xed\xa0\x80", b"\xff" * 40])
def test_a_target_whose_bytes_are_no_utf8_is_refused_naming_them(target):
    """A target spelled with bytes that are not UTF-8 is refused and counted as any target
    outside the list is, its bytes escaped where the refusal names it (it was an internal
    error, a 500)."""
    counted: list[str] = []
    with pytest.raises(Refused) as refused:
        ProgramCheck(rejected=counted.append).deserialize(forge(custom_call(target)))
    assert refused.value.status == 422 and counted == [CUSTOM_CALL]
    assert repr(target.decode("utf-8", "backslashreplace")) in str(refused.value)


def _depth_cases(depth: int):
    """Programs whose deepest operation stands C{depth} deep, as (lines, place, functions):
    regions in main, in the CUDA branch, a chain of calls, and regions around a chain."""
    chain, chained = calls(depth - 1)
    half = depth // 2
    return [(nested(depth), "main", ()), (nested(depth - 1), "cuda branch", ()),
            (chain, "main", chained), (nested(half, CALL), "main", calls(depth - half)[1])]


DEPTH_CASES = ["regions", "cuda branch", "calls", "regions around calls"]


@pytest.mark.parametrize("case", range(4), ids=DEPTH_CASES)
def test_a_program_nested_to_the_limit_passes_and_runs(case):
    """Operations nested MAX_DEPTH deep -- regions in regions, calls followed, both -- pass
    and compute: the limit is far past what JAX exports and what XLA's compiler needs."""
    lines, place, functions = _depth_cases(MAX_DEPTH)[case]
    exported = ProgramCheck().deserialize(forge(lines, place, functions=functions))
    np.testing.assert_array_equal(np.asarray(exported.call(X)), X + X)


@pytest.mark.parametrize("case", range(4), ids=DEPTH_CASES)
def test_a_program_nested_past_the_limit_is_refused(case):
    """One level more is refused (422, counted as nesting), before XLA's compiler, which
    recurses once a level on a thread of its own, overflows its stack (about 220 levels
    crashed a worker, SIGSEGV)."""
    lines, place, functions = _depth_cases(MAX_DEPTH + 1)[case]
    counted: list[str] = []
    with pytest.raises(Refused, match=f"more than {MAX_DEPTH} deep") as refused:
        ProgramCheck(rejected=counted.append).deserialize(forge(lines, place, functions=functions))
    assert refused.value.status == 422 and counted == [NESTING]


@pytest.mark.parametrize("how", sorted(RECURSIONS))
@pytest.mark.parametrize("place", PLACES)
def test_a_function_that_calls_itself_is_refused(how, place):
    """A function that calls itself (by func.call, through another function, or as a
    composite's decomposition) is refused naming it: XLA's compiler follows the calls
    without end (it crashed a worker, SIGSEGV, for a program of 1 kB)."""
    lines, functions = recursion(how)
    counted: list[str] = []
    with pytest.raises(Refused, match="'f0'") as refused:
        ProgramCheck(rejected=counted.append).deserialize(forge(lines, place, functions=functions))
    assert refused.value.status == 422 and counted == [NESTING]


def test_a_module_that_cannot_be_read_is_refused():
    """A program whose module is not StableHLO the check can read is refused, never compiled."""
    carrier = jax.export.export(jax.jit(jnp.sin))(jax.ShapeDtypeStruct((4,), jnp.float32))
    counted: list[str] = []
    garbage = dataclasses.replace(carrier, mlir_module_serialized=b"ML\xefR garbage").serialize()
    with pytest.raises(Refused, match="could not be read"):
        ProgramCheck(rejected=counted.append).deserialize(garbage)
    assert counted == [UNREADABLE]


def test_a_custom_call_of_another_dialect_is_refused_unread():
    """An mhlo.custom_call hidden in a module's bytecode, which a reader that knows mhlo
    (JAX's own, whose program XLA compiled: the worker died of SIGSEGV in a trial) reads
    as it is, is refused unread: the check reads only the dialects JAX writes."""
    program = forge_mhlo("xla_ffi_python_cpu_callback")
    assert "mhlo.custom_call @xla_ffi_python_cpu_callback" in \
        jax.export.deserialize(bytearray(program)).mlir_module()
    counted: list[str] = []
    with pytest.raises(Refused, match="could not be read"):
        ProgramCheck(rejected=counted.append).deserialize(program)
    assert counted == [UNREADABLE]


def test_bytes_that_are_no_program_are_rejected_uncounted():
    """Bytes that are no jax.export program are a 422 as before, not a refused program."""
    counted: list[str] = []
    with pytest.raises(ProgramRejected, match="not a jax.export program"):
        ProgramCheck(rejected=counted.append).deserialize(b"\x00" * 64)
    assert counted == []


def test_the_programs_own_exemptions_are_dropped():
    """A program that passes keeps none of the safety checks it says were disabled."""
    exported = jax.export.export(jax.jit(jnp.sin), platforms=("cpu", "cuda"), disabled_checks=[
        DisabledSafetyCheck.platform(), DisabledSafetyCheck.custom_call("anything")])(
        jax.ShapeDtypeStruct((4,), jnp.float32))
    checked = ProgramCheck().deserialize(exported.serialize())
    assert exported.disabled_safety_checks and checked.disabled_safety_checks == ()


def _jax_exports():
    """Programs as JAX exports them: linear algebra (LAPACK on the CPU,
    cuSOLVER in the CUDA branch), random bits of each key type, shape
    polymorphism, control flow, FFT, convolutions, and a program for two
    devices."""
    f32 = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    c64 = jax.ShapeDtypeStruct((4, 4), jnp.complex64)

    def linalg(a):
        spd = a @ a.T + 4 * jnp.eye(4)
        q, r = jnp.linalg.qr(a)
        u, s, vt = jnp.linalg.svd(a)
        return (jnp.linalg.solve(spd, a), jnp.linalg.cholesky(spd), jnp.linalg.eigh(spd)[0],
                q, r, s, jnp.linalg.det(a), jnp.linalg.inv(spd),
                jax.scipy.linalg.lu(a)[2], jax.scipy.linalg.solve_triangular(spd, a, lower=True))

    def eig(a):
        return jnp.linalg.eigvals(a), jax.scipy.linalg.schur(a)[0]

    def randomness(seed):
        keys = [jax.random.key(seed, impl=impl) for impl in ("threefry2x32", "rbg", "unsafe_rbg")]
        return [jax.random.normal(k, (8,)) for k in keys] + [jax.random.bits(keys[0], (3,))]

    def control(x):
        looped = jax.lax.fori_loop(0, 10, lambda i, v: v * 1.01 + i, x)
        return jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, looped), jnp.sort(x, axis=0), \
            jax.lax.top_k(x, 2)[0], jnp.fft.fft(x), \
            jax.lax.conv_general_dilated(x[None, None], x[None, None], (1, 1), "SAME")

    exports = [
        jax.export.export(jax.jit(linalg), platforms=("cpu", "cuda"))(f32),
        jax.export.export(jax.jit(eig), platforms=("cpu",))(c64),
        jax.export.export(jax.jit(randomness), platforms=("cpu", "cuda"))(
            jax.ShapeDtypeStruct((), jnp.uint32)),
        jax.export.export(jax.jit(control), platforms=("cpu", "cuda"))(f32),
    ]
    batch = jax.export.symbolic_shape("b, 4")
    exports.append(jax.export.export(jax.jit(lambda x: jnp.tanh(x) @ jnp.ones((4, 3))),
                                     platforms=("cpu", "cuda"))(
        jax.ShapeDtypeStruct(batch, jnp.float32)))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    exports.append(jax.export.export(jax.jit(lambda x: jnp.cumsum(x * 2, axis=0),
                                             in_shardings=sharded, out_shardings=sharded),
                                     platforms=("cpu", "cuda"))(f32))
    return exports


def test_whatever_jax_exports_passes():
    """Every program of _jax_exports passes the check and, after it, runs on the CPU as the
    program JAX exported does."""
    check = ProgramCheck()
    x = np.arange(16, dtype=np.float32).reshape(4, 4) / 7 + np.eye(4, dtype=np.float32)
    for exported in _jax_exports():
        checked = check.deserialize(exported.serialize())
        if exported.nr_devices == 1 and exported.in_avals[0].dtype == np.float32 \
                and exported.in_avals[0].shape == (4, 4):
            jax.tree.map(np.testing.assert_allclose, checked.call(x), exported.call(x))


def test_a_bundle_with_a_forged_program_is_unavailable(tmp_path):
    """A bundle whose program holds a refused target loads as UNAVAILABLE, its reason naming
    the target, and is never compiled; the repository's other models are served."""
    export_mlp(tmp_path / "mlp")
    export_mlp(tmp_path / "forged", name="forged")
    program = forge(custom_call("xla_ffi_python_cpu_callback", 1 << 40), "cuda branch")
    (tmp_path / "forged" / PROGRAM).write_bytes(program)
    manifest = json.loads((tmp_path / "forged" / MANIFEST).read_bytes())
    manifest["programs"][0]["sha256"] = hashlib.sha256(program).hexdigest()
    (tmp_path / "forged" / MANIFEST).write_text(json.dumps(manifest))
    counted: list[str] = []
    models = ModelRepository(tmp_path, check=ProgramCheck(rejected=counted.append))
    models.load(jax.local_devices()[0])
    status = {s.name: s for s in models.index()}
    assert status["forged"].state == UNAVAILABLE
    assert "'xla_ffi_python_cpu_callback'" in status["forged"].reason
    assert status["mlp"].state == "READY" and counted == [CUSTOM_CALL]


def test_the_check_costs_little_beside_deserialization():
    """The walk costs well under the 20 ms a program it may take (bench.programcheck
    measures it side by side; this bound only catches a walk gone quadratic)."""
    serialized = _jax_exports()[0].serialize()
    check = ProgramCheck()
    check.deserialize(serialized)
    started = time.perf_counter()
    for _ in range(5):
        check.deserialize(serialized)
    assert (time.perf_counter() - started) / 5 < 0.2


# -- against real processes -----------------------------------------------------------------------

def _attack(url: str, cases, pids) -> int:
    """Send C{cases} forged cases drawn by hypothesis to C{url} (from a thread), each
    L{_refused}. The count of refusals."""
    harmless = Program.from_bytes(forge(HARMLESS, "cuda branch"))
    before = pids()
    sent = 0
    with Client(url, timeout=60) as client:
        def one(case):
            nonlocal sent
            _refused(client, harmless, case, lambda: pids() == before)
            sent += 1

        settings(max_examples=cases, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))(given(forged)(one))()
    return sent


def _refused(client: Client, harmless: Program, case, unchanged) -> None:
    """C{case} sent through C{client}: a 422 program_rejected naming what, in under a
    second; then C{harmless} answers and C{unchanged()} holds (no process replaced)."""
    started = time.monotonic()
    with pytest.raises(ProgramRejected) as refused:
        client.run(Program.from_bytes(forged_bytes(case)), X)
    assert time.monotonic() - started < 1.0
    assert refused.value.reason == "program_rejected" and case[3] in refused.value.message
    assert refused.value.request_id
    np.testing.assert_array_equal(np.asarray(client.run(harmless, X)), X + X)
    assert unchanged()


async def _rejected_total(url: str) -> float:
    """The refusals C{url}'s /metrics counts (a gateway's: its workers', each labelled)."""
    text = (await request("GET", url + "/metrics")).body.decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "kcoral_programs_rejected"
               for sample in family.samples if sample.name.endswith("_total"))


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_real_server_refuses_forged_programs_and_lives(processes):
    """A standalone server refuses each forged program (422 naming it, under a second), keeps
    its pid, answers a harmless program after each, and counts the refusals in /metrics."""
    from tests.conftest import server_args, server_env

    server = await processes.start_service(server_args(), name="server", ready=SERVER_READY,
                                           env=server_env())
    sent = await deferToThread(_attack, server.url, 12, lambda: server.process.pid)
    assert server.process.running
    assert await _rejected_total(server.url) == sent


#: Programs that crashed XLA's compiler, and the server with it (SIGSEGV), before the check
#: refused them: each function that calls itself, and regions nested four times the limit deep.
CRASHERS = [*((lines, "main", (), "'f0'", NESTING, functions)
              for lines, functions in map(recursion, sorted(RECURSIONS))),
            (nested(4 * MAX_DEPTH), "main", (), TOO_DEEP, NESTING, ())]


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_real_server_refuses_what_would_crash_its_compiler_and_lives(processes):
    """Each program that crashed the compiler is refused (422 naming why, under a second), and
    the server keeps running and answers a harmless program after each."""
    from tests.conftest import server_args, server_env

    server = await processes.start_service(server_args(), name="server", ready=SERVER_READY,
                                           env=server_env())
    harmless = Program.from_bytes(forge(HARMLESS, "cuda branch"))

    def attack():
        with Client(server.url, timeout=60) as client:
            for case in CRASHERS:
                _refused(client, harmless, case, lambda: server.process.running)

    await deferToThread(attack)
    assert await _rejected_total(server.url) == len(CRASHERS)


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_node_of_two_workers_refuses_forged_programs_and_no_worker_restarts(processes):
    """Through a node's gateway, forged programs are refused with 422 naming them and no worker
    restarts: each worker's pid stays the same and a harmless program answers after each."""
    node = await start_node(processes, node_args())
    sent = await deferToThread(_attack, node.url, 8, node.pids)
    health = await node.health()
    assert health["status"] == "ok" and all(w["healthy"] for w in health["workers"])
    assert await _rejected_total(node.url) == sent
