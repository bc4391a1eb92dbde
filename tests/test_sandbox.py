"""
A process that runs programs confines itself (L{kcoral.sandbox}): a real
C{kcoral server} as the kernel sees it (C{/proc/<pid>/status}) and as its
C{/health} says; a helper process under the very policy a server builds for
its settings (L{tests.confined}), trying what a program that took it over
would; each mode (strict starts here, where the kernel has every layer; off
warns; a kernel made to look as if it had no Landlock makes strict exit 2
and auto name what is missing); and the policy's paths and ports for a
server's settings.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import pytest_twisted
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.threads import deferToThread

from bench.support.ports import free_port
from kcoral.common.serverconfig import ServerConfig
from kcoral.sandbox import landlock, seccomp
from kcoral.sandbox.policy import otlp_port, policy_for, serves_gpu
from tests.conftest import server_args, server_env
from tests.harness import LISTENING, SERVER_READY, START_TIMEOUT, kcoral_argv, until
from tests.httputil import request

HERE = Path(__file__).parent
#: A fixed pid for the policy's unit tests.
PID = 4242


def status_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}


async def full_health(url: str) -> dict:
    answer = await request("GET", url + "/health", timeout=10)
    assert answer.code == 200
    return answer.json


# -- a real server ---------------------------------------------------------------------------

@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_server_confines_itself_by_default(start_server):
    """A default server has no_new_privs, a seccomp filter and no capability,
    as the kernel says, and its /health says every layer is on."""
    server = await start_server()
    status = status_of(server.process.pid)
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"
    assert status["CapEff"] == status["CapPrm"] == status["CapBnd"] == status["CapAmb"] \
        == "0000000000000000"
    assert (await full_health(server.url))["sandbox"] == {
        "mode": "auto", "no_new_privs": True, "seccomp": True, "landlock_abi": landlock.abi()}


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_strict_starts_where_the_kernel_has_every_layer(start_server):
    """--sandbox strict on this kernel: the server starts with every layer on."""
    server = await start_server("--sandbox", "strict")
    assert (await full_health(server.url))["sandbox"] == {
        "mode": "strict", "no_new_privs": True, "seccomp": True, "landlock_abi": landlock.abi()}


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_off_warns_and_confines_nothing(start_server):
    """--sandbox off: a warning at start, and nothing on."""
    server = await start_server("--sandbox", "off")
    assert server.process.matching(r"warn .*--sandbox off: programs run with every right")
    assert status_of(server.process.pid)["Seccomp"] == "0"
    assert (await full_health(server.url))["sandbox"] == {
        "mode": "off", "no_new_privs": False, "seccomp": False, "landlock_abi": 0}


def unix_health(path: str) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: kcoral\r\nConnection: close\r\n\r\n")
        return s.makefile("rb").readline()


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_server_on_a_unix_socket_stops_cleanly_and_starts_again(processes, tmp_path):
    """A confined server may not remove its UNIX socket's file as it stops: it
    says so and exits 0, and the next server on the same path serves."""
    path = str(tmp_path / "kcoral.sock")
    for start in range(2):
        child = processes.spawn(kcoral_argv("server", "--listen", f"unix:{path}", "--gpus", "none"),
                                name=f"unix-{start}", env=server_env())
        await child.wait_for_line(SERVER_READY, START_TIMEOUT)
        assert (await deferToThread(unix_health, path)).startswith(b"HTTP/1.1 200")
        child.signal("TERM")
        assert await child.exited(30) == 0
        assert child.matching(f"left {path} behind: Permission denied")
        assert not child.matching("Unhandled error")


def without_landlock(*args: str) -> list[str]:
    """A C{kcoral server} on a kernel made to look as if it had no Landlock."""
    return [sys.executable, str(HERE / "nolandlock.py"), *kcoral_argv(*server_args(*args))]


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_strict_exits_2_naming_the_missing_layer(processes):
    """--sandbox strict without Landlock: exit status 2, one line naming it."""
    child = processes.spawn(without_landlock("--sandbox", "strict"), name="strict",
                            env=server_env())
    assert await child.exited(START_TIMEOUT) == 2
    assert len(child.matching("--sandbox strict")) == 1
    assert child.matching(r"--sandbox strict: missing Landlock \(not in this kernel\)")


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_auto_names_what_is_missing_and_applies_the_rest(processes):
    """--sandbox auto without Landlock: one line names it, the other layers are on."""
    child = processes.spawn(without_landlock(), name="auto", env=server_env())
    listening = await child.wait_for_line(LISTENING, START_TIMEOUT)
    await child.wait_for_line(SERVER_READY, START_TIMEOUT)
    assert len(child.matching("confined without Landlock")) == 1
    assert (await full_health(listening.group("url")))["sandbox"] == {
        "mode": "auto", "no_new_privs": True, "seccomp": True, "landlock_abi": 0}


# -- a confined process, tried from inside ---------------------------------------------------

@pytest.fixture
def listeners():
    """Two listening TCP ports of this process: one the helper may not
    connect to, one its configured collector."""
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    yield [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()


@pytest.fixture
def helper_settings(tmp_path, listeners):
    """A server's settings naming a repository, caches, a tokens file, a
    gRPC port and an OTLP collector; and the helper's."""
    repository = tmp_path / "repository"
    repository.mkdir()
    (repository / "bundle").write_text("a model")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "tokens").write_text("a-token\n")
    (secrets / "sibling").write_text("another secret")
    return {"model_repository": str(repository), "cache_dir": str(tmp_path / "cache"),
            "compilation_cache_dir": str(tmp_path / "compiled"), "grpc_port": free_port(),
            "tracing": "otlp", "parent_port": listeners[0], "tokens": str(secrets / "tokens")}


def confined(given: dict, sockets: list | None = None, collector: int | None = None) -> dict:
    """What L{tests.confined} saw, under the policy of the settings C{given}:
    its tries, or with C{sockets} those alone. It runs as a node's workers
    do (C{python -m}), from a working folder of its own holding a secret."""
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector or 1}",
           "PYTHONPATH": str(HERE.parent)}
    argv = [sys.executable, "-m", "tests.confined", json.dumps(given)]
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "secret").write_text("the operator's")
        done = subprocess.run(argv if sockets is None else [*argv, json.dumps(sockets)],
                              capture_output=True, text=True, timeout=120, env=env, check=True,
                              cwd=folder)
    return json.loads(done.stdout.splitlines()[-1])


def test_a_confined_process_is_refused_what_is_not_its_own(helper_settings, listeners):
    """Under a server's policy, a process cannot read files outside it (the working folder
    python -m put on its import path among them), another process's /proc, /dev/shm, ports
    not its own, datagram and raw sockets, programs, ptrace or signals; it reads and writes
    what the server needs and runs JAX."""
    seen = confined(helper_settings, collector=listeners[1])
    assert seen["sandbox"] == {"mode": "auto", "no_new_privs": True, "seccomp": True,
                               "landlock_abi": landlock.abi()}
    assert seen["tries"] == {
        "read /etc/shadow": "EACCES",
        "read its own status": "ok",
        "read /proc/1/environ": "EACCES",
        "read its parent's environ": "EACCES",
        "read /proc/cpuinfo": "ok",
        "read /proc/meminfo": "EACCES",
        "make /dev/shm/x": "EACCES",
        "write /tmp": "EACCES",
        "bind its gRPC port": "ok",
        "bind a port not its own": "EACCES",
        "connect to a port not allowed": "EACCES",
        "connect to its collector": "ok",
        "open a UDP socket": "EPERM",
        "open a raw socket": "EPERM",
        "open a packet socket": "EPERM",
        "start /bin/true": "EPERM",
        "ptrace its parent": "EPERM",
        "signal its parent": "EPERM",
        "write its cache folder": "ok",
        "write its temporary folder": "ok",
        "read the model repository": "ok",
        "read its tokens file": "ok",
        "read a file beside its tokens file": "EACCES",
        "read a file of its working folder": "EACCES",
        "run a jitted function": "ok",
    }


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_the_private_temporary_folder_is_removed_when_the_process_ends(helper_settings,
                                                                          listeners):
    """TMPDIR is a folder of the process's own, gone once it has exited."""
    seen = confined(helper_settings, collector=listeners[1])
    assert os.path.basename(seen["tmpdir"]).startswith("kcoral-")
    await until(lambda: not os.path.exists(seen["tmpdir"]), "the temporary folder removed")


def test_a_thread_started_before_leaves_landlock_off(helper_settings):
    """A thread that runs before the process confines itself would escape
    Landlock: auto leaves Landlock off (and applies the rest)."""
    seen = confined({**helper_settings, "threads": 1}, sockets=[])
    assert seen["sandbox"] == {"mode": "auto", "no_new_privs": True, "seccomp": True,
                               "landlock_abi": 0}


#: socket()'s arguments as a program could pass them: any family, type and
#: protocol, with anything in the register's high half, which the kernel ignores.
registers = st.tuples(
    st.sampled_from([socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_PACKET,
                     socket.AF_NETLINK, 0]) | st.integers(0, 64),
    st.sampled_from([socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW, socket.SOCK_RDM,
                     socket.SOCK_SEQPACKET, 10]) | st.integers(0, 15),
    st.sampled_from([0, socket.IPPROTO_TCP, socket.IPPROTO_UDP, 132, 262]),
    st.sampled_from([0, socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC]),
    st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)
).map(lambda r: (r[0] | r[4] << 32, r[1] | r[3] | r[5] << 32, r[2]))


def allowed(family: int, kind: int, protocol: int) -> bool:
    return (family & 0xFFFFFFFF) in seccomp.FAMILIES and (kind & 0xF) == socket.SOCK_STREAM \
        and protocol in seccomp.PROTOCOLS


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(st.lists(registers, min_size=20, max_size=60))
def test_only_tcp_and_unix_stream_sockets_are_opened(triples):
    """Whatever socket() is asked for, a confined process gets EPERM exactly
    when it is not a TCP or UNIX stream socket (nor IPv4 or IPv6 but TCP)."""
    seen = confined({"gpus": "none"}, triples)
    for triple, result in zip(triples, seen["sockets"]):
        assert (result == "EPERM") == (not allowed(*triple)), (triple, result)


# -- the filter's argument matching ----------------------------------------------------------

@given(st.frozensets(st.integers(0, 2**32 - 1), max_size=6) | st.just(seccomp.FAMILIES),
       st.integers(0, 2**32 - 1))
def test_the_values_refused_are_exactly_those_outside(allowed_values, value):
    """outside() covers every value of 32 bits but the allowed ones, each by one pair."""
    pairs = seccomp.outside(allowed_values)
    matched = [p for p in pairs if value & p[0] == p[1]]
    assert len(matched) == (0 if value in allowed_values else 1)
    assert len(pairs) <= 32 * max(len(allowed_values), 1)


# -- the policy of a server's settings -------------------------------------------------------

def test_the_policy_reads_what_the_settings_name_and_writes_only_the_caches(tmp_path):
    """The repository, TLS and tokens files are read-only; the caches read-write;
    its own /proc/<pid>, never /proc; no GPU rules, no program to run on the CPU."""
    names = {n: str(tmp_path / n) for n in ("repo", "cert", "key", "ca", "tokens", "up", "cc")}
    policy = policy_for(ServerConfig(
        gpus="none", model_repository=names["repo"], tls_cert=names["cert"], tls_key=names["key"],
        tls_client_ca=names["ca"], client_tokens_file=names["tokens"], cache_dir=names["up"],
        compilation_cache_dir=names["cc"]), environ={}, pid=PID)
    assert {names[n] for n in ("repo", "cert", "key", "ca", "tokens")} <= set(policy.read_only)
    assert set(policy.read_write) == {names["up"], names["cc"]}
    assert f"/proc/{PID}" in policy.read_only and "/proc" not in policy.read_only
    assert f"/proc/{PID}/task" in policy.written and "/dev/null" in policy.written
    assert {sys.prefix, sys.base_prefix} <= set(policy.read_only)
    assert not any(p.startswith(("/dev/shm", "/dev/nvidia")) for p in
                   (*policy.read_only, *policy.read_write, *policy.written))
    assert policy.execute is False and policy.bind == () and policy.connect == ()


def test_the_policy_has_no_write_rule_for_a_server_without_caches():
    """No cache folder: nothing but its devices and thread names is written."""
    policy = policy_for(ServerConfig(gpus="none"), environ={}, pid=PID)
    assert policy.read_write == ()
    assert set(policy.written) == {"/dev/null", f"/proc/{PID}/task"}


def test_the_grpc_port_is_the_one_port_left_to_bind():
    """The HTTP port is bound before the process is confined; its gRPC front's after."""
    assert policy_for(ServerConfig(gpus="none", grpc_port=8001), environ={}).bind == (8001,)


@pytest.mark.parametrize("environ, port", [
    ({}, 4318),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4319"}, 4319),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector"}, 443),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4319",
      "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:9999/v1/traces"}, 9999),
])
def test_otlp_tracing_may_connect_to_its_collector_alone(environ, port):
    """--tracing otlp: the collector's port (the traces' own endpoint first), and
    the files a name is looked up in; without it, no port at all."""
    assert otlp_port(environ) == port
    policy = policy_for(ServerConfig(gpus="none", tracing="otlp"), environ=environ)
    assert policy.connect == (port,) and "/etc/hosts" in policy.read_only
    assert policy_for(ServerConfig(gpus="none", tracing="console"), environ=environ).connect == ()


@pytest.mark.parametrize("gpus, platforms", [("none", ""), ("0", "cpu"), ("none", "cuda")])
def test_a_cpu_server_is_not_given_the_gpus_rules(gpus, platforms):
    """--gpus none, or JAX held to the CPU: a CPU server, whatever the host has."""
    assert not serves_gpu(ServerConfig(gpus=gpus), {"JAX_PLATFORMS": platforms})
