"""
A node's front processes (C{--front-processes}, L{kcoral.node.front}): the
port they share, and a node whose gRPC port several processes serve, with
real processes, sockets and JAX.
"""

from __future__ import annotations

import os
import re
import socket

import grpc
import numpy as np
import pytest
import pytest_twisted
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException
from twisted.internet.error import CannotListenError
from twisted.internet.protocol import Factory, Protocol

from kcoral.node.front import FRONT_LISTEN, front_argv
from kcoral.router.service import RouterConfig
from kcoral.web.endpoint import SharedPortEndpoint
from tests.conftest import server_args
from tests.harness import START_TIMEOUT, kcoral_argv, until
from tests.httputil import request
from tests.test_grpc_front import TOKEN, export_mlp, in_thread, timed_probes
from tests.test_node_multi import FAST, GATEWAY

GRPC_PORT = re.compile(r"^\S+ info  \[kcoral\.inference\.h2front\] serving the inference protocol "
                       r"over gRPC on [\d.]+:(?P<port>\d+)")
FRONT_STARTED = re.compile(r"(?P<front>front\d+) started \(pid (?P<pid>\d+)\)")
#: Fresh connections in a row: the kernel spreads connections, not calls.
CONNECTIONS = 30


def _accepting(reactor, port: int):
    """A listener on C{port} shared with others: its port and the
    connections it accepted."""
    accepted: list[Protocol] = []

    class Count(Protocol):
        def connectionMade(self):
            accepted.append(self)

    endpoint = SharedPortEndpoint(reactor, port)
    return endpoint.listen(Factory.forProtocol(Count)), accepted


@pytest_twisted.ensureDeferred
async def test_a_shared_port_is_served_by_every_listener_on_it(reactor):
    """Two listeners with SO_REUSEPORT take the same port, and the kernel gives both
    connections."""
    first, accepted_first = _accepting(reactor, 0)
    first = await first
    port = first.getHost().port
    second, accepted_second = _accepting(reactor, port)
    second = await second
    try:
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        await until(lambda: len(accepted_first) + len(accepted_second) == 40, "40 accepted")
        assert accepted_first and accepted_second, (len(accepted_first), len(accepted_second))
    finally:
        for client in clients:
            client.close()
        await first.stopListening()
        await second.stopListening()


@pytest_twisted.ensureDeferred
async def test_a_port_taken_without_sharing_cannot_be_shared(reactor):
    """A port another socket holds without SO_REUSEPORT is refused, as a taken port is."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listening, _ = _accepting(reactor, taken.getsockname()[1])
        with pytest.raises(CannotListenError):
            await listening


def test_a_front_process_gets_the_gateways_settings_and_a_private_http_port():
    """A front process runs as a Router on the gateway's gRPC port and settings, its HTTP on
    loopback, and no secret on its command line."""
    config = RouterConfig(host="0.0.0.0", grpc_port=0, front_processes=4, max_request_bytes=1000,
                          client_token="hush", client_tokens_file="tokens", tls_cert="c.pem",
                          tls_key="k.pem", routing="least-loaded", unhealthy_threshold=1)
    argv = front_argv(config, 8001)
    assert argv[1:4] == ["-m", "kcoral", "router"]
    given = dict(zip(argv[4::2], argv[5::2], strict=True))
    assert given == {
        "--listen": FRONT_LISTEN, "--host": "0.0.0.0", "--grpc-port": "8001",
        "--front-processes": "4", "--max-request-bytes": "1000", "--routing": "least-loaded",
        "--client-tokens-file": "tokens", "--tls-cert": "c.pem", "--tls-key": "k.pem",
        "--unhealthy-threshold": "1", "--recovery-threshold": "2",
        "--max-status-age-seconds": "5.0", "--queue-wait-timeout-seconds": "1800.0",
        "--max-queued-requests": "1024", "--log-format": "text", "--tracing": "none"}
    assert "hush" not in argv


def _front_counts(text: str) -> dict[str, float]:
    """The runs each front process queued, by its name, from a gateway's /metrics."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kcoral_queue_wait_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count") and "front" in sample.labels:
                    counts[sample.labels["front"]] = sample.value
    return counts


def _front_pids(node) -> dict[str, int]:
    """The process of each front process, the last one started under its name."""
    return {m.group("front"): int(m.group("pid")) for m in map(
        FRONT_STARTED.search, node.matching(FRONT_STARTED)) if m}


def _calls(address: str, count: int, token: str = TOKEN, refused: str | None = None) -> None:
    """C{count} inferences, each on a fresh connection: with C{token}, the same answer
    bit for bit whichever process took the connection; UNAUTHENTICATED without it, and
    with C{refused}."""
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
    answers = []
    for _ in range(count):
        answers.append(timed_probes(address, {"authorization": f"Bearer {token}"}, "mlp", x,
                                    ("input", "output"))[1])
        np.testing.assert_array_equal(answers[-1], answers[0])
        for metadata in ({}, {"authorization": f"Bearer {refused}"} if refused else {}):
            with pytest.raises(InferenceServerException) as ended:
                timed_probes(address, metadata, "mlp", x, ("input", "output"))
            assert ended.value.status() == str(grpc.StatusCode.UNAUTHENTICATED)
    np.testing.assert_allclose(answers[0], np.tanh(x), rtol=1e-6)


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_front_processes_serve_the_gateways_grpc_port(processes, tmp_path):
    """
    With --front-processes 3 a node of one worker has a gateway and two front processes
    on one gRPC port: calls on fresh connections are answered (and refused without the
    token) by all three; a front process killed is restarted and the port goes on
    serving; SIGHUP makes every one of them read the tokens file again; SIGTERM stops
    the node and every process of it, exit status 0.
    """
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    node = processes.spawn(kcoral_argv(*server_args(
        "--model-repository", export_mlp(tmp_path), "--grpc-port", "0",
        "--front-processes", "3", "--client-tokens-file", str(tokens), *FAST)), name="node")
    gateway = (await node.wait_for_line(GATEWAY, START_TIMEOUT)).group("url")
    address = f"127.0.0.1:{(await node.wait_for_line(GRPC_PORT, START_TIMEOUT)).group('port')}"
    for name in ("worker0", "front1", "front2"):
        await node.wait_for_line(rf"\] {name} is ready at ", START_TIMEOUT)

    await in_thread(_calls, address, CONNECTIONS)
    counts = _front_counts((await request("GET", gateway + "/metrics")).body.decode())
    assert set(counts) == {"front1", "front2"} and all(counts.values()), counts

    since = node.mark()
    os.kill(_front_pids(node)["front1"], 9)
    await node.wait_for_line(r"front1 exited with signal 9; restarting", 30, since)
    await node.wait_for_line(r"\] front1 is ready at ", START_TIMEOUT, since)
    await in_thread(_calls, address, 5)

    since = node.mark()
    tokens.write_text(TOKEN[::-1] + "\n")
    node.signal("HUP")
    await until(lambda: len(node.matching(r"read the client tokens of .* again: 1 in force",
                                          since)) == 3, "the tokens file read again by all three")
    await in_thread(_calls, address, CONNECTIONS, TOKEN[::-1], TOKEN)

    started = [int(m.group("pid")) for m in map(FRONT_STARTED.search,
                                                node.matching(FRONT_STARTED)) if m]
    assert len(started) == 3, started  # two, and the one restarted
    node.signal("TERM")
    assert await node.exited(60) == 0, node.tail(80)
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not node.matching("Traceback"), node.tail(80)
