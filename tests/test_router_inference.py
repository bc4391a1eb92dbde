"""
The Router's (and a gateway's) inference front over a pool whose members
report their models, on a fake clock with fake members: a model every
member failed to load is refused at once with its reason, one still loading
is busy, a load goes to every member and what they answer is what the front
knows of them at once, statistics are the members' sum, and the repository
index is each member's own, asked when a client asks (a member that fails
or hangs counts as its last report says).
"""

from __future__ import annotations

import json
import threading

import attrs
import grpc
import numpy as np
import pytest
import pytest_twisted
from tritonclient.grpc import service_pb2
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from kcoral.common.queue import WaitQueue
from kcoral.common.report import parse_report
from kcoral.errors import BadRequest, LoadFailed, ModelNotReady, NotFound, ServerBusy
from kcoral.inference import message
from kcoral.inference.front import InferCall
from kcoral.inference.grpcmethods import status_code_of
from kcoral.inference.message import GrpcMessage, RestMessage
from kcoral.protocol.inference import ON_REACTOR_BYTES, rest_of_grpc_infer
from kcoral.router.forward import Forwarder
from kcoral.router.inference import INDEX_SECONDS, RouterInference
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


def front(states: list[tuple[str, str]], *, answers: dict[str, Answer | Deferred] | None = None,
          clock: Clock | None = None, healthy: bool = True, sent: dict | None = None):
    """A front of one node whose worker i reports mlp version 1 in C{states[i]}
    (state, reason), each C{healthy} or not; C{answers} by URL answer its
    members' GETs and POSTs (a Deferred: when it fires), whose bodies go in
    C{sent} by URL."""
    clock = clock or Clock()
    pool = Pool(clock, max_status_age_seconds=5.0, unhealthy_threshold=3, recovery_threshold=1,
                node_retention_seconds=600.0)
    body = node_report(capacities=(1,) * len(states), healthy=healthy)
    for worker, (state, reason) in zip(body["workers"], states, strict=True):
        worker["models"] = [{"name": "mlp", "version": "1", "state": state, "reason": reason,
                             "max_batch_size": 8 if state == "READY" else 0}]
    pool.report("n", parse_report(body))
    pool.observe()
    asked: list[str] = []

    def ask(url: str, **kwargs):
        asked.append(url)
        if sent is not None:
            sent[url] = kwargs.get("data")
        answer = (answers or {})[url]
        return answer if isinstance(answer, Deferred) else succeed(answer)

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
    """No member can serve it and none will: 400, its state and the first reason given; it
    is not ready (a question answered, not refused)."""
    inference, asked = front([("UNAVAILABLE", "params.safetensors: its SHA-256 is 00"),
                              ("UNAVAILABLE", "")])
    error = failure_of(inference.infer("mlp", None, CALL))
    assert isinstance(error, ModelNotReady) and error.status == 400
    assert "'mlp' is UNAVAILABLE" in error.message and "SHA-256" in error.message
    assert asked == []
    assert isinstance(failure_of(inference.model_metadata("mlp", None)), ModelNotReady)
    assert result_of(inference.model_ready("mlp", None)) is False


def test_a_model_still_loading_somewhere_is_busy_not_refused():
    """While one member loads it, the model is 503 model_loading, to be retried."""
    inference, _ = front([("UNAVAILABLE", "bad"), ("LOADING", "")])
    error = failure_of(inference.infer("mlp", None, CALL))
    assert isinstance(error, ServerBusy) and error.reason == "model_loading"
    assert result_of(inference.model_ready("mlp", None)) is False


def test_an_unknown_model_is_not_found_in_tritons_words():
    """A model (or version) no member lists is 404, and so are its statistics, each message
    starting as Triton's; a version that is no number is 400 in Triton's words."""
    inference, _ = front([("READY", "")])
    error = failure_of(inference.infer("nope", None, CALL))
    assert isinstance(error, NotFound)
    assert error.message == "Request for unknown model: 'nope' is not found"
    assert isinstance(failure_of(inference.model_statistics("nope", None)), NotFound)
    assert failure_of(inference.model_metadata("mlp", "3")).message == (
        "Request for unknown model: 'mlp' version 3 is not found")
    error = failure_of(inference.model_ready("mlp", "three"))
    assert type(error) is BadRequest
    assert error.message.startswith("failed to get model version from specified version string "
                                    "'three'")


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


def test_a_load_sends_its_configuration_to_every_member():
    """A load with a configuration sends each member the configuration, as Triton's
    clients send it; one without, an empty body."""
    urls = [f"http://10.0.0.1:{8000 + i}/v2/repository/models/mlp/load" for i in range(2)]
    sent: dict = {}
    inference, _ = front([("READY", "")] * 2, sent=sent,
                         answers={url: loaded("mlp", "READY") for url in urls})
    result_of(inference.load_model("mlp", '{"max_batch_size": "16"}'))
    assert {url: json.loads(body) for url, body in sent.items()} == {
        url: {"parameters": {"config": '{"max_batch_size": "16"}'}} for url in urls}
    result_of(inference.load_model("mlp"))
    assert set(sent.values()) == {b""}


def test_a_load_that_fails_on_one_member_names_it_with_its_reason():
    """One member refusing: the answer is that error, naming the member and its reason."""
    urls = [f"http://10.0.0.1:{8000 + i}/v2/repository/models/mlp/load" for i in range(2)]
    inference, _ = front([("READY", "")] * 2, answers={
        urls[0]: loaded("mlp", "READY"),
        urls[1]: Answer(400, json.dumps({"error": "failed to load 'mlp': out of memory"}).encode())})
    error = failure_of(inference.load_model("mlp"))
    assert isinstance(error, LoadFailed) and error.status == 400
    assert status_code_of(error) == grpc.StatusCode.INTERNAL
    assert error.message.startswith("failed to load 'mlp' on 1 of 2 member(s): ")
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


def index_answers(url: str, index: list[dict], models: list[dict]) -> dict[str, Answer]:
    """What the member at C{url} answers to its repository index and its /health."""
    return {url + "/v2/repository/index": Answer(200, json.dumps(index).encode()),
            url + "/health": Answer(200, json.dumps({"status": "ok", "models": models}).encode())}


def mlp_state(version: str, state: str = "READY", reason: str = "") -> dict:
    return {"name": "mlp", "version": version, "state": state, "reason": reason,
            "max_batch_size": 8 if state == "READY" else 0}


def test_the_index_is_each_members_own_asked_now_and_what_the_front_serves():
    """A member that serves version 2 before its report says so: the index lists version 2
    READY and the model folder it has not loaded, and version 2 is ready on the front at once."""
    members = ["http://10.0.0.1:8000", "http://10.0.0.1:8001"]
    fresh = [mlp_state("2"), {"name": "spare", "version": "1", "state": "UNAVAILABLE",
                              "reason": "not loaded"}]
    inference, asked = front([("READY", "")] * 2, answers={
        **index_answers(members[0], fresh, [mlp_state("2")]),
        **index_answers(members[1], [mlp_state("1")], [mlp_state("1")])})
    assert isinstance(failure_of(inference.model_ready("mlp", "2")), NotFound)
    index = result_of(inference.repository_index())
    assert [(m["name"], m["version"], m["state"]) for m in index] == [
        ("mlp", "1", "READY"), ("mlp", "2", "READY"), ("spare", "1", "UNAVAILABLE")]
    assert index[2]["reason"] == "not loaded"
    assert sorted(asked) == sorted(url + path for url in members
                                   for path in ("/health", "/v2/repository/index"))
    assert result_of(inference.model_ready("mlp", "2")) is True


def test_a_member_that_fails_or_hangs_counts_as_its_last_report():
    """A member whose index fails (its /health answered), and one that does not answer within
    INDEX_SECONDS: the index and the front say what their reports say, once the time is up."""
    clock = Clock()
    members = ["http://10.0.0.1:8000", "http://10.0.0.1:8001"]
    inference, _ = front([("READY", ""), ("UNAVAILABLE", "unloaded")], clock=clock, answers={
        members[0] + "/v2/repository/index": Answer(500, b'{"error": "broken"}'),
        members[0] + "/health": Answer(200, json.dumps({"models": [mlp_state("2")]}).encode()),
        members[1] + "/v2/repository/index": Deferred(),
        members[1] + "/health": Deferred()})
    index = inference.repository_index()
    assert not index.called
    clock.advance(INDEX_SECONDS)
    assert result_of(index) == [{"name": "mlp", "version": "1", "state": "READY", "reason": ""}]
    assert isinstance(failure_of(inference.model_ready("mlp", "2")), NotFound)


def test_a_member_that_is_not_usable_is_not_asked():
    """A member that is not usable is listed as its report says, UNAVAILABLE, and not asked."""
    inference, asked = front([("READY", "")], healthy=False)
    assert result_of(inference.repository_index()) == [
        {"name": "mlp", "version": "1", "state": "UNAVAILABLE", "reason": ""}]
    assert asked == []
