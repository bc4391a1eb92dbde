"""
The container image, run with podman as an operator runs it: a standalone
node and its gateway, a Router and a node in two containers, a stop in the
middle of a run, and what the image holds. Every container shares the host's
network (C{--network host}) and listens on loopback; programs are sent from
this process with L{kcoral.Client} and their answers compared with JAX here.

Not part of C{make test} (C{norecursedirs} in pyproject.toml): C{make
test-image} builds the CPU image and runs this module against it, named by
C{KCORAL_IMAGE}, with the engines' settings of C{deploy/containers.conf}
(C{CONTAINERS_CONF}). Every container is removed, whether the test passes or
fails; C{make test-image} removes the image.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kcoral import Client, Program
from kcoral._version import __version__
from tests.programs import spin_iterations, spin_program

PODMAN = os.environ.get("PODMAN", "podman")
#: Seconds a node may take to start its workers (JAX's first import and
#: compile, on a busy 2-core machine).
START_SECONDS = 120.0


@pytest.fixture(scope="module")
def image() -> str:
    name = os.environ.get("KCORAL_IMAGE")
    if not name:
        pytest.fail("KCORAL_IMAGE names no image: run these tests with `make test-image`")
    return name


def podman(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([PODMAN, *args], capture_output=True, text=True, timeout=timeout)


class Container:
    """A container of the image, by its name."""

    def __init__(self, name: str):
        self.name = name

    def run(self, image: str, args: list[str], options: tuple[str, ...] = ()) -> None:
        """Starts it detached, on the host's network, with podman's C{options}."""
        started = podman("run", "--detach", "--name", self.name, "--network", "host", *options,
                         image, *args)
        assert started.returncode == 0, started.stderr

    def logs(self) -> str:
        # The services log to standard error, podman's own notices too.
        shown = podman("logs", self.name)
        return shown.stdout + shown.stderr

    def state(self) -> dict:
        inspected = podman("inspect", "--format", "{{json .State}}", self.name)
        assert inspected.returncode == 0, inspected.stderr
        return json.loads(inspected.stdout)

    def stop(self, timeout: int) -> None:
        """SIGTERM, the image's stop signal; SIGKILL after C{timeout} seconds."""
        stopped = podman("stop", "--time", str(timeout), self.name, timeout=timeout + 30)
        assert stopped.returncode == 0, stopped.stderr


@pytest.fixture
def containers(image):
    """Starts containers of the image (C{start(*args, options=...)}); removes
    them all after the test, their logs shown where it failed."""
    started: list[Container] = []

    def start(*args: str, options: tuple[str, ...] = ()) -> Container:
        container = Container(f"kcoral-test-{uuid.uuid4().hex[:12]}")
        # Podman may have created it even where it fails to start it.
        started.append(container)
        container.run(image, list(args), options)
        return container

    yield start
    for container in started:
        print(f"--- {container.name} ---\n{container.logs()}")
        podman("rm", "--force", "--time", "0", container.name)


def free_ports(count: int) -> int:
    """The first of C{count} consecutive ports free on loopback (worker i of
    a node listens on its C{--port} + i, or + 1 + i behind its gateway)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65536:
            continue
        held = []
        try:
            for port in range(first, first + count):
                held.append(socket.socket())
                held[-1].bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return first
    raise AssertionError(f"no {count} consecutive free ports on 127.0.0.1")


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def until(container: Container, check, what: str, timeout: float = START_SECONDS):
    """Polls C{check()} until it returns something true, and returns that;
    fails at the deadline, or as soon as the container exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = check()
        except OSError:
            found = None  # Not listening yet.
        if found:
            return found
        if not container.state()["Running"]:
            pytest.fail(f"{container.name} exited before {what}:\n{container.logs()}")
        time.sleep(0.25)
    pytest.fail(f"no {what} within {timeout} s:\n{container.logs()}")


def wait_ready(container: Container, url: str) -> None:
    until(container, lambda: get(f"{url}/readyz")[0] == 200, f"200 from {url}/readyz")


def healthy_workers(gateway: str, count: int) -> list[dict]:
    """The workers behind C{gateway}, once it sees C{count} of them healthy."""
    workers = json.loads(get(f"{gateway}/health")[1])["workers"]
    return workers if sum(w["healthy"] for w in workers) == count else []


def affine():
    """A program and its inputs, and its answer from JAX in this process."""
    import jax
    import jax.numpy as jnp

    def f(w, x):
        return jnp.tanh(x @ w)

    w = np.random.default_rng(7).standard_normal((64, 32)).astype(np.float32)
    x = np.random.default_rng(8).standard_normal((16, 64)).astype(np.float32)
    return Program.from_function(f, w, x), (w, x), np.asarray(jax.jit(f)(w, x))


def run_and_compare(url: str) -> None:
    program, args, expected = affine()
    with Client(url, timeout=60) as client:
        answer = client.run(program, *args)
    np.testing.assert_allclose(answer, expected, rtol=1e-6, atol=1e-6)


def test_standalone_node(containers):
    """A node with two CPU workers behind its gateway: every part ready, a run
    through the gateway, one scrape of its /metrics covering both workers."""
    port = free_ports(3)
    node = containers("server", "--cpu-workers", "2", "--host", "127.0.0.1", "--port", str(port))
    gateway = f"http://127.0.0.1:{port}"
    wait_ready(node, gateway)
    # The gateway is ready with one worker, and scrapes only those it sees healthy.
    workers = until(node, lambda: healthy_workers(gateway, 2), "two healthy workers behind the gateway")
    assert sorted(w["name"] for w in workers) == ["worker0", "worker1"]
    for worker in workers:
        wait_ready(node, worker["url"])
    run_and_compare(gateway)
    status, metrics = get(f"{gateway}/metrics")
    assert status == 200
    assert b'worker="worker0"' in metrics and b'worker="worker1"' in metrics


def test_node_serves_a_mounted_model_repository(containers, tmp_path):
    """A node whose repository is mounted read-only compiles its model before it is ready,
    and tritonclient (REST and gRPC) gets the model's answers through its gateway."""
    import jax
    import jax.numpy as jnp
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    import kcoral

    def mlp(p, x):
        return jnp.tanh(x @ p["w1"]) @ p["w2"]

    rng = np.random.default_rng(3)
    params = {"w1": rng.standard_normal((16, 32)).astype(np.float32),
              "w2": rng.standard_normal((32, 8)).astype(np.float32)}
    repository = tmp_path / "models"
    kcoral.export_bundle(mlp, params, np.zeros((1, 16), np.float32), dir=repository / "mlp",
                         name="mlp", batch_sizes=[1, 8])
    # The image's user is not this one: what it reads must be readable by all.
    for path in [repository, *repository.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    port = free_ports(4)  # the gateway, two workers, and gRPC on the last
    grpc_port = port + 3
    node = containers("server", "--cpu-workers", "2", "--host", "127.0.0.1", "--port", str(port),
                      "--grpc-port", str(grpc_port), "--model-repository", "/models",
                      options=("--volume", f"{repository}:/models:ro"))
    gateway = f"http://127.0.0.1:{port}"
    wait_ready(node, gateway)
    until(node, lambda: healthy_workers(gateway, 2), "two healthy workers behind the gateway")
    x = rng.standard_normal((3, 16)).astype(np.float32)
    expected = np.asarray(jax.jit(mlp)(params, x))
    rest = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = httpclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    np.testing.assert_allclose(rest.infer("mlp", [tensor]).as_numpy("output"), expected, rtol=1e-5)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    np.testing.assert_allclose(grpc.infer("mlp", [tensor]).as_numpy("output"), expected, rtol=1e-5)
    assert "model mlp version 1 is ready" in node.logs()


def test_router_and_node(containers):
    """A Router in one container, a node in another that joins it, a run through the Router."""
    router_port = free_ports(2)
    node_port = router_port + 1
    router = containers("router", "--host", "127.0.0.1", "--port", str(router_port))
    containers("server", "--router", f"http://127.0.0.1:{router_port}", "--node-id", "n1",
               "--host", "127.0.0.1", "--port", str(node_port))
    # A Router is ready once a node has joined it.
    wait_ready(router, f"http://127.0.0.1:{router_port}")
    run_and_compare(f"http://127.0.0.1:{router_port}")


def test_stop_drains(containers):
    """podman stop in the middle of a run: the run's answer arrives, the node
    says it drained, and the container exits with status 0."""
    port = free_ports(3)
    node = containers("server", "--cpu-workers", "2", "--host", "127.0.0.1", "--port", str(port))
    gateway = f"http://127.0.0.1:{port}"
    wait_ready(node, gateway)
    program, local, x = spin_program()
    n = np.int32(spin_iterations(5.0))
    with Client(gateway, timeout=120) as client, ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.run, program, n, x)
        deadline = time.monotonic() + 30
        while json.loads(get(f"{gateway}/health")[1])["active"] == 0:
            assert time.monotonic() < deadline and not running.done(), "the run never started"
            time.sleep(0.05)
        node.stop(timeout=60)
        np.testing.assert_allclose(running.result(timeout=60), local(n, x), rtol=1e-6)
    logs = node.logs()
    assert "node stopping: draining 2 worker(s)" in logs
    # The gateway holds the run until it is done: its workers have none left.
    assert logs.count("draining: 0 running, 0 waiting") == 2
    assert "kcoral node stopped" in logs
    state = node.state()
    assert (state["Status"], state["ExitCode"]) == ("exited", 0)


def test_image_contents(image):
    """A user without privileges, nothing to build or fetch with (compilers,
    pip) and no caches, and the version of this tree."""
    inspected = podman("image", "inspect", "--format", "{{.Config.User}}", image)
    assert inspected.stdout.strip() == "10001:10001"
    user = podman("run", "--rm", "--entrypoint", "id", image, "-u")
    assert (user.returncode, user.stdout.strip()) == (0, "10001")
    # As root, to see into every directory.
    found = podman("run", "--rm", "--user", "0", "--entrypoint", "sh", image, "-c",
                   "command -v cc gcc c++ clang ld make pip pip3;"
                   " find / -xdev \\( -name .cache -o -name '*.deb' -o -path /src \\) -print;"
                   " find /var/lib/apt/lists /tmp -mindepth 1 ! -name lock ! -name partial -print;"
                   " echo checked")
    assert found.stdout == "checked\n", found.stderr
    version = podman("run", "--rm", image, "--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"kcoral {__version__}")
