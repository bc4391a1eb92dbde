"""
The gRPC front's HTTP/2, as a client that frames its calls its own way meets
it: a message split anywhere across DATA frames, a length prefix over the
bound, a stream reset mid-call, many calls on one connection. The client
here speaks HTTP/2 itself (h2, client side, over a real socket, in a thread)
so that it controls every frame, which gRPC's own clients never let it do.
"""

from __future__ import annotations

import socket
import struct

import grpc
import numpy as np
import pytest_twisted
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, ResponseReceived, StreamEnded, StreamReset, TrailersReceived
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from twisted.internet import defer, threads

from kcoral.inference.h2front import SERVICE
from tests.harness import until
from tests.test_grpc_front import TOKEN, infer_message, serve  # noqa: F401 (serve: a fixture)
from tests.test_inference_fronts import DoubleFront

ADMITTED = ((b"authorization", f"Bearer {TOKEN}".encode()),)


def framed(message: bytes) -> bytes:
    """A gRPC message as it goes in DATA: uncompressed, its length, itself."""
    return struct.pack(">BI", 0, len(message)) + message


class H2Calls:
    """Calls on one HTTP/2 connection, every frame sent as told (blocking: run in a thread)."""

    def __init__(self, port: int):
        self._socket = socket.create_connection(("127.0.0.1", port), timeout=30)
        self._h2 = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        self._h2.initiate_connection()
        self._flush()
        self.ended: dict[int, dict] = {}
        self._open: dict[int, dict] = {}

    def _flush(self) -> None:
        self._socket.sendall(self._h2.data_to_send())

    def start(self, method: str, metadata=ADMITTED) -> int:
        """Opens a call of C{method} (its HEADERS only); its stream id."""
        stream_id = self._h2.get_next_available_stream_id()
        self._h2.send_headers(stream_id, [
            (b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"localhost"),
            (b":path", f"/{SERVICE}/{method}".encode()), (b"content-type", b"application/grpc"),
            (b"te", b"trailers"), *metadata])
        self._open[stream_id] = {"data": b"", "headers": {}}
        self._flush()
        return stream_id

    def send(self, stream_id: int, data: bytes, end: bool = False) -> None:
        """One DATA frame of C{data} (at most a frame's size)."""
        self._h2.send_data(stream_id, data, end_stream=end)
        self._flush()

    def reset(self, stream_id: int) -> None:
        self._h2.reset_stream(stream_id)
        self._open.pop(stream_id)
        self._flush()

    def wait(self, *stream_ids: int) -> list[dict]:
        """The end of each call: C{status}, C{message} (grpc-message), C{data} (its answer's
        message, unframed), C{reset} (the server reset it, whatever it said first)."""
        while not all(s in self.ended for s in stream_ids):
            data = self._socket.recv(1 << 16)
            assert data, "the server closed the connection"
            for event in self._h2.receive_data(data):
                call = self._open.get(getattr(event, "stream_id", 0))
                if call is None:
                    continue
                if isinstance(event, (ResponseReceived, TrailersReceived)):
                    call["headers"].update(dict(event.headers))
                elif isinstance(event, DataReceived):
                    call["data"] += event.data
                    self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, (StreamEnded, StreamReset)):
                    if event.stream_id not in self.ended:
                        headers = call["headers"]
                        self.ended[event.stream_id] = {
                            "status": int(headers.get(b"grpc-status", b"-1")),
                            "message": headers.get(b"grpc-message", b"").decode(),
                            "data": call["data"][5:], "reset": isinstance(event, StreamReset)}
            self._flush()
        return [self.ended[s] for s in stream_ids]

    def close(self) -> None:
        self._socket.close()


def in_thread(f, *args):
    return defer.ensureDeferred(threads.deferToThread(f, *args))


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
