"""
A refused request's bytes are let go as it is answered: a client that sends
large inferences the server refuses (here a binary input that is not its
shape's size) does not pile them up in the server's memory until Python's
cycle collector happens to run. Their failures' frames held the requests in
cycles, one through the thread pool that parsed them, one through the
answer's errback (REST and gRPC alike), and a process of JAX's many
objects collects seldom: 150 refused 4 MiB requests had taken 600 MiB
before the collector ran.
"""

from __future__ import annotations

import http.client
import json

import grpc
import pytest
import pytest_twisted
from tritonclient.grpc import service_pb2
from twisted.internet import threads

from kcoral.inference.h2front import SERVICE
from tests.conftest import server_args
from tests.test_front_door import rss_bytes
from tests.test_models import start_grpc_front
from tests.test_shared_memory import export_simple

SIZE = 4 << 20


@pytest_twisted.async_fixture(scope="module")
async def server(module_processes, tmp_path_factory) -> tuple[str, str, int]:
    """A standalone server of Triton's C{simple}: its REST host:port, its
    gRPC address and its pid."""
    root = tmp_path_factory.mktemp("refusals")
    args = server_args("--model-repository", export_simple(root), "--grpc-port", "0")
    address, url, process = await start_grpc_front(module_processes, "server", args)
    return url.removeprefix("http://"), address, process.pid


def _refused_many(rest: str, grpc_address: str, pid: int, count: int) -> int:
    """Send C{count} inferences whose INPUT0 is SIZE bytes (its shape's is
    64), each refused 400; the server's memory growth meanwhile."""
    header = json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16],
         "parameters": {"binary_data_size": SIZE}},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}]}).encode()
    body = header + bytes(SIZE)
    connection = http.client.HTTPConnection(rest, timeout=60)
    before = rss_bytes(pid)
    try:
        for _ in range(count):
            connection.request("POST", "/v2/models/simple/infer", body,
                               {"Inference-Header-Content-Length": str(len(header))})
            answer = connection.getresponse()
            assert answer.status == 400 and "INPUT0" in json.loads(answer.read())["error"]
    finally:
        connection.close()
    return rss_bytes(pid) - before


@pytest_twisted.ensureDeferred
async def test_refused_large_inferences_are_let_go(server):
    """Sixty refused inferences of 4 MiB each (parsed in a thread, refused,
    answered) leave the server's memory within 64 MiB of where it was, not
    240 MiB above it."""
    await threads.deferToThread(_refused_many, *server, 5)  # the first allocations' own growth
    grown = await threads.deferToThread(_refused_many, *server, 60)
    assert grown < 64 << 20, f"{grown >> 20} MiB"


def _refused_many_over_grpc(rest: str, grpc_address: str, pid: int, count: int) -> int:
    """As L{_refused_many}, over gRPC: each INVALID_ARGUMENT."""
    channel = grpc.insecure_channel(grpc_address, options=[("grpc.max_send_message_length", 2 * SIZE)])
    infer = channel.unary_unary(f"/{SERVICE}/ModelInfer",
                                request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                response_deserializer=service_pb2.ModelInferResponse.FromString)
    pb = service_pb2.ModelInferRequest(model_name="simple")
    pb.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 16])
    pb.inputs.add(name="INPUT1", datatype="INT32", shape=[1, 16])
    pb.raw_input_contents.extend([bytes(SIZE), bytes(64)])
    before = rss_bytes(pid)
    try:
        for _ in range(count):
            with pytest.raises(grpc.RpcError) as refused:
                infer(pb, timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    finally:
        channel.close()
    return rss_bytes(pid) - before


@pytest_twisted.ensureDeferred
async def test_refused_large_grpc_inferences_are_let_go(server):
    """The same over gRPC."""
    await threads.deferToThread(_refused_many_over_grpc, *server, 5)
    grown = await threads.deferToThread(_refused_many_over_grpc, *server, 60)
    assert grown < 64 << 20, f"{grown >> 20} MiB"
