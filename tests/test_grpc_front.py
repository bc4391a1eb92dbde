"""
The gRPC front's bounds, as a client that does not play by the rules meets
them: calls that send their metadata and never their message, calls without
the token, garbage and oversized messages, too many calls, messages framed
across HTTP/2's frames every way; and its drain.
Raw C{grpc} channels make the calls that tritonclient would not; tritonclient
makes the ordinary ones, which must keep being answered meanwhile.

Most tests serve a fake front in this process (the time bound on the
injected clock); the last ones attack a real standalone server, with a real
model, and watch its memory and CPU.
"""

from __future__ import annotations

import functools
import socket
import struct
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import pytest_twisted
import tritonclient.grpc as grpcclient
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    PingAckReceived,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException
from twisted.internet import defer, threads
from twisted.internet.task import Clock

from bench.support.procstat import cpu_seconds
from kcoral.errors import BadRequest
from kcoral.inference.front import InferCall
from kcoral.inference.h2front import MESSAGE_SECONDS, SERVICE, SWEEP_SECONDS, GrpcFront
from kcoral.inference.message import GrpcMessage
from kcoral.protocol.inference import MAX_TYPED_VALUES, parse_infer, rest_of_grpc_infer
from tests.conftest import server_args, server_env
from tests.harness import SERVER_READY, until
from tests.test_inference_fronts import TOKEN, DoubleFront, HangingFront

ADMITTED = (("authorization", f"Bearer {TOKEN}"),)
#: How long an ordinary call may take while the service is under attack.
ANSWERED_WITHIN = 2.0


def infer_message(model: str = "double", rows: int = 1) -> bytes:
    """A ModelInferRequest of C{rows} rows of 4 FP32 in raw_input_contents."""
    pb = service_pb2.ModelInferRequest(model_name=model)
    pb.inputs.add(name="x", datatype="FP32", shape=[rows, 4])
    pb.raw_input_contents.append(np.ones((rows, 4), np.float32).tobytes())
    return pb.SerializeToString()


class RawCalls:
    """
    Calls on one channel, with raw bytes: with a message, or holding it back
    until L{release} (its call then ends without one).
    """

    def __init__(self, target: str):
        self.channel = grpc.insecure_channel(target)
        self._gate = threading.Event()

    def _requests(self, message: bytes | None) -> Iterator[bytes]:
        if message is not None:
            yield message
        else:
            self._gate.wait()

    def start(self, method: str, message: bytes | None = None,
              metadata: tuple = ()) -> defer.Deferred[grpc.StatusCode]:
        """A call of C{method}: its status code once it ends."""
        from twisted.internet import reactor

        call = self.channel.stream_unary(f"/{SERVICE}/{method}")
        future = call.future(self._requests(message), metadata=metadata, timeout=60)
        ended: defer.Deferred[grpc.StatusCode] = defer.Deferred()
        future.add_done_callback(lambda f: reactor.callFromThread(ended.callback, f.code()))
        return ended

    def release(self) -> None:
        self._gate.set()

    def close(self) -> None:
        self.release()
        self.channel.close()


def in_thread(f, *args):
    return defer.ensureDeferred(threads.deferToThread(f, *args))


def timed_probes(target: str, metadata: dict, model: str, x: np.ndarray, names: tuple[str, str]
                 ) -> tuple[float, np.ndarray]:
    """tritonclient's ServerLive, then one inference of C{x} (input and output C{names}): their
    seconds together, and the answer."""
    client = grpcclient.InferenceServerClient(target)
    try:
        began = time.monotonic()
        assert client.is_server_live(client_timeout=10)
        given_input = grpcclient.InferInput(names[0], list(x.shape), "FP32")
        given_input.set_data_from_numpy(x)
        result = client.infer(model, [given_input], headers=metadata, client_timeout=10)
        return time.monotonic() - began, result.as_numpy(names[1])
    finally:
        client.close()


def double_probes(target: str) -> tuple[float, np.ndarray]:
    return timed_probes(target, dict(ADMITTED), "double", np.ones((1, 4), np.float32), ("x", "y"))


def target(grpc_front: GrpcFront) -> str:
    return f"127.0.0.1:{grpc_front.port}"


@pytest_twisted.ensureDeferred
async def test_calls_without_the_token_end_before_their_message(serve):
    """A guarded method called without the token ends UNAUTHENTICATED at once, though its message
    never comes; the front is never asked."""
    front = DoubleFront()
    grpc_front = await serve(front)
    calls = RawCalls(target(grpc_front))
    try:
        codes = await defer.gatherResults([calls.start(method) for method in (
            "ModelInfer", "ModelReady", "ModelMetadata", "ModelConfig", "RepositoryIndex")] * 28)
        assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
        assert front.calls == [] and grpc_front.unread == 0
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_a_message_that_does_not_come_ends_the_call_on_the_clock(serve):
    """A call whose message has not come within the bound (on the injected clock) ends
    DEADLINE_EXCEEDED; before that, it is still open."""
    clock = Clock()
    grpc_front = await serve(DoubleFront(), clock=clock)
    calls = RawCalls(target(grpc_front))
    try:
        ended = calls.start("ModelInfer", metadata=ADMITTED)
        await until(lambda: grpc_front.unread == 1, "the call waits for its message")
        clock.advance(MESSAGE_SECONDS - SWEEP_SECONDS)
        assert not ended.called and grpc_front.unread == 1
        clock.advance(2 * SWEEP_SECONDS)
        assert await ended == grpc.StatusCode.DEADLINE_EXCEEDED
        assert grpc_front.unread == 0
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_too_many_waiting_calls_end_the_oldest_and_starve_no_one(serve):
    """Past the bound on calls waiting for their message, the oldest of them ends
    RESOURCE_EXHAUSTED; ServerLive and inferences of other clients are answered meanwhile."""
    grpc_front = await serve(DoubleFront(), max_unread=4)
    calls = RawCalls(target(grpc_front))
    try:
        held = []
        for count in range(1, 5):
            held.append(calls.start("ModelInfer", metadata=ADMITTED))
            await until(lambda count=count: grpc_front.unread == count, "the call waits")
        more = [calls.start("ModelInfer", metadata=ADMITTED) for _ in range(2)]
        assert await held[0] == await held[1] == grpc.StatusCode.RESOURCE_EXHAUSTED
        seconds, y = await in_thread(double_probes, target(grpc_front))
        assert seconds < ANSWERED_WITHIN
        np.testing.assert_array_equal(y, np.full((1, 4), 2, np.float32))
        assert grpc_front.unread <= 4
        calls.release()
        codes = await defer.gatherResults([*held[2:], *more])
        assert set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_probes_never_wait_for_their_message(serve):
    """ServerLive, ServerReady and ServerMetadata answer without waiting for a message."""
    grpc_front = await serve(DoubleFront())
    calls = RawCalls(target(grpc_front))
    try:
        codes = await defer.gatherResults([calls.start(method) for method in (
            "ServerLive", "ServerReady", "ServerMetadata")])
        assert codes == [grpc.StatusCode.OK] * 3
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_garbage_oversized_and_unknown_calls(serve):
    """A message that is not the method's is INVALID_ARGUMENT, one over the size bound
    RESOURCE_EXHAUSTED, a method not served UNIMPLEMENTED; the front answers the next call."""
    front = DoubleFront()
    grpc_front = await serve(front, max_message_bytes=1 << 20)
    calls = RawCalls(target(grpc_front))
    try:
        assert await calls.start("ModelInfer", b"\xff\xff\xff", ADMITTED) == (
            grpc.StatusCode.INVALID_ARGUMENT)
        assert await calls.start("ModelInfer", infer_message(rows=70_000), ADMITTED) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert await calls.start("Nope", b"", ADMITTED) == grpc.StatusCode.UNIMPLEMENTED
        assert front.calls == []
        assert await calls.start("ModelInfer", infer_message(), ADMITTED) == grpc.StatusCode.OK
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_calls_past_the_count_are_refused(serve):
    """Past C{max_calls} calls at once, a call ends RESOURCE_EXHAUSTED; ServerLive too, since
    the bound is on every call."""
    front = HangingFront()
    grpc_front = await serve(front, max_calls=1)
    calls = RawCalls(target(grpc_front))
    try:
        hanging = calls.start("ModelInfer", infer_message(), ADMITTED)
        pending = await front.arrived
        assert await calls.start("ModelInfer", infer_message(), ADMITTED) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED)
        pending.callback(DoubleFront()._infer("double", _call()))
        assert await hanging == grpc.StatusCode.OK
    finally:
        calls.close()


def _call() -> InferCall:
    """The inference of L{infer_message} as the front receives it."""
    message = infer_message()
    return InferCall(GrpcMessage(service_pb2.ModelInferRequest.FromString(message), len(message)), "r")


@pytest_twisted.ensureDeferred
async def test_stopping_answers_the_calls_in_flight(serve):
    """A front stopping (SIGTERM) answers the calls it has, then stops."""
    front = HangingFront()
    grpc_front = await serve(front)
    calls = RawCalls(target(grpc_front))
    try:
        in_flight = calls.start("ModelInfer", infer_message(), ADMITTED)
        pending = await front.arrived
        stopped = grpc_front.stopService(grace=30)
        assert not stopped.called
        pending.callback(DoubleFront()._infer("double", _call()))
        assert await in_flight == grpc.StatusCode.OK
        await stopped
    finally:
        calls.close()


# -- typed contents -------------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(hnp.arrays(st.sampled_from([np.float32, np.float64]), hnp.array_shapes(max_dims=3, max_side=6),
                  elements={"allow_nan": True}))
def test_float_contents_are_their_bytes(array):
    """FP32 and FP64 inputs in their typed fields become the same array, bit for bit."""
    datatype = "FP32" if array.dtype == np.float32 else "FP64"
    pb = service_pb2.ModelInferRequest(model_name="m")
    tensor = pb.inputs.add(name="x", datatype=datatype, shape=list(array.shape))
    getattr(tensor.contents, f"{datatype.lower()}_contents").extend(array.reshape(-1).tolist())
    rest = rest_of_grpc_infer(service_pb2.ModelInferRequest.FromString(pb.SerializeToString()))
    got = parse_infer(rest.body, rest.header_length).inputs["x"]
    assert got.dtype == array.dtype and got.tobytes() == array.tobytes()


def test_large_integer_contents_are_refused():
    """Integers in a typed field past the bound are refused, pointing at raw_input_contents."""
    pb = service_pb2.ModelInferRequest(model_name="m")
    tensor = pb.inputs.add(name="x", datatype="INT32", shape=[MAX_TYPED_VALUES + 1])
    tensor.contents.int_contents.extend(np.zeros(MAX_TYPED_VALUES + 1, np.int32).tolist())
    with pytest.raises(BadRequest, match="raw_input_contents"):
        rest_of_grpc_infer(pb)


# -- a real server under attack -------------------------------------------------------------

def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def huge_typed_message(megabytes: int) -> bytes:
    """A ModelInferRequest of C{megabytes} MiB of fp32_contents, encoded by hand (building it
    as a message would take longer than the test)."""
    count = (megabytes << 20) // 4
    contents = _field(6, bytes(count * 4))
    tensor = _field(1, b"input") + _field(2, b"FP32") + _field(3, _varint(1) + _varint(count)) \
        + _field(5, contents)
    return _field(1, b"mlp") + _field(5, tensor)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def export_mlp(root) -> str:
    """A repository in C{root} holding C{mlp}: tanh of 16 inputs, batches of one row."""
    import jax.numpy as jnp

    import kcoral

    kcoral.export_bundle(lambda p, x: jnp.tanh(x @ p["w"]), {"w": np.eye(16, dtype=np.float32)},
                         np.zeros((1, 16), np.float32), dir=str(root / "mlp"), name="mlp",
                         batch_sizes=[1])
    return str(root)


async def start_grpc_server(processes, repository: str, *args: str):
    """A standalone server of C{repository} serving gRPC: its process and gRPC address."""
    service = await processes.start_service(
        server_args("--model-repository", repository, "--grpc-port", "0", *args),
        name="server", ready=SERVER_READY, env=server_env())
    found = await service.process.wait_for_line(r"over gRPC on [\d.]+:(?P<port>\d+)", 30)
    return service.process, f"127.0.0.1:{found.group('port')}"


@pytest_twisted.async_fixture(scope="module")
async def guarded_server(module_processes, tmp_path_factory):
    """A standalone server with a client token and an MLP, serving gRPC: its address and pid."""
    process, address = await start_grpc_server(
        module_processes, export_mlp(tmp_path_factory.mktemp("models")), "--client-token", TOKEN)
    return address, process.pid


def mlp_probes(address: str) -> tuple[float, np.ndarray]:
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
    seconds, y = timed_probes(address, dict(ADMITTED), "mlp", x, ("input", "output"))
    np.testing.assert_allclose(y, np.tanh(x), rtol=1e-6)
    return seconds, y


@pytest_twisted.ensureDeferred
async def test_a_server_held_by_message_less_calls_answers_others(guarded_server):
    """140 calls that never send their message, without the token and then with it, hold
    nothing: ServerLive and a real inference are answered within the bound meanwhile."""
    address, _ = guarded_server
    for metadata, ended in (((), grpc.StatusCode.UNAUTHENTICATED), (ADMITTED, None)):
        calls = RawCalls(address)
        try:
            held = [calls.start("ModelInfer", metadata=metadata) for _ in range(140)]
            if ended is not None:
                assert set(await defer.gatherResults(held)) == {ended}
            seconds, _ = await in_thread(mlp_probes, address)
            assert seconds < ANSWERED_WITHIN, seconds
        finally:
            calls.close()


@pytest_twisted.ensureDeferred
async def test_a_huge_message_without_the_token_is_never_read(guarded_server):
    """150 MiB of fp32_contents without the token: UNAUTHENTICATED, under half a second of the
    server's CPU and 64 MiB of its memory, and a real inference answered meanwhile."""
    address, pid = guarded_server
    message = huge_typed_message(150)
    calls = RawCalls(address)
    try:
        rss, cpu = rss_bytes(pid), cpu_seconds(pid)
        refused = calls.start("ModelInfer", message)
        seconds, _ = await in_thread(mlp_probes, address)
        assert await refused == grpc.StatusCode.UNAUTHENTICATED
        assert seconds < ANSWERED_WITHIN, seconds
        assert cpu_seconds(pid) - cpu < 0.5
        assert rss_bytes(pid) - rss < 64 << 20
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_a_huge_typed_message_with_the_token_is_parsed_in_moments(guarded_server):
    """With the token, 150 MiB of fp32_contents is read without a Python float apiece: answered
    (INVALID_ARGUMENT: not the model's shape) within a few seconds, and ServerLive meanwhile."""
    address, pid = guarded_server
    message = huge_typed_message(150)
    calls = RawCalls(address)
    try:
        cpu = cpu_seconds(pid)
        answered = calls.start("ModelInfer", message, ADMITTED)
        seconds, _ = await in_thread(mlp_probes, address)
        assert await answered == grpc.StatusCode.INVALID_ARGUMENT
        assert seconds < ANSWERED_WITHIN, seconds
        assert cpu_seconds(pid) - cpu < 3.0
    finally:
        calls.close()


# -- HTTP/2 framing, frame by frame ------------------------------------------------------------
# The client here speaks HTTP/2 itself (h2, client side, over a real socket, in a thread) so that
# it controls every frame, which gRPC's own clients never let it do.

H2_ADMITTED = ((b"authorization", f"Bearer {TOKEN}".encode()),)


def framed(message: bytes) -> bytes:
    """A gRPC message as it goes in DATA: uncompressed, its length, itself."""
    return struct.pack(">BI", 0, len(message)) + message


class H2Calls:
    """Calls on one HTTP/2 connection, every frame sent as told (blocking: run in a thread).
    With C{acknowledge} False it reads what comes and never gives the window back: a client
    that does not read its answers."""

    def __init__(self, port: int, acknowledge: bool = True):
        self._socket = socket.create_connection(("127.0.0.1", port), timeout=30)
        self._h2 = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        self._h2.initiate_connection()
        self.flush()
        self.acknowledge = acknowledge
        self.ended: dict[int, dict] = {}
        self.pongs = 0
        self._open: dict[int, dict] = {}

    def flush(self) -> None:
        """Writes every frame made so far, in one write."""
        self._socket.sendall(self._h2.data_to_send())

    # Each of these writes its frames at once, unless told not to (C{flush=False}): frames
    # kept for one write reach the front in one read.

    def start(self, method: str, metadata=H2_ADMITTED, flush: bool = True) -> int:
        """Opens a call of C{method} (its HEADERS only); its stream id."""
        stream_id = self._h2.get_next_available_stream_id()
        self._h2.send_headers(stream_id, [
            (b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"localhost"),
            (b":path", f"/{SERVICE}/{method}".encode()), (b"content-type", b"application/grpc"),
            (b"te", b"trailers"), *metadata])
        self._open[stream_id] = {"data": b"", "headers": {}}
        self._written(flush)
        return stream_id

    def send(self, stream_id: int, data: bytes, end: bool = False, flush: bool = True) -> None:
        """One DATA frame of C{data} (at most a frame's size)."""
        self._h2.send_data(stream_id, data, end_stream=end)
        self._written(flush)

    def reset(self, stream_id: int, flush: bool = True) -> None:
        self._h2.reset_stream(stream_id)
        self._open.pop(stream_id)
        self._written(flush)

    def _written(self, flush: bool) -> None:
        if flush:
            self.flush()

    def ping(self) -> None:
        """A PING: its answer, once read (L{pongs}), says the server has taken every frame
        sent before it."""
        self._h2.ping(b"kcoral!!")
        self.flush()

    def messages(self, stream_id: int) -> list[bytes]:
        """The messages the server has sent on C{stream_id} so far, unframed."""
        return unframed(self._open[stream_id]["data"])

    def wait(self, *stream_ids: int) -> list[dict]:
        """The end of each call: C{status}, C{message} (grpc-message), C{data} (its answer's
        message, unframed), C{messages} (every message it sent, unframed), C{reset} (the
        server reset it, whatever it said first)."""
        self.read_until(lambda: all(s in self.ended for s in stream_ids))
        return [self.ended[s] for s in stream_ids]

    def read_until(self, done) -> None:
        """Reads what the server sends until C{done()}."""
        while not done():
            data = self._socket.recv(1 << 16)
            assert data, "the server closed the connection"
            for event in self._h2.receive_data(data):
                if isinstance(event, PingAckReceived):
                    self.pongs += 1
                call = self._open.get(getattr(event, "stream_id", 0))
                if call is None:
                    continue
                if isinstance(event, (ResponseReceived, TrailersReceived)):
                    call["headers"].update(dict(event.headers))
                elif isinstance(event, DataReceived):
                    call["data"] += event.data
                    if self.acknowledge:
                        self._h2.acknowledge_received_data(event.flow_controlled_length,
                                                           event.stream_id)
                elif isinstance(event, (StreamEnded, StreamReset)):
                    if event.stream_id not in self.ended:
                        headers = call["headers"]
                        self.ended[event.stream_id] = {
                            "status": int(headers.get(b"grpc-status", b"-1")),
                            "message": headers.get(b"grpc-message", b"").decode(),
                            "data": call["data"][5:], "messages": unframed(call["data"]),
                            "reset": isinstance(event, StreamReset),
                            "request_id": headers.get(b"x-request-id")}
            self.flush()

    def acknowledge_all(self) -> None:
        """Gives the server back the window of everything read so far, and of what comes."""
        self.acknowledge = True
        for stream_id, call in self._open.items():
            if call["data"] and stream_id not in self.ended:
                self._h2.acknowledge_received_data(len(call["data"]), stream_id)
        self.flush()

    def table(self) -> list[bytes]:
        """The names of the headers the server has put in this connection's header table."""
        return [name for name, _ in self._h2.decoder.header_table.dynamic_entries]

    def terminated(self) -> int | None:
        """Reads until the server closes the connection: the error code of its GOAWAY."""
        code = None
        while data := self._socket.recv(1 << 16):
            for event in self._h2.receive_data(data):
                if isinstance(event, ConnectionTerminated):
                    code = event.error_code
        return code

    def close(self) -> None:
        self._socket.close()


def unframed(data: bytes) -> list[bytes]:
    """The gRPC messages of a stream's DATA."""
    messages = []
    while len(data) >= 5:
        _, length = struct.unpack_from(">BI", data)
        messages.append(data[5:5 + length])
        data = data[5 + length:]
    return messages


def doubled(answer: bytes, rows: int = 1) -> None:
    """C{answer} is DoubleFront's to L{infer_message} of C{rows}: 2 everywhere."""
    response = service_pb2.ModelInferResponse.FromString(answer)
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.float32),
                                  np.full(rows * 4, 2, np.float32))


@pytest_twisted.ensureDeferred
async def test_a_prefix_split_across_frames_is_read_whole(serve):
    """A message whose 5-byte prefix and body come one byte per DATA frame is answered as if
    it came in one."""
    grpc_front = await serve(DoubleFront())
    calls = H2Calls(grpc_front.port)

    def call():
        stream_id = calls.start("ModelInfer")
        data = framed(infer_message())
        for i in range(len(data)):
            calls.send(stream_id, data[i:i + 1], end=i == len(data) - 1)
        return calls.wait(stream_id)[0]

    try:
        ended = await in_thread(call)
        assert ended["status"] == grpc.StatusCode.OK.value[0], ended
        doubled(ended["data"])
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_calls_reset_as_they_open_leave_the_connection_serving(serve):
    """A call the client resets in the same write that opens it (HTTP/2 has closed its stream
    before the front reads its metadata) is dropped unanswered, whether the front would have
    answered it at once (ServerLive), refused it (no such method, no token, the server
    stopping) or waited for its message; the connection goes on serving the next call."""
    grpc_front = await serve(DoubleFront())
    calls = H2Calls(grpc_front.port)

    def abandoned_then_one_call():
        for method, metadata in (("ServerLive", ()), ("Nope", ()), ("ModelInfer", ()),
                                 ("ModelInfer", H2_ADMITTED)):
            calls.reset(calls.start(method, metadata, flush=False))
        stream_id = calls.start("ModelInfer")
        calls.send(stream_id, framed(infer_message()), True)
        return calls.wait(stream_id)[0]

    try:
        ended = await in_thread(abandoned_then_one_call)
        assert ended["status"] == grpc.StatusCode.OK.value[0], ended
        doubled(ended["data"])
        assert grpc_front.calls == 0 and grpc_front.unread == 0
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_an_oversized_prefix_ends_the_call_before_its_message(serve):
    """A prefix that announces a message over the bound ends the call RESOURCE_EXHAUSTED as
    soon as it arrives, though none of the message ever comes; the front is never asked."""
    front = DoubleFront()
    grpc_front = await serve(front, max_message_bytes=1 << 20)
    calls = H2Calls(grpc_front.port)

    def call():
        stream_id = calls.start("ModelInfer")
        calls.send(stream_id, struct.pack(">BI", 0, (1 << 20) + 1))
        return calls.wait(stream_id)[0]

    try:
        ended = await in_thread(call)
        assert ended["status"] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], ended
        assert "over the bound" in ended["message"]
        assert front.calls == [] and grpc_front.unread == 0
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_a_stream_reset_mid_message_frees_its_call(serve):
    """A call reset after half its message no longer waits for the rest, and the connection
    answers the next call."""
    grpc_front = await serve(DoubleFront())
    calls = H2Calls(grpc_front.port)
    data = framed(infer_message())
    try:
        stream_id = await in_thread(calls.start, "ModelInfer")
        await in_thread(calls.send, stream_id, data[:len(data) // 2])
        await until(lambda: grpc_front.unread == 1, "the call waits for the rest")
        await in_thread(calls.reset, stream_id)
        await until(lambda: grpc_front.unread == 0 and grpc_front.calls == 0, "the call is gone")

        def next_call():
            again = calls.start("ModelInfer")
            calls.send(again, data, end=True)
            return calls.wait(again)[0]

        ended = await in_thread(next_call)
        assert ended["status"] == grpc.StatusCode.OK.value[0], ended
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_many_calls_on_one_connection_are_each_answered(serve):
    """A hundred calls open at once on one connection, their messages sent in reverse order,
    are each answered with their own answer."""
    front = DoubleFront()
    grpc_front = await serve(front, max_unread=128)
    calls = H2Calls(grpc_front.port)

    def call():
        stream_ids = {calls.start("ModelInfer"): 1 + i % 4 for i in range(100)}
        for stream_id, rows in reversed(stream_ids.items()):
            calls.send(stream_id, framed(infer_message(rows=rows)), end=True)
        return list(zip(stream_ids.values(), calls.wait(*stream_ids), strict=True))

    try:
        answers = await in_thread(call)
        for rows, ended in answers:
            assert ended["status"] == grpc.StatusCode.OK.value[0], ended
            doubled(ended["data"], rows)
        assert len(front.calls) == 100
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_request_ids_take_no_place_in_the_header_table(serve):
    """Each answer's trailers carry its own request id, sent as a header never indexed:
    after 200 calls on one connection the header table holds none, and every answer's
    headers are still there, each sent as an index."""
    grpc_front = await serve(DoubleFront(), max_unread=256)
    calls = H2Calls(grpc_front.port)

    def call():
        answers = []
        for _ in range(2):
            stream_ids = [calls.start("ModelInfer") for _ in range(100)]
            for stream_id in stream_ids:
                calls.send(stream_id, framed(infer_message()), end=True)
            answers += calls.wait(*stream_ids)
        return answers, calls.table()

    try:
        answers, table = await in_thread(call)
        assert len({ended["request_id"] for ended in answers}) == 200, answers[:2]
        assert all(ended["status"] == grpc.StatusCode.OK.value[0] for ended in answers)
        assert b"x-request-id" not in table and b"content-type" in table, table
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_a_message_split_anywhere_is_answered(serve):
    """However a message (prefix included) is cut into DATA frames, the answer is the same."""
    grpc_front = await serve(DoubleFront())
    calls = H2Calls(grpc_front.port)
    data = framed(infer_message(rows=3))

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.integers(1, len(data) - 1), max_size=8).map(sorted))
    def split(cuts):
        stream_id = calls.start("ModelInfer")
        bounds = [0, *cuts, len(data)]
        for start, stop in zip(bounds, bounds[1:], strict=False):
            calls.send(stream_id, data[start:stop])
        calls.send(stream_id, b"", end=True)
        ended = calls.wait(stream_id)[0]
        assert ended["status"] == grpc.StatusCode.OK.value[0], ended
        doubled(ended["data"], 3)

    try:
        await in_thread(split)
    finally:
        calls.close()


#: Calls a client may open: admitted, without the token, answered without a message, unknown.
OPENED = (("ModelInfer", H2_ADMITTED), ("ModelInfer", ()), ("ServerLive", ()), ("Nope", ()))


@pytest_twisted.ensureDeferred
async def test_no_course_of_calls_faults_the_connection(serve):
    """Whatever a client does with its calls (opens each, sends any part of its message or
    none, ends it or not, resets it or not) and however its frames are gathered into writes,
    the front never faults: the next call on the connection is answered, and no call is left
    counted once the client has reset those it left open."""
    grpc_front = await serve(DoubleFront())
    calls = H2Calls(grpc_front.port)
    data = framed(infer_message())
    step = st.tuples(st.sampled_from(OPENED), st.integers(0, len(data)), st.booleans(),
                     st.booleans(), st.booleans())

    @settings(max_examples=100, deadline=None)
    @given(st.lists(step, max_size=6))
    def course(steps):
        left_open = []
        for (method, metadata), sent, end, reset, write in steps:
            stream_id = calls.start(method, metadata, flush=False)
            if sent or end:
                calls.send(stream_id, data[:sent], end=end, flush=False)
            if reset:
                calls.reset(stream_id, flush=False)
            elif not end:
                left_open.append(stream_id)
            if write:
                calls.flush()
        for stream_id in left_open:
            calls.reset(stream_id, flush=False)
        stream_id = calls.start("ModelInfer", flush=False)
        calls.send(stream_id, data, end=True)
        ended = calls.wait(stream_id)[0]
        assert ended["status"] == grpc.StatusCode.OK.value[0], ended
        assert (grpc_front.calls, grpc_front.unread) == (0, 0)

    try:
        await in_thread(course)
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_oversized_metadata_ends_the_connection_and_no_other(serve):
    """A call whose metadata is past the header list bound ends its connection (GOAWAY, no
    call made); another connection is answered meanwhile."""
    front = DoubleFront()
    grpc_front = await serve(front)
    calls, other = H2Calls(grpc_front.port), H2Calls(grpc_front.port)

    def attack():
        calls.start("ModelInfer", (*H2_ADMITTED, (b"x-padding", b"a" * (100 << 10))))
        return calls.terminated()

    def ordinary():
        stream_id = other.start("ModelInfer")
        other.send(stream_id, framed(infer_message()), end=True)
        return other.wait(stream_id)[0]

    try:
        assert await in_thread(attack) is not None
        assert front.calls == [] and grpc_front.calls == 0
        ended = await in_thread(ordinary)
        assert ended["status"] == grpc.StatusCode.OK.value[0], ended
    finally:
        calls.close()
        other.close()


@pytest_twisted.ensureDeferred
async def test_more_than_one_message_ends_a_unary_call(serve):
    """A unary call that sends two messages ends INVALID_ARGUMENT, the front never asked."""
    front = DoubleFront()
    grpc_front = await serve(front)
    calls = H2Calls(grpc_front.port)

    def call():
        stream_id = calls.start("ModelInfer")
        calls.send(stream_id, framed(infer_message()) * 2, end=True)
        return calls.wait(stream_id)[0]

    try:
        ended = await in_thread(call)
        assert ended["status"] == grpc.StatusCode.INVALID_ARGUMENT.value[0], ended
        assert front.calls == []
    finally:
        calls.close()


class Looping:
    """Clients that infer in a loop, each until a call fails: the calls answered, and how
    each loop ended."""

    def __init__(self, address: str, clients: int):
        self.answered = 0
        self.ended: list[str] = []
        self._address = address
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _loop(self) -> None:
        client = grpcclient.InferenceServerClient(self._address)
        given_input = grpcclient.InferInput("input", [1, 16], "FP32")
        given_input.set_data_from_numpy(np.zeros((1, 16), np.float32))
        try:
            while True:
                client.infer("mlp", [given_input], client_timeout=30)
                self.answered += 1
        except InferenceServerException as e:
            self.ended.append(str(e.status()) + " " + str(e.message()))
        finally:
            client.close()

    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)


@pytest_twisted.ensureDeferred
async def test_sigterm_under_load_fails_no_call(processes, tmp_path):
    """SIGTERM under a steady gRPC load: the server exits 0, every call that reached the front
    is answered without a fault (no error logged), and each client's calls are answered until
    one is refused as UNAVAILABLE (draining, or the server gone) or CANCELLED (gRPC's own end
    of a call it had not yet handed over when it stopped)."""
    process, address = await start_grpc_server(processes, export_mlp(tmp_path))
    load = Looping(address, 8)
    await until(lambda: load.answered >= 100, "the load is on", timeout=60)
    process.signal("TERM")
    assert await process.exited(60) == 0, process.tail()
    await until(load.done, "every client has ended", timeout=60)
    assert {ended.split()[0] for ended in load.ended} <= {"StatusCode.UNAVAILABLE",
                                                          "StatusCode.CANCELLED"}, load.ended
    assert process.matching(r"Traceback|internal error|handed over failed") == [], process.tail(80)


@pytest_twisted.ensureDeferred
async def test_two_authorization_values_are_never_one_token(guarded_server):
    """Two authorization metadata values are refused whichever holds the token, as over HTTP."""
    address, _ = guarded_server
    channel = grpc.insecure_channel(address)
    stub = channel.unary_unary(f"/{SERVICE}/RepositoryIndex")
    message = service_pb2.RepositoryIndexRequest().SerializeToString()
    try:
        for values in ((TOKEN, "wrong"), ("wrong", TOKEN), (TOKEN, TOKEN)):
            metadata = tuple(("authorization", f"Bearer {value}") for value in values)
            with pytest.raises(grpc.RpcError) as refused:
                await in_thread(functools.partial(stub, message, metadata=metadata, timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()


@pytest_twisted.ensureDeferred
async def test_a_call_past_its_own_deadline_ends_and_cancels_its_inference(serve):
    """A call that sent ``grpc-timeout: 5S`` ends DEADLINE_EXCEEDED once 5 s pass on the
    front's clock, and the inference it started is cancelled; before that it is still open."""
    clock = Clock()
    front = HangingFront()
    grpc_front = await serve(front, clock=clock)
    calls = H2Calls(grpc_front.port)
    try:
        stream_id = await in_thread(calls.start, "ModelInfer", (*H2_ADMITTED, (b"grpc-timeout", b"5S")))
        await in_thread(calls.send, stream_id, framed(infer_message()), True)
        # Polled, not awaited: awaiting would resume this test inside the front's infer().
        await until(lambda: front.arrived.called, "the inference arrives")
        clock.advance(4.9)
        assert not front.cancelled.called and grpc_front.calls == 1
        clock.advance(0.2)
        await until(lambda: front.cancelled.called, "the inference is cancelled", timeout=10)
        ended = (await in_thread(calls.wait, stream_id))[0]
        assert ended["status"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], ended
        await until(lambda: grpc_front.calls == 0, "the call is gone")
    finally:
        calls.close()
