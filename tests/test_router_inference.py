"""
The Router's (and a gateway's) inference front over a pool whose members
report their models, on a fake clock with fake members: a model every
member failed to load is refused at once with its reason, one still loading
is busy, a load goes to every member and what they answer is what the front
knows of them at once, and statistics are the members' sum.
"""

from __future__ import annotations

import json
import threading

import attrs
import numpy as np
import pytest
import pytest_twisted
from tritonclient.grpc import service_pb2
from twisted.internet.defer import succeed
from twisted.internet.task import Clock

from kcoral.common.queue import WaitQueue
from kcoral.common.report import parse_report
from kcoral.errors import BadRequest, ModelNotReady, NotFound, ServerBusy
from kcoral.inference import message
from kcoral.inference.front import InferCall
from kcoral.inference.message import GrpcMessage, RestMessage
from kcoral.protocol.inference import ON_REACTOR_BYTES, rest_of_grpc_infer
from kcoral.router.forward import Forwarder
from kcoral.router.inference import RouterInference
from kcoral.router.pool import Pool
from kcoral.router.proxy import Proxy
from kcoral.router.scheduler import Scheduler
from tests.fakes import node_report
from tests.harness import until


@attrs.frozen
class Answer:
    code: int
    body: bytes

    def content(self):
        return succeed(self.body)


def front(states: list[tuple[str, str]], *, answers: dict[str, Answer] | None = None):
    """A front of one node whose worker i reports mlp version 1 in C{states[i]}
    (state, reason); C{answers} by URL answer its members' GETs and POSTs."""
    clock = Clock()
    pool = Pool(clock, max_status_age_seconds=5.0, unhealthy_threshold=3, recovery_threshold=1,
                node_retention_seconds=600.0)
    body = node_report(capacities=(1,) * len(states))
    for worker, (state, reason) in zip(body["workers"], states, strict=True):
        worker["models"] = [{"name": "mlp", "version": "1", "state": state, "reason": reason,
                             "max_batch_size": 8 if state == "READY" else 0}]
    pool.report("n", parse_report(body))
    pool.observe()
    asked: list[str] = []

    def ask(url: str, **kwargs):
        asked.append(url)
        return succeed((answers or {})[url])

    # Nothing here is forwarded: the proxy has no client.
    forwarder = Forwarder(Scheduler(pool, WaitQueue(clock, 16, 30.0)), Proxy(None), clock)
    inference = RouterInference(pool=pool, forwarder=forwarder, get=ask, post=ask,
                                is_ready=lambda: True, clock=clock, most_waiting=8)
    return inference, asked


def failure_of(d):
    failures: list = []
    d.addErrback(failures.append)
    assert failures, "it succeeded"
    return failures[0].value


def result_of(d):
    results: list = []
    d.addCallback(results.append)
    assert results, "it failed or is waiting"
    return results[0]


CALL = InferCall(RestMessage(b"{}", None), "r1")


def test_a_model_every_member_failed_is_refused_at_once_with_its_reason():
    """No member can serve it and none will: 400, its state and the first reason given."""
    inference, asked = front([("UNAVAILABLE", "params.safetensors: its SHA-256 is 00"),
                              ("UNAVAILABLE", "")])
    error = failure_of(inference.infer("mlp", None, CALL))
    assert isinstance(error, ModelNotReady) and error.status == 400
    assert "'mlp' is UNAVAILABLE" in error.message and "SHA-256" in error.message
    assert asked == []
    assert isinstance(failure_of(inference.model_metadata("mlp", None)), ModelNotReady)


def test_a_model_still_loading_somewhere_is_busy_not_refused():
    """While one member loads it, the model is 503 model_loading, to be retried."""
    inference, _ = front([("UNAVAILABLE", "bad"), ("LOADING", "")])
    error = failure_of(inference.infer("mlp", None, CALL))
    assert isinstance(error, ServerBusy) and error.reason == "model_loading"
    assert result_of(inference.model_ready("mlp", None)) is False


def test_an_unknown_model_is_not_found():
    """A model no member lists is 404, and so are its statistics."""
    inference, _ = front([("READY", "")])
    assert isinstance(failure_of(inference.infer("nope", None, CALL)), NotFound)
    assert isinstance(failure_of(inference.model_statistics("nope", None)), NotFound)


def loaded(name: str, state: str) -> Answer:
    return Answer(200, json.dumps({"models": [{"name": name, "version": "1", "state": state,
                                               "reason": "", "max_batch_size": 8}]}).encode())


def test_a_load_goes_to_every_member_and_their_answers_count_at_once():
    """A load is sent to each member; once both answer READY, the model is ready on the
    front before any report says so."""
    urls = [f"http://10.0.0.1:{8000 + i}/v2/repository/models/mlp/load" for i in range(2)]
    inference, asked = front([("UNAVAILABLE", "not loaded")] * 2,
                             answers={url: loaded("mlp", "READY") for url in urls})
    answer = result_of(inference.load_model("mlp"))
    assert sorted(asked) == urls
    assert [m["state"] for m in answer["models"]] == ["READY", "READY"]
    assert result_of(inference.model_ready("mlp", None)) is True


def test_a_load_that_fails_on_one_member_names_it_with_its_reason():
    """One member refusing: the answer is that error, naming the member and its reason."""
    urls = [f"http://10.0.0.1:{8000 + i}/v2/repository/models/mlp/load" for i in range(2)]
    inference, _ = front([("READY", "")] * 2, answers={
        urls[0]: loaded("mlp", "READY"),
        urls[1]: Answer(400, json.dumps({"error": "failed to load 'mlp': out of memory"}).encode())})
    error = failure_of(inference.load_model("mlp"))
    assert isinstance(error, BadRequest)
    assert "on 1 of 2 member(s)" in error.message
    assert "n/worker1: failed to load 'mlp': out of memory" in error.message


@pytest.mark.parametrize("stats_answer", [b"not json", b'{"model_stats": "x"}'])
def test_statistics_are_the_members_sum_and_a_bad_answer_is_left_out(stats_answer):
    """The front's statistics add up its members'; a member whose answer cannot be read is
    left out, not a failure (a client polling statistics must not fail for one member)."""
    one = {"name": "mlp", "version": "1", "last_inference": 5, "inference_count": 3,
           "execution_count": 1, "inference_stats": {"success": {"count": 3, "ns": 30}},
           "batch_stats": []}
    inference, _ = front([("READY", "")] * 3, answers={
        "http://10.0.0.1:8000/v2/models/stats": Answer(200, json.dumps({"model_stats": [one]}).encode()),
        "http://10.0.0.1:8001/v2/models/stats": Answer(200, json.dumps(
            {"model_stats": [{**one, "last_inference": 9}]}).encode()),
        "http://10.0.0.1:8002/v2/models/stats": Answer(200, stats_answer)})
    [total] = result_of(inference.model_statistics(None, None))["model_stats"]
    assert total["inference_count"] == 6 and total["last_inference"] == 9
    assert total["inference_stats"]["success"] == {"count": 6, "ns": 60}


@pytest_twisted.ensureDeferred
async def test_a_large_grpc_inference_is_forwarded_in_its_rest_form_made_off_the_reactor(monkeypatch):
    """A gRPC inference too large to merge goes alone, in its REST form, made in a thread:
    its inputs' bytes are not copied on the reactor."""
    made_in: list[int] = []

    def rest_of(pb):
        made_in.append(threading.get_ident())
        return rest_of_grpc_infer(pb)

    monkeypatch.setattr(message, "rest_of_grpc_infer", rest_of)
    inference, _ = front([("READY", "")])
    pb = service_pb2.ModelInferRequest(model_name="mlp")
    pb.inputs.add(name="x", datatype="FP32", shape=[1, ON_REACTOR_BYTES // 4 + 1])
    pb.raw_input_contents.append(np.zeros(ON_REACTOR_BYTES // 4 + 1, np.float32).tobytes())
    answer = inference.infer("mlp", None, InferCall(GrpcMessage(pb, pb.ByteSize()), "r1"))
    answer.addErrback(lambda _: None)  # nothing is forwarded here: the proxy has no client
    await until(lambda: made_in, "its REST form made")
    assert made_in[0] != threading.get_ident()
