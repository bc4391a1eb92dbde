"""
A node's worker gets an allow-list of the node's environment
(L{kcoral.node.environment}): what Python, JAX, XLA, CUDA and the C library
read, never a token or a credential, and one more variable a name with
C{--worker-env}. Property tests over variable names (a credential never
passes, whatever its case or place in the name; a name on the list passes),
the option's checks, the supervisor's and the front processes' children on a
fake reactor, and a real node configured by its environment, as the
Kubernetes manifests configure one: its workers' C{/proc/<pid>/environ}
holds none of its secrets, holds what C{--worker-env} names, and its workers
are servers (given the node's Router and id, a worker used to start a node
of its own, and that one another).
"""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import pytest_twisted
from hypothesis import given
from hypothesis import strategies as st
from twisted.python import usage

from kcoral import AsyncClient, Program
from kcoral.common.serverconfig import ServerConfig
from kcoral.node.config import NodeConfig
from kcoral.node.devices import WorkerSpec
from kcoral.node.environment import (
    NAMES,
    PREFIXES,
    SECURED_ENV,
    WITHHELD,
    WorkerEnvironment,
    credential,
)
from kcoral.node.front import FrontProcesses
from kcoral.node.restart import RestartSettings
from kcoral.node.supervisor import SupervisorService
from kcoral.router.service import RouterConfig
from kcoral.taps.node import NodeOptions
from tests.conftest import server_env
from tests.fakes import FakeOutgoing, ProcessReactor
from tests.harness import START_TIMEOUT, kcoral_argv, until
from tests.httputil import request
from tests.test_routed import FAST_NODE, pool_nodes, start_router

#: What a credential's name says it is (any case, anywhere in the name).
CREDENTIAL_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "KEY", "API_KEY",
                    "CREDENTIALS", "AUTH", "AUTHORIZATION", "COOKIE", "HEADERS", "PRIVATE",
                    "SESSION", "SIGNATURE")
#: The providers whose every variable is a credential.
CREDENTIAL_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "GCP_")
#: Characters of a variable's name.
NAME_CHARACTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_"


def mixed_case(word: str):
    return st.lists(st.booleans(), min_size=len(word), max_size=len(word)).map(
        lambda upper: "".join(c.upper() if u else c.lower() for c, u in zip(word, upper)))


names = st.text(NAME_CHARACTERS, max_size=12)


@given(st.sampled_from(sorted(NAMES) + list(PREFIXES) + [""]), names,
       st.sampled_from(CREDENTIAL_WORDS).flatmap(mixed_case), names)
def test_a_credential_never_passes(start, before, word, after):
    """A name holding a credential's word, in any case and place, passes neither the
    allow-list nor --worker-env, even after a prefix the list takes."""
    name = start + before + word + after
    assert credential(name)
    assert WorkerEnvironment().of({name: "s3cret"}) == {}
    with pytest.raises(ValueError, match="credential"):
        WorkerEnvironment((name,))


@given(st.sampled_from(CREDENTIAL_PREFIXES).flatmap(mixed_case), names)
def test_a_cloud_providers_variable_never_passes(prefix, rest):
    """Every AWS_, GOOGLE_, AZURE_ or GCP_ variable is taken for a credential."""
    name = prefix + rest
    assert WorkerEnvironment().of({name: "s3cret"}) == {}
    with pytest.raises(ValueError):
        WorkerEnvironment((name,))


@given(st.sampled_from(PREFIXES), st.text("0123456789_XYZ", max_size=12))
def test_a_variable_under_a_prefix_of_the_list_passes(prefix, rest):
    """A name under a prefix of the list that says nothing of a credential passes."""
    name = prefix + rest
    assert WorkerEnvironment().of({name: "1", "UNLISTED": "2"}) == {name: "1"}


@pytest.mark.parametrize("name", [
    "PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "PYTHONPATH", "PYTHONHASHSEED",
    "VIRTUAL_ENV", "JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS",
    "XLA_PYTHON_CLIENT_PREALLOCATE", "TF_CPP_MIN_LOG_LEVEL", "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES", "NCCL_DEBUG", "LD_LIBRARY_PATH", "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_ENDPOINT",
    "KCORAL_GPU_CHECK_RUN"])
def test_what_python_jax_cuda_and_the_c_library_read_passes(name):
    """The variables the worker's stack reads pass, and the GPU check's mark."""
    assert WorkerEnvironment().of({name: "v"}) == {name: "v"}


@pytest.mark.parametrize("name", [
    "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "AWS_SECRET_ACCESS_KEY",
    "AWS_PROFILE", "GOOGLE_APPLICATION_CREDENTIALS", "GITHUB_TOKEN", "HF_TOKEN", "DB_PASSWORD",
    "OPENAI_API_KEY", "SSH_AUTH_SOCK", "LD_PRELOAD", "DOCKER_CONFIG", "KUBECONFIG"])
def test_what_a_worker_does_not_read_does_not_pass(name):
    """Credentials, and whatever is not on the list, stay with the node."""
    assert WorkerEnvironment().of({name: "v"}) == {}


def test_the_nodes_own_variables_never_pass():
    """Every variable a node reads its settings from is withheld (a worker given the
    node's Router and id would be a node itself), and --worker-env cannot ask for one."""
    for variable in NodeOptions.environment.values():
        assert variable in WITHHELD
        assert WorkerEnvironment().of({variable: "v"}) == {}
        with pytest.raises(ValueError):
            WorkerEnvironment((variable,))


def test_worker_env_passes_a_variable_by_name():
    """--worker-env FOO passes FOO, and only it, beyond the list."""
    environment = WorkerEnvironment(("FOO",))
    assert environment.of({"FOO": "1", "BAR": "2", "PATH": "/bin"}) == {"FOO": "1", "PATH": "/bin"}


@pytest.mark.parametrize("argv,error", [
    (["--worker-env", "AWS_SECRET_ACCESS_KEY"], "may hold a credential"),
    (["--worker-env", "KCORAL_ROUTER_ENDPOINT"], "the node's own"),
    (["--worker-env", "NOT A NAME"], "is not a variable's name"),
    (["--worker-env", "FOO"], None),
])
def test_worker_env_is_checked_at_start(argv, error):
    """A --worker-env that may not pass is a usage error naming it, before anything starts."""
    options = NodeOptions()
    if error is None:
        options.parseOptions(["--cpu-workers", "2", *argv])
        assert options.node_config().worker_env == ("FOO",)
    else:
        with pytest.raises(usage.UsageError, match=error):
            options.parseOptions(["--cpu-workers", "2", *argv])


def test_worker_env_from_the_node_file(tmp_path):
    """The node file's worker_env key takes a list of names, or one."""
    path = tmp_path / "node.yaml"
    path.write_text("cpu_workers: 2\nworker_env: [FOO, BAR]\n")
    options = NodeOptions()
    options.parseOptions(["--config", str(path)])
    assert options.node_config().worker_env == ("FOO", "BAR")


def test_a_worker_of_a_node_with_a_token_counts_as_secured(monkeypatch):
    """A worker never gets the node token, but its supervisor's mark makes it secured."""
    for variable in ("KCORAL_NODE_TOKEN", SECURED_ENV):
        monkeypatch.delenv(variable, raising=False)
    options = NodeOptions()
    options.parseOptions([])
    assert not options.server_config().secured
    monkeypatch.setenv(SECURED_ENV, "1")
    options = NodeOptions()
    options.parseOptions([])
    assert options.server_config().secured


# -- the supervisor's children, on a fake reactor -------------------------------------------

NODE_ENVIRONMENT = {"KCORAL_NODE_TOKEN": "node-s3cret", "KCORAL_CLIENT_TOKEN": "client-s3cret",
                    "KCORAL_ROUTER_ENDPOINT": "http://router:9000", "KCORAL_NODE_ID": "gpu-a",
                    "AWS_SECRET_ACCESS_KEY": "aws-s3cret", "FOO": "foo", "PATH": "/usr/bin",
                    "JAX_PLATFORMS": "cpu"}


def started(node: NodeConfig, monkeypatch) -> ProcessReactor:
    """The processes a supervisor of C{node} starts, in an environment of secrets."""
    for name, value in NODE_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    reactor = ProcessReactor()
    supervisor = SupervisorService(node, ServerConfig(port=0, gpus="none"), reactor,
                                   [WorkerSpec("worker0", 0, None), WorkerSpec("worker1", 1, None)],
                                   [0, 0], "2 CPU worker(s)", outgoing=FakeOutgoing())
    supervisor.privilegedStartService()
    supervisor.startService()
    return reactor


def test_a_worker_gets_the_allow_list_and_its_supervisors_settings(monkeypatch):
    """Each worker gets the list's variables, --worker-env's, its device's and its
    supervisor's marks; no token, no credential, none of the node's settings."""
    reactor = started(NodeConfig(cpu_workers=2, node_token="node-s3cret", worker_env=("FOO",)),
                      monkeypatch)
    assert len(reactor.processes) == 2
    for process in reactor.processes:
        assert process.executable == sys.executable
        env = process.env
        assert not {"KCORAL_NODE_TOKEN", "KCORAL_CLIENT_TOKEN", "KCORAL_ROUTER_ENDPOINT",
                    "KCORAL_NODE_ID", "AWS_SECRET_ACCESS_KEY"} & set(env)
        assert not any("s3cret" in value for value in env.values())
        assert (env["FOO"], env["PATH"], env["JAX_PLATFORMS"]) == ("foo", "/usr/bin", "cpu")
        assert (env["KCORAL_SUPERVISED"], env[SECURED_ENV], env["CUDA_VISIBLE_DEVICES"]) == (
            "1", "1", "")


def test_a_worker_of_a_node_without_a_token_is_not_marked_secured(monkeypatch):
    """Without a node token, no mark: a worker on a public address warns as any server does."""
    reactor = started(NodeConfig(cpu_workers=2), monkeypatch)
    assert all(SECURED_ENV not in p.env and "FOO" not in p.env for p in reactor.processes)


def test_front_processes_keep_the_nodes_environment_and_their_own_token(monkeypatch):
    """A front process runs no programs: it keeps the node's environment, with the token
    its supervisor drew for it in place of the node's, and the gateway's client token."""
    for name, value in NODE_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    reactor = ProcessReactor()
    FrontProcesses(RouterConfig(grpc_port=0, front_processes=2, client_token="client-tok"),
                   lambda: 8001, RestartSettings(), reactor, FakeOutgoing().client,
                   dict).startService()
    assert reactor.process.args[1:4] == ["-m", "kcoral", "router"]
    env = reactor.process.env
    assert env["AWS_SECRET_ACCESS_KEY"] == "aws-s3cret" and env["FOO"] == "foo"
    assert env["KCORAL_NODE_TOKEN"] not in ("", "node-s3cret")
    assert env["KCORAL_CLIENT_TOKEN"] == "client-tok"


# -- a real node --------------------------------------------------------------------------------

NODE_TOKEN = "node-token-5b1e8c0d7a2f4e96"
CLIENT_TOKEN = "client-token-c47d2a9e1b3f5086"
AWS_SECRET = "aws-secret-9e8d7c6b5a4f3e2d"
FOO = "foo-for-the-workers"
STARTED = re.compile(r"(?P<worker>worker\d+) started \(pid (?P<pid>\d+)\)")


def environ_of(pid: int) -> dict[str, str]:
    """The environment the process C{pid} was started with."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read()
    return dict(entry.decode().split("=", 1) for entry in raw.split(b"\0") if entry)


@pytest.mark.slow
@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_real_nodes_workers_hold_none_of_its_secrets(processes):
    """
    A node of two CPU workers configured by its environment (Router, node id, node token,
    a client token, an AWS key) and --worker-env FOO: each worker's environ holds none of
    the secrets and holds FOO; each worker is a server (two worker starts in the node's
    log, not a node within a node); the Router lists both with the sandbox each says it
    runs in; a program runs; SIGTERM stops the node with status 0.
    """
    router = await start_router(processes, "--node-token", NODE_TOKEN)
    env = {**server_env(), "KCORAL_ROUTER_ENDPOINT": router.url, "KCORAL_NODE_ID": "env-node",
           "KCORAL_NODE_TOKEN": NODE_TOKEN, "KCORAL_CLIENT_TOKEN": CLIENT_TOKEN,
           "AWS_SECRET_ACCESS_KEY": AWS_SECRET, "FOO": FOO}
    node = processes.spawn(kcoral_argv("server", "--port", "0", "--gpus", "none",
                                       "--cpu-workers", "2", "--worker-env", "FOO", *FAST_NODE),
                           name="env-node", env=env)
    await node.wait_for_line(r"registered with the Router as env-node ", START_TIMEOUT)
    for worker in ("worker0", "worker1"):
        await node.wait_for_line(rf"{worker} is ready at ", START_TIMEOUT)

    pids = [int(STARTED.search(line).group("pid")) for line in node.matching(STARTED)]
    assert len(pids) == 2, node.tail(60)
    assert not node.matching(r"\[worker\d\] .*kcoral node starting"), node.tail(60)
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
        for secret in (NODE_TOKEN, CLIENT_TOKEN, AWS_SECRET, router.url):
            assert secret.encode() not in raw
        environ = environ_of(pid)
        assert environ["FOO"] == FOO and environ[SECURED_ENV] == "1"

    async def confined():
        workers = (await pool_nodes(router)).get("env-node", {}).get("workers", [])
        return workers if len(workers) == 2 and all(
            w["healthy"] and w["sandbox"] for w in workers) else None

    for worker in await until(confined, "both workers healthy, with their sandbox", 60):
        own = (await request("GET", worker["url"] + "/health", timeout=10)).json
        assert worker["sandbox"] == own["sandbox"]

    program = Program.from_function(lambda x: x * 2, np.ones(4, np.float32))
    client = AsyncClient(router.url)
    try:
        answer = await client.run(program, np.arange(4, dtype=np.float32))
    finally:
        await client.close()
    np.testing.assert_array_equal(answer, np.arange(4, dtype=np.float32) * 2)

    node.signal("TERM")
    assert await node.exited(60) == 0, node.tail(60)
