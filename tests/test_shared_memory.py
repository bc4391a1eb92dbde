"""
System shared memory, Triton's extension: regions registered by a client on
the same host, named by an inference's inputs and outputs, on a standalone
server and a node's gateway, over REST and gRPC, with tritonclient's own
shared-memory utilities; and the registry's bounds against hostile input.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import uuid

import numpy as np
import pytest
import pytest_twisted
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException
from twisted.internet import threads
from twisted.internet.defer import Deferred

from kcoral.common.serverconfig import ServerConfig
from kcoral.errors import BadRequest
from kcoral.inference.message import RestMessage
from kcoral.inference.sharedmemory import NOT_LOOPBACK, OFF, ROUTER, Caller, SharedMemory
from kcoral.node.devices import WorkerSpec
from kcoral.node.supervisor import worker_argv
from kcoral.router.service import RouterConfig, build_router
from kcoral.sandbox.policy import policy_for
from tests.conftest import server_args
from tests.test_models import start_grpc_front

TOKENS = ("t0ken-a", "t0ken-b")
LOCAL = Caller(b"Bearer a", "127.0.0.1")
OBJECT_BYTES = 4096


# -- the registry -------------------------------------------------------------------------------

@pytest.fixture
def folder(tmp_path):
    """A shared-memory folder holding one object, C{/obj}, of L{OBJECT_BYTES}."""
    (tmp_path / "obj").write_bytes(bytes(range(256)) * (OBJECT_BYTES // 256))
    os.symlink("/etc/passwd", tmp_path / "link")
    os.mkdir(tmp_path / "dir")
    return str(tmp_path)


def test_hostile_registrations_are_refused_in_words(folder):
    """Any key, offset and size is registered only where the key is a
    shared-memory name of an object that holds the whole region within the
    bound; anything else is a BadRequest (never another error), and a
    refused registration leaves nothing registered."""
    registry = SharedMemory(refused=None, max_bytes=1024, directory=folder)
    keys = st.one_of(st.sampled_from(["/obj", "/link", "/dir", "/missing", "obj", "//obj",
                                      "/../obj", "/" + "x" * 256, "/ob\x00j", ""]),
                     st.text(max_size=20), st.integers(), st.none())
    counts = st.one_of(st.integers(-2, OBJECT_BYTES + 2), st.integers(), st.floats(), st.text())

    @settings(max_examples=300, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(key=keys, offset=counts, size=counts)
    def check(key, offset, size):
        try:
            registry.register(LOCAL, "r", key, offset, size)
        except BadRequest:
            assert registry.status(LOCAL, None) == []
            return
        assert key == "/obj" and 0 <= offset and 1 <= size <= 1024
        assert offset + size <= OBJECT_BYTES
        registry.unregister(LOCAL, "r")

    check()


def _settled(d: Deferred):
    """What a Deferred that has fired holds: its result, or its Failure."""
    out: list = []
    d.addBoth(out.append)
    return out[0]


def _infer_body(parameters: dict) -> RestMessage:
    return RestMessage(httpclient.InferenceServerClient.generate_request_body(
        [_shm_input("X", parameters)])[0], None)


def _shm_input(name: str, parameters: dict) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, [4], "UINT8")
    tensor.set_shared_memory(parameters["region"], parameters["size"], parameters["offset"])
    return tensor


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, 200), size=st.integers(0, 200))
def test_slices_outside_the_region_are_refused(folder, offset, size):
    """An input's slice is read from the region when it lies within it, and
    refused with Triton's words when it does not."""
    registry = SharedMemory(refused=None, max_bytes=1024, directory=folder)
    registry.register(LOCAL, "r", "/obj", 16, 100)
    try:
        resolved = registry.resolve(LOCAL, _infer_body({"region": "r", "size": size, "offset": offset}))
        assert resolved is not None
        if offset + size > 100:
            failure = _settled(resolved)
            assert failure.check(BadRequest)
            assert "Invalid offset + byte size for shared memory region: 'r'" in failure.value.message
        else:
            message, placement = _settled(resolved)
            body = message.body
            assert body[message.header_length:] == bytes(range(16 + offset, 16 + offset + size))
            assert placement.outputs == {}
    finally:
        registry.close()


def test_regions_are_per_token_and_for_local_clients(folder):
    """A region serves only the token that registered it; a client that is
    not on loopback cannot register; a refusing registry names why."""
    registry = SharedMemory(refused=None, max_bytes=1024, namespaced=True, directory=folder)
    registry.register(LOCAL, "r", "/obj", 0, 64)
    other = Caller(b"Bearer b", "::1")
    with pytest.raises(BadRequest, match="Unable to find shared memory region: 'r'"):
        registry.status(other, "r")
    failure = _settled(registry.resolve(
        other, _infer_body({"region": "r", "size": 4, "offset": 0})))
    assert "Unable to find shared memory region: 'r'" in failure.value.message
    with pytest.raises(BadRequest, match="Unable to find system shared memory region"):
        registry.unregister(other, "r")
    assert registry.status(LOCAL, None)[0]["key"] == "/obj"
    with pytest.raises(BadRequest, match="loopback"):
        registry.register(Caller(None, "10.1.2.3"), "s", "/obj", 0, 64)
    assert NOT_LOOPBACK.startswith("shared memory is served only")
    for why in (OFF, ROUTER):
        with pytest.raises(BadRequest, match="allow-client-shm" if why is OFF else "Router"):
            SharedMemory(refused=why, max_bytes=1024, directory=folder).register(
                LOCAL, "r", "/obj", 0, 64)
    registry.close()


def test_an_object_that_shrinks_is_refused_not_faulted(folder):
    """A client that truncates its object after registering it gets a
    refusal (a short read), and the server no fault."""
    registry = SharedMemory(refused=None, max_bytes=1024, directory=folder)
    registry.register(LOCAL, "r", "/obj", 0, 64)
    os.truncate(os.path.join(folder, "obj"), 8)
    failure = _settled(registry.resolve(
        LOCAL, _infer_body({"region": "r", "size": 4, "offset": 32})))
    assert "shorter than it was when registered" in failure.value.message
    registry.close()


def test_only_a_standalone_server_given_the_option_may_open_dev_shm():
    """With --allow-client-shm a standalone server's Landlock rules allow
    /dev/shm, and without it they do not; a node's workers are never given
    the option (their gateway opens the regions)."""
    cpu = {"JAX_PLATFORMS": "cpu"}
    assert "/dev/shm" in policy_for(ServerConfig(allow_client_shm=True), environ=cpu).read_write
    assert "/dev/shm" not in policy_for(ServerConfig(), environ=cpu).read_write
    argv = worker_argv(ServerConfig(allow_client_shm=True), WorkerSpec("worker0", 0, None), 8100)
    assert not any("shm" in arg for arg in argv)


def test_a_router_refuses_registration(reactor):
    """A Router's front refuses registration with 400 saying why (its
    clients' regions are on other hosts), even from loopback."""
    app, _ = build_router(RouterConfig(), reactor)
    with pytest.raises(BadRequest, match="a Router serves no shared memory") as raised:
        app.shared_memory.register(LOCAL, "r", "/obj", 0, 64)
    assert raised.value.status == 400


# -- real fronts ----------------------------------------------------------------------------------

def export_simple(root) -> str:
    """A repository in C{root} holding Triton's C{simple}: INPUT0, INPUT1
    int32 [1, 16] -> OUTPUT0 their sum, OUTPUT1 their difference."""
    import kcoral

    x = np.zeros((1, 16), np.int32)
    kcoral.export_bundle(lambda a, b: (a + b, a - b), None, x, x, dir=str(root / "simple"),
                         name="simple", input_names=["INPUT0", "INPUT1"],
                         output_names=["OUTPUT0", "OUTPUT1"])
    return str(root)


@pytest_twisted.async_fixture(scope="module", params=["server", "gateway"])
async def shm_front(request: pytest.FixtureRequest, module_processes, tmp_path_factory):
    """A standalone server, or a node's gateway before two CPU workers, of
    C{simple}, serving shared memory, REST and gRPC, to two client tokens:
    its host:port for REST, and for gRPC."""
    root = tmp_path_factory.mktemp("shm")
    (root / "tokens").write_text("\n".join(TOKENS) + "\n")
    args = server_args("--model-repository", export_simple(root), "--grpc-port", "0",
                       "--client-tokens-file", str(root / "tokens"), "--allow-client-shm")
    address, url, _ = await start_grpc_front(module_processes, request.param, args)
    return url.removeprefix("http://"), address


def _headers(token: str) -> dict:
    # Lower case: gRPC metadata keys must be.
    return {"authorization": f"Bearer {token}"}


class Regions:
    """An input and an output region of this process, for C{simple}."""

    def __init__(self):
        tag = uuid.uuid4().hex[:12]
        self.keys = (f"/kc-in-{tag}", f"/kc-out-{tag}")
        self.a = np.arange(16, dtype=np.int32).reshape(1, 16)
        self.b = np.full((1, 16), 7, np.int32)
        self.inputs = shm.create_shared_memory_region(f"in-{tag}", self.keys[0], 128)
        self.outputs = shm.create_shared_memory_region(f"out-{tag}", self.keys[1], 128)
        shm.set_shared_memory_region(self.inputs, [self.a])
        shm.set_shared_memory_region(self.inputs, [self.b], offset=64)

    def sum_and_difference(self) -> tuple[np.ndarray, np.ndarray]:
        return (shm.get_contents_as_numpy(self.outputs, np.int32, [1, 16]),
                shm.get_contents_as_numpy(self.outputs, np.int32, [1, 16], offset=64))

    def destroy(self) -> None:
        shm.destroy_shared_memory_region(self.inputs)
        shm.destroy_shared_memory_region(self.outputs)


def _tensors(module, regions: Regions, through: bool):
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"),
              module.InferInput("INPUT1", [1, 16], "INT32")]
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    if through:
        inputs[0].set_shared_memory("in", 64)
        inputs[1].set_shared_memory("in", 64, offset=64)
        outputs[0].set_shared_memory("out", 64)
        outputs[1].set_shared_memory("out", 64, offset=64)
    else:
        inputs[0].set_data_from_numpy(regions.a)
        inputs[1].set_data_from_numpy(regions.b)
    return inputs, outputs


def _round_trip(module, address: str) -> None:
    """Infer C{simple} with and without regions; the answers agree. Each
    call has headers of its own: tritonclient's infer adds to them."""
    client = module.InferenceServerClient(address)
    regions = Regions()
    try:
        client.unregister_system_shared_memory(headers=_headers(TOKENS[0]))
        client.register_system_shared_memory("in", regions.keys[0], 128, headers=_headers(TOKENS[0]))
        client.register_system_shared_memory("out", regions.keys[1], 128, headers=_headers(TOKENS[0]))
        inputs, outputs = _tensors(module, regions, through=False)
        plain = client.infer("simple", inputs, outputs=outputs, headers=_headers(TOKENS[0]))
        inputs, outputs = _tensors(module, regions, through=True)
        through = client.infer("simple", inputs, outputs=outputs, headers=_headers(TOKENS[0]))
        total, difference = regions.sum_and_difference()
        np.testing.assert_array_equal(total, plain.as_numpy("OUTPUT0"))
        np.testing.assert_array_equal(difference, plain.as_numpy("OUTPUT1"))
        np.testing.assert_array_equal(total, regions.a + regions.b)
        assert through.get_output("OUTPUT0") is not None
        status = client.get_system_shared_memory_status(headers=_headers(TOKENS[0]))
        names = {r["name"] for r in status} if module is httpclient else set(status.regions)
        assert names == {"in", "out"}
        # Another token sees none of them, and cannot infer from them.
        with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
            client.infer("simple", inputs, outputs=outputs, headers=_headers(TOKENS[1]))
        client.unregister_system_shared_memory(headers=_headers(TOKENS[0]))
    finally:
        regions.destroy()
        client.close()


@pytest_twisted.ensureDeferred
async def test_http_inputs_and_outputs_through_regions_answer_as_without(shm_front):
    """Over REST, an inference whose inputs and outputs are in regions
    answers what it answers without them; another token's request naming
    the regions is refused."""
    await threads.deferToThread(_round_trip, httpclient, shm_front[0])


@pytest_twisted.ensureDeferred
async def test_grpc_inputs_and_outputs_through_regions_answer_as_without(shm_front):
    """Over gRPC, the same."""
    await threads.deferToThread(_round_trip, grpcclient, shm_front[1])


def _hostile(address: str) -> None:
    client = httpclient.InferenceServerClient(address)
    headers = _headers(TOKENS[0])
    try:
        for key, size, words in (("no-slash", 64, "Unable to open shared memory region"),
                                 ("/a/b", 64, "Unable to open shared memory region"),
                                 ("/kc-missing-" + uuid.uuid4().hex, 64, "Unable to open"),
                                 ("/x", 1 << 40, "over the")):
            with pytest.raises(InferenceServerException, match=words) as raised:
                client.register_system_shared_memory("bad", key, size, headers=headers)
            assert raised.value.status() == "400"
        with pytest.raises(InferenceServerException, match="Unable to find system shared memory"):
            client.unregister_system_shared_memory("never", headers=headers)
        assert client.get_cuda_shared_memory_status(headers=headers) == []
        client.unregister_cuda_shared_memory(headers=headers)
        # Refused: the server holds no GPU, a gateway none at all.
        with pytest.raises(InferenceServerException,
                           match="CUDA shared memory is (not served|served only by a standalone)"):
            # A handle as Triton's client library gives it: base64.
            client.register_cuda_shared_memory("c", base64.b64encode(b"\0" * 64), 0, 64,
                                               headers=headers)
        assert "system_shared_memory" in client.get_server_metadata()["extensions"]
        assert client.is_server_live()
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_hostile_registrations_answer_in_triton_words(shm_front):
    """Keys that are no shared-memory name or name nothing, sizes over the
    bound and an unknown region's unregistration are refused with 400 in
    Triton's words; CUDA shared memory is empty and refused; the front is
    live afterwards and lists the extension."""
    await threads.deferToThread(_hostile, shm_front[0])


def _fuzzed(address: str) -> None:
    connection = http.client.HTTPConnection(address, timeout=30)
    values = st.one_of(st.integers(), st.integers(-2, 1 << 20), st.text(max_size=8), st.none(),
                       st.floats(), st.lists(st.integers(), max_size=2))
    keys = st.one_of(values, st.sampled_from(["/", "/x", "/" + "k" * 300, "/../etc/passwd"]),
                     st.text(max_size=40).map(lambda t: "/" + t))

    @settings(max_examples=120, deadline=None)
    @given(name=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="/?#%"),
                        min_size=1, max_size=40),
           key=keys, offset=values, size=values)
    def check(name, key, offset, size):
        # Only what names no object: one that exists might be registered.
        assume(not isinstance(key, str) or not os.path.isfile(os.path.join("/dev/shm", key[1:])))
        connection.request("POST", f"/v2/systemsharedmemory/region/{name}/register",
                           json.dumps({"key": key, "offset": offset, "byte_size": size}),
                           {**_headers(TOKENS[0]), "Content-Type": "application/json"})
        answer = connection.getresponse()
        body = answer.read()
        assert answer.status == 400, (answer.status, body)
        assert json.loads(body)["error"] and answer.getheader("X-Request-Id")

    try:
        check()
        connection.request("GET", "/v2/systemsharedmemory/status", headers=_headers(TOKENS[0]))
        answer = connection.getresponse()
        assert answer.status == 200 and json.loads(answer.read()) == []
    finally:
        connection.close()


@pytest_twisted.ensureDeferred
async def test_fuzzed_registrations_are_json_400s_with_request_ids(shm_front):
    """Registrations of any name, key, offset and size that name no object
    of this process's are refused with 400, a JSON error and a request id,
    and leave nothing registered."""
    await threads.deferToThread(_fuzzed, shm_front[0])


def _refused(address: str) -> None:
    client = httpclient.InferenceServerClient(address)
    try:
        with pytest.raises(InferenceServerException, match="--allow-client-shm") as raised:
            client.register_system_shared_memory("r", "/anything", 64)
        assert raised.value.status() == "400"
        assert client.get_system_shared_memory_status() == []
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_shared_memory_is_off_by_default(server):
    """A server started without --allow-client-shm refuses registration
    with 400 naming the option."""
    await threads.deferToThread(_refused, server.url.removeprefix("http://"))
