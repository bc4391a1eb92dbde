"""
CUDA shared memory: the registry a front keeps of its clients' regions (by
client token, bounded), the checks of a registration, and the answers of a
service none of whose workers holds a GPU (status empty, unregistration
accepted, registration refused with the reason once the request itself is
well formed), over REST and gRPC on a standalone server and a node's
gateway. Opening a region on a GPU is bench/gpu_check.sh's to verify.
"""

from __future__ import annotations

import base64
import http.client
import json

import grpc
import pytest
import pytest_twisted
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException
from twisted.internet import threads
from zope.interface.verify import verifyObject

from kcoral.errors import BadRequest
from kcoral.inference.cudasharedmemory import (
    HANDLE_BYTES,
    NO_GPU,
    CudaIpcOpener,
    CudaRegistration,
    CudaSharedMemory,
    IDeviceMemoryOpener,
)
from kcoral.inference.h2front import SERVICE
from kcoral.inference.sharedmemory import MAX_REGIONS, Caller
from tests.conftest import server_args
from tests.test_models import start_grpc_front
from tests.test_shared_memory import TOKENS, _headers, export_simple

A, B = Caller(b"Bearer a", "127.0.0.1"), Caller(b"Bearer b", "127.0.0.1")
HANDLE = base64.b64encode(bytes(range(HANDLE_BYTES))).decode()


def _body(**changes: object) -> dict:
    return {"raw_handle": {"b64": HANDLE}, "device_id": 0, "byte_size": 64, **changes}


def test_a_region_is_its_tokens_alone_and_a_token_holds_a_bounded_number():
    """A registered region is listed in Triton's form for its token only; a
    name is registered once per token; a token holds at most MAX_REGIONS;
    unregistering one that is not there is accepted, as Triton does."""
    cuda = CudaSharedMemory(refused=None, max_bytes=1 << 20, namespaced=True)
    cuda.register(A, cuda.registration("r", _body(device_id=1)))
    assert cuda.status(A, None) == [{"name": "r", "device_id": 1, "byte_size": 64}]
    assert cuda.status(A, "r") == cuda.status(A, None)
    assert cuda.status(B, None) == [] and cuda.status(A, "other") == []
    with pytest.raises(BadRequest, match="already in manager"):
        cuda.register(A, cuda.registration("r", _body()))
    cuda.register(B, cuda.registration("r", _body()))
    for i in range(MAX_REGIONS - 1):
        cuda.register(A, cuda.registration(f"r{i}", _body()))
    with pytest.raises(BadRequest, match=f"{MAX_REGIONS} regions"):
        cuda.register(A, cuda.registration("one-more", _body()))
    cuda.unregister(A, "never")
    cuda.unregister(A, "r")
    assert len(cuda.status(A, None)) == MAX_REGIONS - 1
    cuda.unregister(A, None)
    assert cuda.status(A, None) == [] and len(cuda.status(B, None)) == 1


@pytest.mark.parametrize("body, words", [
    ([], "a JSON object"),
    (_body(raw_handle=HANDLE), "raw_handle must be"),
    (_body(raw_handle={"b64": "not base64!"}), "raw_handle must be"),
    (_body(raw_handle={"b64": base64.b64encode(b"short").decode()}), "raw_handle must be"),
    (_body(raw_handle={"b64": "\udcff"}), "raw_handle must be"),
    (_body(device_id=-1), "device_id"), (_body(device_id=True), "device_id"),
    (_body(device_id="0"), "device_id"), (_body(device_id=1 << 40), "device_id"),
    (_body(byte_size=0), "byte_size"), (_body(byte_size=(1 << 20) + 1), "byte_size"),
    (_body(byte_size=64.0), "byte_size"), (_body(byte_size=None), "byte_size"),
])
def test_a_malformed_registration_is_refused_with_what_is_wrong(body, words):
    """Each part of a registration is checked, and its refusal names it."""
    with pytest.raises(BadRequest, match=words):
        CudaRegistration.of_rest("r", body, max_bytes=1 << 20)


def test_with_no_gpu_a_well_formed_registration_is_refused_naming_why():
    """Where no worker holds a GPU the registry stays empty and a
    well-formed registration is refused with the reason; a malformed one is
    refused for what is wrong with it first."""
    cuda = CudaSharedMemory()
    with pytest.raises(BadRequest, match="no worker of this service holds a GPU"):
        cuda.register(A, cuda.registration("r", _body()))
    with pytest.raises(BadRequest, match="name must be"):
        cuda.register(A, cuda.registration("", _body()))
    assert cuda.status(A, None) == []


def test_the_cuda_opener_provides_the_interface_without_cuda_python():
    """The CUDA opener is an IDeviceMemoryOpener, made without importing
    cuda-python (which only a worker on a GPU needs)."""
    assert verifyObject(IDeviceMemoryOpener, CudaIpcOpener())


@pytest_twisted.async_fixture(scope="module", params=["server", "gateway"])
async def front(request: pytest.FixtureRequest, module_processes, tmp_path_factory):
    """A standalone server, or a node's gateway before two CPU workers, with
    client tokens: its REST host:port and its gRPC address."""
    root = tmp_path_factory.mktemp("cudashm")
    (root / "tokens").write_text("\n".join(TOKENS) + "\n")
    args = server_args("--model-repository", export_simple(root), "--grpc-port", "0",
                       "--client-tokens-file", str(root / "tokens"), "--allow-client-shm")
    address, url, _ = await start_grpc_front(module_processes, request.param, args)
    return url.removeprefix("http://"), address


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
FIELDS = st.fixed_dictionaries({}, optional={
    "raw_handle": JSON | st.builds(lambda b: {"b64": b}, JSON | st.sampled_from([HANDLE, ""])),
    "device_id": JSON | st.integers(-2, 4), "byte_size": JSON | st.integers(-2, 1 << 64)})


def _rest_hostile(rest: str) -> None:
    connection = http.client.HTTPConnection(rest, timeout=30)
    client = httpclient.InferenceServerClient(rest)
    headers = {**_headers(TOKENS[0]), "Content-Type": "application/json"}

    def refused(body: bytes) -> str:
        connection.request("POST", "/v2/cudasharedmemory/region/r/register", body, headers)
        answer = connection.getresponse()
        data = answer.read()
        assert answer.status == 400, (body, answer.status, data)
        assert answer.getheader("X-Request-Id"), data
        return json.loads(data)["error"]

    @settings(max_examples=120, deadline=None)
    @given(body=JSON | FIELDS)
    def fuzzed(body):
        assert refused(json.dumps(body).encode())

    try:
        for raw in (b"", b"{", b"[" * 100_000, b"\xff\xfe", b"x" * 70_000):
            assert refused(raw)
        assert NO_GPU in refused(json.dumps(_body()).encode())
        fuzzed()
        # Triton's client library, as its CUDA shared memory examples call it.
        with pytest.raises(InferenceServerException, match="holds a GPU") as raised:
            client.register_cuda_shared_memory("c", HANDLE.encode(), 0, 64, headers=headers)
        assert raised.value.status() == "400"
        assert client.get_cuda_shared_memory_status(headers=headers) == []
        assert client.get_cuda_shared_memory_status("c", headers=headers) == []
        client.unregister_cuda_shared_memory("c", headers=headers)
        client.unregister_cuda_shared_memory(headers=headers)
        assert client.is_server_live()
    finally:
        connection.close()
        client.close()


@pytest_twisted.ensureDeferred
async def test_hostile_rest_registrations_are_json_400s_with_a_request_id(front):
    """Any registration body (not JSON, too deep, too large, any JSON value,
    handles that are not 64 bytes of base64, device numbers and sizes of any
    type and range) is a 400 with a JSON error and a request id, a
    well-formed one included (no worker holds a GPU), never a 5xx; status is
    empty and unregistration accepted, through Triton's client library; the
    front is live after."""
    await threads.deferToThread(_rest_hostile, front[0])


def _grpc_hostile(address: str) -> None:
    channel = grpc.insecure_channel(address)
    register = channel.unary_unary(
        f"/{SERVICE}/CudaSharedMemoryRegister",
        request_serializer=service_pb2.CudaSharedMemoryRegisterRequest.SerializeToString,
        response_deserializer=service_pb2.CudaSharedMemoryRegisterResponse.FromString)
    metadata = [("authorization", f"Bearer {TOKENS[0]}")]
    client = grpcclient.InferenceServerClient(address)

    @settings(max_examples=80, deadline=None)
    @given(name=st.text(max_size=300), handle=st.binary(max_size=80) | st.just(b"\0" * HANDLE_BYTES),
           device_id=st.integers(-(1 << 63), (1 << 63) - 1) | st.integers(-1, 2),
           byte_size=st.integers(0, (1 << 64) - 1) | st.integers(0, 100))
    def fuzzed(name, handle, device_id, byte_size):
        with pytest.raises(grpc.RpcError) as raised:
            register(service_pb2.CudaSharedMemoryRegisterRequest(
                name=name, raw_handle=handle, device_id=device_id, byte_size=byte_size),
                metadata=metadata, timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
        assert raised.value.details()

    try:
        fuzzed()
        with pytest.raises(InferenceServerException, match="holds a GPU"):
            client.register_cuda_shared_memory("c", HANDLE.encode(), 0, 64, headers=dict(metadata))
        assert not client.get_cuda_shared_memory_status(headers=dict(metadata)).regions
        client.unregister_cuda_shared_memory("c", headers=dict(metadata))
        client.unregister_cuda_shared_memory(headers=dict(metadata))
        assert client.is_server_live()
    finally:
        client.close()
        channel.close()


@pytest_twisted.ensureDeferred
async def test_hostile_grpc_registrations_are_invalid_argument(front):
    """Over gRPC, any registration (names of any length, handles of any
    size, device numbers and sizes over their whole range) is
    INVALID_ARGUMENT with its reason, a well-formed one included; status is
    empty and unregistration accepted; the front is live after."""
    await threads.deferToThread(_grpc_hostile, front[1])
