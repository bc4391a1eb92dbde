"""
The wire format (kcoral.protocol.wire, kcoral.protocol.dtypes): round trips
for every dtype and shape, and malformed frames that must raise WireError and
nothing else.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcoral.protocol import wire
from kcoral.protocol.dtypes import DTYPES, UnknownDType, dtype_from_name, name_of
from kcoral.protocol.wire import (
    ALIGN,
    MAGIC,
    PREFIX,
    WireError,
    decode_outputs,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
    sha256,
    wire_array,
)
from tests.programs import references

DTYPE_NAMES = sorted(DTYPES)
# Types numpy itself can byte-swap (ml-dtypes types are single-byte or
# have no big-endian variant worth sending).
SWAPPABLE = [n for n in DTYPE_NAMES if DTYPES[n].itemsize > 1 and DTYPES[n].kind in "iufc"]


def join(parts_and_length) -> bytes:
    parts, length = parts_and_length
    body = b"".join(bytes(p) for p in parts)
    assert len(body) == length
    return body


def frame(header, payload: bytes = b"") -> bytes:
    """A frame with any JSON header, as a foreign client could send it."""
    text = json.dumps(header).encode()
    head = PREFIX.pack(MAGIC, len(text)) + text
    return head + b"\0" * (-len(head) % ALIGN) + payload


def sample(dtype_name: str, shape=(3, 5), seed=0) -> np.ndarray:
    """An array of valid values of any wire dtype."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape))
    if dtype.kind == "b":
        return (rng.random(count) > 0.5).reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True).reshape(shape)
    if dtype.kind == "c":
        return (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dtype).reshape(shape)
    if dtype_name in ("int2", "int4", "uint2", "uint4"):
        info = ml_dtypes.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max) + 1, count).astype(dtype).reshape(shape)
    # Floats, the ml-dtypes ones included: small values every format holds.
    return (rng.integers(1, 4, count) * 0.5).astype(dtype).reshape(shape)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bits (NaN-safe)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.asarray(a).tobytes() == np.asarray(b).tobytes())


def result_round_trip(arrays):
    return decode_result(join(encode_result(arrays)))


def request_round_trip(arrays, digests=None, inline=None):
    digests = digests or [None] * len(arrays)
    inline = inline or [True] * len(arrays)
    program = b"serialized program"
    inputs = [(wire_array(a), d, i) for a, d, i in zip(arrays, digests, inline)]
    run = decode_request(join(encode_request(sha256(program), program, inputs)))
    assert run.program.digest == sha256(program)
    assert bytes(run.program.data) == program
    return run


# -- dtypes ---------------------------------------------------------------

def test_every_jax_dtype_is_on_the_wire():
    """Every dtype JAX uses has a wire name, and name_of gives JAX's own name for it."""
    import jax.numpy as jnp

    expected = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
                "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                "float8_e4m3b11fnuz"}
    assert expected <= set(DTYPES)
    for name in expected:
        assert name_of(jnp.dtype(name)) == name


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_dtype_names_round_trip(name):
    """Each wire dtype name maps to a dtype whose wire name is that name again."""
    assert name_of(dtype_from_name(name)) == name


@pytest.mark.parametrize("bad", ["float128", "object", "", "FLOAT32", "<f4", None, 3, ["float32"],
                                 "x" * 1000])
def test_unknown_dtype_names(bad):
    """A name that is not a wire dtype (other case, numpy codes, non-strings) raises UnknownDType."""
    with pytest.raises(UnknownDType):
        dtype_from_name(bad)


@pytest.mark.parametrize("dtype", [np.dtype(object), np.dtype("U3"), np.dtype([("a", "i4")]),
                                   np.dtype("datetime64[s]")])
def test_unsendable_dtypes(dtype):
    """Object, string, structured and datetime dtypes have no wire name: UnknownDType."""
    with pytest.raises(UnknownDType):
        name_of(dtype)


# -- round trips -------------------------------------------------------------

@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(3, 5), (), (0,), (2, 0, 3), (7,)], ids=str)
def test_result_round_trip(name, shape):
    """An output of any wire dtype and shape, empty and zero-dimensional included, decodes bit for bit."""
    array = sample(name, shape)
    [back] = result_round_trip([array])
    assert same(back, array)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_request_round_trip(name):
    """Inline inputs of a request frame decode with their dtype, shape and bits, and no digest."""
    arrays = [sample(name, (4, 3), seed=1), sample(name, (), seed=2), sample(name, (0, 2))]
    run = request_round_trip(arrays)
    assert len(run.inputs) == 3
    for spec, array in zip(run.inputs, arrays):
        assert spec.dtype == array.dtype
        assert spec.shape == array.shape
        assert spec.blob.digest is None
        assert same(spec.view(spec.blob.data), array)


def test_zero_dimensional_arrays_stay_zero_dimensional():
    """A zero-dimensional array is sent and decoded with shape (), not as a vector."""
    scalar = np.array(7, dtype=np.int64)
    assert wire_array(scalar).shape == ()
    [back] = result_round_trip([scalar])
    assert back.shape == () and back == 7


@pytest.mark.parametrize("make", [
    lambda a: a[:, ::2],
    lambda a: a.T,
    lambda a: np.asfortranarray(a),
    lambda a: a[::-1],
    lambda a: a[1:3, 1:4],
], ids=["strided", "transposed", "fortran", "reversed", "sliced"])
def test_non_contiguous_inputs(make):
    """Strided, transposed, Fortran-ordered, reversed and sliced arrays arrive with their values."""
    base = np.arange(48, dtype=np.float32).reshape(6, 8)
    view = make(base)
    [back] = result_round_trip([view])
    np.testing.assert_array_equal(back, view)
    run = request_round_trip([view])
    np.testing.assert_array_equal(run.inputs[0].view(run.inputs[0].blob.data), view)


@pytest.mark.parametrize("name", SWAPPABLE)
def test_big_endian_inputs_arrive_little_endian(name):
    """A big-endian array has its type's wire name and decodes as the native type, same values."""
    little = sample(name, (2, 3))
    big = little.astype(little.dtype.newbyteorder(">"))
    assert name_of(big.dtype) == name
    [back] = result_round_trip([big])
    assert back.dtype == DTYPES[name] and back.dtype.byteorder in "<=|"
    np.testing.assert_array_equal(back, little)


def test_buffers_are_aligned_and_decoded_without_copies():
    """Decoded outputs are views into the body, each starting on an ALIGN-byte boundary."""
    arrays = [np.arange(n, dtype=np.float64) for n in (1, 3, 17, 100)]
    body = join(encode_result(arrays))
    back = decode_result(body)
    header, payload = wire.read_frame(body)
    for entry in header["outputs"]:
        assert entry["data"][0] % ALIGN == 0
    base = np.frombuffer(body, dtype=np.uint8)
    for array in back:
        # A view into the body itself: no copy was made.
        assert np.shares_memory(array, base)
        assert (array.ctypes.data - base.ctypes.data) % ALIGN == 0


def test_references_and_inline_content():
    """An input by reference carries only its digest and is listed; inline ones carry their bytes."""
    big = np.ones(wire.CACHE_THRESHOLD_BYTES // 4, np.float32)
    small = np.arange(3, dtype=np.int8)
    digest = sha256(wire_array(big))
    inputs = [(wire_array(big), digest, False), (wire_array(small), None, True),
              (wire_array(big), digest, True)]
    body = join(encode_request("a" * 64, None, inputs))
    run = decode_request(body)
    assert references(run) == ["a" * 64, digest]
    assert run.inputs[0].blob.data is None and run.inputs[0].blob.digest == digest
    assert run.inputs[1].blob.digest is None
    assert bytes(run.inputs[2].blob.data) == big.tobytes()
    # A reference costs a few bytes; inline content costs its size.
    assert len(body) < 2 * big.nbytes
    assert len(join(encode_request("a" * 64, None, inputs[:2]))) < 1024


# -- property tests ---------------------------------------------------------------

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@st.composite
def wire_arrays(draw):
    """Any wire dtype and shape, from raw bytes; sometimes non-contiguous or
    big-endian."""
    name = draw(st.sampled_from(DTYPE_NAMES))
    dtype = DTYPES[name]
    shape = draw(shapes)
    count = int(np.prod(shape, dtype=np.int64))
    if dtype.kind == "b":
        array = np.array(draw(st.lists(st.booleans(), min_size=count, max_size=count)),
                         dtype=bool).reshape(shape)
    else:
        raw = draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))
        array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    layout = draw(st.sampled_from(["c", "transposed", "strided", "big-endian"]))
    if layout == "transposed":
        array = array.T
    elif layout == "strided" and array.ndim and array.shape[0] > 1:
        array = array[::2]
    elif layout == "big-endian" and name in SWAPPABLE:
        array = array.astype(array.dtype.newbyteorder(">"))
    return array


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(wire_arrays(), max_size=6))
def test_result_round_trip_property(arrays):
    """Any list of arrays, of any dtype, shape and layout, survives a result frame bit for bit."""
    back = result_round_trip(arrays)
    assert len(back) == len(arrays)
    for got, sent in zip(back, arrays):
        assert got.shape == sent.shape
        assert same(got, wire_array(sent))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(wire_arrays(), st.booleans()), max_size=6))
def test_request_round_trip_property(inputs):
    """Any mix of inline and by-reference inputs decodes with its shapes, dtypes, digests and bytes."""
    arrays = [wire_array(a) for a, _ in inputs]
    digests = [sha256(a) if by_reference else None for a, (_, by_reference) in zip(arrays, inputs)]
    run = request_round_trip(arrays, digests, [not by_ref for _, by_ref in inputs])
    for spec, array, digest in zip(run.inputs, arrays, digests):
        assert spec.shape == array.shape and spec.dtype == array.dtype
        assert spec.blob.digest == digest
        if digest is None:
            assert same(spec.view(spec.blob.data), array)
        else:
            assert spec.blob.data is None
    assert references(run) == [d for d in digests if d is not None]


# -- malformed frames -----------------------------------------------------------

def decodes_or_wire_error(body) -> list[str]:
    """How each decoder took C{body}: "decoded" or "refused" (WireError).
    Any other exception fails the test."""
    outcomes = []
    for decode in (decode_request, decode_result):
        try:
            decode(body)
        except WireError:
            outcomes.append("refused")
        else:
            outcomes.append("decoded")
    return outcomes


GOOD_REQUEST = join(encode_request(sha256(b"p"), b"p", [
    (wire_array(np.arange(6, dtype=np.float32).reshape(2, 3)), None, True),
    (wire_array(np.ones(3, np.int8)), "b" * 64, False)]))


@pytest.mark.parametrize("body, message", [
    (b"", "shorter than"),
    (b"KCR", "shorter than"),
    (b"GET / HTTP/1.1\r\n\r\n", "magic"),
    (PREFIX.pack(MAGIC, 1 << 30), "exceeds"),
    (PREFIX.pack(MAGIC, 100) + b"{}", "ends inside"),
    (PREFIX.pack(MAGIC, 5) + b"{nope", "not valid JSON"),
    (PREFIX.pack(MAGIC, 6) + b"[1, 2]", "JSON object"),
    (PREFIX.pack(MAGIC, 2) + b"\xff\xfe", "not valid JSON"),
    (frame({"program": {"digest": "a" * 64}, "inputs": [], "extra": 1}), "unknown header field"),
    (frame({"inputs": []}), "'program'"),
    (frame({"program": "a" * 64, "inputs": []}), "'program'"),
    (frame({"program": {"digest": "A" * 64}, "inputs": []}), "digest"),
    (frame({"program": {"digest": "a" * 63}, "inputs": []}), "digest"),
    (frame({"program": {"data": [0, 0]}, "inputs": []}), "needs a 'digest'"),
    (frame({"program": {"digest": "a" * 64}}), "'inputs'"),
    (frame({"program": {"digest": "a" * 64}, "inputs": {}}), "'inputs'"),
    (frame({"program": {"digest": "a" * 64}, "inputs": [{}] * 5000}), "'inputs'"),
    (frame({"program": {"digest": "a" * 64}, "inputs": [3]}), "JSON object"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float128", "shape": [], "digest": "b" * 64}]}), "unknown dtype"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": [1], "digest": "b" * 64, "x": 1}]}), "unknown field"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "uint32", "shape": [2], "digest": "b" * 64, "key_type": ""}]}),
     "key_type"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "uint32", "shape": [2], "digest": "b" * 64, "key_type": 3}]}),
     "key_type"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "uint32", "shape": [2], "digest": "b" * 64,
                        "key_type": "threefry/2x32"}]}), "key_type"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": [-1], "digest": "b" * 64}]}), "dimension"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": [1.0], "digest": "b" * 64}]}), "dimension"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": [True], "digest": "b" * 64}]}), "dimension"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": [1] * 65, "digest": "b" * 64}]}), "shape"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": "3", "digest": "b" * 64}]}), "shape"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": [2]}]}), "needs 'data', 'digest' or both"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": [2], "data": [0, 8]}]}), "outside the body"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": [2], "data": [0, 4]}]}, b"\0" * 64), "needs 8 bytes"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": [2], "data": [0]}]}), "[offset, length]"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": [2], "data": [-8, 8]}]}), "[offset, length]"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": [0, 2 ** 62], "data": [0, 0]}]}), "too large"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "float32", "shape": [2 ** 62, 2 ** 62], "digest": "b" * 64}]}), "too large"),
    (frame({"program": {"digest": "a" * 64},
            "inputs": [{"dtype": "complex128", "shape": [2 ** 62], "digest": "b" * 64}]}), "too large"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_malformed_requests(body, message):
    """Each malformed request frame raises WireError with a message naming what is wrong."""
    with pytest.raises(WireError, match=".*" + __import__("re").escape(message)):
        decode_request(body)


def test_deeply_nested_json_header():
    """A JSON header nested 100,000 levels deep raises WireError, not RecursionError."""
    text = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(WireError):
        decode_request(PREFIX.pack(MAGIC, len(text)) + text)


def test_key_types_travel_with_inputs_and_outputs():
    """An input's or output's key type comes out of the frame as it went in; other arrays have none."""
    data, plain = np.zeros((3, 2), np.uint32), np.ones(2, np.float32)
    inputs = [(wire_array(data), None, True), (wire_array(plain), None, True)]
    run = decode_request(join(encode_request(sha256(b"p"), b"p", inputs, ["threefry2x32", None])))
    assert [spec.key_type for spec in run.inputs] == ["threefry2x32", None]
    assert run.inputs[0].view(run.inputs[0].blob.data).shape == (3, 2)
    arrays, key_types = decode_outputs(join(encode_result([plain, data], [None, "rbg"])))
    assert key_types == [None, "rbg"]
    assert same(arrays[1], data)
    assert decode_outputs(join(encode_result([plain])))[1] == [None]


def test_result_frames_need_outputs_with_data():
    """A result frame without 'outputs', or with an output that has no data, raises WireError."""
    with pytest.raises(WireError, match="outputs"):
        decode_result(frame({"inputs": []}))
    with pytest.raises(WireError, match="no data"):
        decode_result(frame({"outputs": [{"dtype": "int8", "shape": [1], "digest": "b" * 64}]}))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_raise_anything_but_wire_error(body):
    """Any bytes decode or raise WireError; without the magic, both decoders refuse them."""
    if not body.startswith(MAGIC):
        assert decodes_or_wire_error(body) == ["refused", "refused"]
    assert set(decodes_or_wire_error(MAGIC + body)) <= {"decoded", "refused"}


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_mutated_frames_never_raise_anything_but_wire_error(data):
    """A frame with bytes changed or cut decodes or raises WireError; cut in the prefix, it is refused."""
    body = bytearray(GOOD_REQUEST)
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, len(body) - 1))
        body[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    assert set(decodes_or_wire_error(bytes(body))) <= {"decoded", "refused"}
    # Cut inside the 8-byte prefix, nothing decodes.
    outcome = decodes_or_wire_error(bytes(body[:cut]))
    if cut < PREFIX.size:
        assert outcome == ["refused", "refused"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=8)
    | st.sampled_from(["a" * 64, "float32", "bfloat16", "int4"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
shape_values = (st.lists(st.integers(-1, 2 ** 63) | st.sampled_from([0, 1, 2, 2 ** 62]), max_size=4)
                | json_values)
entries = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(DTYPE_NAMES) | json_values,
    "shape": shape_values,
    "data": st.lists(st.integers(-1, 300), min_size=2, max_size=2) | json_values,
    "digest": st.sampled_from(["b" * 64]) | json_values,
})


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.fixed_dictionaries({}, optional={"digest": st.sampled_from(["a" * 64]) | json_values,
                                                   "data": entries.map(lambda e: e.get("data", [0, 0]))}),
       inputs=st.lists(entries, max_size=4) | json_values,
       payload=st.binary(max_size=300))
def test_hostile_headers_never_raise_anything_but_wire_error(program, inputs, payload):
    """Headers of arbitrary JSON decode or raise WireError; a request is never a result, nor the reverse."""
    body = frame({"program": program, "inputs": inputs}, payload)
    request_outcome, result_outcome = decodes_or_wire_error(body)
    assert result_outcome == "refused"  # no 'outputs' in a request frame
    if "digest" not in program:
        assert request_outcome == "refused"
    request_outcome, _ = decodes_or_wire_error(frame({"outputs": inputs}, payload))
    assert request_outcome == "refused"  # no 'program' in a result frame
