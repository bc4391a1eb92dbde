"""
Fixtures shared by the test suite. The process harness itself lives in
L{tests.harness}; these are thin fixtures over it.

Servers started here run on the CPU (C{--gpus none}) so that results do not
depend on the machine; set C{KCORAL_TEST_GPUS} (e.g. C{0}) to run the
integration tests against a GPU instead. Set C{KCORAL_TEST_ECHO=1} to see the
children's output live.
"""

from __future__ import annotations

import os
import sys

import pytest
import pytest_twisted

from kcoral.common.hostdevices import HOST_DEVICE_COUNT, host_device_flags
from tests.harness import SERVER_READY, ProcessGroup

# The test process only exports programs and checks results: keep its JAX on
# the CPU, so that it never takes GPU memory a server under test needs
# (nothing imported above imports JAX).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Two host devices, for the programs exported for two (tests/conformance.py),
# which run here as on a server with --devices-per-worker 2. A server sets
# its own count, whatever it inherits from this process.
if HOST_DEVICE_COUNT not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = host_device_flags(os.environ.get("XLA_FLAGS", ""), 2)

TEST_GPUS = os.environ.get("KCORAL_TEST_GPUS")


def _echo():
    if os.environ.get("KCORAL_TEST_ECHO"):
        return lambda line: print(line, file=sys.__stderr__, flush=True)
    return None


def server_args(*args: str) -> list[str]:
    """C{kcoral server} arguments: an ephemeral port on loopback, the test device."""
    return ["server", "--port", "0", "--gpus", TEST_GPUS or "none", *args]


def server_env() -> dict:
    # With a GPU under test, let the server see it (this process hides it).
    return {"JAX_PLATFORMS": None} if TEST_GPUS else {}


@pytest.fixture
def reactor():
    from twisted.internet import reactor

    return reactor


@pytest_twisted.async_yield_fixture
async def processes():
    """A L{ProcessGroup} whose children are all stopped after the test."""
    from twisted.internet import reactor

    group = ProcessGroup(reactor, _echo())
    yield group
    await group.stop_all()


@pytest_twisted.async_yield_fixture(scope="module")
async def module_processes():
    """A L{ProcessGroup} shared by a test module, stopped after its last test."""
    from twisted.internet import reactor

    group = ProcessGroup(reactor, _echo())
    yield group
    await group.stop_all()


@pytest.fixture
def start_server(processes):
    """
    C{start_server(*extra_args, name="server", env=None)}: a Deferred that
    fires with a L{tests.harness.RunningService} once a fresh C{kcoral server}
    is ready, C{env} added to its environment. The server is stopped after
    the test.
    """

    def start(*args: str, name: str = "server", env: dict | None = None):
        return processes.start_service(server_args(*args), name=name, ready=SERVER_READY,
                                       env={**server_env(), **(env or {})})

    return start


@pytest_twisted.async_fixture(scope="module")
async def server(module_processes):
    """A default C{kcoral server}, shared by the tests of one module."""
    return await module_processes.start_service(server_args(), name="server",
                                                ready=SERVER_READY, env=server_env())


@pytest.fixture(scope="module")
def spin():
    """(program, its iterations per second, x): the program that runs as long as it is told."""
    from tests import programs  # JAX, for the tests that run programs only

    program, _, x = programs.spin_program()
    return program, programs.spin_iterations(1.0), x


@pytest_twisted.async_yield_fixture
async def serve():
    """C{await serve(front, **options)}: a started gRPC front of C{front} (a fake
    C{IInferenceFront}) on loopback, guarded by the test client token
    (L{tests.test_inference_fronts.TOKEN}), stopped after the test."""
    from twisted.internet import reactor

    from kcoral.inference.h2front import GrpcFront
    from kcoral.web.auth import CLIENT_ROUTES, TokenGuard
    from tests.test_inference_fronts import TOKEN

    started: list[GrpcFront] = []

    async def start(front, **options) -> GrpcFront:
        grpc_front = GrpcFront(front, reactor=reactor, guard=TokenGuard.of([TOKEN], CLIENT_ROUTES),
                               **options)
        grpc_front.startService()
        started.append(grpc_front)
        return grpc_front

    yield start
    for grpc_front in started:
        if grpc_front.running:
            await grpc_front.stopService(grace=0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Show the recent output of every live child when a test fails."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and ProcessGroup.live:
        text = "\n\n".join(group.report() for group in ProcessGroup.live if group.children)
        if text:
            report.sections.append(("kcoral child processes", text))
