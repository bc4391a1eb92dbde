"""
Integration tests against one real C{kcoral server} process (on an ephemeral
port, real JAX), shared by this module: programs and their results, what a
repeated call sends, and every bad input of the status-code table that a
running server can see. Restarts, draining and the small-limit server are in
L{tests.test_server_lifecycle}.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import pytest_twisted
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.threads import deferToThread

from kcoral import AsyncClient, Client, KCoralError, ProgramFailed, ProgramRejected, __version__
from kcoral.protocol.dtypes import SUB_BYTE
from kcoral.protocol.wire import ALIGN, MAGIC, PREFIX, encode_request, sha256, wire_array
from tests import programs
from tests.conftest import TEST_GPUS
from tests.httputil import parse_raw, post_run, raw_exchange, request

pytestmark = pytest.mark.integration

jax = pytest.importorskip("jax")


def assert_tree_close(got, expected):
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        e = np.asarray(e)
        assert np.asarray(g).shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def frame(header: dict, payload: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    head = PREFIX.pack(MAGIC, len(text)) + text
    return head + b"\0" * (-len(head) % ALIGN) + payload


def run_frame(program, arrays, *, send_program=True) -> bytes:
    inputs = [(wire_array(a), None, True) for a in arrays]
    parts, _ = encode_request(program.digest, program.serialized if send_program else None, inputs)
    return b"".join(bytes(p) for p in parts)


async def metrics(server) -> dict:
    """Every sample of the server's /metrics, by (name, sorted labels)."""
    answer = await request("GET", server.url + "/metrics")
    assert answer.code == 200
    samples = {}
    for family in text_string_to_metric_families(answer.body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def assert_healthy(server):
    answer = await request("GET", server.url + "/health")
    assert answer.code == 200, answer
    assert answer.json["status"] == "ok"


def attempt(url, program, *args, request_id=None, **kwargs):
    """Run with a blocking client; return the outputs or the KCoralError."""
    with Client(url, busy_timeout=0) as client:
        try:
            return client.run(program, *args, request_id=request_id, **kwargs)
        except KCoralError as e:
            return e


@pytest.fixture(scope="module")
def affine():
    return programs.affine_program()


# -- health ---------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_health_of_a_real_server(server):
    """/health gives status, target, capacity, runtime versions and devices, and echoes the request id."""
    answer = await request("GET", server.url + "/health", headers={"X-Request-ID": "probe-1"})
    assert answer.code == 200
    assert answer.request_id == "probe-1"
    health = answer.json
    assert health["status"] == "ok"
    if TEST_GPUS:
        assert health["gpu_target"].startswith("cuda:sm_")
    else:
        assert health["gpu_target"] == "cpu" == server.ready.group("target")
    assert health["capacity"] == 2 and health["active"] == 0
    assert health["runtime"] == {"kcoral": __version__, "jax": jax.__version__,
                                 "jaxlib": __import__("jaxlib").__version__}
    assert health["devices"] and health["devices"][0]["platform"] in ("cpu", "gpu", "cuda")
    ready = await request("GET", server.url + "/readyz")
    assert ready.code == 200 and ready.json["ready"] is True
    # The blocking client reads the same document.
    assert (await deferToThread(lambda: Client(server.url).health()))["status"] == "ok"


# -- programs ---------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_three_programs(server, affine):
    """Programs with dict, tuple and list outputs, integer dtypes and keyword inputs run right."""
    integer, integer_args, integer_expected = programs.integer_program()
    keyword, kw_args, kw_kwargs, kw_expected = programs.keyword_program()
    program, args, expected = affine

    def work():
        with Client(server.url) as client:
            return (client.run(program, *args), client.run(integer, *integer_args),
                    client.run(keyword, *kw_args, **kw_kwargs))

    first, second, third = await deferToThread(work)
    assert isinstance(first, dict) and isinstance(first["stats"], tuple)
    assert_tree_close(first, expected(*args))
    assert isinstance(second, tuple) and len(second) == 3
    assert [a.dtype for a in second] == [np.int16, np.int32, np.bool_]
    assert_tree_close(second, integer_expected(*integer_args))
    assert isinstance(third, list) and third[1]["empty"].shape == (0, 4)
    assert_tree_close(third, kw_expected(*kw_args, **kw_kwargs))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64", "int64", "uint8", "complex64",
                                   "float8_e4m3fn", "float8_e5m2"])
@pytest_twisted.ensureDeferred
async def test_dtypes_through_a_real_server(server, dtype):
    """Inputs and outputs of narrow, wide, complex and float8 dtypes run with exact values."""
    import jax.numpy as jnp

    from kcoral import Program

    x = (np.arange(6) % 4).astype(jnp.dtype(dtype)).reshape(2, 3)
    with jax.enable_x64(True):  # 64-bit types are exported as such only with x64
        program = Program.from_function(lambda v: (v, v.T, v[0] + v[1]), x)
    same, transposed, total = await deferToThread(attempt, server.url, program, x)
    assert same.dtype == x.dtype and transposed.shape == (3, 2)
    np.testing.assert_array_equal(same, x)
    np.testing.assert_array_equal(transposed, x.T)
    np.testing.assert_array_equal(total, (x[0] + x[1]))


NEW_USER_ARGUMENTS = {
    "int64": lambda: np.arange(6),
    "float64": lambda: np.random.default_rng(0).standard_normal((2, 3)),
    "complex128": lambda: np.arange(4) * (1 + 2j),
    "python float": lambda: 3.0,
}


@pytest.mark.parametrize("case", sorted(NEW_USER_ARGUMENTS))
@pytest_twisted.ensureDeferred
async def test_arguments_as_jax_takes_them(server, case):
    """numpy's 64-bit defaults and a Python float run as jax.jit(exported.call) runs them in process."""
    from kcoral import Program

    x = NEW_USER_ARGUMENTS[case]()
    program = Program.from_function(lambda v: v * 2 + 1, x)
    expected = np.asarray(jax.jit(program.exported.call)(x))
    got = await deferToThread(attempt, server.url, program, x)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


@pytest_twisted.ensureDeferred
async def test_jax_arrays_none_and_keywords_through_the_async_client(server):
    """The AsyncClient takes jax.Arrays, None leaves and keyword scalars as Exported.call does."""
    import jax.numpy as jnp

    from kcoral import Program

    def f(x, nothing, *, scale):
        return x * scale

    x = jnp.arange(6, dtype=jnp.float32)
    program = Program.from_function(f, x, None, scale=1.0)
    expected = np.asarray(jax.jit(program.exported.call)(x, None, scale=2.5))
    client = AsyncClient(server.url)
    try:
        got = await client.run(program, x, None, scale=2.5)
    finally:
        await client.close()
    np.testing.assert_array_equal(got, expected)


def wide(i, f, c, u, *, third):
    """64-bit arithmetic that 32 bits would get wrong."""
    return {"i": i * (2**33 + 1), "f": f + 1e-12, "c": c * c, "u": u + np.uint64(2**63),
            "third": third / 3}


@pytest_twisted.ensureDeferred
async def test_64_bit_programs_whatever_the_server_default(server, start_server):
    """A program exported under x64 gives its 64-bit answers on servers started with x64 off or on."""
    from kcoral import Program

    args = (np.arange(3) + 2**40, np.array([1.0, 2.0]), np.array([1 + 2j, 3e-9j]),
            np.arange(2, dtype=np.uint64))
    with jax.enable_x64(True):
        program = Program.from_function(wide, *args, third=1.0)
        expected = jax.device_get(jax.jit(program.exported.call)(*args, third=1.0))
    x64_off = await start_server(name="x64-off-server", env={"JAX_ENABLE_X64": "0"})

    def run(url):
        # A Python float for a 64-bit input: only under x64 is it a float64,
        # as for Exported.call; the arrays are 64-bit numpy ones either way.
        with jax.enable_x64(True):
            return attempt(url, program, *args, third=1.0)

    for url in (server.url, x64_off.url):
        got = await deferToThread(run, url)
        assert isinstance(got, dict), got
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():
            assert got[name].dtype == value.dtype and value.dtype.itemsize >= 8, name
            assert got[name].tobytes() == value.tobytes(), name


def draw(key, scale):
    """A typed key in, a key and random numbers out."""
    key, sub = jax.random.split(key)
    return key, jax.random.normal(sub, (2, 3)) * scale


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest_twisted.ensureDeferred
async def test_typed_prng_keys(server, impl):
    """A typed key in and keys out (split) give jax.jit(exported.call)'s numbers and keys."""
    from kcoral import Program

    key = jax.random.key(42, impl=impl)
    program = Program.from_function(draw, key, 1.0)
    expected_key, expected = jax.jit(program.exported.call)(key, 2.0)
    got_key, got = await deferToThread(attempt, server.url, program, key, 2.0)
    assert got_key.dtype == expected_key.dtype
    np.testing.assert_array_equal(jax.random.key_data(got_key), jax.random.key_data(expected_key))
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, np.asarray(expected))


@pytest_twisted.ensureDeferred
async def test_key_data_that_is_no_key_is_rejected(server):
    """Key data of an unknown key type, or of the wrong shape for its type, is answered 422."""
    from kcoral import Program

    program = Program.from_function(lambda k: jax.random.normal(k, (2,)), jax.random.key(0))
    for key_type, data, message in [("nope", np.zeros(2, np.uint32), "unrecognized PRNG"),
                                    ("threefry2x32", np.zeros(3, np.uint32), "key data")]:
        parts, _ = encode_request(program.digest, program.serialized,
                                  [(data, None, True)], [key_type])
        answer = await post_run(server.url, b"".join(bytes(p) for p in parts))
        assert answer.code == 422, answer.body
        assert message in answer.error()["message"]


@pytest.mark.parametrize("dtype", ["int4", "uint4", "float4_e2m1fn", "bfloat16", "bool",
                                   "float8_e4m3fn", "complex64"])
@pytest_twisted.ensureDeferred
async def test_large_inputs_of_every_kind_run_again_from_the_caches(server, dtype):
    """A large input of any type goes by reference on a second run, from the device cache if it can.

    Content-addressed (64 KiB and up) inputs of narrow and exotic types: the
    sub-byte ones run from host memory, not from the device cache."""
    import jax.numpy as jnp

    from kcoral import Program

    x = (np.arange(256 * 260) % 2).astype(jnp.dtype(dtype)).reshape(256, 260)
    assert x.nbytes >= 64 * 1024
    program = Program.from_function(lambda v: v[::64, ::64], x)

    def twice():
        with Client(server.url) as client:
            first = client.run(program, x)
            sent = client.bytes_sent
            second = client.run(program, x)
            return first, second, client.bytes_sent - sent

    def device_hits(samples):
        return sample(samples, "kcoral_cache_hits_total", cache="device", tier="device")

    before = await metrics(server)
    first, second, sent_second = await deferToThread(twice)
    for result in (first, second):
        assert result.dtype == x.dtype
        np.testing.assert_array_equal(result, x[::64, ::64])
    assert sent_second < 1024
    hits = device_hits(await metrics(server)) - device_hits(before)
    assert hits == (0 if x.dtype in SUB_BYTE else 1), (dtype, hits)


@pytest_twisted.ensureDeferred
async def test_the_same_bytes_as_two_float8_types_stay_two_arrays(server):
    """The same bytes sent as two float8 types come back as two arrays, each of its own type.

    Regression: the device cache keyed arrays by digest and dtype.str,
    which most float8 types share ('<V1'): zeros sent as float8_e4m3fn, then
    as float8_e4m3fnuz, came back from the second run as the first type."""
    import jax.numpy as jnp

    from kcoral import Program

    def run_zeros(name):
        x = np.zeros((256, 256), dtype=jnp.dtype(name))
        program = Program.from_function(lambda v: v[:2, :2], x)
        with Client(server.url) as client:
            return client.run(program, x)

    for name in ("float8_e4m3fn", "float8_e4m3fnuz"):
        result = await deferToThread(run_zeros, name)
        assert result.dtype == np.dtype(jnp.dtype(name)), (name, result.dtype)


@pytest_twisted.ensureDeferred
async def test_a_run_out_of_device_memory_drops_the_device_cache_and_runs_once_more(
        start_server, affine):
    """A run out of device memory empties the device cache and runs once more before failing."""
    server = await start_server(name="oom-server")
    program, (w, x, b), expected = affine

    def work():
        with Client(server.url) as client:
            first = client.run(program, w, x, b)  # leaves w on the device
            try:
                client.run(programs.huge_allocation_program(), np.float32(1), request_id="oom-1")
            except ProgramFailed as e:
                return first, e
            raise AssertionError("a 1 TiB allocation ran")

    first, error = await deferToThread(work)
    assert_tree_close(first, expected(w, x, b))
    assert "RESOURCE_EXHAUSTED" in error.message
    await server.process.wait_for_line(
        r"oom-1 ran out of device memory: dropped 1 cached input\(s\), running once more", 10)
    samples = await metrics(server)
    assert sample(samples, "kcoral_cache_entries", cache="device", tier="device") == 0


@pytest_twisted.ensureDeferred
async def test_a_repeated_call_sends_only_references(server, affine):
    """A repeated call sends the program and large inputs by reference; a new client sends everything."""
    program, (w, x, b), expected = affine
    before = await metrics(server)

    def work():
        with Client(server.url) as client:
            first = client.run(program, w, x, b, request_id="repeat-1")
            sent_first = client.bytes_sent
            second = client.run(program, w, x, b * 2, request_id="repeat-2")
            return first, second, sent_first, client.bytes_sent - sent_first

    first, second, sent_first, sent_second = await deferToThread(work)
    assert_tree_close(first, expected(w, x, b))
    assert_tree_close(second, expected(w, x, b * 2))
    assert sent_first > w.nbytes + len(program.serialized)
    # The program and the 128 KiB weights go by reference: a frame header.
    assert sent_second < 1024 and sent_second < sent_first / 100
    after = await metrics(server)
    assert sample(after, "kcoral_cache_hits_total", cache="upload", tier="memory") >= \
        sample(before, "kcoral_cache_hits_total", cache="upload", tier="memory") + 2
    # The weights stayed on the device: the second run did not copy them.
    assert sample(after, "kcoral_cache_hits_total", cache="device", tier="device") >= \
        sample(before, "kcoral_cache_hits_total", cache="device", tier="device") + 1
    # Another client of the same server first sends everything: it does not
    # know what the server holds.
    sent_by_other = await deferToThread(lambda: _bytes_of_one_run(server.url, program, w, x, b))
    assert sent_by_other == sent_first


def _bytes_of_one_run(url, program, *args):
    with Client(url) as client:
        client.run(program, *args)
        return client.bytes_sent


@pytest_twisted.ensureDeferred
async def test_a_repeated_program_never_recompiles(server):
    """A program run three times is compiled once."""
    from kcoral import Program

    program = Program.from_function(lambda v: jax.numpy.tanh(v) * 3, np.ones(5, np.float32))
    before = await metrics(server)

    def work():
        with Client(server.url) as client:
            return [client.run(program, np.full(5, i, np.float32)) for i in range(3)]

    results = await deferToThread(work)
    for i, result in enumerate(results):
        np.testing.assert_allclose(result, np.tanh(np.full(5, i, np.float32)) * 3, rtol=1e-6)
    after = await metrics(server)
    misses = sample(after, "kcoral_cache_misses_total", cache="compile") - \
        sample(before, "kcoral_cache_misses_total", cache="compile")
    hits = sample(after, "kcoral_cache_hits_total", cache="compile", tier="memory") - \
        sample(before, "kcoral_cache_hits_total", cache="compile", tier="memory")
    assert (misses, hits) == (1, 2)
    assert sample(after, "kcoral_executions_total", outcome="ok") >= 3


@pytest_twisted.ensureDeferred
async def test_symbolic_shapes_compile_once_per_concrete_shape(server):
    """A program with a symbolic dimension compiles once per concrete shape it runs with."""
    from jax import export

    from kcoral import Program

    (n,) = export.symbolic_shape("n")
    program = Program.from_function(lambda v: v.sum(axis=1),
                                    jax.ShapeDtypeStruct((n, 3), np.float32))
    before = await metrics(server)

    def work():
        with Client(server.url) as client:
            return [client.run(program, np.ones((rows, 3), np.float32)) for rows in (2, 7, 2)]

    results = await deferToThread(work)
    assert [r.shape for r in results] == [(2,), (7,), (2,)]
    np.testing.assert_array_equal(results[1], np.full(7, 3.0, np.float32))
    after = await metrics(server)
    assert sample(after, "kcoral_cache_misses_total", cache="compile") - \
        sample(before, "kcoral_cache_misses_total", cache="compile") == 2


@pytest_twisted.ensureDeferred
async def test_async_client(server, affine):
    """The AsyncClient gives the right results, and its second call sends references only."""
    program, (w, x, b), expected = affine
    client = AsyncClient(server.url)
    try:
        first = await client.run(program, w, x, b, request_id="async-1")
        sent_first = client.bytes_sent
        second = await client.run(program, w, x, b)
        sent_second = client.bytes_sent - sent_first
    finally:
        await client.close()
    assert_tree_close(first, expected(w, x, b))
    assert_tree_close(second, expected(w, x, b))
    assert sent_second < sent_first / 100


@pytest_twisted.ensureDeferred
async def test_async_client_errors(server):
    """The AsyncClient raises ProgramFailed, with the request id, for a run that fails; the server goes on."""
    client = AsyncClient(server.url, busy_timeout=0)
    try:
        with pytest.raises(ProgramFailed) as failed:
            await client.run(programs.huge_allocation_program(), np.float32(1), request_id="async-500")
    finally:
        await client.close()
    assert failed.value.request_id == "async-500"
    await assert_healthy(server)


@pytest_twisted.ensureDeferred
async def test_request_id_is_echoed_on_a_successful_run(server, affine):
    """A successful run echoes the client's X-Request-ID, or generates one, with the result content type."""
    program, args, _ = affine
    answer = await post_run(server.url, run_frame(program, args), program_digest=program.digest,
                            request_id="my-run-7")
    assert answer.code == 200
    assert answer.request_id == "my-run-7"
    assert answer.header("Content-Type") == "application/x-kcoral-result"
    generated = await post_run(server.url, run_frame(program, args))
    assert generated.code == 200 and generated.request_id


# -- bad input ------------------------------------------------------------------

def _unknown_dtype_frame(affine):
    return frame({"program": {"digest": "a" * 64},
                  "inputs": [{"dtype": "float128", "shape": [2], "data": [0, 32]}]}, b"\0" * 32)


def _digest_mismatch_frame(affine):
    program = affine[0]
    parts, _ = encode_request(sha256(b"something else"), program.serialized, [])
    return b"".join(bytes(p) for p in parts)


def _wrong_input_digest_frame(affine):
    program, (w, x, b), _ = affine
    inputs = [(wire_array(w), sha256(b"not w"), True), (wire_array(x), None, True),
              (wire_array(b), None, True)]
    parts, _ = encode_request(program.digest, program.serialized, inputs)
    return b"".join(bytes(p) for p in parts)


def _reference_frame(affine):
    parts, _ = encode_request(sha256(b"a program nobody uploaded"), None, [])
    return b"".join(bytes(p) for p in parts)


def _wrong_shape_frame(affine):
    program, (w, x, b), _ = affine
    return run_frame(program, [w[:, :64], x[:64], b])


def _wrong_dtype_frame(affine):
    program, (w, x, b), _ = affine
    return run_frame(program, [w.astype(np.float64), x, b])


def _wrong_count_frame(affine):
    program, (w, x, b), _ = affine
    return run_frame(program, [w, x])


def _not_a_program_frame(affine):
    data = b"definitely not a jax.export flatbuffer"
    parts, _ = encode_request(sha256(data), data, [])
    return b"".join(bytes(p) for p in parts)


RAW_CASES = {
    "framing": (lambda affine: b"POST me a frame", 400, "bad_request", "magic"),
    "unknown dtype": (_unknown_dtype_frame, 400, "bad_request", "float128"),
    "program digest mismatch": (_digest_mismatch_frame, 400, "bad_request", "does not match its digest"),
    "input digest mismatch": (_wrong_input_digest_frame, 400, "bad_request", "does not match its digest"),
    "unknown reference": (_reference_frame, 409, "missing_content", "does not hold"),
    "wrong shapes": (_wrong_shape_frame, 422, "program_rejected", "shape"),
    "wrong dtype": (_wrong_dtype_frame, 422, "program_rejected", "dtype"),
    "wrong input count": (_wrong_count_frame, 422, "program_rejected", "inputs"),
    "not a program": (_not_a_program_frame, 422, "program_rejected", "not a jax.export program"),
}


@pytest.mark.parametrize("case", sorted(RAW_CASES))
@pytest_twisted.ensureDeferred
async def test_bad_requests(server, affine, case):
    """Each bad frame is answered with its status, error type, message and request id, and logged."""
    make, status, type_, message = RAW_CASES[case]
    rid = "bad-" + case.replace(" ", "-")
    mark = server.process.mark()
    answer = await post_run(server.url, make(affine), request_id=rid)
    assert answer.code == status, answer.body
    info = answer.error()
    assert info["type"] == type_
    assert info["request_id"] == rid
    assert message in info["message"]
    if status == 409:
        assert info["missing"] == [sha256(b"a program nobody uploaded")]
    # Every log line about the request names it.
    await server.process.wait_for_line(rf"{rid} answered {status} {type_}", 30, since=mark)
    await assert_healthy(server)


CLIENT_CASES = {
    "platform mismatch": (lambda: programs.other_platform_program(TEST_GPUS), (np.float32(1),),
                          ProgramRejected, "exported for"),
    "compile failure": (programs.uncompilable_program, (np.ones(4, np.float32),), ProgramRejected,
                        "failed to compile"),
    "runtime failure": (programs.huge_allocation_program, (np.float32(1),), ProgramFailed,
                        "failed while running"),
}


@pytest.mark.parametrize("case", sorted(CLIENT_CASES))
@pytest_twisted.ensureDeferred
async def test_rejected_and_failed_programs(server, case):
    """A program for another platform, or failing to compile or run, raises its error; the server goes on."""
    make, args, error_type, message = CLIENT_CASES[case]
    rid = "client-" + case.replace(" ", "-")
    mark = server.process.mark()
    error = await deferToThread(attempt, server.url, make(), *args, request_id=rid)
    assert type(error) is error_type, error
    assert message in error.message
    assert error.request_id == rid
    await server.process.wait_for_line(rf"{rid} answered {error_type.status}", 30, since=mark)
    await assert_healthy(server)
    # The server still runs programs afterwards.
    from kcoral import Program

    ok = Program.from_function(lambda v: v + 1, np.float32(1))
    assert await deferToThread(attempt, server.url, ok, np.float32(41)) == 42


def test_client_checks_inputs_before_sending(server, affine):
    """The client refuses inputs of a wrong shape or dtype before sending a byte."""
    program, (w, x, b), _ = affine
    with Client(server.url) as client:
        with pytest.raises(ValueError, match="shape"):
            client.run(program, w.T, x, b)
        with pytest.raises(ValueError, match="dtype"):
            client.run(program, w, x.astype(np.int32), b)
        assert client.bytes_sent == 0


@pytest_twisted.ensureDeferred
async def test_413_from_content_length_before_the_body(server):
    """A Content-Length over the limit is answered 413 from the head alone, with the request id."""
    head = (b"POST /v1/run HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/x-kcoral-run\r\n"
            b"X-Request-ID: too-big-1\r\n"
            b"Content-Length: 100000000000\r\n\r\n")
    mark = server.process.mark()
    # Only the head is sent: the answer cannot depend on reading the body.
    raw = await deferToThread(raw_exchange, server.port, head, timeout=30)
    status, headers, body = parse_raw(raw)
    assert status == 413
    assert headers["x-request-id"] == "too-big-1"
    info = json.loads(body)["error"]
    assert info["type"] == "payload_too_large" and info["request_id"] == "too-big-1"
    assert "100000000000" in info["message"]
    await server.process.wait_for_line(r"too-big-1 refused", 30, since=mark)
    await assert_healthy(server)


@pytest_twisted.ensureDeferred
async def test_unknown_routes_and_methods(server):
    """An unknown route is a 404 with the request id; a wrong method is a 405 method_not_allowed."""
    answer = await request("GET", server.url + "/v1/nothing", headers={"X-Request-ID": "nf-1"})
    assert answer.code == 404 and answer.error()["request_id"] == "nf-1"
    answer = await request("GET", server.url + "/v1/run")
    assert answer.code == 405 and answer.error()["type"] == "method_not_allowed"


@pytest_twisted.ensureDeferred
async def test_http_metrics(server):
    """/metrics counts requests by route and code, their durations, cache sizes and active runs."""
    await request("GET", server.url + "/health")
    await post_run(server.url, b"junk")
    samples = await metrics(server)
    assert sample(samples, "kcoral_http_requests_total", route="/health", code="200") >= 1
    assert sample(samples, "kcoral_http_requests_total", route="/v1/run", code="400") >= 1
    assert sample(samples, "kcoral_http_request_duration_seconds_count", route="/v1/run") >= 1
    for name in ("kcoral_cache_bytes", "kcoral_cache_entries"):
        assert any(key[0] == name for key in samples)
    assert sample(samples, "kcoral_active_runs") == 0
