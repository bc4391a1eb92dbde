"""
L{kcoral.Program}: exporting, serializing, digests, input checks and pytrees,
with real C{jax.export}.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402

from kcoral import Program, ProgramExportError  # noqa: E402
from kcoral.client.exchange import RunCall  # noqa: E402
from kcoral.protocol.wire import decode_request, decode_result, encode_result  # noqa: E402


def add(x, y):
    return x + y


def test_from_function_defaults_to_cpu_and_cuda():
    """A program exported from a function targets cpu and cuda; its digest is the SHA-256 of its bytes."""
    program = Program.from_function(add, np.float32(1), np.float32(2))
    assert program.platforms == ("cpu", "cuda")
    assert program.digest == hashlib.sha256(program.serialized).hexdigest()


def test_from_function_with_other_platforms():
    """The platforms given to from_function are those the program is exported for."""
    program = Program.from_function(add, np.float32(1), np.float32(2), platforms=("cpu",))
    assert program.platforms == ("cpu",)


def test_shape_dtype_structs_as_examples():
    """A ShapeDtypeStruct serves as an example input and gives the program its shape."""
    spec = jax.ShapeDtypeStruct((3, 4), jnp.float32)
    program = Program.from_function(lambda a: a.sum(axis=0), spec)
    assert program.exported.in_avals[0].shape == (3, 4)


def test_from_exported_and_from_bytes_agree():
    """A program from an Exported equals one from its serialized bytes (any bytes-like), digest and all."""
    exported = export.export(jax.jit(add), platforms=("cpu",))(np.int32(1), np.int32(2))
    first = Program.from_exported(exported)
    second = Program.from_bytes(first.serialized)
    assert first == second
    assert second.digest == first.digest
    assert second.exported.in_avals == exported.in_avals
    # Any bytes-like object works.
    assert Program.from_bytes(bytearray(first.serialized)).digest == first.digest


def test_digest_depends_on_the_program():
    """Another function or other input shapes give another digest; the same export gives the same one."""
    a = Program.from_function(add, np.float32(1), np.float32(2))
    b = Program.from_function(lambda x, y: x * y, np.float32(1), np.float32(2))
    c = Program.from_function(add, np.zeros(3, np.float32), np.zeros(3, np.float32))
    assert len({a.digest, b.digest, c.digest}) == 3
    assert a.digest == Program.from_function(add, np.float32(1), np.float32(2)).digest


def test_from_bytes_refuses_garbage():
    """Bytes that are not a serialized jax.export program raise ProgramExportError."""
    with pytest.raises(ProgramExportError, match="not a serialized jax.export program"):
        Program.from_bytes(b"\x00garbage")


def noisy(x):
    jax.debug.print("x = {}", x)
    return x * 2


def hidden_callback(x):
    scalar = jax.ShapeDtypeStruct((), np.float32)
    return jax.lax.cond(x > 0, lambda v: jax.pure_callback(np.negative, scalar, v), lambda v: v, x)


@pytest.mark.parametrize("function", [noisy, hidden_callback])
@pytest.mark.parametrize("platforms", [("cpu", "cuda"), ("cpu",), ("cuda",)])
def test_host_callbacks_fail_locally_with_a_clear_message(function, platforms):
    """A function with a host callback, even in a branch, fails to export with a message about callbacks."""
    with pytest.raises(ProgramExportError) as info:
        Program.from_function(function, np.float32(1), platforms=platforms)
    assert "callback" in str(info.value).lower()


def test_untraceable_functions_fail_locally():
    """A function that branches on a traced value fails to export, naming the function."""
    def branchy(x):
        if x > 0:  # a Python branch on a traced value
            return x
        return -x

    with pytest.raises(ProgramExportError, match="branchy"):
        Program.from_function(branchy, np.float32(1))


# -- input checks --------------------------------------------------------------

@pytest.fixture(scope="module")
def matmul():
    return Program.from_function(lambda w, x: w @ x, np.zeros((4, 3), np.float32),
                                 np.zeros(3, np.float32))


def test_inputs_are_checked_before_sending(matmul):
    """Inputs of a wrong dtype, shape or pytree structure raise ValueError when flattened."""
    w, x = np.ones((4, 3), np.float32), np.ones(3, np.float32)
    assert len(matmul.flatten_inputs((w, x), {}).arrays) == 2
    with pytest.raises(ValueError, match="dtype"):
        matmul.flatten_inputs((w.astype(np.int32), x), {})
    with pytest.raises(ValueError, match="shape"):
        matmul.flatten_inputs((np.ones((3, 4), np.float32), x), {})
    with pytest.raises(ValueError, match="shape"):
        matmul.flatten_inputs((w, np.ones((3, 1), np.float32)), {})
    with pytest.raises(ValueError, match="structure"):
        matmul.flatten_inputs((w,), {})
    with pytest.raises(ValueError, match="structure"):
        matmul.flatten_inputs((w, x), {"extra": x})


def test_symbolic_dimensions_accept_any_size():
    """A symbolic dimension accepts any size; the fixed dimensions are still checked."""
    (n,) = export.symbolic_shape("n")
    program = Program.from_function(lambda v: v * 2, jax.ShapeDtypeStruct((n, 2), jnp.float32))
    for rows in (1, 5):
        assert program.flatten_inputs((np.zeros((rows, 2), np.float32),), {}).arrays[0].shape == \
            (rows, 2)
    with pytest.raises(ValueError, match="shape"):
        program.flatten_inputs((np.zeros((5, 3), np.float32),), {})


def test_dimension_variables_are_checked_before_sending():
    """Sizes no dimension variable can take (below 1, two for one variable) are a ValueError.

    Regression: only fixed dimensions were checked, and the server refused
    these with a 422 after the whole request had been sent."""
    (n,) = export.symbolic_shape("n")
    vector = jax.ShapeDtypeStruct((n,), jnp.float32)
    program = Program.from_function(lambda x, y: x + y, vector, vector)
    with pytest.raises(ValueError, match="Expected value >= 1 for dimension variable 'n'"):
        program.flatten_inputs((np.zeros(0, np.float32), np.zeros(0, np.float32)), {})
    with pytest.raises(ValueError, match="inconsistency"):
        program.flatten_inputs((np.zeros(2, np.float32), np.zeros(3, np.float32)), {})
    assert len(program.flatten_inputs((np.zeros(3, np.float32), np.zeros(3, np.float32)), {}).arrays) == 2
    with jax.enable_x64(True):
        wide = Program.from_function(lambda x: x * 2, jax.ShapeDtypeStruct((n,), jnp.float64))
    # A 64-bit array of a 64-bit program, from a process without x64.
    assert wide.flatten_inputs((np.zeros(4),), {}).arrays[0].dtype == np.float64


# -- arguments as Exported.call takes them ------------------------------------

def jax_accepts(program, *args, **kwargs) -> bool:
    """Whether the program's own Exported.call, in this process, takes these arguments."""
    try:
        jax.jit(program.exported.call)(*args, **kwargs)
    except (ValueError, TypeError, OverflowError):
        return False
    return True


@pytest.mark.parametrize("example, expected", [
    (np.arange(6), np.int32),
    (np.linspace(0, 1, 6), np.float32),
    (np.arange(6) * (1 + 2j), np.complex64),
    (np.arange(6, dtype=np.uint64), np.uint32),
    (np.float64(2.5), np.float32),
    (np.int64(7), np.int32),
    (2.5, np.float32),
    (7, np.int32),
    (2 - 1j, np.complex64),
    (True, np.bool_),
], ids=["int64", "float64", "complex128", "uint64", "np.float64", "np.int64", "float", "int",
        "complex", "bool"])
def test_arguments_are_canonicalized_as_jax_does_without_x64(example, expected):
    """Without x64, 64-bit arrays and Python scalars become the 32-bit host arrays JAX makes of them."""
    program = Program.from_function(lambda v: v * 2, example)
    (array,) = program.flatten_inputs((example,), {}).arrays
    assert isinstance(array, np.ndarray) and array.dtype == expected
    assert array.dtype == program.exported.in_avals[0].dtype
    np.testing.assert_array_equal(array, np.asarray(jnp.asarray(example)))
    assert jax_accepts(program, example)


@pytest.mark.parametrize("example, expected", [
    (np.arange(6), np.int64), (np.linspace(0, 1, 6), np.float64),
    (np.arange(6) * 1j, np.complex128), (2.5, np.float64), (7, np.int64),
], ids=["int64", "float64", "complex128", "float", "int"])
def test_nothing_is_narrowed_with_x64(example, expected):
    """With x64, 64-bit arrays and Python scalars keep their 64-bit types; an array is not copied."""
    with jax.enable_x64(True):
        program = Program.from_function(lambda v: v * 2, example)
        (array,) = program.flatten_inputs((example,), {}).arrays
    assert array.dtype == expected
    if isinstance(example, np.ndarray):
        assert array is example


def test_a_64_bit_array_runs_a_64_bit_program_without_x64():
    """An array of the program's own 64-bit type is sent as it is, even without x64."""
    x = np.array([2**40 + 1, -3])
    with jax.enable_x64(True):
        program = Program.from_function(lambda v: v * 2, x)
    (array,) = program.flatten_inputs((x,), {}).arrays
    assert array is x


def test_64_bit_values_wrap_as_jax_wraps_them():
    """An int64 array that does not fit int32 wraps around as JAX's own transfer wraps it, not refused."""
    x = np.array([2**40 + 5, -(2**33) - 1, 7])
    program = Program.from_function(lambda v: v, x)
    (array,) = program.flatten_inputs((x,), {}).arrays
    np.testing.assert_array_equal(array, np.asarray(jnp.asarray(x)))
    assert jax_accepts(program, x)


@pytest.mark.parametrize("example, argument, message", [
    (np.int32(1), 2**40, "too large"),
    (np.int32(1), 2.5, "dtype float32"),
    (np.float32(1), 3, "dtype int32"),
    (np.float32(1), True, "dtype bool"),
    (np.int32(1), np.uint32(3), "dtype uint32"),
    (np.float32(1), "text", "not a valid JAX type"),
], ids=["int overflow", "float for int", "int for float", "bool for float", "uint for int",
        "string"])
def test_what_jax_refuses_is_refused(example, argument, message):
    """An argument Exported.call refuses (an int that does not fit, another kind of type) is a ValueError."""
    program = Program.from_function(lambda v: v, example)
    assert not jax_accepts(program, argument)
    with pytest.raises(ValueError, match=message):
        program.flatten_inputs((argument,), {})


def test_a_64_bit_program_without_x64_says_how_to_call_it():
    """A 32-bit argument for a 64-bit program, without x64, is refused with a word about x64."""
    with jax.enable_x64(True):
        program = Program.from_function(lambda v: v, 2.5)
    with pytest.raises(ValueError, match="expects float64 .*jax_enable_x64 off"):
        program.flatten_inputs((2.5,), {})


def test_a_cpu_jax_array_is_not_copied():
    """A jax.Array on the CPU is sent from its own buffer, and one of another dtype is converted."""
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    program = Program.from_function(lambda v: v.sum(), x)
    (array,) = program.flatten_inputs((x,), {}).arrays
    assert np.shares_memory(array, np.asarray(x))
    with pytest.raises(ValueError, match="dtype int32"):
        program.flatten_inputs((x.astype(jnp.int32),), {})


def test_none_leaves_and_keyword_arguments():
    """None leaves and keyword arguments are taken where the program's in_tree has them, refused elsewhere."""
    def f(x, nothing, *, scale, extra=None):
        return x * scale

    x, scale = np.ones(3, np.float32), np.float32(2)
    program = Program.from_function(f, x, None, scale=scale, extra=None)
    arrays = program.flatten_inputs((x, None), {"scale": 2.0, "extra": None}).arrays
    assert [a.dtype for a in arrays] == [np.float32, np.float32]
    assert jax_accepts(program, x, None, scale=2.0, extra=None)
    for args, kwargs in [((x, x), {"scale": scale, "extra": None}),
                         ((x, None), {"scale": scale}),
                         ((x, None, None), {"scale": scale, "extra": None})]:
        assert not jax_accepts(program, *args, **kwargs)
        with pytest.raises(ValueError, match="structure"):
            program.flatten_inputs(args, kwargs)


@pytest.mark.parametrize("impl, count", [("threefry2x32", None), ("rbg", 3)])
def test_typed_keys_travel_as_key_data_with_their_key_type(impl, count):
    """Typed PRNG keys are sent as their key data, named by their implementation; other inputs have none."""
    keys = jax.random.key(7, impl=impl)
    if count:
        keys = jax.random.split(keys, count)
    program = Program.from_function(lambda k, n: jax.random.key_data(k) * n, keys, 1)
    inputs = program.flatten_inputs((keys, 2), {})
    assert inputs.key_types == [impl, None]
    np.testing.assert_array_equal(inputs.arrays[0], jax.random.key_data(keys))
    call = RunCall.prepare(program, (keys, 2), {})
    run = decode_request(b"".join(bytes(p) for p in call.send(set(), None).parts))
    assert [spec.key_type for spec in run.inputs] == [impl, None]


def test_keys_are_checked_like_other_inputs():
    """Keys of another implementation or shape, or raw key data, are refused as Exported.call refuses them."""
    key = jax.random.key(0)
    program = Program.from_function(lambda k: jax.random.normal(k, (2,)), key)
    for wrong, message in [(jax.random.key(0, impl="rbg"), "dtype key<rbg>"),
                           (jax.random.split(key), "shape"),
                           (jax.random.key_data(key), "dtype uint32")]:
        assert not jax_accepts(program, wrong)
        with pytest.raises(ValueError, match=message):
            program.flatten_inputs((wrong,), {})


def test_key_outputs_are_keys_again():
    """Outputs that arrive with a key type are typed keys of that implementation in the result."""
    key = jax.random.key(3)
    program = Program.from_function(lambda k: (jax.random.split(k), jnp.float32(1)), key)
    data = np.asarray(jax.random.key_data(jax.random.split(key)))
    keys, one = program.unflatten_outputs([data, np.float32(1)], ["threefry2x32", None])
    assert jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(keys), data)
    assert one == 1


# -- pytrees -------------------------------------------------------------------

def nested(params, x, *, scale):
    hidden = params["w"] @ x + params["b"]
    return {"out": (hidden * scale, [jnp.sum(hidden), {"mean": jnp.mean(hidden)}]),
            "shape": jnp.asarray(hidden.shape)}


def test_pytree_inputs_and_outputs_through_the_wire():
    """Pytree inputs are sent as flat leaves, and flat outputs come back in the function's structure."""
    params = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3, np.float32)}
    x = np.linspace(0, 1, 4, dtype=np.float32)
    scale = np.float32(2)
    program = Program.from_function(nested, params, x, scale=scale)

    # What the client frames is what the server decodes.
    call = RunCall.prepare(program, (params, x), {"scale": scale})
    send = call.send(set(), "rid")
    run = decode_request(b"".join(bytes(p) for p in send.parts))
    assert run.program.digest == program.digest
    assert bytes(run.program.data) == program.serialized
    assert [spec.shape for spec in run.inputs] == [(3,), (3, 4), (4,), ()]

    # The server's flat outputs come back in the function's structure.
    expected = jax.jit(nested)(params, x, scale=scale)
    flat = [np.asarray(leaf) for leaf in jax.tree.leaves(expected)]
    body = b"".join(bytes(p) for p in encode_result(flat)[0])
    result = program.unflatten_outputs(decode_result(body))
    assert jax.tree.structure(result) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_allclose, result, jax.tree.map(np.asarray, expected))


@pytest.mark.parametrize("make_output", [
    lambda x: x,
    lambda x: (x,),
    lambda x: (x, x + 1),
    lambda x: [x, (x, {"a": x})],
    lambda x: {"b": x, "a": (x, x)},
    lambda x: (),
], ids=["leaf", "1-tuple", "tuple", "nested-list", "dict", "empty"])
def test_output_structures(make_output):
    """Flat outputs are rebuilt into any output structure: a leaf, tuples, lists, dicts or nothing."""
    program = Program.from_function(make_output, np.float32(1))
    expected = make_output(np.float32(1))
    leaves = [np.asarray(leaf, np.float32) for leaf in jax.tree.leaves(expected)]
    result = program.unflatten_outputs(leaves)
    assert jax.tree.structure(result) == jax.tree.structure(expected)


# -- property: any pytree of arrays survives client -> wire -> server -> wire -> client

LEAF_DTYPES = ["float32", "int32", "bool", "bfloat16", "float16", "int8", "uint8", "complex64",
               "float8_e4m3fn", "uint32"]


@st.composite
def leaves(draw):
    dtype = jnp.dtype(draw(st.sampled_from(LEAF_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    values = np.arange(int(np.prod(shape, dtype=np.int64))) % 3
    array = values.astype(dtype).reshape(shape)
    if draw(st.booleans()) and array.ndim >= 2:
        array = array.T  # not contiguous
    return array


pytrees = st.recursive(
    leaves(),
    lambda inner: (st.lists(inner, min_size=1, max_size=3).map(tuple)
                   | st.lists(inner, min_size=1, max_size=3)
                   | st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), inner,
                                     min_size=1, max_size=3)),
    max_leaves=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pytrees)
def test_pytrees_round_trip_through_the_wire(tree):
    """Any pytree of arrays survives the wire both ways with its structure, dtypes, shapes and bytes."""
    program = Program.from_function(lambda t: jax.tree.map(lambda a: a, t), tree, platforms=("cpu",))
    call = RunCall.prepare(program, (tree,), {})
    run = decode_request(b"".join(bytes(p) for p in call.send(set(), None).parts))
    # An identity program's outputs are its inputs, in the same order.
    flat = [spec.view(spec.blob.data) for spec in run.inputs]
    body = b"".join(bytes(p) for p in encode_result(flat)[0])
    result = program.unflatten_outputs(decode_result(body))
    assert jax.tree.structure(result) == jax.tree.structure(tree)
    for got, sent in zip(jax.tree.leaves(result), jax.tree.leaves(tree)):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert got.tobytes() == np.ascontiguousarray(sent).tobytes()
