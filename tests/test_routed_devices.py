"""
Programs for several devices with real processes on loopback and real JAX:
a Router with a node of two-device workers (C{--devices-per-worker 2}, two
host devices each) and a node of one-device workers sends a two-device
program only to the first, which gives JAX's in-process answer; a pool of
one-device workers (a standalone node's gateway) and a one-device server
called directly refuse it at once with 422 C{not_enough_devices}.
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from kcoral import Client, ProgramRejected
from tests import conformance
from tests.test_conformance import assert_identical
from tests.test_node_multi import node_args
from tests.test_node_multi import start_node as start_standalone
from tests.test_routed import pool_nodes, start_node, start_router, until_ready

pytestmark = pytest.mark.integration

jax = pytest.importorskip("jax")


#: Workers of host devices, whatever the run's KCORAL_TEST_GPUS says.
ON_THE_CPU = ("--gpus", "none")


def case(name: str) -> conformance.Case:
    return next(c for c in conformance.cases(False) if c.name == name)


def refused(url: str, program) -> ProgramRejected:
    """The refusal of C{program}'s run at C{url} (with no retries)."""
    with Client(url, busy_timeout=0, timeout=30) as client, pytest.raises(ProgramRejected) as e:
        client.run(program, *case("sharded.matmul").calls[0].args)
    return e.value


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_a_router_sends_a_two_device_program_to_a_two_device_worker(processes):
    """Through a Router a two-device program runs, as in process bit for bit, only where a worker owns two."""
    router = await start_router(processes)
    # Host devices, even in a GPU run (KCORAL_TEST_GPUS): the test process's
    # JAX, the reference, has two of them (tests/conftest.py).
    await start_node(processes, router.url, "one", *ON_THE_CPU)
    await start_node(processes, router.url, "two", *ON_THE_CPU, "--devices-per-worker", "2")
    nodes = await until_ready(router, "one", "two")
    assert [w["devices"] for w in nodes["one"]["workers"]] == [1]
    assert [w["devices"] for w in nodes["two"]["workers"]] == [2]

    sharded, plain = case("sharded.matmul"), case("structure.reshape[float32]")

    def runs():
        program = conformance.export(sharded)
        expected = conformance.run_in_process(sharded, program)
        with Client(router.url) as client:
            # Any run sent to the one-device worker would be refused there.
            got = [conformance.run_through(sharded, program, client) for _ in range(4)]
            single = conformance.export(plain)
            assert_identical(conformance.run_through(plain, single, client),
                             conformance.run_in_process(plain, single))
        return got, expected

    got, expected = await deferToThread(runs)
    for outputs in got:
        for g, e in zip(outputs, expected, strict=True):
            assert_identical(g, e)
    assert all(n["active"] == 0 for n in (await pool_nodes(router)).values())


@pytest_twisted.ensureDeferred
async def test_one_device_workers_refuse_a_two_device_program(processes):
    """A gateway of one-device workers, and one of them directly, answer 422 not_enough_devices at once."""
    node = await start_standalone(processes, node_args())
    health = await node.health()
    assert [w["devices"] for w in health["workers"]] == [1, 1]
    program = await deferToThread(conformance.export, case("sharded.matmul"))
    assert program.nr_devices == 2
    for url in (node.url, health["workers"][0]["url"]):
        error = await deferToThread(refused, url, program)
        assert error.reason == "not_enough_devices" and "2 devices" in error.message, url
