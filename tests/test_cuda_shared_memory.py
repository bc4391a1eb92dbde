"""
CUDA shared memory: the registry a front keeps of its clients' regions (by
client token, bounded, one namespace with system regions), the checks of a
registration, and the answers of a service none of whose workers holds a
GPU (status empty, unregistration accepted, registration refused with the
reason once the request itself is well formed), over REST and gRPC on a
standalone server and a node's gateway. Inferences through regions run on
a standalone server and a node's gateway whose opener maps host memory
(tests.hostmemory), the same paths as CUDA's but for the copies; opening a
region on a GPU is bench/gpu_check.sh's to verify (bench.cudashm_check).
"""

from __future__ import annotations

import base64
import ctypes
import enum
import gc
import http.client
import json
import os
import re
import sys
import types
import uuid

import grpc
import numpy as np
import pytest
import pytest_twisted
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException
from twisted.internet import threads
from twisted.internet.defer import Deferred
from twisted.logger import formatEvent, globalLogPublisher
from zope.interface.verify import verifyObject

from kcoral.errors import BadRequest
from kcoral.inference.cudasharedmemory import (
    CUDA_OFF,
    HANDLE_BYTES,
    NO_GPU,
    NOT_HERE,
    CudaIpcOpener,
    CudaRegistration,
    CudaSharedMemory,
    IDeviceMemoryOpener,
    IDeviceRegion,
)
from kcoral.inference.h2front import SERVICE
from kcoral.inference.message import RestMessage
from kcoral.inference.sharedmemory import MAX_REGIONS, NOT_LOOPBACK, Caller, SharedMemory
from kcoral.protocol.inference import InferAnswer
from tests.conftest import server_args
from tests.hostmemory import HostMemoryOpener, handle_of
from tests.test_models import start_grpc_front
from tests.test_shared_memory import TOKENS, _headers, export_simple

A, B = Caller(b"Bearer a", "127.0.0.1"), Caller(b"Bearer b", "127.0.0.1")
HANDLE = base64.b64encode(bytes(range(HANDLE_BYTES))).decode()


def _body(**changes: object) -> dict:
    return {"raw_handle": {"b64": HANDLE}, "device_id": 0, "byte_size": 64, **changes}


@pytest.fixture
def memory(tmp_path) -> HostMemoryOpener:
    """An opener over host memory: one region's memory, C{mem}, of 256 bytes
    counting up, in a folder of its own."""
    (tmp_path / "mem").write_bytes(bytes(range(256)))
    return HostMemoryOpener(str(tmp_path))


def _registries(opener: HostMemoryOpener, max_bytes: int = 1 << 20
                ) -> tuple[SharedMemory, CudaSharedMemory]:
    """A front's registry of system regions, and the CUDA regions in it, served."""
    shared = SharedMemory(refused=None, max_bytes=max_bytes, namespaced=True,
                          directory=opener.folder)
    return shared, CudaSharedMemory(shared, refused=None, opener=opener, max_bytes=max_bytes)


@pytest_twisted.ensureDeferred
async def test_a_region_is_its_tokens_alone_and_a_token_holds_a_bounded_number(memory):
    """A registered region is listed in Triton's form for its token only; a
    name is registered once per token; a token holds at most MAX_REGIONS;
    unregistering one that is not there is accepted, as Triton does."""
    _, cuda = _registries(memory)
    handle = base64.b64encode(handle_of("mem")).decode()

    def body(**changes: object) -> dict:
        return _body(raw_handle={"b64": handle}, **changes)

    await cuda.register(A, cuda.registration("r", body(device_id=1)))
    assert cuda.status(A, None) == [{"name": "r", "device_id": 1, "byte_size": 64}]
    assert cuda.status(A, "r") == cuda.status(A, None)
    assert cuda.status(B, None) == [] and cuda.status(A, "other") == []
    with pytest.raises(BadRequest, match="already in manager"):
        await cuda.register(A, cuda.registration("r", body()))
    await cuda.register(B, cuda.registration("r", body()))
    for i in range(MAX_REGIONS - 1):
        await cuda.register(A, cuda.registration(f"r{i}", body()))
    with pytest.raises(BadRequest, match=f"{MAX_REGIONS} regions"):
        await cuda.register(A, cuda.registration("one-more", body()))
    cuda.unregister(A, "never")
    cuda.unregister(A, "r")
    assert len(cuda.status(A, None)) == MAX_REGIONS - 1
    cuda.unregister(A, None)
    assert cuda.status(A, None) == [] and len(cuda.status(B, None)) == 1


@pytest_twisted.ensureDeferred
async def test_system_and_cuda_regions_share_one_namespace_of_names(memory):
    """As in Triton, a name is one region's of either kind: a CUDA region
    named as a system one is refused, and the reverse; each kind's status
    and unregistration see only that kind."""
    shared, cuda = _registries(memory)
    shared.register(A, "sys", "/mem", 0, 64)
    with pytest.raises(BadRequest, match="already in manager"):
        await cuda.register(A, cuda.checked("sys", handle_of("mem"), 0, 64))
    await cuda.register(A, cuda.checked("dev", handle_of("mem"), 0, 64))
    with pytest.raises(BadRequest, match="already in manager"):
        shared.register(A, "dev", "/mem", 0, 64)
    assert [r["name"] for r in shared.status(A, None)] == ["sys"]
    assert [r["name"] for r in cuda.status(A, None)] == ["dev"]
    with pytest.raises(BadRequest, match="Unable to find system shared memory region"):
        shared.unregister(A, "dev")
    cuda.unregister(A, None)
    assert [r["name"] for r in shared.status(A, None)] == ["sys"]


@pytest_twisted.ensureDeferred
async def test_a_registration_the_opener_refuses_leaves_nothing_registered(memory):
    """A handle the opener cannot open, or a size past the memory it
    exports, is refused with the opener's reason; nothing is registered. A
    client on another host is refused before anything is opened."""
    _, cuda = _registries(memory)
    with pytest.raises(BadRequest, match="no memory of that handle"):
        await cuda.register(A, cuda.checked("r", handle_of("missing"), 0, 64))
    with pytest.raises(BadRequest, match="runs past the memory its handle exports"):
        await cuda.register(A, cuda.checked("r", handle_of("mem"), 0, 257))
    with pytest.raises(BadRequest, match=re.escape(NOT_LOOPBACK)):
        await cuda.register(Caller(b"Bearer a", "10.0.0.7"), cuda.checked("r", handle_of("mem"), 0, 64))
    assert cuda.status(A, None) == [] and memory.closed == []


def _request(inputs: list[tuple[str, int, int]], outputs: list[tuple[str, int, int]]) -> RestMessage:
    """A REST inference naming C{(region, size, offset)} for each input (UINT8)
    and output."""
    header = {
        "inputs": [{"name": f"IN{i}", "shape": [size], "datatype": "UINT8", "parameters": {
            "shared_memory_region": region, "shared_memory_byte_size": size,
            "shared_memory_offset": offset}} for i, (region, size, offset) in enumerate(inputs)],
        "outputs": [{"name": f"OUT{i}", "parameters": {
            "shared_memory_region": region, "shared_memory_byte_size": size,
            "shared_memory_offset": offset}} for i, (region, size, offset) in enumerate(outputs)]}
    return RestMessage(json.dumps(header).encode(), None)


def _resolve(shared: SharedMemory, caller: Caller, request: RestMessage) -> Deferred:
    """What C{shared} resolves C{request} to, which names a region."""
    resolved = shared.resolve(caller, request)
    assert resolved is not None
    return resolved


def _answer(data: bytes) -> InferAnswer:
    """A binary answer of OUT0, C{data}."""
    header = json.dumps({"model_name": "m", "outputs": [{
        "name": "OUT0", "shape": [len(data)], "datatype": "UINT8",
        "parameters": {"binary_data_size": len(data)}}]}).encode()
    return InferAnswer(header + data, len(header))


@pytest_twisted.ensureDeferred
async def test_inputs_are_read_and_outputs_written_within_the_callers_regions(memory):
    """An input naming a CUDA region is read from its slice into the binary
    tensor that the model gets, in a thread (a device's copies wait for its
    work); an output naming one is written into its slice and its answer
    carries no data; a slice past the region, and another token's region,
    are refused in Triton's words."""
    shared, cuda = _registries(memory)
    await cuda.register(A, cuda.checked("r", handle_of("mem"), 0, 256))
    resolved = _resolve(shared, A, _request([("r", 4, 8), ("r", 2, 0)], [("r", 3, 100)]))
    assert not resolved.called  # in a thread
    message, placement = await resolved
    assert bytes(message.body[message.header_length:]) == bytes([8, 9, 10, 11, 0, 1])
    header = json.loads(bytes(message.body[:message.header_length]))
    assert [i["parameters"] for i in header["inputs"]] == [{"binary_data_size": 4},
                                                           {"binary_data_size": 2}]
    placed = await placement.place(_answer(b"\xaa\xbb\xcc"))
    with open(os.path.join(memory.folder, "mem"), "rb") as f:
        assert f.read()[99:104] == bytes([99, 0xaa, 0xbb, 0xcc, 103])
    assert placed.header_length is None
    assert json.loads(placed.body)["outputs"][0]["parameters"] == {
        "shared_memory_region": "r", "shared_memory_byte_size": 3, "shared_memory_offset": 100}
    for request, words in ((_request([("r", 8, 250)], []), "Invalid offset \\+ byte size"),
                           (_request([], [("r", 300, 0)]), "Invalid offset \\+ byte size"),
                           (_request([("r", 4, 0)], []), "Unable to find shared memory region")):
        with pytest.raises(BadRequest, match=words):
            await _resolve(shared, B if "find" in words else A, request)
    with pytest.raises(BadRequest, match="is 3 bytes, its shared memory slice 2"):
        await (await _resolve(shared, A, _request([], [("r", 2, 0)])))[1].place(_answer(b"abc"))


@pytest_twisted.ensureDeferred
async def test_a_region_unregistered_in_use_is_let_go_once_its_inference_is_done(memory):
    """A region unregistered while an inference that names it is in flight
    stays open for that inference (its output is written), and is closed
    once nothing holds it; a later inference naming it is refused."""
    shared, cuda = _registries(memory)
    await cuda.register(A, cuda.checked("r", handle_of("mem"), 0, 256))
    _, placement = await _resolve(shared, A, _request([("r", 4, 0)], [("r", 1, 0)]))
    cuda.unregister(A, "r")
    assert memory.closed == []
    await placement.place(_answer(b"\x7f"))
    with open(os.path.join(memory.folder, "mem"), "rb") as f:
        assert f.read(2) == b"\x7f\x01"
    del placement
    gc.collect()
    assert memory.closed == ["r"]
    with pytest.raises(BadRequest, match="Unable to find shared memory region"):
        await _resolve(shared, A, _request([("r", 4, 0)], []))


def test_the_host_memory_opener_provides_the_interfaces(memory):
    """The tests' opener is an IDeviceMemoryOpener whose regions are
    IDeviceRegions, as the CUDA opener's."""
    assert verifyObject(IDeviceMemoryOpener, memory)
    region = memory.open(CudaRegistration("r", handle_of("mem"), 0, 16))
    assert verifyObject(IDeviceRegion, region)
    region.close()
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


@pytest.mark.parametrize("refused", [NO_GPU, CUDA_OFF, NOT_HERE])
def test_where_it_is_not_served_a_well_formed_registration_is_refused_naming_why(refused):
    """Where it is not served (a server without a GPU, one on a GPU without
    --allow-client-shm, a Router, the default) the registry
    stays empty and a well-formed registration is refused with the reason; a
    malformed one is refused for what is wrong with it first."""
    cuda = CudaSharedMemory(refused=refused) if refused != NOT_HERE else CudaSharedMemory()
    failure = _failure(cuda.register(A, cuda.registration("r", _body())))
    assert failure.check(BadRequest) and failure.value.message == refused
    with pytest.raises(BadRequest, match="name must be"):
        cuda.register(A, cuda.registration("", _body()))
    assert cuda.status(A, None) == []


@pytest.mark.parametrize("opener, allowed, refused", [
    (False, True, NO_GPU), (True, False, CUDA_OFF), (True, True, None)])
def test_a_server_serves_cuda_regions_on_a_device_it_can_open_and_with_the_option(
        tmp_path, opener, allowed, refused):
    """A standalone server refuses CUDA regions naming why until it has a
    device it can open them on (the CUDA opener's once its device is a GPU,
    or one given), and without --allow-client-shm names the option."""
    from twisted.internet.task import Clock

    from kcoral.common.serverconfig import ServerConfig
    from kcoral.server.service import ServerService

    server = ServerService(ServerConfig(port=0, gpus="none", allow_client_shm=allowed), Clock(),
                           device_memory=HostMemoryOpener(str(tmp_path)) if opener else None)
    assert server.cuda_memory.refused == refused


@pytest.mark.parametrize("gpus, opener, allowed, refused", [
    (False, False, True, NO_GPU), (True, False, False, CUDA_OFF), (True, False, True, None),
    (False, True, True, None)])
def test_a_gateway_serves_cuda_regions_where_its_node_has_gpus_and_with_the_option(
        tmp_path, gpus, opener, allowed, refused):
    """A node's gateway, on the GPUs' host, serves its clients' CUDA regions
    where its node has GPU workers (or it was given an opener) and the
    option; a Router, whose clients are on other hosts, never does."""
    from twisted.internet.task import Clock

    from kcoral.node.gateway import Gateway
    from kcoral.router.service import RouterConfig, build_router

    gateway = Gateway(RouterConfig(port=0), Clock(), allowed, on_gpu=gpus,
                      device_memory=HostMemoryOpener(str(tmp_path)) if opener else None)
    assert gateway.app.cuda_memory.refused == refused
    router, _ = build_router(RouterConfig(port=0), Clock())
    assert router.cuda_memory.refused == NOT_HERE


def _failure(d):
    """The Failure a Deferred that has failed holds (then handled)."""
    out: list = []
    d.addErrback(out.append)
    return out[0]


def test_the_cuda_opener_provides_the_interface_without_cuda_python():
    """The CUDA opener is an IDeviceMemoryOpener, made without importing
    cuda-python (which only a worker on a GPU needs)."""
    assert verifyObject(IDeviceMemoryOpener, CudaIpcOpener())


class _Error(enum.Enum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1


class _Kind(enum.Enum):
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2


class FakeCudaRuntime:
    """
    cuda-python's runtime bindings, as far as the CUDA opener calls them,
    over host memory: C{device} is the memory a client exported, its
    address the pointer an IPC handle opens to; each call is kept in
    C{calls} (this machine has no GPU, nor cuda-python, to run them).
    """

    cudaError_t = _Error
    cudaMemcpyKind = _Kind
    cudaIpcMemLazyEnablePeerAccess = 1

    class cudaIpcMemHandle_t:
        reserved = b""

    def __init__(self, device: np.ndarray, close_error: _Error = _Error.cudaSuccess):
        self.device, self.close_error = device, close_error
        self.calls: list[tuple] = []

    def cudaSetDevice(self, number):
        self.calls.append(("set", number))
        return (_Error.cudaSuccess,)

    def cudaIpcOpenMemHandle(self, handle, flags):
        return _Error.cudaSuccess, self.device.ctypes.data

    def cudaMemcpy(self, to, source, size, kind):
        self.calls.append(("copy", kind))
        ctypes.memmove(to, source, size)
        return (_Error.cudaSuccess,)

    def cudaDeviceSynchronize(self):
        self.calls.append(("synchronize",))
        return (_Error.cudaSuccess,)

    def cudaIpcCloseMemHandle(self, pointer):
        self.calls.append(("close", pointer))
        return (self.close_error,)


def _fake_cuda(monkeypatch, runtime: FakeCudaRuntime) -> None:
    """cuda-python's bindings, as C{runtime} and a driver that says the
    handle exports C{runtime.device} whole."""
    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0

    driver = types.SimpleNamespace(CUresult=CUresult, cuMemGetAddressRange=lambda pointer: (
        CUresult.CUDA_SUCCESS, runtime.device.ctypes.data, runtime.device.nbytes))
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", runtime)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)


def test_the_cuda_opener_copies_on_the_regions_device_and_waits_only_for_copies_to_it(
        monkeypatch):
    """A region opened by the CUDA opener copies to and from the host on its own device (set
    in the copying thread each time); it waits for the device after a copy to it, not after one
    from it (which has ended when it returns); closed, on its device too."""
    device = np.arange(64, dtype=np.uint8)
    runtime = FakeCudaRuntime(device)
    _fake_cuda(monkeypatch, runtime)
    region = CudaIpcOpener().open(CudaRegistration("r", bytes(HANDLE_BYTES), 3, 64))
    host = bytearray(8)
    region.read_into(16, memoryview(host))
    assert bytes(host) == bytes(range(16, 24))
    region.write(0, memoryview(b"\xff" * 4))
    assert bytes(device[:5]) == b"\xff\xff\xff\xff\x04"
    region.close()
    assert runtime.calls == [
        ("set", 3),  # opened on it
        ("set", 3), ("copy", _Kind.cudaMemcpyDeviceToHost),
        ("set", 3), ("copy", _Kind.cudaMemcpyHostToDevice), ("synchronize",),
        ("set", 3), ("close", device.ctypes.data)]


def test_a_region_that_fails_to_close_is_logged_not_raised(monkeypatch):
    """Closing happens as a region is let go, for no request: a failure is logged, naming
    the region and its device."""
    runtime = FakeCudaRuntime(np.zeros(64, np.uint8), close_error=_Error.cudaErrorInvalidValue)
    _fake_cuda(monkeypatch, runtime)
    region = CudaIpcOpener().open(CudaRegistration("r", bytes(HANDLE_BYTES), 1, 64))
    logged: list = []
    globalLogPublisher.addObserver(logged.append)
    try:
        region.close()
    finally:
        globalLogPublisher.removeObserver(logged.append)
    [event] = [e for e in logged if "was not closed" in e.get("log_format", "")]
    assert formatEvent(event) == ("CUDA shared memory region 'r' on device 1 was not closed: "
                                  "cudaErrorInvalidValue")


@pytest_twisted.ensureDeferred
async def test_a_server_without_cuda_python_refuses_a_registration_saying_so(
        tmp_path, monkeypatch):
    """On a GPU, a server whose environment lacks cuda-python's bindings (the cuda extra)
    refuses a registration as a bad request naming what to install, not an internal error;
    nothing is registered."""
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", None)
    shared = SharedMemory(refused=None, max_bytes=1 << 20, namespaced=True,
                          directory=str(tmp_path))
    cuda = CudaSharedMemory(shared, refused=None, opener=CudaIpcOpener(), max_bytes=1 << 20)
    with pytest.raises(BadRequest, match=r"kcoral\[cuda\]"):
        await cuda.register(A, cuda.checked("r", bytes(HANDLE_BYTES), 0, 64))
    assert cuda.status(A, None) == []


@pytest_twisted.async_fixture(scope="module", params=["server", "gateway"])
async def front(request: pytest.FixtureRequest, module_processes, tmp_path_factory):
    """A standalone server, or a node's gateway before two CPU workers, with
    client tokens: its REST host:port, its gRPC address, and why it refuses
    CUDA regions."""
    root = tmp_path_factory.mktemp("cudashm")
    (root / "tokens").write_text("\n".join(TOKENS) + "\n")
    args = server_args("--model-repository", export_simple(root), "--grpc-port", "0",
                       "--client-tokens-file", str(root / "tokens"), "--allow-client-shm")
    address, url, _ = await start_grpc_front(module_processes, request.param, args)
    return url.removeprefix("http://"), address, NO_GPU


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
FIELDS = st.fixed_dictionaries({}, optional={
    "raw_handle": JSON | st.builds(lambda b: {"b64": b}, JSON | st.sampled_from([HANDLE, ""])),
    "device_id": JSON | st.integers(-2, 4), "byte_size": JSON | st.integers(-2, 1 << 64)})


def _rest_hostile(rest: str, why: str) -> None:
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
        assert why in refused(json.dumps(_body()).encode())
        fuzzed()
        # Triton's client library, as its CUDA shared memory examples call it.
        with pytest.raises(InferenceServerException, match=re.escape(why)) as raised:
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
    well-formed one included (no worker behind the front holds a GPU), never
    a 5xx; status is empty and unregistration accepted, through Triton's
    client library; the front is live after."""
    await threads.deferToThread(_rest_hostile, front[0], front[2])


def _grpc_hostile(address: str, why: str) -> None:
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
        with pytest.raises(InferenceServerException, match=re.escape(why)):
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
    await threads.deferToThread(_grpc_hostile, front[1], front[2])


# -- inferences through regions, on a server whose opener maps host memory ----------------------

def _over_host_memory(*args: str) -> list[str]:
    """C{kcoral server ARGS...}, its CUDA regions files of /dev/shm."""
    assert args[0] == "server", args
    return [sys.executable, "-m", "tests.hostmemory", "/dev/shm", *args[1:]]


@pytest_twisted.async_fixture(scope="module", params=["server", "gateway"])
async def host_memory_server(request: pytest.FixtureRequest, module_processes, tmp_path_factory):
    """A standalone server of C{simple}, or a node's gateway before two CPU
    workers, with two client tokens, whose CUDA regions are files of
    /dev/shm (tests.hostmemory): its REST host:port and its gRPC address."""
    root = tmp_path_factory.mktemp("cudainfer")
    (root / "tokens").write_text("\n".join(TOKENS) + "\n")
    args = server_args("--model-repository", export_simple(root), "--grpc-port", "0",
                       "--client-tokens-file", str(root / "tokens"), "--allow-client-shm")
    address, url, _ = await start_grpc_front(module_processes, request.param, args,
                                             argv=_over_host_memory)
    return url.removeprefix("http://"), address


class DeviceRegions:
    """An input and an output region of C{simple}'s, as a client's device
    memory: files of /dev/shm, registered by their handles."""

    def __init__(self):
        tag = uuid.uuid4().hex[:12]
        self.names = (f"kc-cuda-in-{tag}", f"kc-cuda-out-{tag}")
        self.a = np.arange(16, dtype=np.int32).reshape(1, 16)
        self.b = np.full((1, 16), 7, np.int32)
        with open(f"/dev/shm/{self.names[0]}", "wb") as f:
            f.write(self.a.tobytes() + self.b.tobytes())
        with open(f"/dev/shm/{self.names[1]}", "wb") as f:
            f.write(bytes(128))

    def handle(self, which: int) -> bytes:
        """Its handle as Triton's client library gives it: base64."""
        return base64.b64encode(handle_of(self.names[which]))

    def outputs(self) -> tuple[np.ndarray, np.ndarray]:
        with open(f"/dev/shm/{self.names[1]}", "rb") as f:
            data = np.frombuffer(f.read(), np.int32)
        return data[:16].reshape(1, 16), data[16:].reshape(1, 16)

    def destroy(self) -> None:
        for name in self.names:
            os.unlink(f"/dev/shm/{name}")


def _through_regions(module, regions: DeviceRegions, input_offset: int = 64):
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"),
              module.InferInput("INPUT1", [1, 16], "INT32")]
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    inputs[0].set_shared_memory("in", 64)
    inputs[1].set_shared_memory("in", 64, offset=input_offset)
    outputs[0].set_shared_memory("out", 64)
    outputs[1].set_shared_memory("out", 64, offset=64)
    return inputs, outputs


def _listed(status) -> dict:
    """The regions of a status answer of either client library: by name,
    their device and size (a system region's: its offset and size)."""
    if isinstance(status, list):
        return {r["name"]: (r.get("device_id", r.get("offset")), r["byte_size"]) for r in status}
    return {name: (r.device_id if hasattr(r, "device_id") else r.offset,
                   r.byte_size) for name, r in status.regions.items()}


def _cuda_round_trip(module, address: str) -> None:
    """Register two regions by handle, infer C{simple} through them, and
    check the refusals of bounds, another token and a region unregistered."""
    client = module.InferenceServerClient(address)
    regions = DeviceRegions()
    mine, theirs = _headers(TOKENS[0]), _headers(TOKENS[1])
    try:
        client.unregister_cuda_shared_memory(headers=dict(mine))
        client.register_cuda_shared_memory("in", regions.handle(0), 0, 128, headers=dict(mine))
        client.register_cuda_shared_memory("out", regions.handle(1), 0, 128, headers=dict(mine))
        with pytest.raises(InferenceServerException, match="runs past the memory"):
            client.register_cuda_shared_memory("big", regions.handle(1), 0, 129, headers=dict(mine))
        inputs, outputs = _through_regions(module, regions)
        answer = client.infer("simple", inputs, outputs=outputs, headers=dict(mine))
        total, difference = regions.outputs()
        np.testing.assert_array_equal(total, regions.a + regions.b)
        np.testing.assert_array_equal(difference, regions.a - regions.b)
        assert answer.get_output("OUTPUT0") is not None
        assert _listed(client.get_cuda_shared_memory_status(headers=dict(mine))) == {
            "in": (0, 128), "out": (0, 128)}
        assert _listed(client.get_system_shared_memory_status(headers=dict(mine))) == {}
        with pytest.raises(InferenceServerException, match="Invalid offset \\+ byte size") as raised:
            inputs, outputs = _through_regions(module, regions, input_offset=100)
            client.infer("simple", inputs, outputs=outputs, headers=dict(mine))
        assert raised.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        # Another token sees none of them, and cannot infer from them.
        assert _listed(client.get_cuda_shared_memory_status(headers=dict(theirs))) == {}
        with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
            inputs, outputs = _through_regions(module, regions)
            client.infer("simple", inputs, outputs=outputs, headers=dict(theirs))
        client.unregister_cuda_shared_memory("in", headers=dict(mine))
        with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
            inputs, outputs = _through_regions(module, regions)
            client.infer("simple", inputs, outputs=outputs, headers=dict(mine))
        client.unregister_cuda_shared_memory(headers=dict(mine))
        assert client.is_server_live()
    finally:
        regions.destroy()
        client.close()


@pytest_twisted.ensureDeferred
async def test_http_inferences_read_and_write_cuda_regions(host_memory_server):
    """Over REST, with Triton's client library: inputs are read from the
    caller's CUDA regions and outputs written into them; a slice past a
    region, another token's region and an unregistered one are refused."""
    await threads.deferToThread(_cuda_round_trip, httpclient, host_memory_server[0])


@pytest_twisted.ensureDeferred
async def test_grpc_inferences_read_and_write_cuda_regions(host_memory_server):
    """Over gRPC, the same."""
    await threads.deferToThread(_cuda_round_trip, grpcclient, host_memory_server[1])
