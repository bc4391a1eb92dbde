"""
The page "Run a Node" of the sibling node supervisor, run as written with
KCoral's names, with real processes and real JAX: a bundle of the page's MLP
(4 -> 8 -> 3, batch sizes 1 and 8) in C{models/mlp}; the page's node file
(C{model_repo}, C{base_port}, C{metrics_base_port}, C{global.runtime.backend},
C{global.endpoints.host}); C{KCORAL_GPUS=0 KCORAL_CPU_WORKERS=2}; C{/readyz}
on each worker's HTTP port and on the gateway's; tritonclient over gRPC on the
gateway with an 8-row batch; one scrape of the gateway's C{/metrics}; SIGTERM
and exit status 0.

The page's ports (8001, 8002, 8080, 9100) may be taken on a test machine, so
the integration test writes free ones of the same layout into its node file,
below the ephemeral range the other tests' listeners draw from; the literal
layout is checked from the options alone. The node is started from another
folder than its node file's, whose relative C{model_repo} must still be found.
"""

from __future__ import annotations

import os
import random
import re
import socket

import numpy as np
import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from kcoral.node.supervisor import worker_grpc_port, worker_port
from kcoral.taps import node as node_tap
from tests.harness import kcoral_argv, until
from tests.httputil import request
from tests.test_node_multi import STARTED, scrape

pytestmark = pytest.mark.integration

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
grpcclient = pytest.importorskip("tritonclient.grpc")

START_TIMEOUT = 180.0
#: The page's node file, as it writes it (its model_repo relative here).
NODE_FILE = """\
model_repo: {models}
base_port: {base_port}
metrics_base_port: {metrics_base_port}
global:
  runtime:
    backend: cpu           # cuda on a GPU host
  endpoints:
    host: 127.0.0.1
"""
#: The page's environment: a CPU node of two workers.
SEED_ENV = {"KCORAL_GPUS": "0", "KCORAL_CPU_WORKERS": "2"}


def mlp(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def free_ports(count: int) -> int:
    """
    The first of C{count} consecutive ports free on loopback, chosen below
    Linux's ephemeral range (32768 and up), where no other test's port 0
    listener lands.
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise AssertionError(f"no {count} consecutive free ports below 32000")


@pytest.fixture
def page(tmp_path):
    """The page's folder: models/mlp (the MLP's bundle) and its params."""
    import kcoral

    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((4, 8)).astype(np.float32),
              "b1": np.zeros(8, np.float32),
              "w2": rng.standard_normal((8, 3)).astype(np.float32),
              "b2": np.zeros(3, np.float32)}
    kcoral.export_bundle(mlp, params, np.zeros((1, 4), np.float32),
                         dir=str(tmp_path / "models" / "mlp"), name="mlp", batch_sizes=[1, 8])
    return tmp_path, params


def grpc_infer(address: str, x: np.ndarray) -> np.ndarray:
    client = grpcclient.InferenceServerClient(address)
    try:
        given = grpcclient.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        return client.infer("mlp", [given], client_timeout=60).as_numpy("output")
    finally:
        client.close()


def grpc_live(address: str) -> bool:
    client = grpcclient.InferenceServerClient(address)
    try:
        return client.is_server_live() and client.is_model_ready("mlp")
    finally:
        client.close()


async def until_ready(url: str, node) -> None:
    async def ready():
        if not node.running:
            raise AssertionError(f"the node exited before {url} was ready\n{node.tail()}")
        try:
            answer = await request("GET", url, timeout=5)
        except Exception:
            return None
        return answer.code == 200 or None
    await until(ready, f"{url} answering 200", START_TIMEOUT)


@pytest_twisted.ensureDeferred
async def test_the_node_page_runs_as_written(processes, page, tmp_path_factory):
    """The page's node file and environment give a CPU node of two workers on
    the page's port layout, whose gateway serves the MLP to tritonclient over
    gRPC, whose one /metrics covers every worker, and which exits 0 on SIGTERM."""
    folder, params = page
    # The gateway's two ports, then two for the workers' gRPC and two for their HTTP.
    base = free_ports(6)
    gateway_grpc, gateway_http = base, base + 1
    base_port, metrics_base_port = base + 2, base + 4
    node_file = folder / "node.yaml"
    node_file.write_text(NODE_FILE.format(models="models", base_port=base_port,
                                          metrics_base_port=metrics_base_port)
                         + f"grpc_port: {gateway_grpc}\nport: {gateway_http}\n")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    node = processes.spawn(kcoral_argv("server", "--config", str(node_file)), name="node",
                           env=SEED_ENV, cwd=str(elsewhere))

    for i in range(2):
        await until_ready(f"http://127.0.0.1:{metrics_base_port + i}/readyz", node)
    await until_ready(f"http://127.0.0.1:{gateway_http}/readyz", node)
    assert {m.group("worker") for m in map(STARTED.search, node.matching(STARTED))} \
        == {"worker0", "worker1"}
    for i in range(2):
        assert node.matching(rf"\[worker{i}\] "), f"no [worker{i}] lines\n{node.tail()}"
        assert await deferToThread(grpc_live, f"127.0.0.1:{base_port + i}")

    x = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)
    y = await deferToThread(grpc_infer, f"127.0.0.1:{gateway_grpc}", x)
    np.testing.assert_allclose(y, np.asarray(mlp(params, x)), rtol=1e-5, atol=1e-5)

    async def both_workers():
        text, _ = await scrape(f"http://127.0.0.1:{gateway_http}")
        return 'worker="worker1"' in text and 'worker="worker0"' in text

    # A gateway's /metrics holds a worker's series only when that worker
    # answered its scrape in time (2 s), which a worker just ready and a
    # loaded machine may miss once.
    assert await until(both_workers, "both workers' series on the gateway's /metrics")

    node.signal("TERM")
    assert await node.exited(60) == 0, node.tail()


def test_the_page_layout(tmp_path, monkeypatch):
    """The page's node file, as written, puts the gateway on gRPC 8001 and
    HTTP 8002, worker i's gRPC on 8080 + i and its HTTP on 9100 + i, with two
    CPU workers and the host of global.endpoints.host."""
    (tmp_path / "models").mkdir()
    node_file = tmp_path / "node.yaml"
    node_file.write_text(NODE_FILE.format(models=tmp_path / "models", base_port=8080,
                                          metrics_base_port=9100))
    for name, value in SEED_ENV.items():
        monkeypatch.setenv(name, value)
    options = node_tap.Options()
    options.parseOptions(["--config", str(node_file)])
    assert (options["grpc-port"], options["port"], options["host"]) == (8001, 8002, "127.0.0.1")
    assert (options["gpus"], options["cpu-workers"], options.supervised) == ("none", 2, True)
    assert [worker_grpc_port(options, i) for i in range(2)] == [8080, 8081]
    assert [worker_port(options, i) for i in range(2)] == [9100, 9101]


@pytest_twisted.ensureDeferred
async def test_a_missing_repository_stops_the_node_at_start(processes, tmp_path):
    """A node file whose model_repo is not there (relative to the node file's
    folder) stops the node at once: exit status 2, one line naming the folder,
    no worker started."""
    node_file = tmp_path / "node.yaml"
    node_file.write_text(NODE_FILE.format(models="models", base_port=0, metrics_base_port=0))
    node = processes.spawn(kcoral_argv("server", "--config", str(node_file)), name="node",
                           env=SEED_ENV)
    assert await node.exited(60) == 2
    lines = [line for line in node.output.lines if line.strip()]
    assert len(lines) == 1, lines
    assert os.path.join(str(tmp_path), "models") in lines[0] and "No such file" in lines[0]
    assert not re.search("Traceback", lines[0])
