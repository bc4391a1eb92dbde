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
    assert len(matmul.flatten_inputs((w, x), {})) == 2
    with pytest.raises(ValueError, match="dtype"):
        matmul.flatten_inputs((w.astype(np.float64), x), {})
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
        assert program.flatten_inputs((np.zeros((rows, 2), np.float32),), {})[0].shape == (rows, 2)
    with pytest.raises(ValueError, match="shape"):
        program.flatten_inputs((np.zeros((5, 3), np.float32),), {})


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
