"""
Conformance: programs nobody wrote for KCoral (L{tests.conformance}: JAX's
primitives across the dtypes each accepts, control flow, linear algebra,
random numbers, pytrees, large, empty and 0-d arrays, shape-polymorphic
programs) give through a real server, bit for bit, what
C{jax.jit(exported.call)} gives in this process: the same tree structure,
and for each leaf the same dtype, shape and bytes (typed PRNG keys: their key
type and key data).

By default only the quick part runs (one dtype per primitive, every dtype
through the identity, every kind of program once: about 175 programs, some
30 seconds on two cores). The whole set (about 1400 programs, some three
minutes) runs with C{KCORAL_CONFORMANCE=full}::

    KCORAL_CONFORMANCE=full python -m pytest tests/test_conformance.py

Both sides run on the CPU of this machine with the same jaxlib, and every
case is compared bitwise, with no tolerance: transcendental functions,
reductions, contractions, LAPACK's factorizations and every PRNG are
reproducible across the two processes. Against a GPU server
(C{KCORAL_TEST_GPUS}), set C{JAX_PLATFORMS=cuda} too, so that the in-process
side runs on the same platform as the server; a CPU answer is no bitwise
reference for a GPU one.

Programs for two devices (inputs and outputs sharded over a mesh of two,
C{shard_map} with a C{psum}, a shape-polymorphic one) run here on two host
devices (tests/conftest.py) and on a server started with
C{--devices-per-worker 2}, which runs every other program on the first of
its two devices. Against a single GPU the server owns one device, and the
sharded programs are left out.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from kcoral import Client
from tests import conformance
from tests.conftest import TEST_GPUS, server_args, server_env
from tests.harness import SERVER_READY

pytestmark = pytest.mark.integration

jax = pytest.importorskip("jax")

FULL = os.environ.get("KCORAL_CONFORMANCE") == "full"


#: The devices of the server under test: two host devices on the CPU, for
#: the sharded programs; a GPU under test is one.
DEVICES = 1 if TEST_GPUS else 2


@pytest_twisted.async_fixture(scope="module")
async def server(module_processes):
    """A C{kcoral server} with L{DEVICES} devices, shared by this module's tests."""
    return await module_processes.start_service(
        server_args("--devices-per-worker", str(DEVICES)), name="server", ready=SERVER_READY,
        env=server_env())


def runnable(cases: list[conformance.Case]) -> list[conformance.Case]:
    """The cases whose programs the server under test owns devices for."""
    return [case for case in cases if case.mesh is None or case.mesh.size <= DEVICES]


@pytest.fixture(scope="module")
def client(server):
    with Client(server.url) as client:
        yield client


def host(leaf):
    """A leaf as what is compared: its dtype, shape and bytes; a typed key's
    key data, under its key type's name."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        data = np.asarray(jax.random.key_data(leaf))
        return f"key<{jax.random.key_impl(leaf)}>", data.shape, data.tobytes()
    array = np.asarray(leaf)
    return array.dtype, array.shape, array.tobytes()


def assert_identical(got, expected):
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
        where = jax.tree_util.keystr(path) or "output"
        (g_dtype, g_shape, g_bytes), (e_dtype, e_shape, e_bytes) = host(g), host(e)
        assert (g_dtype, g_shape) == (e_dtype, e_shape), where
        assert g_bytes == e_bytes, f"{where}: {np.asarray(g)!r} != {np.asarray(e)!r}"


def both(case: conformance.Case, client: Client):
    program = conformance.export(case)
    return conformance.run_through(case, program, client), conformance.run_in_process(case, program)


@pytest.mark.parametrize("case", runnable(conformance.cases(FULL)), ids=lambda case: case.name)
@pytest_twisted.ensureDeferred
async def test_runs_as_in_process(client, case):
    """A program gives through a server exactly the tree, dtypes, shapes and bytes it gives in process."""
    got, expected = await deferToThread(both, case, client)
    for g, e in zip(got, expected, strict=True):
        assert_identical(g, e)


@pytest.mark.parametrize("case", conformance.refused(), ids=lambda case: case.name)
@pytest_twisted.ensureDeferred
async def test_refused_as_in_process(client, case):
    """A call jax.jit(exported.call) refuses is refused by the client too, before it sends a byte."""
    program = conformance.export(case)
    with pytest.raises(ValueError):
        conformance.run_in_process(case, program)
    sent = client.bytes_sent
    with pytest.raises(ValueError):
        await deferToThread(conformance.run_through, case, program, client)
    assert client.bytes_sent == sent


@pytest_twisted.ensureDeferred
async def test_large_inputs_go_by_reference(server):
    """A large input's second run sends a reference, and gives the same answer."""
    case = next(c for c in conformance.cases(False) if c.name == "large.matvec")

    def twice():
        program = conformance.export(case)
        with Client(server.url) as fresh:
            first = conformance.run_through(case, program, fresh)
            sent = fresh.bytes_sent
            again = conformance.run_through(case, program, fresh)
            return first, again, sent, fresh.bytes_sent - sent

    first, again, sent_first, sent_again = await deferToThread(twice)
    weights = case.calls[0].args[0]
    # At most once: by reference first (this module's server may hold them
    # from an earlier test), else inline after the server's 409.
    assert sent_first < weights.nbytes + 65536 and sent_again < 2 * 768 * 4 + 4096
    for g, e in zip(again, first, strict=True):
        assert_identical(g, e)
