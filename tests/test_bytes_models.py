"""
Models of BYTES tensors served by a standalone server and a node's gateway:
Triton's simple_string (decimal strings summed and subtracted by JAX code)
and simple_identity, written by examples/triton_models.py, driven with
tritonclient over REST (JSON and binary tensors), gRPC (raw contents and
bytes_contents) and system shared memory; concurrent requests of elements
of different lengths batched together; and hostile BYTES bodies.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
import pytest_twisted
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, serialize_byte_tensor
from twisted.internet import threads

from kcoral.protocol.strings import Strings
from tests.conftest import server_args
from tests.test_models import START_TIMEOUT, grpc_address, start_grpc_front
from tests.test_routed import start_node as start_routed_node
from tests.test_routed import start_router, until_ready

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "triton_models.py"
#: simple_identity's max_length, as examples/triton_models.py exports it.
IDENTITY_LENGTH = 64


def decimal(values) -> np.ndarray:
    return np.array([str(v).encode() for v in np.ravel(values)], dtype=object).reshape(np.shape(values))


@pytest.mark.parametrize("invariant", [False, True], ids=["batched", "batch-invariant"])
def test_rows_of_several_requests_run_as_one_execution(tmp_path, invariant):
    """A model's BYTES rows of several requests, their elements of different
    lengths, run as one execution padded to a compiled batch size (or,
    batch invariant, row by row in one of max_batch_size): the program sees
    each element zero padded to max_length with its length, and each row's
    outputs are its own."""
    import jax

    import kcoral
    from kcoral.server.models import ModelRepository

    def echo_and_length(strings):
        return strings, strings.lengths, strings.data.astype(np.int32).sum(axis=-1)

    manifest = kcoral.export_bundle(echo_and_length, None, Strings.of([[b""] * 2], 8),
                                    dir=tmp_path / "echo", name="echo", batch_sizes=[1, 4])
    assert [t.to_json() for t in manifest.inputs] == [
        {"name": "input", "datatype": "BYTES", "shape": [-1, 2], "max_length": 8}]
    assert [t.datatype for t in manifest.outputs] == ["BYTES", "INT32", "INT32"]
    repository = ModelRepository(tmp_path, batch_invariant=invariant)
    repository.load(jax.devices("cpu")[0])
    model = repository.get("echo")
    assert model.batch_invariant is invariant
    first = np.array([[b"a", b"12345678"]], dtype=object)
    second = np.array([[b"", b"\0\0"], [b"xyz", b"\xff"]], dtype=object)
    outputs = model.run_batch({"input": np.concatenate([first, second])}, 3)
    assert outputs["output0"].tolist() == [*first.tolist(), *second.tolist()]
    assert outputs["output1"].tolist() == [[1, 8], [0, 2], [3, 1]]
    assert outputs["output2"].tolist() == [[97, sum(b"12345678")], [0, 0], [sum(b"xyz"), 255]]


def test_export_refuses_what_no_bytes_tensor_is(tmp_path):
    """export_bundle refuses an example Strings of other dtypes or shapes,
    and a function whose Strings output is not uint8 bytes and int32
    lengths of its shape, saying which tensor and what it must be."""
    import jax.numpy as jnp

    import kcoral

    good = Strings.of([[b"a"]], 4)
    for example in (Strings(good.data.astype(np.int32), good.lengths),
                    Strings(good.data, good.lengths.astype(np.int64)),
                    Strings(good.data[..., :0], good.lengths),
                    Strings(good.data[0, 0], good.lengths[0, 0])):
        with pytest.raises(ValueError, match="input 0: a BYTES input's example is a Strings"):
            kcoral.export_bundle(lambda s: s, None, example, dir=tmp_path / "x", name="x")
    with pytest.raises(ValueError, match="output 0: a BYTES output is a Strings of uint8"):
        kcoral.export_bundle(lambda s: Strings(s.data.astype(jnp.int32), s.lengths), None, good,
                             dir=tmp_path / "y", name="y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest_twisted.async_fixture(scope="module")
async def repository(tmp_path_factory) -> str:
    """The repository examples/triton_models.py writes (no fillers)."""
    root = tmp_path_factory.mktemp("bytes") / "repo"
    await threads.deferToThread(subprocess.run, [sys.executable, str(EXAMPLES), str(root),
                                                 "--models", "5"], check=True, timeout=300)
    return str(root)


@pytest_twisted.async_fixture(scope="module", params=[
    "server", pytest.param("gateway", marks=pytest.mark.slow)])
async def front(request: pytest.FixtureRequest, module_processes, repository):
    """A standalone server, or a node's gateway before two CPU workers, of
    the repository, serving REST, gRPC and shared memory: its host:port for
    REST, and for gRPC."""
    args = server_args("--model-repository", repository, "--grpc-port", "0", "--allow-client-shm")
    address, url, _ = await start_grpc_front(module_processes, request.param, args)
    return url.removeprefix("http://"), address


def _sums(module, address: str, binary: bool) -> None:
    client = module.InferenceServerClient(address)
    try:
        a = np.arange(-24, 24, dtype=np.int32).reshape(3, 16) * 1234567
        b = np.arange(48, dtype=np.int32).reshape(3, 16) - 7
        inputs = [module.InferInput("INPUT0", [3, 16], "BYTES"),
                  module.InferInput("INPUT1", [3, 16], "BYTES")]
        outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
        if module is httpclient:
            inputs[0].set_data_from_numpy(decimal(a), binary_data=binary)
            inputs[1].set_data_from_numpy(decimal(b), binary_data=not binary)
            outputs = [module.InferRequestedOutput("OUTPUT0", binary_data=binary),
                       module.InferRequestedOutput("OUTPUT1", binary_data=not binary)]
        else:
            inputs[0].set_data_from_numpy(decimal(a))
            inputs[1].set_data_from_numpy(decimal(b))
        result = client.infer("simple_string", inputs, outputs=outputs)
        for name, expected in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
            got = result.as_numpy(name)
            assert got.shape == (3, 16)
            assert [int(v) for v in got.reshape(-1)] == expected.reshape(-1).tolist()
        metadata = client.get_model_metadata("simple_string")
        config = client.get_model_config("simple_string")
        if module is httpclient:
            assert [t["datatype"] for t in metadata["inputs"]] == ["BYTES", "BYTES"]
            assert config["input"][0]["data_type"] == "TYPE_STRING"
        else:
            assert [t.datatype for t in metadata.inputs] == ["BYTES", "BYTES"]
            assert config.config.input[0].data_type == 13  # TYPE_STRING
    finally:
        client.close()


@pytest.mark.parametrize("binary", [True, False])
@pytest_twisted.ensureDeferred
async def test_rest_decimal_strings_are_summed(front, binary):
    """Over REST, simple_string's rows of decimal strings, one input binary
    and the other JSON, answer their sums and differences as decimal
    strings, binary or JSON as asked; its metadata says BYTES, its
    configuration TYPE_STRING."""
    await threads.deferToThread(_sums, httpclient, front[0], binary)


@pytest_twisted.ensureDeferred
async def test_grpc_decimal_strings_are_summed(front):
    """Over gRPC (raw contents), the same."""
    await threads.deferToThread(_sums, grpcclient, front[1], True)


def _identity(address: str) -> None:
    blobs = [bytes(range(i, i + 4)) for i in range(16)]
    values = np.array([b"he\x00llo", b"", b"\xff\xfe" * 32, *blobs[:13]], dtype=object).reshape(1, 16)
    rest = httpclient.InferenceServerClient(address[0])
    grpc = grpcclient.InferenceServerClient(address[1])
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc._channel)
    try:
        binary = httpclient.InferInput("INPUT0", [1, 16], "BYTES")
        binary.set_data_from_numpy(values)
        got = rest.infer("simple_identity", [binary]).as_numpy("OUTPUT0")
        assert got.tolist() == values.tolist()
        tensor = grpcclient.InferInput("INPUT0", [1, 16], "BYTES")
        tensor.set_data_from_numpy(values)
        assert grpc.infer("simple_identity", [tensor]).as_numpy("OUTPUT0").tolist() == values.tolist()
        # bytes_contents, as grpc_explicit_byte_content_client.py sends them.
        request = service_pb2.ModelInferRequest(model_name="simple_identity")
        explicit = request.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, 16])
        explicit.contents.bytes_contents.extend(values.reshape(-1).tolist())
        answer = stub.ModelInfer(request)
        assert answer.raw_output_contents[0] == serialize_byte_tensor(values).item()
        # Bytes that are not UTF-8 cannot be JSON: asked so, refused in words.
        with pytest.raises(InferenceServerException, match="not UTF-8") as raised:
            rest.infer("simple_identity", [binary],
                       outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])
        assert raised.value.status() == "400"
    finally:
        rest.close()
        grpc.close()


@pytest_twisted.ensureDeferred
async def test_any_bytes_come_back_as_they_went(front):
    """simple_identity gives back embedded NULs, empty elements, bytes that
    are not UTF-8 and an element at max_length exactly, over REST, gRPC raw
    contents and gRPC bytes_contents; JSON refuses what it cannot carry."""
    await threads.deferToThread(_identity, front)


def _concurrent(address: str) -> None:
    def one(i: int) -> None:
        client = httpclient.InferenceServerClient(address)
        try:
            values = np.array([bytes([65 + i]) * ((i + j) % (IDENTITY_LENGTH + 1))
                               for j in range(16 * (1 + i % 3))], dtype=object).reshape(-1, 16)
            tensor = httpclient.InferInput("INPUT0", list(values.shape), "BYTES")
            tensor.set_data_from_numpy(values)
            got = client.infer("simple_identity", [tensor], request_id=f"r{i}").as_numpy("OUTPUT0")
            assert got.tolist() == values.tolist(), i
        finally:
            client.close()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for done in [pool.submit(one, i) for i in range(24)]:
            done.result()


@pytest_twisted.ensureDeferred
async def test_concurrent_rows_of_different_lengths_each_get_their_own(front):
    """Concurrent requests of 1 to 3 rows, elements of every length up to
    max_length, batched together by the front and the worker, each get
    exactly their own elements back."""
    await threads.deferToThread(_concurrent, front[0])


def _through_regions(module, address: str) -> None:
    client = module.InferenceServerClient(address)
    tag = uuid.uuid4().hex[:12]
    a, b = decimal(np.arange(16).reshape(1, 16) * -3), decimal(np.full((1, 16), 1000))
    expected = (decimal(np.arange(16).reshape(1, 16) * -3 + 1000),
                decimal(np.arange(16).reshape(1, 16) * -3 - 1000))
    data = [serialize_byte_tensor(x).item() for x in (a, b, *expected)]
    regions = [shm.create_shared_memory_region(f"{i}-{tag}", f"/kc-s{i}-{tag}", len(d))
               for i, d in enumerate(data)]
    try:
        for i in (0, 1):
            shm.set_shared_memory_region(regions[i], [np.frombuffer(data[i], np.uint8)])
        for i, d in enumerate(data):
            client.register_system_shared_memory(f"r{i}", f"/kc-s{i}-{tag}", len(d))
        inputs = [module.InferInput("INPUT0", [1, 16], "BYTES"),
                  module.InferInput("INPUT1", [1, 16], "BYTES")]
        outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
        for i, tensor in enumerate((*inputs, *outputs)):
            tensor.set_shared_memory(f"r{i}", len(data[i]))
        client.infer("simple_string", inputs, outputs=outputs)
        for i, want in ((2, expected[0]), (3, expected[1])):
            got = shm.get_contents_as_numpy(regions[i], np.object_, [1, 16])
            assert got.tolist() == want.tolist()
        # An output region too small for the answer is refused in words.
        outputs[0].set_shared_memory("r2", len(data[2]) - 1)
        with pytest.raises(InferenceServerException, match="shared memory slice"):
            client.infer("simple_string", inputs, outputs=outputs)
        client.unregister_system_shared_memory()
    finally:
        for region in regions:
            shm.destroy_shared_memory_region(region)
        client.close()


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["rest", "grpc"])
@pytest_twisted.ensureDeferred
async def test_strings_through_shared_memory(front, module):
    """BYTES inputs read from regions in Triton's binary form, and outputs
    written into regions in it, as simple_*_shm_string_client.py use them;
    an output region smaller than the answer is refused."""
    await threads.deferToThread(_through_regions, module, front[0 if module is httpclient else 1])


def _prefixed(*elements: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


#: Binary forms of an INPUT0 of shape [1, 16] that do not hold it.
HOSTILE = st.one_of(
    st.binary(max_size=200),
    st.integers(0, 15).map(lambda n: _prefixed(*[b"x"] * n)),                   # too few
    st.integers(17, 40).map(lambda n: _prefixed(*[b"x"] * n)),                  # too many
    st.integers(1, 3).map(lambda cut: _prefixed(*[b"ab"] * 16)[:-cut]),         # truncated
    st.integers(IDENTITY_LENGTH + 1, 4096).map(lambda n: _prefixed(b"y" * n, *[b""] * 15)),  # over long
    st.integers(1 << 20, (1 << 32) - 1).map(lambda n: struct.pack("<I", n) + b"abc"),  # huge prefix
)


def _hostile(address: str) -> None:
    connection = http.client.HTTPConnection(address, timeout=30)

    def post(body: bytes, header_length: int | None) -> tuple[int, bytes, str | None]:
        headers = {"Content-Type": "application/octet-stream"}
        if header_length is not None:
            headers["Inference-Header-Content-Length"] = str(header_length)
        connection.request("POST", "/v2/models/simple_identity/infer", body, headers)
        answer = connection.getresponse()
        return answer.status, answer.read(), answer.getheader("X-Request-Id")

    @settings(max_examples=150, deadline=None)
    @given(data=HOSTILE, declared=st.one_of(st.none(), st.integers(0, 300)),
           json_data=st.one_of(st.none(), st.lists(st.one_of(st.integers(), st.text(max_size=3),
                                                             st.none()), max_size=20)))
    def check(data, declared, json_data):
        entry: dict = {"name": "INPUT0", "datatype": "BYTES", "shape": [1, 16]}
        if json_data is not None:
            entry["data"] = json_data
            header = json.dumps({"inputs": [entry]}).encode()
            status, body, rid = post(header, None)
            if len(json_data) == 16 and all(isinstance(v, str) for v in json_data):
                assert status == 200, body
                return
        else:
            entry["parameters"] = {"binary_data_size": len(data) if declared is None else declared}
            header = json.dumps({"inputs": [entry]}).encode()
            status, body, rid = post(header + data, len(header))
            if declared in (None, len(data)) and _fits(data):
                assert status == 200, body
                return
        assert status == 400, (status, body)
        assert json.loads(body)["error"] and rid

    try:
        check()
        status, body, _ = post(*_good())
        assert status == 200, body
        status, body, _ = post(*_over_long())
        assert status == 400 and "over its max_length of 64" in json.loads(body)["error"]
    finally:
        connection.close()


def _fits(data: bytes) -> bool:
    """Whether C{data} is the binary form of 16 elements of at most
    IDENTITY_LENGTH bytes (random bytes rarely are: 64 zeros are)."""
    at, count = 0, 0
    while at + 4 <= len(data):
        (length,) = struct.unpack_from("<I", data, at)
        at += 4 + length
        if at > len(data) or length > IDENTITY_LENGTH:
            return False
        count += 1
    return at == len(data) and count == 16


def _good() -> tuple[bytes, int]:
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 16],
                                     "parameters": {"binary_data_size": 16 * 5}}]}).encode()
    return header + _prefixed(*[b"z"] * 16), len(header)


def _over_long() -> tuple[bytes, int]:
    data = _prefixed(b"y" * (IDENTITY_LENGTH + 1), *[b""] * 15)
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 16],
                                     "parameters": {"binary_data_size": len(data)}}]}).encode()
    return header + data, len(header)


@pytest_twisted.ensureDeferred
async def test_hostile_bytes_bodies_are_400s_with_request_ids(front):
    """BYTES bodies of any bytes, length prefixes past the end or of 4 GiB,
    elements truncated, too few or too many, over max_length, a declared
    size that is not theirs, JSON data that is not 16 strings: each a JSON
    400 with a request id (an element over the bound naming it), and the
    front serves a good request afterwards."""
    await threads.deferToThread(_hostile, front[0])


def _kcoral_client(address: str) -> None:
    import kcoral

    client = kcoral.Client(f"http://{address}")
    try:
        values = np.array([[b"he\x00llo", b"", b"\xff" * IDENTITY_LENGTH, b"x"] * 4], dtype=object)
        assert client.infer("simple_identity", {"INPUT0": values})["OUTPUT0"].tolist() == values.tolist()
        a, b = decimal(np.arange(16).reshape(1, 16)), decimal(np.full((1, 16), -5))
        outputs = client.infer("simple_string", {"INPUT0": a, "INPUT1": b})
        assert outputs["OUTPUT0"].tolist() == decimal(np.arange(16).reshape(1, 16) - 5).tolist()
        with pytest.raises(kcoral.BadRequest, match="every element bytes"):
            client.infer("simple_identity", {"INPUT0": np.array([["text"] * 16], dtype=object)})
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_kcoral_client_sends_and_reads_bytes(front):
    """KCoral's own client sends an array of bytes objects as a BYTES input
    and reads BYTES outputs back as one; an array of other objects is
    refused before it is sent."""
    await threads.deferToThread(_kcoral_client, front[0])


def _hostile_grpc(address: str) -> None:
    client = grpcclient.InferenceServerClient(address)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(client._channel)

    @settings(max_examples=80, deadline=None)
    @given(data=HOSTILE, explicit=st.booleans())
    def check(data, explicit):
        request = service_pb2.ModelInferRequest(model_name="simple_identity")
        tensor = request.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, 16])
        if explicit:
            # Elements in bytes_contents: too few or too many, or too long.
            count = len(data) % 33
            tensor.contents.bytes_contents.extend([data[:IDENTITY_LENGTH + 1]] * count)
            fits = count == 16 and len(data[:IDENTITY_LENGTH + 1]) <= IDENTITY_LENGTH
        else:
            request.raw_input_contents.append(data)
            fits = _fits(data)
        try:
            stub.ModelInfer(request, timeout=30)
        except grpc.RpcError as e:
            assert not fits and e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            assert e.details()
            return
        assert fits

    try:
        check()
        assert client.is_server_ready() and client.is_model_ready("simple_identity")
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_hostile_grpc_bytes_are_invalid_argument(front):
    """Over gRPC, raw contents of any bytes and bytes_contents of the wrong
    count or over max_length are each INVALID_ARGUMENT with a message, and
    the front is ready afterwards."""
    await threads.deferToThread(_hostile_grpc, front[1])


def _numbers_refuse_bytes(address: str) -> None:
    client = httpclient.InferenceServerClient(address)
    try:
        inputs = [httpclient.InferInput(name, [1, 16], "BYTES") for name in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(decimal(np.ones((1, 16), np.int32)))
        with pytest.raises(InferenceServerException, match="has datatype BYTES, the model takes INT32"):
            client.infer("simple", inputs)
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_a_model_of_numbers_refuses_bytes(front):
    """A BYTES tensor sent to a model that declares none is a 400 naming
    both datatypes."""
    await threads.deferToThread(_numbers_refuse_bytes, front[0])


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_a_router_serves_strings(module_processes, repository):
    """A Router before a node of the repository answers simple_string and
    simple_identity over REST and gRPC as a server does."""
    router = await start_router(module_processes, "--grpc-port", "0")
    await start_routed_node(module_processes, router.url, "n0", "--model-repository", repository)
    await until_ready(router, "n0", timeout=START_TIMEOUT)
    address = await grpc_address(router.process)
    url = router.url.removeprefix("http://")
    await threads.deferToThread(_sums, httpclient, url, True)
    await threads.deferToThread(_sums, grpcclient, address, True)
    await threads.deferToThread(_identity, (url, address))
