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

import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcoral.errors import BadRequest
from kcoral.inference.message import RestMessage
from kcoral.inference.sharedmemory import BYTE_SIZE, OFFSET, REGION, Caller, SharedMemory
from kcoral.protocol.inference import InferAnswer

A, B = Caller(b"Bearer a", "127.0.0.1"), Caller(b"Bearer b", "127.0.0.1")


def _settled(d):
    """What a Deferred that has fired holds: its result, or its Failure."""
    out: list = []
    d.addBoth(out.append)
    return out[0]


def _open_on(path: str) -> int:
    """How many of this process's descriptors are open on C{path}."""
    return sum(os.path.realpath(f"/proc/self/fd/{fd}") == path for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


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
    assert _open_on(path) == 1
    del placement
    assert _open_on(path) == 0
    registry.close()
    assert _open_on(str(tmp_path / "b")) == 0


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
