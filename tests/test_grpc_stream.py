"""
gRPC's bidirectional stream, ModelStreamInfer: each message is answered on
the stream in the order it came, a message that fails with its error as an
answer (the stream goes on); after the client's half-close every message is
answered and the call ends OK; a reset or a lost connection cancels what is
in flight. A stream has at most a bounded number of messages in flight, and
a client that does not read its answers is stopped by its own window.

tritonclient's own stream APIs (the thread-based one and asyncio's) make the
ordinary calls; L{H2Calls} sends every frame of the others. Most tests serve
a fake front in this process; the last ones a real standalone server and a
real node's gateway, with a real model.
"""

from __future__ import annotations

import asyncio
import queue
import struct

import grpc
import numpy as np
import pytest
import pytest_twisted
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, PingAckReceived
from h2.settings import SettingCodes
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from twisted.internet import defer
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from zope.interface import implementer

from kcoral.inference.front import IInferenceFront
from kcoral.inference.h2front import MAX_UNREAD_BYTES, SERVICE, GrpcFront
from kcoral.web.auth import CLIENT_ROUTES, TokenGuard
from tests.conftest import server_args
from tests.harness import ChildProcess, until
from tests.httputil import request as http_request
from tests.test_grpc_front import (
    ANSWERED_WITHIN,
    H2_ADMITTED,
    TOKEN,
    H2Calls,
    export_mlp,
    framed,
    in_thread,
    mlp_probes,
    rss_bytes,
    target,
    unframed,
)
from tests.test_inference_fronts import DoubleFront
from tests.test_models import start_grpc_front

STREAM = "ModelStreamInfer"
ADMITTED = {"authorization": f"Bearer {TOKEN}"}
OK = grpc.StatusCode.OK.value[0]


def infer_request(index: int, model: str = "double", shape=(1, 4)) -> bytes:
    """A ModelInferRequest whose id is C{index} and whose input holds C{index} everywhere."""
    pb = service_pb2.ModelInferRequest(model_name=model, id=str(index))
    pb.inputs.add(name="x", datatype="FP32", shape=list(shape))
    pb.raw_input_contents.append(np.full(shape, index, np.float32).tobytes())
    return pb.SerializeToString()


def answered(message: bytes) -> tuple[str, np.ndarray | None, str]:
    """A ModelStreamInferResponse: its answer's id and output (from DoubleFront), or its error."""
    response = service_pb2.ModelStreamInferResponse.FromString(message)
    if response.error_message:
        return "", None, response.error_message
    infer = response.infer_response
    return infer.id, np.frombuffer(infer.raw_output_contents[0], np.float32), ""


def check_doubled(messages: list[bytes], indexes) -> None:
    """C{messages} are DoubleFront's answers to L{infer_request} of each of C{indexes}, in order."""
    assert len(messages) == len(indexes)
    for message, index in zip(messages, indexes, strict=True):
        rid, y, error = answered(message)
        assert (rid, error) == (str(index), ""), (rid, error)
        np.testing.assert_array_equal(y, np.full(y.size, 2 * index, np.float32))


@implementer(IInferenceFront)
class HeldFront(DoubleFront):
    """DoubleFront whose answers wait until L{release}d: C{held} has each inference's Deferred
    in the order they came, C{cancelled} counts those cancelled."""

    def __init__(self):
        super().__init__()
        self.held: list[tuple[defer.Deferred, object]] = []
        self.cancelled = 0

    def infer(self, name, version, call):
        try:
            result = self._infer(name, call)
        except Exception:
            result = Failure()
        d = defer.Deferred(lambda _: setattr(self, "cancelled", self.cancelled + 1))
        self.held.append((d, result))
        return d

    def release(self, index: int) -> None:
        d, result = self.held[index]
        if isinstance(result, Failure):
            d.errback(result)
        else:
            d.callback(result)


# -- tritonclient's stream APIs ---------------------------------------------------------------

#: The real model's tensor names (L{export_models}); DoubleFront's are x and y.
INPUT_NAMES = {"mlp": "input", "wide": "input"}
OUTPUT_NAMES = {"mlp": "output", "wide": "output"}


def tritonclient_stream(address: str, requests: list[tuple[str, np.ndarray]], metadata: dict,
                        cancel_after: int | None = None) -> list:
    """tritonclient.grpc's stream: C{requests} (model, input) sent with request ids 0, 1, ...,
    then stop_stream (which waits for every answer), or, once C{cancel_after} answers have
    come, stop_stream(cancel_requests=True). What the callback got: (id, y) or an error."""
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(address)
    try:
        client.start_stream(lambda result, error: got.put((result, error)), headers=metadata)
        for index, (model, x) in enumerate(requests):
            given_input = grpcclient.InferInput(INPUT_NAMES.get(model, "x"), list(x.shape), "FP32")
            given_input.set_data_from_numpy(x)
            client.async_stream_infer(model, [given_input], request_id=str(index))
        results = []
        if cancel_after is not None:
            results = [got.get(timeout=30) for _ in range(cancel_after)]
            client.stop_stream(cancel_requests=True)
        else:
            client.stop_stream()
        while not got.empty():
            results.append(got.get())
        return [(r.get_response().id, r.as_numpy(OUTPUT_NAMES.get(r.get_response().model_name, "y")))
                if r is not None else e for r, e in results]
    finally:
        client.close()


def aio_stream(address: str, requests: list[tuple[str, np.ndarray]], metadata: dict) -> list:
    """tritonclient.grpc.aio's stream_infer, as L{tritonclient_stream}: what it yields."""

    async def stream():
        client = aioclient.InferenceServerClient(address)

        async def inputs():
            for index, (model, x) in enumerate(requests):
                given_input = grpcclient.InferInput(INPUT_NAMES.get(model, "x"), list(x.shape), "FP32")
                given_input.set_data_from_numpy(x)
                yield {"model_name": model, "inputs": [given_input], "request_id": str(index)}

        try:
            results = []
            async for result, error in client.stream_infer(inputs(), headers=metadata):
                results.append((result.get_response().id,
                                result.as_numpy(OUTPUT_NAMES.get(result.get_response().model_name, "y")))
                               if result is not None else error)
            return results
        finally:
            await client.close()

    return asyncio.run(stream())


def with_errors(count: int, model: str, width: int, unknown: int, misshapen: int) -> list:
    """C{count} requests of C{model}, the one at C{unknown} for a model that is not there and
    the one at C{misshapen} of the wrong shape."""
    requests = []
    for index in range(count):
        x = np.full((1, width), index / count, np.float32)
        if index == unknown:
            requests.append(("nope", x))
        elif index == misshapen:
            requests.append((model, np.ones((1, width + 1), np.float32)))
        else:
            requests.append((model, x))
    return requests


def check_in_order(results: list, requests: list, f, unknown: int, misshapen: int) -> None:
    """Each result answers its request, in order: f(x), or the error of the two that fail."""
    assert len(results) == len(requests), results
    for index, (result, (_, x)) in enumerate(zip(results, requests, strict=True)):
        if index in (unknown, misshapen):
            assert isinstance(result, Exception), (index, result)
            assert ("nope" if index == unknown else "shape") in str(result), result
        else:
            rid, y = result
            assert rid == str(index)
            np.testing.assert_allclose(y, f(x), rtol=1e-6)


@pytest_twisted.ensureDeferred
async def test_tritonclient_streams_are_answered_in_order_errors_included(serve):
    """tritonclient's stream (thread-based and asyncio): 12 requests, one for an unknown model
    and one of a wrong shape among them, each answered in order, the two with their errors,
    and the stream ends once all are answered; each inference has its own request id, the
    call's numbered."""
    front = DoubleFront()
    grpc_front = await serve(front)
    requests = with_errors(12, "double", 4, unknown=4, misshapen=8)
    results = await in_thread(tritonclient_stream, target(grpc_front), requests,
                              {**ADMITTED, "x-request-id": "s1"})
    check_in_order(results, requests, lambda x: 2 * x, unknown=4, misshapen=8)
    # The one for the unknown model never reached the model.
    assert [call.request_id for call in front.calls] == [f"s1.{n}" for n in range(1, 13) if n != 5]
    results = await in_thread(aio_stream, target(grpc_front), requests, ADMITTED)
    check_in_order(results, requests, lambda x: 2 * x, unknown=4, misshapen=8)
    assert grpc_front.calls == 0


@pytest_twisted.ensureDeferred
async def test_an_answer_waits_for_those_before_it(serve):
    """Six inferences whose answers are ready last first are answered on the stream in the
    order they were asked."""
    front = HeldFront()
    grpc_front = await serve(front)
    requests = [("double", np.full((1, 4), i, np.float32)) for i in range(6)]
    streamed = in_thread(aio_stream, target(grpc_front), requests, ADMITTED)
    await until(lambda: len(front.held) == 6, "the six inferences are asked")
    for index in reversed(range(6)):
        front.release(index)
    results = await streamed
    assert [rid for rid, _ in results] == [str(i) for i in range(6)]
    for index, (_, y) in enumerate(results):
        np.testing.assert_array_equal(y, np.full((1, 4), 2 * index, np.float32))


# -- the stream, frame by frame ---------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_the_half_close_ends_the_call_ok_once_all_is_answered(serve):
    """Five messages and a message that is not a ModelInferRequest, sent with the half-close
    in one write: six answers in order (the odd one its error), then OK with the request id;
    a stream half-closed before any message ends OK without one."""
    grpc_front = await serve(DoubleFront())
    calls = H2Calls(grpc_front.port)

    def call():
        stream_id = calls.start(STREAM, flush=False)
        messages = [framed(infer_request(i)) for i in range(5)]
        messages.insert(2, framed(b"\xff\xff\xff"))
        calls.send(stream_id, b"".join(messages), end=True)
        empty = calls.start(STREAM, flush=False)
        calls.send(empty, b"", end=True)
        return calls.wait(stream_id, empty)

    try:
        ended, empty = await in_thread(call)
        assert ended["status"] == OK and ended["request_id"], ended
        odd = ended["messages"].pop(2)
        assert answered(odd)[2] == "the message is not a ModelInferRequest"
        check_doubled(ended["messages"], range(5))
        assert (empty["status"], empty["messages"]) == (OK, [])
        assert grpc_front.calls == 0
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_a_failed_messages_error_names_the_request_it_answers(serve):
    """As Triton's: the error answer of a request that fails (an unknown model) carries that
    request's id in its infer_response, so that a client can tell which of its requests
    failed (a decoupled model's answers being any number); a message that is no request has
    no id to carry."""
    grpc_front = await serve(DoubleFront())
    calls = H2Calls(grpc_front.port)

    def call():
        stream_id = calls.start(STREAM, flush=False)
        messages = [infer_request(0), infer_request(7, model="nope"), b"\xff\xff\xff",
                    infer_request(3)]
        calls.send(stream_id, b"".join(framed(m) for m in messages), end=True)
        return calls.wait(stream_id)[0]

    try:
        ended = await in_thread(call)
        assert ended["status"] == OK, ended
        answers = [service_pb2.ModelStreamInferResponse.FromString(m) for m in ended["messages"]]
        assert [(a.infer_response.id, bool(a.error_message)) for a in answers] == [
            ("0", False), ("7", True), ("", True), ("3", False)]
        assert "nope" in answers[1].error_message
    finally:
        calls.close()


#: What ends a stream mid-way, after two good messages, and the status it ends with.
BAD_ENDINGS = {
    "a message over the bound": (struct.pack(">BI", 0, (1 << 20) + 1), False,
                                 grpc.StatusCode.RESOURCE_EXHAUSTED),
    "a compressed message": (struct.pack(">BI", 1, 3) + b"abc", False, grpc.StatusCode.UNIMPLEMENTED),
    "half a message, then the half-close": (framed(infer_request(9))[:12], True,
                                            grpc.StatusCode.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("ending", BAD_ENDINGS)
@pytest_twisted.ensureDeferred
async def test_a_bad_frame_ends_the_stream_after_the_answers_before_it(serve, ending):
    """A message over the bound, a compressed one, or a half-close in the middle of a message
    ends the stream with its status, after the answers of the messages before it; the
    connection goes on serving."""
    data, end, code = BAD_ENDINGS[ending]
    front = DoubleFront()
    grpc_front = await serve(front, max_message_bytes=1 << 20)
    calls = H2Calls(grpc_front.port)

    def call():
        stream_id = calls.start(STREAM)
        calls.send(stream_id, framed(infer_request(0)) + framed(infer_request(1)) + data, end=end)
        ended = calls.wait(stream_id)[0]
        again = calls.start(STREAM)
        calls.send(again, framed(infer_request(2)), end=True)
        return ended, calls.wait(again)[0]

    try:
        ended, again = await in_thread(call)
        assert ended["status"] == code.value[0], ended
        check_doubled(ended["messages"], range(2))
        assert again["status"] == OK
        check_doubled(again["messages"], [2])
        assert len(front.calls) == 3 and (grpc_front.calls, grpc_front.unread) == (0, 0)
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_a_reset_or_a_lost_connection_cancels_the_inferences_in_flight(serve):
    """A stream reset with three inferences in flight (the middle one answered, waiting for
    the first) has the other two cancelled and is forgotten, the connection serving on; a
    connection lost does the same to its stream's."""
    front = HeldFront()
    grpc_front = await serve(front)
    calls = H2Calls(grpc_front.port)

    def stream(count: int) -> int:
        stream_id = calls.start(STREAM)
        calls.send(stream_id, b"".join(framed(infer_request(i)) for i in range(count)))
        return stream_id

    try:
        stream_id = await in_thread(stream, 3)
        await until(lambda: len(front.held) == 3, "three inferences in flight")
        front.release(1)
        await in_thread(calls.reset, stream_id)
        await until(lambda: front.cancelled == 2, "the other two are cancelled")
        assert grpc_front.calls == 0

        def next_call():
            again = calls.start("ModelInfer")
            calls.send(again, framed(infer_request(7)), end=True)
            return again

        again = await in_thread(next_call)
        await until(lambda: len(front.held) == 4, "the next call's inference")
        front.release(3)
        assert (await in_thread(calls.wait, again))[0]["status"] == OK
        await in_thread(stream, 2)
        await until(lambda: len(front.held) == 6, "two more in flight")
    finally:
        calls.close()
    await until(lambda: front.cancelled == 4, "the lost connection's two are cancelled")
    await until(lambda: grpc_front.calls == 0, "the call is gone")


@pytest_twisted.ensureDeferred
async def test_tritonclient_cancelling_its_stream_cancels_what_is_in_flight(serve):
    """tritonclient's stop_stream(cancel_requests=True) once the first of four answers has
    come cancels the three inferences still in flight."""
    front = HeldFront()
    grpc_front = await serve(front)
    requests = [("double", np.full((1, 4), i, np.float32)) for i in range(4)]
    streamed = in_thread(tritonclient_stream, target(grpc_front), requests, ADMITTED, 1)
    await until(lambda: len(front.held) == 4, "four inferences in flight")
    front.release(0)
    results = await streamed
    assert results[0][0] == "0"
    await until(lambda: front.cancelled == 3, "the other three are cancelled")
    await until(lambda: grpc_front.calls == 0, "the call is gone")


@pytest_twisted.ensureDeferred
async def test_a_streams_deadline_ends_it_and_cancels_its_inferences(serve):
    """A stream that sent grpc-timeout 5S ends DEADLINE_EXCEEDED once 5 s pass on the front's
    clock, its inferences in flight cancelled."""
    clock = Clock()
    front = HeldFront()
    grpc_front = await serve(front, clock=clock)
    calls = H2Calls(grpc_front.port)
    try:
        stream_id = await in_thread(calls.start, STREAM, (*H2_ADMITTED, (b"grpc-timeout", b"5S")))
        await in_thread(calls.send, stream_id, framed(infer_request(0)) + framed(infer_request(1)))
        await until(lambda: len(front.held) == 2, "two inferences in flight")
        clock.advance(5)
        ended = (await in_thread(calls.wait, stream_id))[0]
        assert ended["status"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], ended
        assert front.cancelled == 2 and grpc_front.calls == 0
    finally:
        calls.close()


# -- the bound on a stream, and clients that do not read --------------------------------------

@pytest_twisted.ensureDeferred
async def test_a_stream_has_at_most_its_bound_in_flight(serve):
    """With a bound of 4, ten messages sent at once start four inferences; each answer sent
    starts the next; all ten are answered in order."""
    front = HeldFront()
    grpc_front = await serve(front, max_in_flight=4)
    calls = H2Calls(grpc_front.port)

    def send_all() -> int:
        stream_id = calls.start(STREAM)
        calls.send(stream_id, b"".join(framed(infer_request(i)) for i in range(10)), end=True)
        calls.ping()
        calls.read_until(lambda: calls.pongs == 1)
        return stream_id

    try:
        stream_id = await in_thread(send_all)
        # The front has taken every frame sent (the ping's answer came after them).
        assert len(front.held) == 4
        for index in range(10):
            started = min(index + 4, 10)
            await until(lambda count=started: len(front.held) >= count, "the next one starts")
            assert len(front.held) == started
            front.release(index)
        ended = (await in_thread(calls.wait, stream_id))[0]
        assert ended["status"] == OK
        check_doubled(ended["messages"], range(10))
    finally:
        calls.close()


@pytest_twisted.ensureDeferred
async def test_a_client_that_does_not_read_its_answers_is_stopped_by_its_window(serve):
    """A client that never gives the window of its answers back: the front sends what that
    window (HTTP/2's first 65,535 bytes) holds, keeps at most the stream's bound of answers
    more, and starts nothing else, though 3,000 messages were sent; once the client
    reads, the rest are answered, in order, and the call ends OK."""
    front = DoubleFront()
    grpc_front = await serve(front, max_in_flight=4)
    calls = H2Calls(grpc_front.port, acknowledge=False)
    # Four-digit ids: every answer of the same size.
    indexes = range(1000, 4000)

    def send_all() -> int:
        # The server's settings first: its window is wider than HTTP/2's first one.
        calls.ping()
        calls.read_until(lambda: calls.pongs == 1)
        stream_id = calls.start(STREAM)
        for index in indexes:
            calls.send(stream_id, framed(infer_request(index)), flush=False)
        calls.ping()
        calls.read_until(lambda: calls.pongs == 2)
        return stream_id

    try:
        stream_id = await in_thread(send_all)
        answer = len(framed(calls.messages(stream_id)[0]))
        sent = 65535 // answer
        assert len(front.calls) == sent + 4 < len(indexes)

        def read_the_rest():
            calls.acknowledge_all()
            calls.send(stream_id, b"", end=True)
            return calls.wait(stream_id)[0]

        ended = await in_thread(read_the_rest)
        assert ended["status"] == OK and len(front.calls) == len(indexes)
        check_doubled(ended["messages"], indexes)
    finally:
        calls.close()


class ByHand:
    """A client's HTTP/2 over a transport driven by hand: what it sends is handed to the
    front's connection, what the connection writes is read back by the client."""

    def __init__(self, grpc_front: GrpcFront, window: int = 65535):
        self.connection = grpc_front.factory().buildProtocol(IPv4Address("TCP", "127.0.0.1", 1))
        self.transport = StringTransport()
        self.connection.makeConnection(self.transport)
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        self.h2.initiate_connection()
        if window > 65535:
            self.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: window})
            self.h2.increment_flow_control_window(window - 65535)
        self.send()
        self.read()

    def send(self) -> None:
        self.connection.dataReceived(self.h2.data_to_send())

    def read(self) -> list:
        """The events of what the connection has written since."""
        written = self.transport.value()
        self.transport.clear()
        events = self.h2.receive_data(written) if written else []
        self.send()
        return events

    def stream(self, data: bytes) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, [
            (b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"localhost"),
            (b":path", f"/{SERVICE}/{STREAM}".encode()), (b"content-type", b"application/grpc"),
            *H2_ADMITTED])
        self.h2.send_data(stream_id, data)
        self.send()
        return stream_id


def unstarted(front, clock: Clock, **options) -> GrpcFront:
    """A GrpcFront of C{front} on C{clock}, guarded by the token, for connections made by hand."""
    return GrpcFront(front, reactor=clock, guard=TokenGuard.of([TOKEN], CLIENT_ROUTES), **options)


# The transport's pauses, driven by hand: a real socket's come when the kernel's buffers are
# full, at a moment no test can name.

def test_a_client_behind_on_reading_is_sent_no_answer_until_it_catches_up():
    """While the transport says the client is behind on reading (its producer paused), the
    front writes no answer and a stream stops at its bound, however wide the client's window;
    once it catches up, every answer is written, in order."""
    clock = Clock()
    front = DoubleFront()
    client = ByHand(unstarted(front, clock, max_in_flight=4), window=(1 << 31) - 1)
    client.connection.pauseProducing()
    stream_id = client.stream(b"".join(framed(infer_request(i)) for i in range(20)))
    clock.advance(0)
    assert not [e for e in client.read() if isinstance(e, DataReceived)]
    assert len(front.calls) == 4
    client.connection.resumeProducing()
    clock.advance(0)
    written = b"".join(e.data for e in client.read() if isinstance(e, DataReceived))
    client.h2.end_stream(stream_id)
    client.send()
    clock.advance(0)
    written += b"".join(e.data for e in client.read() if isinstance(e, DataReceived))
    check_doubled(unframed(written), range(20))


def test_a_client_behind_on_reading_that_makes_more_frames_is_dropped():
    """A client behind on reading that goes on making frames no window holds back (pings,
    whose answers are written whatever the window) is dropped once they pass the bound."""
    clock = Clock()
    client = ByHand(unstarted(DoubleFront(), clock))
    client.connection.pauseProducing()
    pings = MAX_UNREAD_BYTES // 17 + 1  # a ping's answer is 17 bytes
    for _ in range(pings):
        client.h2.ping(b"kcoral!!")
    client.send()
    clock.advance(0)
    assert client.transport.disconnecting
    assert len([e for e in client.read() if isinstance(e, PingAckReceived)]) < pings


# -- whatever a stream carries ------------------------------------------------------------------

#: What a stream's DATA may hold: good messages, one that is not a ModelInferRequest, and any
#: bytes (among them prefixes of compressed messages, of ones over the bound, of half ones).
PIECES = st.one_of(st.integers(0, 9).map(lambda i: framed(infer_request(i))),
                   st.just(framed(b"\xff\xff\xff")), st.binary(max_size=12))
STREAM_BOUND = 1 << 16


def expected_end(data: bytes) -> tuple[int, int]:
    """How a stream of C{data}, then the half-close, ends: its status, and how many
    messages are answered before it."""
    count = 0
    while data:
        if len(data) < 5:
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], count
        compressed, length = struct.unpack_from(">BI", data)
        if compressed:
            return grpc.StatusCode.UNIMPLEMENTED.value[0], count
        if length > STREAM_BOUND:
            return grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], count
        if len(data) < 5 + length:
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], count
        count += 1
        data = data[5 + length:]
    return OK, count


@pytest_twisted.ensureDeferred
async def test_no_stream_of_bytes_faults_the_connection(serve):
    """Whatever a stream carries, cut into DATA frames anywhere, and whether it is half-closed
    or reset: half-closed, it ends with the status its bytes call for, each whole message
    before what ended it answered; the next call on the connection is answered, and no call
    is left counted."""
    grpc_front = await serve(DoubleFront(), max_message_bytes=STREAM_BOUND)
    calls = H2Calls(grpc_front.port)

    @settings(max_examples=80, deadline=None)
    @given(st.lists(PIECES, max_size=6), st.lists(st.integers(1, 300), max_size=4), st.booleans())
    def course(pieces, cuts, reset):
        data = b"".join(pieces)
        stream_id = calls.start(STREAM)
        bounds = sorted({0, len(data), *(cut for cut in cuts if cut < len(data))})
        for start, stop in zip(bounds, bounds[1:], strict=False):
            calls.send(stream_id, data[start:stop], flush=False)
        if reset:
            calls.reset(stream_id)
        else:
            calls.send(stream_id, b"", end=True)
            ended = calls.wait(stream_id)[0]
            assert (ended["status"], len(ended["messages"])) == expected_end(data), ended
        probe = calls.start("ModelInfer", flush=False)
        calls.send(probe, framed(infer_request(0)), end=True)
        assert calls.wait(probe)[0]["status"] == OK
        assert (grpc_front.calls, grpc_front.unread) == (0, 0)

    try:
        await in_thread(course)
    finally:
        calls.close()


class RawStream:
    """A ModelStreamInfer call of grpc's own client, its messages given one by one."""

    def __init__(self, channel: grpc.Channel):
        self._messages: queue.Queue = queue.Queue()
        self.call = channel.stream_stream(f"/{SERVICE}/{STREAM}")(
            iter(self._messages.get, None), metadata=tuple(ADMITTED.items()))

    def send(self, message: bytes) -> None:
        self._messages.put(message)

    def half_close(self) -> None:
        self._messages.put(None)

    def answers(self) -> tuple[list[bytes], grpc.StatusCode]:
        """Every message it answers, and how it ends (blocking: run in a thread)."""
        messages = []
        try:
            messages.extend(self.call)
        except grpc.RpcError:
            pass
        return messages, self.call.code()


@pytest_twisted.ensureDeferred
async def test_a_stopping_front_answers_its_streams_then_ends_them(serve):
    """A front that stops answers the messages its streams have in flight, then ends each:
    UNAVAILABLE for one the client had not half-closed, OK for one it had."""
    front = HeldFront()
    grpc_front = await serve(front)
    channel = grpc.insecure_channel(target(grpc_front))
    left_open, closed = RawStream(channel), RawStream(channel)
    try:
        left_open.send(infer_request(0))
        closed.send(infer_request(1))
        closed.half_close()
        await until(lambda: len(front.held) == 2, "both in flight")
        stopped = grpc_front.stopService(grace=30)
        front.release(0)
        front.release(1)
        (open_answers, open_code), (closed_answers, closed_code) = await defer.gatherResults(
            [in_thread(left_open.answers), in_thread(closed.answers)])
        await stopped
        assert (open_code, closed_code) == (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK)
        check_doubled(open_answers, [0])
        check_doubled(closed_answers, [1])
    finally:
        left_open.half_close()
        channel.close()


# -- real fronts: a standalone server, a node's gateway ---------------------------------------

#: The wide model's answer: 16 inputs, each repeated so many times (a 1 MiB answer to a
#: 64-byte input).
WIDE = 16384


def export_models(root) -> str:
    """A repository of mlp (L{export_mlp}) and wide (its 16 inputs, each repeated L{WIDE}
    times)."""
    import jax.numpy as jnp

    import kcoral

    kcoral.export_bundle(lambda x: jnp.tile(x, (1, WIDE)), None, np.zeros((1, 16), np.float32),
                         dir=str(root / "wide"), name="wide", batch_sizes=[1])
    return export_mlp(root)


@pytest_twisted.async_fixture(scope="module", params=["server", "gateway"])
async def real_front(request: pytest.FixtureRequest, module_processes, tmp_path_factory
                     ) -> tuple[str, str, ChildProcess]:
    """A standalone server, or a node's gateway before two CPU workers, of mlp and wide,
    serving gRPC with a client token: its gRPC address, its URL and its process."""
    repository = export_models(tmp_path_factory.mktemp("models"))
    args = server_args("--model-repository", repository, "--grpc-port", "0",
                       "--client-token", TOKEN)
    return await start_grpc_front(module_processes, request.param, args)


def mlp_requests(count: int, unknown: int, misshapen: int) -> list:
    return with_errors(count, "mlp", 16, unknown, misshapen)


@pytest_twisted.ensureDeferred
async def test_a_real_front_answers_tritonclient_streams_in_order(real_front):
    """A standalone server and a node's gateway, with a real model: tritonclient's streams
    (thread-based and asyncio) of 16 requests, one for an unknown model and one of a wrong
    shape, are answered in order, the two with their errors, and end once all are."""
    address, _, process = real_front
    requests = mlp_requests(16, unknown=5, misshapen=11)
    for client in (tritonclient_stream, aio_stream):
        results = await in_thread(client, address, requests, ADMITTED)
        check_in_order(results, requests, np.tanh, unknown=5, misshapen=11)
    assert process.matching(r"Traceback|internal error") == [], process.tail(40)


@pytest_twisted.ensureDeferred
async def test_a_real_front_serves_on_after_a_stream_is_cancelled(real_front):
    """A stream of 64 requests that tritonclient cancels once its first answer has come
    leaves the front serving: a probe and another stream are answered, nothing logged as
    failed."""
    address, _, process = real_front
    requests = mlp_requests(64, unknown=-1, misshapen=-1)
    results = await in_thread(tritonclient_stream, address, requests, ADMITTED, 1)
    assert results[0][0] == "0"
    seconds, _ = await in_thread(mlp_probes, address)
    assert seconds < ANSWERED_WITHIN
    again = mlp_requests(4, unknown=-1, misshapen=-1)
    check_in_order(await in_thread(tritonclient_stream, address, again, ADMITTED), again, np.tanh,
                   unknown=-1, misshapen=-1)
    assert process.matching(r"Traceback|internal error") == [], process.tail(40)


def wide_answers(metrics: str) -> float:
    """How many inferences of wide the front (or its workers) have answered."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("kcoral_inference_requests_total{") and 'model="wide"' in line)


@pytest_twisted.ensureDeferred
async def test_a_real_front_holds_a_stream_that_never_reads_at_its_bound(real_front):
    """A client that streams 1,000 requests for 1 MiB answers and never gives their window
    back has 32 inferences run for it (the stream's bound), the front's memory grows by a
    fraction of what the answers would take, and other clients are answered meanwhile; once
    it goes, the front serves on."""
    address, url, process = real_front
    before = wide_answers((await http_request("GET", url + "/metrics")).body.decode())
    port = int(address.rsplit(":", 1)[1])
    rss = rss_bytes(process.pid)
    calls = H2Calls(port, acknowledge=False)
    message = service_pb2.ModelInferRequest(model_name="wide")
    message.inputs.add(name="input", datatype="FP32", shape=[1, 16])
    message.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    data = framed(message.SerializeToString())

    def send_all():
        # The server's settings first: its window is wider than HTTP/2's first one.
        calls.ping()
        calls.read_until(lambda: calls.pongs == 1)
        stream_id = calls.start(STREAM)
        for _ in range(1000):
            calls.send(stream_id, data, flush=False)
        calls.ping()
        calls.read_until(lambda: calls.pongs == 2)

    try:
        await in_thread(send_all)

        async def answered():
            metrics = (await http_request("GET", url + "/metrics")).body.decode()
            return wide_answers(metrics) - before >= 32 or None
        await until(answered, "the stream's 32 inferences answered", 60)
        seconds, _ = await in_thread(mlp_probes, address)
        assert seconds < ANSWERED_WITHIN
        assert wide_answers((await http_request("GET", url + "/metrics")).body.decode()) - before == 32
        # A gigabyte of answers asked, 32 MiB of them run.
        assert rss_bytes(process.pid) - rss < 128 << 20
    finally:
        calls.close()
    seconds, _ = await in_thread(mlp_probes, address)
    assert seconds < ANSWERED_WITHIN
