"""
Batching at a Router's or a gateway's front (L{kcoral.router.batching}) in
process: one fake worker of one slot that serves a row-wise model and holds
its answers until the test releases them, on a fake clock.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import pytest_twisted
from tritonclient.grpc import service_pb2
from twisted.internet.defer import CancelledError, gatherResults
from twisted.internet.task import Clock
from twisted.web import server
from twisted.web.resource import Resource

from kcoral.common.queue import WaitQueue
from kcoral.common.report import parse_report
from kcoral.errors import BadRequest, KCoralError, ProgramFailed
from kcoral.inference import message
from kcoral.inference.front import InferCall
from kcoral.inference.message import GrpcAnswer, GrpcMessage, RestMessage
from kcoral.protocol.inference import (
    ON_REACTOR_BYTES,
    InferAnswer,
    encode_infer,
    grpc_of_rest_answer,
    parse_infer,
)
from kcoral.router import batching
from kcoral.router.batching import FrontBatcher, forwarded
from kcoral.router.forward import Forwarder
from kcoral.router.pool import Pool
from kcoral.router.proxy import Proxy
from kcoral.router.scheduler import Scheduler
from kcoral.tracing import NO_SPAN
from kcoral.web.family import FORMED_BATCH_HEADER, INFERENCE_HEADER_LENGTH
from tests.fakes import FakeWorkers, node_report

PATH = b"/v2/models/mlp/infer"


def model(x: np.ndarray) -> np.ndarray:
    """A row-wise model: each output row depends on its input row alone."""
    return x[:, ::-1] * np.float32(2) + np.float32(1)


class ModelWorker(Resource):
    """A worker's inference route for L{model}: it holds each request until
    L{release}, answers 400 to inputs holding NaN, or C{code} to all; its answers
    carry C{header_length} in place of their own when it is set."""

    isLeaf = True

    def __init__(self, code: int = 200):
        super().__init__()
        self.code = code
        self.held: list = []
        self.rows: list[int] = []
        self.lost: list = []
        self.header_length: bytes | None = None

    def render_POST(self, request):
        self.held.append(request)
        request.notifyFinish().addErrback(lambda _: self.lost.append(request))
        return server.NOT_DONE_YET

    def release(self) -> None:
        held, self.held = self.held, []
        for request in held:
            length = request.getHeader(INFERENCE_HEADER_LENGTH)
            parsed = parse_infer(request.content.read(), None if length is None else int(length))
            x = parsed.inputs["x"]
            self.rows.append(len(x))
            if self.code != 200 or np.isnan(x).any():
                request.setResponseCode(self.code if self.code != 200 else 400)
                request.write(json.dumps({"error": "bad rows"}).encode())
            else:
                answer = encode_infer("mlp", "1", parsed, {"y": model(x)})
                if answer.header_length is not None:
                    request.setHeader(INFERENCE_HEADER_LENGTH,
                                      self.header_length or b"%d" % answer.header_length)
                request.write(answer.body)
            request.finish()


class Front:
    """A pool of one node that has C{mlp} ready, batched by C{most_rows}: one
    worker of one slot, or one per C{capacities}, on C{gpu_target}."""

    def __init__(self, worker: ModelWorker, most_rows: int = 8, *, capacities=(1,),
                 gpu_target: str = "sm_90"):
        self.clock = Clock()
        self.pool = Pool(self.clock, max_status_age_seconds=5.0, unhealthy_threshold=3,
                         recovery_threshold=1, node_retention_seconds=600.0)
        body = node_report(host="10.0.0.1", capacities=capacities, gpu_target=gpu_target)
        for each in body["workers"]:
            each["models"] = [{"name": "mlp", "version": "1", "state": "READY",
                               "reason": "", "max_batch_size": most_rows}]
        self.pool.report("n", parse_report(body))
        self.pool.observe()
        self.worker = worker
        self.workers = FakeWorkers(**{"10.0.0.1": worker})
        self.client = self.workers.client()
        scheduler = Scheduler(self.pool, WaitQueue(self.clock, 16, 30.0))
        #: The queue waits the forwarder observed.
        self.waits: list[float] = []
        self.batcher = FrontBatcher(Forwarder(scheduler, Proxy(self.client), self.clock,
                                              observe_wait=self.waits.append),
                                    self.clock, most_waiting=32)
        self.most_rows = most_rows

    def infer(self, body: bytes, header_length: int | None, rid: str = "r"):
        """The Deferred answer of one inference, and a list that gets its outcome."""
        return self.send(RestMessage(body, header_length), rid)

    def send(self, message, rid: str = "r"):
        """As L{infer}, of an inference of any message."""
        call = InferCall(message, rid)
        d = self.batcher.infer(forwarded(PATH, call), call, "mlp", self.most_rows, NO_SPAN)
        done: list = []
        d.addCallbacks(done.append, lambda f: done.append(f.value))
        return d, done

    def serve_until_answered(self, outcomes: list[list]) -> list[bytes]:
        """Let the worker answer until every outcome is in; the bodies it was sent, in order."""
        sent = []
        while any(not o for o in outcomes):
            self.turn()
            sent += [r.content.getvalue() for r in self.worker.held]
            self.worker.release()
            self.turn()
        return sent

    def turn(self) -> None:
        """The reactor's next turn: batches form, requests and answers travel."""
        self.client.flush()
        self.clock.advance(0)
        self.client.flush()


def request(x: np.ndarray, *, binary_output: bool = True, rid: str | None = None
            ) -> tuple[bytes, int]:
    """An inference of C{x} as a client sends it: a binary input."""
    data = np.ascontiguousarray(x, dtype="<f4")
    header: dict = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                "parameters": {"binary_data_size": data.nbytes}}],
                    "parameters": {"binary_data_output": binary_output}}
    if rid is not None:
        header["id"] = rid
    encoded = json.dumps(header).encode()
    return encoded + data.tobytes(), len(encoded)


def alone(body: bytes, header_length: int) -> bytes:
    """The bytes the worker answers to this request sent alone."""
    return answered_alone(body, header_length).body


def answered_alone(body: bytes, header_length: int | None) -> InferAnswer:
    """The worker's answer to this request sent alone."""
    parsed = parse_infer(body, header_length)
    return encode_infer("mlp", "1", parsed, {"y": model(parsed.inputs["x"])})


def rows(count: int, seed: int, columns: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, columns), dtype=np.float32)


def test_requests_waiting_for_a_slot_go_as_one_and_each_gets_its_own_answer_bit_for_bit():
    """Requests that waited while the one slot was busy go as one request of all their
    rows once it frees; each answer is byte for byte the answer it gets alone, whether it
    asked for binary or JSON outputs, under its own id."""
    front = Front(ModelWorker())
    first = request(rows(1, 0))
    front.infer(*first)
    front.turn()
    bodies = [request(rows(1, 1), rid="a"), request(rows(2, 2), binary_output=False),
              request(rows(3, 3), rid="c", binary_output=False)]
    outcomes = [front.infer(*body, rid=f"r{i}")[1] for i, body in enumerate(bodies)]
    front.turn()
    assert front.worker.rows == [] and len(front.worker.held) == 1
    front.worker.release()
    front.turn()
    assert len(front.worker.held) == 1  # the three, merged
    front.worker.release()
    front.turn()
    assert front.worker.rows == [1, 6]
    for body, outcome in zip(bodies, outcomes):
        assert outcome[0].body == alone(*body)


def test_grpc_inferences_merged_with_rest_ones_are_answered_in_their_own_form():
    """gRPC inferences merge with REST ones; each gRPC one is answered with its gRPC answer,
    made from its rows (byte for byte the conversion of its REST answer alone), each REST
    one with its REST bytes."""
    front = Front(ModelWorker())
    front.infer(*request(rows(1, 0)))
    front.turn()
    inputs = [rows(1, 1), rows(2, 2), rows(1, 3)]
    sent = []
    for i, x in enumerate(inputs):
        if i == 1:
            sent.append(RestMessage(*request(x)))
            continue
        pb = service_pb2.ModelInferRequest(model_name="mlp", id=f"g{i}")
        pb.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
        pb.raw_input_contents.append(x.tobytes())
        sent.append(GrpcMessage(pb, pb.ByteSize()))
    outcomes = [front.send(each, f"r{i}")[1] for i, each in enumerate(sent)]
    front.turn()
    front.serve_until_answered(outcomes)
    assert front.worker.rows == [1, 4]
    for each, outcome in zip(sent, outcomes):
        rest = each.rest()
        answer = answered_alone(rest.body, rest.header_length)
        if isinstance(each, GrpcMessage):
            assert outcome[0] == GrpcAnswer(grpc_of_rest_answer(
                answer.body, answer.header_length).SerializeToString())
        else:
            assert outcome[0].body == answer.body


def test_a_grpc_inference_with_no_rest_form_is_refused_as_it_is_read():
    """A gRPC inference the front cannot read (two inputs, one raw_input_contents) is refused
    at once with what is wrong, as the gRPC front read it; nothing goes to the worker."""
    front = Front(ModelWorker())
    pb = service_pb2.ModelInferRequest(model_name="mlp")
    for name in ("x", "z"):
        pb.inputs.add(name=name, datatype="FP32", shape=[1, 4])
    pb.raw_input_contents.append(rows(1, 1).tobytes())
    with pytest.raises(BadRequest, match="raw_input_contents holds 1 tensors for 2 inputs"):
        front.send(GrpcMessage(pb, pb.ByteSize()))
    front.turn()
    assert front.worker.held == [] and front.worker.rows == []


def test_the_cpu_workers_of_a_node_take_one_batch_of_a_model_at_a_time():
    """A node's CPU workers are one lane: while a batch of a tenth of the model's rows runs, the
    next waits, free slots or not, and takes everything that arrived meanwhile."""
    worker = ModelWorker()
    front = Front(worker, most_rows=8, capacities=(1, 1), gpu_target="cpu")
    first = front.infer(*request(rows(1, 0)))[1]
    front.turn()
    later = [front.infer(*request(rows(1, seed)))[1] for seed in (1, 2, 3)]
    front.turn()
    assert len(worker.held) == 1
    worker.release()
    front.turn()
    assert len(first) == 1 and len(worker.held) == 1
    worker.release()
    front.turn()
    assert worker.rows == [1, 3]
    assert all(len(done) == 1 and not isinstance(done[0], Exception) for done in later)


def test_a_batch_that_runs_too_long_no_longer_holds_back_the_next():
    """A batch on its way for LANE_HOLD_SECONDS lets go of its lane: the next takes a free slot."""
    worker = ModelWorker()
    front = Front(worker, most_rows=4, capacities=(1, 1), gpu_target="cpu")
    front.infer(*request(rows(1, 0)))
    front.turn()
    later = front.infer(*request(rows(1, 1)))[1]
    front.clock.advance(batching.LANE_HOLD_SECONDS - 0.01)
    front.turn()
    assert len(worker.held) == 1
    front.clock.advance(0.01)
    front.turn()
    assert len(worker.held) == 2
    worker.release()
    front.turn()
    assert worker.rows == [1, 1] and len(later) == 1


def test_a_small_batch_holds_no_lane():
    """A batch of less than a tenth of the model's rows holds no lane: the next takes a free slot."""
    worker = ModelWorker()
    front = Front(worker, most_rows=16, capacities=(1, 1), gpu_target="cpu")
    front.infer(*request(rows(1, 0)))
    front.turn()
    front.infer(*request(rows(1, 1)))
    front.turn()
    assert len(worker.held) == 2


def test_each_gpu_worker_is_a_lane_of_its_own():
    """GPU workers run batches side by side: a second batch goes to the other worker at once."""
    worker = ModelWorker()
    front = Front(worker, most_rows=4, capacities=(1, 1))
    front.infer(*request(rows(1, 0)))
    front.turn()
    for seed in (1, 2, 3):
        front.infer(*request(rows(1, seed)))
    front.turn()
    worker.release()
    assert worker.rows == [1, 3]


def test_rows_never_cross_between_concurrent_clients():
    """Many clients with distinct inputs, merged in batches up to max_batch_size rows:
    each gets the model's output of its own rows, and no batch passes max_batch_size."""
    front = Front(ModelWorker(), most_rows=8)
    inputs = [rows(1 + i % 3, seed=i) for i in range(20)]
    outcomes = [front.infer(*request(x))[1] for x in inputs]
    while front.worker.held or any(not o for o in outcomes):
        front.turn()
        front.worker.release()
        front.turn()
    assert max(front.worker.rows) <= 8 and sum(front.worker.rows) == sum(len(x) for x in inputs)
    assert len(front.worker.rows) < len(inputs)
    for x, outcome in zip(inputs, outcomes):
        answer = outcome[0]
        parsed = json.loads(answer.body[:answer.header_length])
        y = np.frombuffer(answer.body[answer.header_length:], dtype="<f4").reshape(
            parsed["outputs"][0]["shape"])
        np.testing.assert_array_equal(y, model(x))


def test_a_request_of_other_dimensions_is_not_merged_nor_passed():
    """A request whose dimensions past the first differ goes in a batch of its own,
    and those behind it wait for it: no client's requests are reordered."""
    front = Front(ModelWorker())
    front.infer(*request(rows(1, 0)))
    front.turn()
    shapes = [(1, 4), (2, 4), (1, 5), (1, 4)]
    outcomes = [front.infer(*request(rows(n, i, columns)))[1]
                for i, (n, columns) in enumerate(shapes)]
    seen = []
    while any(not o for o in outcomes):
        front.turn()
        seen += [parse_infer(r.content.getvalue(), int(r.getHeader(INFERENCE_HEADER_LENGTH)))
                 .inputs["x"].shape for r in front.worker.held]
        front.worker.release()
        front.turn()
    assert seen == [(1, 4), (3, 4), (1, 5), (1, 4)]


def test_a_client_that_leaves_before_its_batch_goes_drops_its_rows():
    """A request cancelled while it waits is not sent; the others go without its rows."""
    front = Front(ModelWorker())
    front.infer(*request(rows(1, 0)))
    front.turn()
    bodies = [request(rows(1, 1)), request(rows(2, 2)), request(rows(3, 3))]
    sent = [front.infer(*body) for body in bodies]
    sent[1][0].cancel()
    for _ in range(2):
        front.turn()
        front.worker.release()
        front.turn()
    assert front.worker.rows == [1, 4]
    assert isinstance(sent[1][1][0], CancelledError)
    assert sent[0][1][0].body == alone(*bodies[0]) and sent[2][1][0].body == alone(*bodies[2])


def test_a_batch_whose_clients_all_left_is_cancelled():
    """Once every client of a batch on its way has left, its request to the worker is closed."""
    front = Front(ModelWorker())
    d, done = front.infer(*request(rows(2, 0)))
    front.turn()
    d.cancel()
    front.client.flush()
    assert isinstance(done[0], CancelledError) and len(front.worker.lost) == 1
    assert front.pool.active() == 0


def test_a_bad_request_does_not_fail_the_others():
    """A merged request that the worker refuses (400) is sent again member by member: the
    bad one gets its own 400, the others their own answers."""
    front = Front(ModelWorker())
    front.infer(*request(rows(1, 0)))
    front.turn()
    bad = rows(2, 1)
    bad[1, 2] = np.nan
    bodies = [request(rows(1, 2)), request(bad), request(rows(3, 3))]
    outcomes = [front.infer(*body)[1] for body in bodies]
    while any(not o for o in outcomes):
        front.turn()
        front.worker.release()
        front.turn()
    assert front.worker.rows == [1, 6, 1, 2, 3]
    assert isinstance(outcomes[1][0], BadRequest)
    assert outcomes[0][0].body == alone(*bodies[0]) and outcomes[2][0].body == alone(*bodies[2])


@pytest.mark.parametrize("code", [500, 507])
def test_a_merged_request_that_may_fail_for_one_member_is_sent_again_member_by_member(code):
    """A 500 or a 507 for a merged request may be one client's doing: each member is sent
    again alone, once, and gets the answer to its own request."""
    front = Front(ModelWorker(code=code))
    front.infer(*request(rows(1, 0)))
    front.turn()
    outcomes = [front.infer(*request(rows(1, i)))[1] for i in range(3)]
    while any(not o for o in outcomes):
        front.turn()
        front.worker.release()
        front.turn()
    assert front.worker.rows == [1, 3, 1, 1, 1]
    assert all(isinstance(o[0], KCoralError) and o[0].status == code for o in outcomes)
    assert front.pool.active() == 0


@pytest.mark.parametrize("code", [502, 504])
def test_a_merged_request_that_fails_for_want_of_capacity_fails_each_member_alike(code):
    """Any other failure of a merged request (a 502: its node lost; a 504: the batch passed
    the worker's run limit, as each member's rows would) is what each member would have
    met alone: each gets it, and none is sent again."""
    front = Front(ModelWorker(code=code))
    front.infer(*request(rows(1, 0)))
    front.turn()
    outcomes = [front.infer(*request(rows(1, i)))[1] for i in range(3)]
    for _ in range(2):
        front.turn()
        front.worker.release()
        front.turn()
    assert front.worker.rows == [1, 3]
    errors = [o[0] for o in outcomes]
    assert all(isinstance(e, KCoralError) and e.status == code for e in errors)
    assert len({(e.status, e.message) for e in errors}) == 1


@pytest.mark.parametrize("most_rows", [0, 2])
def test_what_cannot_merge_goes_alone_as_it_came(most_rows):
    """A model of no batch dimension, or a request of more rows than a batch takes, is
    forwarded alone with the client's own bytes."""
    front = Front(ModelWorker(), most_rows=most_rows)
    bodies = [request(rows(3, i)) for i in range(3)]
    outcomes = [front.infer(*body)[1] for body in bodies]
    sent = front.serve_until_answered(outcomes)
    assert sent == [body for body, _ in bodies]


def test_what_the_front_forwards_says_it_is_a_formed_batch():
    """Every request the front forwards, alone or merged, tells the worker
    that its batch was formed (so the worker does not wait for more rows)."""
    front = Front(ModelWorker())
    outcomes = [front.infer(*request(rows(1, 0)))[1]]
    front.turn()
    outcomes += [front.infer(*request(rows(1, i)))[1] for i in (1, 2)]
    formed = []
    while any(not o for o in outcomes):
        front.turn()
        formed += [r.getHeader(FORMED_BATCH_HEADER) for r in front.worker.held]
        front.worker.release()
        front.turn()
    assert front.worker.rows == [1, 2] and formed == [b"true", b"true"]


def test_a_malformed_answer_to_a_batch_fails_each_member_and_frees_the_slot():
    """A merged request answered with a header length that is no number is the worker's
    failure: each member gets a 500, and the slot serves the next request."""
    front = Front(ModelWorker())
    front.infer(*request(rows(1, 0)))
    front.turn()
    outcomes = [front.infer(*request(rows(1, i)))[1] for i in range(3)]
    front.worker.release()
    front.turn()
    front.worker.header_length = b"many"
    front.worker.release()
    front.turn()
    assert all(isinstance(o[0], ProgramFailed) for o in outcomes)
    assert front.pool.active() == 0
    front.worker.header_length = None
    body = request(rows(2, 9))
    done = front.infer(*body)[1]
    front.serve_until_answered([done])
    assert done[0].body == alone(*body)


@pytest.mark.parametrize("broken", ["merge_infer", "parse_answer"])
def test_a_fault_while_forming_or_answering_a_batch_fails_its_members_and_frees_the_slot(
        monkeypatch, broken):
    """An unexpected exception while a batch is formed and sent, or while its answer is
    split, fails each of its members with a 500 (none waits forever) and gives back its
    lease, so the next batch is served."""
    front = Front(ModelWorker())
    front.infer(*request(rows(1, 0)))
    front.turn()
    outcomes = [front.infer(*request(rows(1, i)))[1] for i in range(3)]

    def fault(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(batching, broken, fault)
    for _ in range(2):
        front.worker.release()
        front.turn()
    assert all(isinstance(o[0], KCoralError) and o[0].status == 500 for o in outcomes)
    assert front.pool.active() == 0
    monkeypatch.undo()
    body = request(rows(2, 9))
    done = front.infer(*body)[1]
    front.serve_until_answered([done])
    assert done[0].body == alone(*body)


@pytest_twisted.inlineCallbacks
def test_a_large_merged_answer_is_split_off_the_reactor(monkeypatch):
    """A merged answer over ON_REACTOR_BYTES is split and encoded in a thread; each client still
    gets its own rows' bytes."""
    encoded_in: list[int] = []

    def encode(*args):
        encoded_in.append(threading.get_ident())
        return encode_infer(*args)

    monkeypatch.setattr(message, "encode_infer", encode)
    front = Front(ModelWorker())
    front.infer(*request(rows(1, 0)))
    front.turn()
    # Rows of 16 KiB: each body parses on the reactor, the answer of eight does not.
    bodies = [request(rows(1, seed, columns=4096)) for seed in range(1, 9)]
    assert all(len(body) <= ON_REACTOR_BYTES for body, _ in bodies)
    sent = [front.infer(*body) for body in bodies]
    for _ in range(2):
        front.worker.release()
        front.turn()
    assert front.worker.rows == [1, 8]
    yield gatherResults([d for d, _ in sent])
    assert [done[0].body for _, done in sent] == [alone(*body) for body in bodies]
    assert len(encoded_in) == 8 and threading.get_ident() not in encoded_in


def test_a_request_sent_again_alone_has_its_queue_wait_observed_once():
    """Members of a refused batch, sent again one by one, each had their wait for capacity
    observed when their batch was taken, and not again."""
    front = Front(ModelWorker())
    front.infer(*request(rows(1, 0)))
    front.turn()
    bad = rows(1, 1)
    bad[0, 0] = np.nan
    outcomes = [front.infer(*request(x))[1] for x in (rows(1, 2), bad, rows(1, 3))]
    while any(not o for o in outcomes):
        front.turn()
        front.worker.release()
        front.turn()
    assert front.worker.rows == [1, 3, 1, 1, 1]
    assert len(front.waits) == 4


def test_a_body_too_large_to_parse_on_the_reactor_goes_alone_unparsed(monkeypatch):
    """Requests of bodies over ON_REACTOR_BYTES that could merge are not parsed at the
    front: each goes alone, with its client's own bytes."""
    parsed: list = []
    monkeypatch.setattr(message, "parse_infer", lambda *args: parsed.append(args) or parse_infer(*args))
    front = Front(ModelWorker())
    front.infer(*request(rows(1, 0)))
    front.turn()
    columns = ON_REACTOR_BYTES // 4 + 1
    bodies = [request(rows(1, i, columns)) for i in range(1, 3)]
    outcomes = [front.infer(*body)[1] for body in bodies]
    sent = front.serve_until_answered(outcomes)
    assert len(parsed) == 1
    assert sent == [request(rows(1, 0))[0]] + [body for body, _ in bodies]
    assert [o[0].body for o in outcomes] == [alone(*body) for body in bodies]


def test_each_waiting_request_times_out_from_its_own_arrival():
    """While no slot frees, each waiting request gets 503 queue_timeout once it has waited
    the scheduler's queue wait timeout since its own arrival: the lease's timeout on behalf
    of an older request does not fail one that arrived later."""
    front = Front(ModelWorker())
    front.infer(*request(rows(1, 0)))
    front.turn()
    _, older = front.infer(*request(rows(1, 1)))
    front.clock.advance(20)
    _, newer = front.infer(*request(rows(1, 2)))
    front.clock.advance(10)
    assert older[0].status == 503 and older[0].reason == "queue_timeout" and newer == []
    front.clock.advance(19)
    assert newer == []
    front.clock.advance(1)
    assert newer[0].status == 503 and newer[0].reason == "queue_timeout"
    assert newer[0].message == older[0].message == "no capacity freed up within the queue wait timeout"
    assert front.worker.rows == [] and len(front.worker.held) == 1


def test_a_request_that_outlives_the_lease_timeout_is_served_when_a_slot_frees():
    """After the queue's lease times out for an older request, the lease is asked for again
    for the newer: it goes once the slot frees, and gets its answer."""
    front = Front(ModelWorker())
    front.infer(*request(rows(1, 0)))
    front.turn()
    front.infer(*request(rows(1, 1)))
    front.clock.advance(20)
    body = request(rows(2, 2))
    _, newer = front.infer(*body)
    front.clock.advance(15)
    front.worker.release()
    front.turn()
    front.worker.release()
    front.turn()
    assert front.worker.rows == [1, 2] and newer[0].body == alone(*body)
