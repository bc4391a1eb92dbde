"""
System shared memory attacked: what a client with a token, on the same
host, can try against the registry of regions and the routes that serve it,
on a standalone server and a node's gateway, over REST, gRPC and the gRPC
stream. Each attempt is refused with Triton's words (a JSON 400 with a
request id, or INVALID_ARGUMENT), touches no other token's region, and
leaves the front serving.

tests/test_shared_memory.py covers the ordinary use and the first refusals
(keys that are no shared-memory name, slices outside a region, another
token's inference naming a region, sizes over the bound).
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import resource
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import numpy as np
import pytest
import pytest_twisted
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException
from twisted.internet import threads

from kcoral.errors import BadRequest
from kcoral.inference.h2front import SERVICE
from kcoral.inference.message import RestMessage
from kcoral.inference.sharedmemory import (
    BYTE_SIZE,
    MAX_OPEN_REGIONS,
    MAX_REGIONS,
    OFF,
    OFFSET,
    REGION,
    SHM_DIR,
    Caller,
    SharedMemory,
)
from kcoral.protocol.inference import InferAnswer
from kcoral.web.fdlimit import connection_limit
from tests.conftest import server_args
from tests.test_models import start_grpc_front
from tests.test_shared_memory import TOKENS, _headers, export_simple

A, B = Caller(b"Bearer a", "127.0.0.1"), Caller(b"Bearer b", "127.0.0.1")


def _settled(d):
    """What a Deferred that has fired holds: its result, or its Failure."""
    out: list = []
    d.addBoth(out.append)
    return out[0]


def _descriptors_on(pid: int, path: str) -> int:
    """How many descriptors of process C{pid} are open on C{path}."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}") == path
        except FileNotFoundError:
            pass  # closed as it was listed
    return count


def _output_request(region: str, size: int) -> RestMessage:
    header = {"inputs": [], "outputs": [{"name": "y", "parameters": {REGION: region, BYTE_SIZE: size}}]}
    return RestMessage(memoryview(json.dumps(header).encode()), None)


def _answer(data: bytes) -> InferAnswer:
    header = json.dumps({"outputs": [{"name": "y", "datatype": "UINT8", "shape": [len(data)],
                                      "parameters": {"binary_data_size": len(data)}}]}).encode()
    return InferAnswer(header + data, len(header))


def test_an_inference_in_flight_never_writes_another_tokens_region(tmp_path):
    """A client that unregisters its output region while its inference runs,
    another client registering its own region meanwhile: the answer goes to
    the first client's object (its descriptor still open, not a number the
    second region now holds), the second's is untouched, and the first's
    descriptor is closed once the inference is done with it."""
    (tmp_path / "a").write_bytes(b"a" * 64)
    (tmp_path / "b").write_bytes(b"b" * 64)
    registry = SharedMemory(refused=None, max_bytes=1024, namespaced=True, directory=str(tmp_path))
    registry.register(A, "out", "/a", 0, 64)
    _, placement = _settled(registry.resolve(A, _output_request("out", 8)))
    registry.unregister(A, "out")
    registry.register(B, "mine", "/b", 0, 64)
    _settled(placement.place(_answer(b"ANSWER!!")))
    assert (tmp_path / "b").read_bytes() == b"b" * 64
    assert (tmp_path / "a").read_bytes() == b"ANSWER!!" + b"a" * 56
    path = str(tmp_path / "a")
    assert _descriptors_on(os.getpid(), path) == 1
    del placement
    assert _descriptors_on(os.getpid(), path) == 0
    registry.close()
    assert _descriptors_on(os.getpid(), str(tmp_path / "b")) == 0


def test_a_fronts_regions_are_bounded_in_all_and_left_out_of_its_connections(tmp_path):
    """Clients of many tokens together hold at most MAX_OPEN_REGIONS
    regions (each a descriptor), the next refused in words until one goes;
    a front serving shared memory leaves that many descriptors out of its
    client connections' share, one that does not serve it none."""
    (tmp_path / "obj").write_bytes(bytes(64))
    registry = SharedMemory(refused=None, max_bytes=1024, namespaced=True, directory=str(tmp_path))
    callers = [Caller(b"Bearer %d" % i, "127.0.0.1") for i in range(MAX_OPEN_REGIONS // MAX_REGIONS + 1)]
    try:
        for caller in callers[:-1]:
            for i in range(MAX_REGIONS):
                registry.register(caller, f"r{i}", "/obj", 0, 64)
        with pytest.raises(BadRequest, match=f"{MAX_OPEN_REGIONS} regions of all clients are registered"):
            registry.register(callers[-1], "r0", "/obj", 0, 64)
        assert _descriptors_on(os.getpid(), str(tmp_path / "obj")) == MAX_OPEN_REGIONS
        registry.unregister(callers[0], "r0")
        registry.register(callers[-1], "r0", "/obj", 0, 64)
    finally:
        registry.close()
    assert _descriptors_on(os.getpid(), str(tmp_path / "obj")) == 0
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        assert connection_limit(registry.descriptors) == connection_limit() - MAX_OPEN_REGIONS
        assert SharedMemory(refused=OFF, max_bytes=1024).descriptors == 0
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


@pytest_twisted.ensureDeferred
async def test_a_region_named_many_times_is_bounded_as_a_body(tmp_path):
    """A request of a few bytes naming one region's slice many times, or a
    region's slice and binary data in its body, adds up to no more than a
    request may hold: past it, refused before anything is read or allocated;
    up to it, read."""
    (tmp_path / "obj").write_bytes(bytes(range(256)) * 4)
    registry = SharedMemory(refused=None, max_bytes=1024, directory=str(tmp_path))
    registry.register(A, "r", "/obj", 0, 1024)

    def request(count: int, size: int, tail: bytes = b"") -> RestMessage:
        inputs = [_input_entry(f"x{i}", {REGION: "r", BYTE_SIZE: size}) for i in range(count)]
        if tail:
            inputs.append(_input_entry("y", {"binary_data_size": len(tail)}))
        header = json.dumps({"inputs": inputs}).encode()
        return RestMessage(memoryview(header + tail), len(header))

    try:
        for hostile in (request(10_000, 1024), request(2, 513), request(1, 1024, b"t")):
            with pytest.raises(BadRequest, match="over the 1024 bytes a request may hold"):
                await registry.resolve(A, hostile)
        message, _ = await registry.resolve(A, request(2, 512))
        assert bytes(message.body[message.header_length:]) == bytes(range(256)) * 4
    finally:
        registry.close()


def _input_entry(name: str, parameters: dict) -> dict:
    return {"name": name, "datatype": "UINT8", "shape": [parameters.get(BYTE_SIZE, 1)],
            "parameters": parameters}


NOBODY = 65534


@pytest.mark.parametrize("owner, mode, granted", [
    (os.geteuid(), 0o600, True), (os.geteuid(), 0o400, False), (NOBODY, 0o600, False),
    (NOBODY, 0o666, True), (NOBODY, 0o660, False),
])
def test_an_object_is_opened_only_as_its_mode_grants_the_services_user(tmp_path, owner, mode, granted):
    """An object is registered only where its mode lets the service's user
    read and write it without privilege: root (a node's gateway is not
    confined) opens no other user's private object, and none it may only
    read."""
    path = tmp_path / "obj"
    path.write_bytes(bytes(64))
    os.chown(path, owner, -1 if owner == os.geteuid() else NOBODY)
    os.chmod(path, mode)
    registry = SharedMemory(refused=None, max_bytes=1024, directory=str(tmp_path))
    try:
        if granted:
            registry.register(A, "r", "/obj", 0, 64)
        else:
            with pytest.raises(BadRequest, match="Unable to open shared memory region: '/obj': "
                                                 "Permission denied"):
                registry.register(A, "r", "/obj", 0, 64)
            assert _descriptors_on(os.getpid(), str(path)) == 0
    finally:
        registry.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-(1 << 70), 1 << 70)
    | st.floats() | st.text(max_size=6) | st.sampled_from(["r", REGION, BYTE_SIZE, OFFSET]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["name", "parameters", "inputs", "outputs", "data", "binary_data_size",
                         REGION, BYTE_SIZE, OFFSET, "x"]), inner, max_size=4),
    max_leaves=16)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.sampled_from(["inputs", "outputs", "id", "parameters"]), json_values,
                              max_size=3),
       tail=st.binary(max_size=16))
def test_any_request_naming_a_region_is_resolved_or_refused_in_words(tmp_path, header, tail):
    """A request whose header names a region, of any shape: left to be
    refused where it is read (None), resolved, or refused with a
    BadRequest; never another error, whatever its inputs and outputs are."""
    (tmp_path / "obj").write_bytes(bytes(256))
    registry = SharedMemory(refused=None, max_bytes=1024, directory=str(tmp_path))
    registry.register(A, "r", "/obj", 0, 128)
    encoded = json.dumps({**header, "x": REGION}).encode()
    try:
        resolved = registry.resolve(A, RestMessage(memoryview(encoded + tail), len(encoded)))
        if resolved is not None:
            result = _settled(resolved)
            if not isinstance(result, tuple):
                assert result.check(BadRequest), result.getTraceback()
    finally:
        registry.close()


# -- real fronts ----------------------------------------------------------------------------------

@pytest_twisted.async_fixture(scope="module", params=["server", "gateway"])
async def front(request: pytest.FixtureRequest, module_processes, tmp_path_factory):
    """A standalone server, or a node's gateway before two CPU workers, of
    Triton's C{simple}, serving shared memory to two client tokens over REST
    and gRPC: its REST host:port, its gRPC address, and its process (the
    one that opens the regions)."""
    root = tmp_path_factory.mktemp("shm-attacks")
    (root / "tokens").write_text("\n".join(TOKENS) + "\n")
    args = server_args("--model-repository", export_simple(root), "--grpc-port", "0",
                       "--client-tokens-file", str(root / "tokens"), "--allow-client-shm")
    address, url, process = await start_grpc_front(module_processes, request.param, args)
    return url.removeprefix("http://"), address, process


def _plain_inputs(module) -> list:
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    inputs[1].set_data_from_numpy(np.ones((1, 16), np.int32))
    return inputs


def _answers_harmlessly(rest: str, grpc_address: str) -> None:
    """A plain inference is answered correctly, over REST and gRPC."""
    for module, address in ((httpclient, rest), (grpcclient, grpc_address)):
        client = module.InferenceServerClient(address)
        try:
            result = client.infer("simple", _plain_inputs(module), headers=_headers(TOKENS[1]))
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(1, 17).reshape(1, 16))
        finally:
            client.close()


class Owned:
    """An object of this process in /dev/shm, zeroed, C{size} bytes, with
    a unique key."""

    def __init__(self, size: int = 256):
        self.key = f"/kc-attack-{uuid.uuid4().hex[:12]}"
        self.handle = shm.create_shared_memory_region(self.key[1:], self.key, size)
        self.path = os.path.join(SHM_DIR, self.key[1:])

    def contents(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def destroy(self) -> None:
        shm.destroy_shared_memory_region(self.handle)


@contextmanager
def _refused(words: str) -> Iterator[None]:
    """What runs inside is refused: REST 400 / gRPC INVALID_ARGUMENT, C{words} in its message."""
    with pytest.raises(InferenceServerException) as raised:
        yield
    assert words in raised.value.message(), raised.value.message()
    assert raised.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), raised.value.status()


def _out_of_reach(rest: str, grpc_address: str) -> None:
    owned = Owned()
    # Each call its own headers: tritonclient's infer adds to them.
    def a():
        return _headers(TOKENS[0])

    def b():
        return _headers(TOKENS[1])

    clients = [httpclient.InferenceServerClient(rest), grpcclient.InferenceServerClient(grpc_address)]
    try:
        clients[0].register_system_shared_memory("mine", owned.key, 256, headers=a())
        for module, client in zip((httpclient, grpcclient), clients, strict=True):
            with _refused("Unable to find shared memory region: 'mine'"):
                client.get_system_shared_memory_status("mine", headers=b())
            with _refused("Unable to find system shared memory region: 'mine'"):
                client.unregister_system_shared_memory("mine", headers=b())
            client.unregister_system_shared_memory(headers=b())  # all of B's: none
            outputs = [module.InferRequestedOutput("OUTPUT0")]
            outputs[0].set_shared_memory("mine", 64)
            with _refused("Unable to find shared memory region: 'mine'"):
                client.infer("simple", _plain_inputs(module), outputs=outputs, headers=b())
        _streamed_by_another(grpc_address, b())
        # A's region is still A's, and nothing was written into it.
        assert [r["name"] for r in clients[0].get_system_shared_memory_status(headers=a())] == ["mine"]
        assert owned.contents() == bytes(256)
        clients[0].unregister_system_shared_memory("mine", headers=a())
    finally:
        for client in clients:
            client.close()
        owned.destroy()


def _streamed_by_another(grpc_address: str, headers: dict) -> None:
    """On B's stream, an inference naming A's region is answered with its
    error, and the next (plain) one is answered."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_address)
    try:
        client.start_stream(lambda result, error: answers.put((result, error)), headers=headers)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0")]
        outputs[0].set_shared_memory("mine", 64)
        client.async_stream_infer("simple", _plain_inputs(grpcclient), outputs=outputs)
        client.async_stream_infer("simple", _plain_inputs(grpcclient))
        result, error = answers.get(timeout=30)
        assert result is None and "Unable to find shared memory region: 'mine'" in error.message()
        result, error = answers.get(timeout=30)
        assert error is None
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(1, 17).reshape(1, 16))
        client.stop_stream()
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_another_tokens_region_is_out_of_reach(front):
    """Token B can neither see, unregister (by name or all at once), nor
    name in an inference (REST, gRPC, the gRPC stream) a region token A
    registered: each refused in Triton's words, the stream going on; A's
    region stays registered and its object unwritten."""
    await threads.deferToThread(_out_of_reach, front[0], front[1])
    await threads.deferToThread(_answers_harmlessly, front[0], front[1])


def _bounded(rest: str, grpc_address: str, pid: int) -> None:
    owned = Owned()
    clients = [httpclient.InferenceServerClient(rest), grpcclient.InferenceServerClient(grpc_address)]
    try:
        for client in clients:
            client.register_system_shared_memory("twice", owned.key, 64, headers=_headers(TOKENS[0]))
            with _refused("shared memory region 'twice' already in manager"):
                client.register_system_shared_memory("twice", owned.key, 128, headers=_headers(TOKENS[0]))
            status = client.get_system_shared_memory_status("twice", headers=_headers(TOKENS[0]))
            size = status[0]["byte_size"] if client is clients[0] else status.regions["twice"].byte_size
            assert int(size) == 64  # the first registration, unchanged
            client.unregister_system_shared_memory(headers=_headers(TOKENS[0]))
        for i in range(MAX_REGIONS):
            clients[0].register_system_shared_memory(f"r{i}", owned.key, 64, headers=_headers(TOKENS[0]))
        assert _descriptors_on(pid, owned.path) == MAX_REGIONS
        for client in clients:
            with _refused(f"{MAX_REGIONS} regions are already registered"):
                client.register_system_shared_memory("one-more", owned.key, 64,
                                                     headers=_headers(TOKENS[0]))
        # Another token's bound is its own.
        clients[1].register_system_shared_memory("r0", owned.key, 64, headers=_headers(TOKENS[1]))
        for token in TOKENS:
            clients[0].unregister_system_shared_memory(headers=_headers(token))
        assert _descriptors_on(pid, owned.path) == 0
    finally:
        for client in clients:
            client.close()
        owned.destroy()


@pytest_twisted.ensureDeferred
async def test_a_name_is_registered_once_and_a_token_holds_a_bounded_number(front):
    """A name registered again is refused and the first registration kept
    (REST and gRPC); a token holds at most MAX_REGIONS regions, each an
    open descriptor of the front's, another token its own as many; once
    unregistered, the front holds none of them open."""
    await threads.deferToThread(_bounded, front[0], front[1], front[2].pid)
    await threads.deferToThread(_answers_harmlessly, front[0], front[1])


def _not_shared_memory(rest: str, grpc_address: str) -> None:
    owned = Owned()
    tag = uuid.uuid4().hex[:12]
    made = {"link": f"kc-link-{tag}", "fifo": f"kc-fifo-{tag}", "folder": f"kc-dir-{tag}"}
    os.symlink(owned.path, os.path.join(SHM_DIR, made["link"]))
    os.mkfifo(os.path.join(SHM_DIR, made["fifo"]))
    os.mkdir(os.path.join(SHM_DIR, made["folder"]))
    made["other"] = f"kc-other-{tag}"
    other = os.path.join(SHM_DIR, made["other"])
    with open(other, "wb") as f:
        f.write(bytes(64))
    os.chown(other, NOBODY, NOBODY)
    os.chmod(other, 0o600)
    keys = {"/" + made["link"]: "Unable to open shared memory region",
            "/" + made["fifo"]: "not a shared memory object",
            "/" + made["folder"]: "Unable to open shared memory region",
            "/" + made["other"]: "Permission denied",
            "/..": "Unable to open shared memory region", "/.": "Unable to open shared memory region",
            "/" + "k" * 255: "Unable to open shared memory region",
            "/" + "k" * 256: "a key is a POSIX shared memory name",
            owned.key + "/": "a key is a POSIX shared memory name",
            "/dev/shm" + owned.key: "a key is a POSIX shared memory name",
            owned.key[1:]: "a key is a POSIX shared memory name",
            "/kc-\ud800": "a key is a POSIX shared memory name",
            "/\udcff-kc": "a key is a POSIX shared memory name",
            "/" + owned.key: "a key is a POSIX shared memory name"}
    clients = [httpclient.InferenceServerClient(rest), grpcclient.InferenceServerClient(grpc_address)]
    try:
        for client in clients:
            for key, words in keys.items():
                if not key.isascii():
                    continue  # tritonclient sends UTF-8, which holds no lone surrogate: below
                with _refused(words):
                    client.register_system_shared_memory("r", key, 64, headers=_headers(TOKENS[0]))
        connection = http.client.HTTPConnection(rest, timeout=30)
        for key in filter(lambda key: not key.isascii(), keys):
            connection.request("POST", "/v2/systemsharedmemory/region/r/register",
                               json.dumps({"key": key, "offset": 0, "byte_size": 64}),
                               {**_headers(TOKENS[0]), "Content-Type": "application/json"})
            answer = connection.getresponse()
            assert answer.status == 400 and keys[key] in json.loads(answer.read())["error"], key
        connection.close()
        assert clients[0].get_system_shared_memory_status(headers=_headers(TOKENS[0])) == []
    finally:
        for client in clients:
            client.close()
        os.unlink(os.path.join(SHM_DIR, made["link"]))
        os.unlink(os.path.join(SHM_DIR, made["fifo"]))
        os.rmdir(os.path.join(SHM_DIR, made["folder"]))
        os.unlink(other)
        owned.destroy()


@pytest_twisted.ensureDeferred
async def test_what_is_no_shared_memory_object_is_never_opened(front):
    """A link in /dev/shm (to an object the client owns), a FIFO (which an
    open would wait on), a folder, another user's private object, '..', '.', a name of 255 bytes that
    names nothing, and keys that are no POSIX shared-memory name (256
    bytes, a trailing or second slash, a path, no slash, a lone surrogate,
    which JSON may escape) are refused over
    REST and gRPC, nothing registered, the front serving on."""
    await threads.deferToThread(_not_shared_memory, front[0], front[1])
    await threads.deferToThread(_answers_harmlessly, front[0], front[1])


def _input(parameters: object) -> dict:
    return {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": parameters}


#: Headers naming region "r" that no front may serve, each a 400.
HOSTILE_HEADERS = [
    {"inputs": 5, "x": REGION}, {"inputs": None, "x": REGION}, {"inputs": {REGION: "r"}},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: 64})], "outputs": "OUTPUT0"},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: 64})], "outputs": {"name": "x"}},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: 1 << 64})]},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: 64, OFFSET: (1 << 63) - 1})]},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: 64, OFFSET: -64})]},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: -1})]},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: 64.0})]},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: "64"})]},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: True})]},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: 10 ** 30})]},
    {"inputs": [_input({REGION: ["r"], BYTE_SIZE: 64})]},
    {"inputs": [_input({REGION: "r" * 300, BYTE_SIZE: 64})]},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: 32})]},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: 64, "binary_data_size": 64})]},
    {"inputs": [{**_input({REGION: "r", BYTE_SIZE: 64}), "data": list(range(16))}]},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: 64})],
     "outputs": [{"name": "OUTPUT0", "parameters": {REGION: "r", BYTE_SIZE: 8}}]},
    {"inputs": [_input({REGION: "r", BYTE_SIZE: 64})],
     "outputs": [{"name": "OUTPUT0", "parameters": {REGION: "r", BYTE_SIZE: 64, OFFSET: 250}}]},
]


def _post(connection: http.client.HTTPConnection, header: object, tail: bytes = b"") -> tuple[int, dict]:
    encoded = json.dumps(header).encode()
    connection.request("POST", "/v2/models/simple/infer", encoded + tail, {
        **_headers(TOKENS[0]), "Inference-Header-Content-Length": str(len(encoded)),
        "Content-Type": "application/octet-stream"})
    answer = connection.getresponse()
    body = answer.read()
    assert answer.getheader("X-Request-Id"), body
    return answer.status, json.loads(body[:int(answer.getheader("Inference-Header-Content-Length")
                                               or len(body))])


def _hostile_inferences(rest: str) -> None:
    owned = Owned()
    connection = http.client.HTTPConnection(rest, timeout=30)
    client = httpclient.InferenceServerClient(rest)
    values = st.one_of(st.integers(), st.integers(-2, 300), st.sampled_from([1 << 63, 1 << 64, -(1 << 63)]),
                       st.floats(), st.text(max_size=4), st.none(), st.booleans(), st.just("r"))
    parameters = st.dictionaries(st.sampled_from([REGION, BYTE_SIZE, OFFSET, "binary_data_size"]),
                                 values, max_size=4).map(lambda p: {REGION: "r", **p})

    @settings(max_examples=80, deadline=None)
    @given(inputs=st.lists(parameters, min_size=1, max_size=2), output=st.none() | parameters,
           tail=st.binary(max_size=80))
    def fuzzed(inputs, output, tail):
        header = {"inputs": [{**_input(p), "name": f"INPUT{i}"} for i, p in enumerate(inputs)]}
        if output is not None:
            header["outputs"] = [{"name": "OUTPUT0", "parameters": output}]
        status, answer = _post(connection, header, tail)
        assert status in (200, 400), (status, answer)
        assert status == 200 or answer["error"]

    try:
        client.register_system_shared_memory("r", owned.key, 256, headers=_headers(TOKENS[0]))
        for header in HOSTILE_HEADERS:
            status, answer = _post(connection, header)
            assert status == 400 and answer["error"], (header, status, answer)
        fuzzed()
        assert client.get_system_shared_memory_status(headers=_headers(TOKENS[0]))[0]["name"] == "r"
        client.unregister_system_shared_memory(headers=_headers(TOKENS[0]))
    finally:
        connection.close()
        client.close()
        owned.destroy()


@pytest_twisted.ensureDeferred
async def test_hostile_inferences_naming_a_region_are_json_400s(front):
    """Inference requests naming a registered region with inputs or outputs
    that are not lists, sizes and offsets outside the region or past 64
    bits, of the wrong types, a slice that is not the input's size, data
    given twice, an output slice too small, and fuzzed parameters over any
    body: each a 400 with a JSON error and a request id (a fuzzed request
    that happens to be valid a 200), never a 5xx; the region stays, and a
    plain inference is answered correctly after."""
    await threads.deferToThread(_hostile_inferences, front[0])
    await threads.deferToThread(_answers_harmlessly, front[0], front[1])


def _parameter(value: object) -> service_pb2.InferParameter:
    if isinstance(value, bool):
        return service_pb2.InferParameter(bool_param=value)
    if isinstance(value, str):
        return service_pb2.InferParameter(string_param=value)
    if isinstance(value, float):
        return service_pb2.InferParameter(double_param=value)
    if isinstance(value, int) and value >= 1 << 63:
        return service_pb2.InferParameter(uint64_param=value)
    return service_pb2.InferParameter(int64_param=value)


def _grpc_request(parameters: dict, output: dict | None = None,
                  raw: bool = True) -> service_pb2.ModelInferRequest:
    """C{simple}'s INPUT0 from region parameters C{parameters}, INPUT1 in raw contents."""
    pb = service_pb2.ModelInferRequest(model_name="simple")
    first = pb.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 16])
    for key, value in parameters.items():
        first.parameters[key].CopyFrom(_parameter(value))
    pb.inputs.add(name="INPUT1", datatype="INT32", shape=[1, 16])
    if raw:
        pb.raw_input_contents.append(np.ones(16, np.int32).tobytes())
    if output is not None:
        requested = pb.outputs.add(name="OUTPUT0")
        for key, value in output.items():
            requested.parameters[key].CopyFrom(_parameter(value))
    return pb


def _hostile_grpc(grpc_address: str, rest: str) -> None:
    owned = Owned()
    client = httpclient.InferenceServerClient(rest)
    channel = grpc.insecure_channel(grpc_address)
    infer = channel.unary_unary(f"/{SERVICE}/ModelInfer",
                                request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                response_deserializer=service_pb2.ModelInferResponse.FromString)
    metadata = [("authorization", f"Bearer {TOKENS[0]}")]
    values = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.integers(-2, 300), st.booleans(),
                       st.floats(allow_nan=False), st.text(max_size=4), st.just("r"))
    parameters = st.dictionaries(st.sampled_from([REGION, BYTE_SIZE, OFFSET]), values,
                                 max_size=3).map(lambda p: {REGION: "r", **p})

    def refused(pb: service_pb2.ModelInferRequest) -> None:
        with pytest.raises(grpc.RpcError) as raised:
            infer(pb, metadata=metadata, timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
        assert raised.value.details()

    @settings(max_examples=60, deadline=None)
    @given(first=parameters, output=st.none() | parameters, raw=st.booleans())
    def fuzzed(first, output, raw):
        try:
            answer = infer(_grpc_request(first, output, raw), metadata=metadata, timeout=30)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        else:
            assert answer.model_name == "simple"

    try:
        client.register_system_shared_memory("r", owned.key, 256, headers=_headers(TOKENS[0]))
        for hostile in ({BYTE_SIZE: 64, OFFSET: -1}, {BYTE_SIZE: (1 << 64) - 1},
                        {BYTE_SIZE: 64, OFFSET: (1 << 64) - 1}, {BYTE_SIZE: -(1 << 63)},
                        {BYTE_SIZE: True}, {BYTE_SIZE: "64"}, {BYTE_SIZE: 64.0}, {BYTE_SIZE: 32},
                        {BYTE_SIZE: 64, OFFSET: 200}):
            refused(_grpc_request({REGION: "r", **hostile}))
        refused(_grpc_request({REGION: "r", BYTE_SIZE: 64},
                              {REGION: "r", BYTE_SIZE: 64, OFFSET: 1 << 63}))
        fuzzed()
        assert client.get_system_shared_memory_status(headers=_headers(TOKENS[0]))[0]["name"] == "r"
        client.unregister_system_shared_memory(headers=_headers(TOKENS[0]))
    finally:
        channel.close()
        client.close()
        owned.destroy()


@pytest_twisted.ensureDeferred
async def test_hostile_grpc_inferences_naming_a_region_are_invalid_argument(front):
    """gRPC inferences whose region parameters are negative, past 64 bits of
    the region, of the wrong type (bool, string, double), not the input's
    size, or an output slice outside the region, and fuzzed parameters:
    each INVALID_ARGUMENT with a message (or answered, where valid); the
    region stays, and a plain inference is answered correctly after."""
    await threads.deferToThread(_hostile_grpc, front[1], front[0])
    await threads.deferToThread(_answers_harmlessly, front[0], front[1])


def _forging(rest: str, grpc_address: str) -> None:
    forged = "\nERROR [kcoral.forged] a line of the client's"
    owned = Owned()
    clients = [httpclient.InferenceServerClient(rest), grpcclient.InferenceServerClient(grpc_address)]
    connection = http.client.HTTPConnection(rest, timeout=30)
    try:
        for client in clients:
            with _refused("Unable to open shared memory region"):
                client.register_system_shared_memory("r", "/kc" + forged, 64, headers=_headers(TOKENS[0]))
        # A REST path holding a newline is refused before any route; gRPC's names are any text.
        with _refused("Unable to find system shared memory region"):
            clients[1].unregister_system_shared_memory("r" + forged, headers=_headers(TOKENS[0]))
        with _refused("Unable to find shared memory region"):
            clients[1].get_system_shared_memory_status("r" + forged, headers=_headers(TOKENS[0]))
        clients[0].register_system_shared_memory("r", owned.key, 256, headers=_headers(TOKENS[0]))
        status, answer = _post(connection, {"inputs": [{**_input({REGION: "r", BYTE_SIZE: 64, OFFSET: 250}),
                                                        "name": "INPUT0" + forged}]})
        assert status == 400 and "Invalid offset + byte size" in answer["error"]
        status, answer = _post(connection, {"inputs": [_input({REGION: "r" + forged, BYTE_SIZE: 64})]})
        assert status == 400 and "Unable to find shared memory region" in answer["error"]
        clients[0].unregister_system_shared_memory(headers=_headers(TOKENS[0]))
    finally:
        connection.close()
        for client in clients:
            client.close()
        owned.destroy()


@pytest_twisted.ensureDeferred
async def test_keys_and_names_forge_no_log_line(front):
    """A key, a region's name or an input's name holding a newline, in a
    registration, an unregistration, a status or an inference, is refused,
    and the front's log has no line that the client wrote."""
    since = front[2].mark()
    await threads.deferToThread(_forging, front[0], front[1])
    await threads.deferToThread(_answers_harmlessly, front[0], front[1])
    assert not front[2].matching(r"^\S*\s*ERROR \[kcoral\.forged\]", since)
