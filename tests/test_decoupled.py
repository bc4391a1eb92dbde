"""
Decoupled models (several answers to one request), as Triton serves them:
the bundle (C{export_bundle(..., decoupled=True)}: model.json, the
configuration, bad ones refused), the answers a gRPC front makes of one
execution's rows (L{kcoral.protocol.decoupled}), and real fronts (a
standalone server, a node's gateway, a Router before a node) answering
tritonclient's streams in order, refusing a unary or REST inference in
Triton's words.
"""

from __future__ import annotations

import json
import os
import queue

import attrs
import grpc
import jax.numpy as jnp
import numpy as np
import pytest
import pytest_twisted
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

import kcoral
from kcoral.errors import BadRequest, ProgramFailed
from kcoral.models.config import ConfigError, config_of, parse_config
from kcoral.models.manifest import MANIFEST, InvalidManifest, ModelManifest
from kcoral.protocol.decoupled import FINAL, answers_of, empty_final
from kcoral.protocol.strings import serialize
from tests.conftest import server_args
from tests.httputil import request
from tests.test_grpc_front import in_thread
from tests.test_models import grpc_address, start_grpc_front
from tests.test_routed import start_node, start_router, until_ready

#: repeat's IN: four elements, four answers.
REPEATS = 4


def repeat(values, delay):
    """An answer for each element of C{values}: the element, and its index."""
    del delay
    return values[:, None], jnp.arange(values.shape[0], dtype=jnp.uint32)[:, None]


def export_repeat(folder, name: str = "repeat", fn=repeat, count: int = REPEATS):
    return kcoral.export_bundle(fn, None, np.zeros(count, np.int32), np.zeros(count, np.uint32),
                                dir=os.path.join(folder, name), name=name,
                                input_names=["IN", "DELAY"], output_names=["OUT", "IDX"],
                                decoupled=True)


# -- the bundle ---------------------------------------------------------------------------------

def test_model_json_records_a_decoupled_model(tmp_path):
    """model.json says decoupled, not batched: the inputs' whole shapes, each output's shape
    in one answer; it reads back, and config shows Triton's model_transaction_policy."""
    manifest = export_repeat(tmp_path)
    written = json.loads((tmp_path / "repeat" / MANIFEST).read_bytes())
    assert (written["decoupled"], written["max_batch_size"], written["batch_sizes"]) == (True, 0, [])
    assert [(t["name"], t["datatype"], t["shape"]) for t in written["inputs"]] == [
        ("IN", "INT32", [REPEATS]), ("DELAY", "UINT32", [REPEATS])]
    assert [(t["name"], t["datatype"], t["shape"]) for t in written["outputs"]] == [
        ("OUT", "INT32", [1]), ("IDX", "UINT32", [1])]
    assert ModelManifest.loads((tmp_path / "repeat" / MANIFEST).read_bytes()) == manifest
    config = config_of(manifest)
    assert config["model_transaction_policy"] == {"decoupled": True}
    assert "dynamic_batching" not in config
    assert "model_transaction_policy" not in config_of(attrs.evolve(manifest, decoupled=False))


@pytest.mark.parametrize("fn, why", [
    (lambda values, delay: (values[:, None], values[:2, None]), "the same number in every output"),
    (lambda values, delay: (values.sum(), values[:, None]), "one row for each answer"),
])
def test_outputs_that_are_no_rows_of_answers_are_refused_at_export(tmp_path, fn, why):
    """A decoupled model whose outputs differ in rows, or one with a scalar output, is
    refused at export, saying so; nothing is written."""
    with pytest.raises(ValueError, match=why):
        export_repeat(tmp_path, fn=fn)
    assert not (tmp_path / "repeat").exists()


def test_a_decoupled_sequence_model_is_refused_at_export(tmp_path):
    """A decoupled model with a state is refused: each of its requests stands alone."""
    with pytest.raises(ValueError, match="not a sequence model"):
        kcoral.export_bundle(lambda state, x: (state, x), None, np.zeros((1, 1), np.int32),
                             dir=tmp_path / "m", name="m", state=np.zeros((1, 1), np.int32),
                             decoupled=True)


@pytest.mark.parametrize("change, why", [
    ({"decoupled": "yes"}, "decoupled must be true or false"),
    ({"max_batch_size": 4, "batch_sizes": [4]}, "neither batched"),
])
def test_a_manifest_of_a_decoupled_model_it_cannot_be_is_refused(tmp_path, change, why):
    """A manifest whose decoupled is no bool, or which is decoupled and batched, is refused
    with the reason."""
    export_repeat(tmp_path)
    value = json.loads((tmp_path / "repeat" / MANIFEST).read_bytes())
    value.update(change)
    if "max_batch_size" in change:
        value["programs"][0]["batch_sizes"] = [4]
        for tensor in value["inputs"] + value["outputs"]:
            tensor["shape"] = [-1, *tensor["shape"]]
    with pytest.raises(InvalidManifest, match=why):
        ModelManifest.from_json(value)


def test_a_configuration_may_say_decoupled_as_the_model_is(tmp_path):
    """A load's configuration may carry model_transaction_policy as the model's config shows
    it (read, changed and sent back, it loads); one saying otherwise than the model is refused,
    naming the field."""
    decoupled, ordinary = export_repeat(tmp_path), attrs.evolve(export_repeat(tmp_path),
                                                                decoupled=False)
    parse_config(json.dumps(config_of(decoupled))).check(decoupled)
    for manifest, said in ((decoupled, False), (ordinary, True)):
        given = parse_config(json.dumps({"model_transaction_policy": {"decoupled": said}}))
        with pytest.raises(ConfigError, match="model_transaction_policy.decoupled must be "
                           f"the model's own, {str(not said).lower()}"):
            given.check(manifest)


# -- a front's answers of one execution --------------------------------------------------------

def stacked(*outputs: tuple[str, str, list[int], bytes]) -> service_pb2.ModelInferResponse:
    """A ModelInferResponse holding all the answers of a request, as a server makes it."""
    response = service_pb2.ModelInferResponse(model_name="m", model_version="1", id="r7")
    for name, datatype, shape, data in outputs:
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        response.raw_output_contents.append(data)
    return response


def read(answer: bytes) -> service_pb2.ModelInferResponse:
    return service_pb2.ModelInferResponse.FromString(answer)


def test_each_row_is_an_answer_in_order_then_the_final_one_where_asked():
    """Three rows of an INT32 output and a BYTES one are three answers in row order, each
    with its request's id and triton_final_response false; asked for, a last answer with no
    outputs and triton_final_response true."""
    words = np.array([[b"a", b""], [b"bc", b"d"], [b"", b"efg"]], dtype=object)
    response = stacked(("OUT", "INT32", [3, 2], np.arange(6, dtype="<i4").tobytes()),
                       ("WORDS", "BYTES", [3, 2], serialize(words)))
    for ended in (False, True):
        answers = [read(a) for a in answers_of(response, ended)]
        assert len(answers) == 3 + ended
        for i, answer in enumerate(answers[:3]):
            assert (answer.id, answer.model_name, answer.model_version) == ("r7", "m", "1")
            assert answer.parameters[FINAL].bool_param is False
            assert [(o.name, list(o.shape)) for o in answer.outputs] == [("OUT", [2]), ("WORDS", [2])]
            np.testing.assert_array_equal(
                np.frombuffer(answer.raw_output_contents[0], "<i4"), [2 * i, 2 * i + 1])
            assert answer.raw_output_contents[1] == serialize(words[i])
    final = answers[-1]
    assert (final.id, final.parameters[FINAL].bool_param, len(final.outputs)) == ("r7", True, 0)


def test_no_rows_are_no_answers_but_the_final_one_where_asked():
    """An execution of zero rows answers nothing, or the final answer alone."""
    response = stacked(("OUT", "INT32", [0, 1], b""))
    assert answers_of(response, False) == []
    (final,) = [read(a) for a in answers_of(response, True)]
    assert final.parameters[FINAL].bool_param is True and not final.outputs


@pytest.mark.parametrize("outputs, why", [
    ((("A", "INT32", [2, 1], bytes(8)), ("B", "INT32", [3, 1], bytes(12))), "the same number"),
    ((("A", "INT32", [2, 1], b""),), "not written to shared memory"),
    ((("A", "BYTES", [2], serialize(np.array([b"x"], dtype=object))),), "not written to shared"),
])
def test_outputs_that_are_not_rows_of_answers_fail_the_request(outputs, why):
    """Outputs of different rows, or whose contents are not their shapes' (written to a
    shared-memory region), fail the request as the model's fault, saying why."""
    with pytest.raises(ProgramFailed, match=why):
        answers_of(stacked(*outputs), False)


def test_the_final_answer_is_asked_for_with_a_bool_alone():
    """triton_enable_empty_final_response: a bool says; anything else is refused in Triton's
    words; none is no."""
    request = service_pb2.ModelInferRequest()
    assert empty_final(request.parameters) is False
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    assert empty_final(request.parameters) is True
    request.parameters["triton_enable_empty_final_response"].string_param = "true"
    with pytest.raises(BadRequest, match="invalid value type for "
                       "'triton_enable_empty_final_response' parameter, expected bool_param"):
        empty_final(request.parameters)


# -- real fronts -------------------------------------------------------------------------------

def export_models(root) -> str:
    """repeat (L{repeat}), none (always zero answers) and double (an ordinary batched model)."""
    export_repeat(root)
    kcoral.export_bundle(lambda x: (x[:0, None],), None, np.zeros(2, np.int32), dir=root / "none",
                         name="none", input_names=["IN"], output_names=["OUT"], decoupled=True)
    kcoral.export_bundle(lambda x: x * 2, None, np.zeros((1, 2), np.int32), dir=root / "double",
                         name="double", batch_sizes=[1, 4], input_names=["IN"],
                         output_names=["OUT"])
    return str(root)


@pytest_twisted.async_fixture(scope="module", params=["server", "gateway", "router"])
async def front(request: pytest.FixtureRequest, module_processes, tmp_path_factory
                ) -> tuple[str, str]:
    """A standalone server, a node's gateway before two CPU workers, or a Router before a
    node, of L{export_models}, serving gRPC: its gRPC address and its URL."""
    repository = export_models(tmp_path_factory.mktemp("models"))
    if request.param != "router":
        address, url, _ = await start_grpc_front(
            module_processes, request.param,
            server_args("--model-repository", repository, "--grpc-port", "0"))
        return address, url
    router = await start_router(module_processes, "--grpc-port", "0")
    await start_node(module_processes, router.url, "n1", "--model-repository", repository)
    await until_ready(router, "n1")
    return await grpc_address(router.process), router.url


def inputs(module, model: str, first: int) -> list:
    """The inputs of C{model}: IN counting from C{first} (and repeat's DELAY)."""
    if model == "double":
        given = module.InferInput("IN", [1, 2], "INT32")
        given.set_data_from_numpy(np.array([[first, first + 1]], np.int32))
        return [given]
    count = REPEATS if model == "repeat" else 2
    given = [module.InferInput("IN", [count], "INT32")]
    given[0].set_data_from_numpy(np.arange(first, first + count, dtype=np.int32))
    if model == "repeat":
        given.append(module.InferInput("DELAY", [count], "UINT32"))
        given[1].set_data_from_numpy(np.zeros(count, np.uint32))
    return given


def stream(address: str, requests: list[tuple[str, int, bool]]) -> list:
    """tritonclient's stream: C{requests} (model, first, empty final) sent with request ids
    0, 1, ..., then stop_stream (which waits for every answer). What each answer is: (id,
    OUT, IDX, triton_final_response) or an error's message."""
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(address)
    try:
        client.start_stream(lambda result, error: got.put((result, error)))
        for index, (model, first, ended) in enumerate(requests):
            client.async_stream_infer(model, inputs(grpcclient, model, first),
                                      request_id=str(index), enable_empty_final_response=ended)
        client.stop_stream()
    finally:
        client.close()
    answers = []
    while not got.empty():
        result, error = got.get()
        if error is not None:
            answers.append(error.message())
            continue
        response = result.get_response()
        final = response.parameters[FINAL].bool_param if FINAL in response.parameters else None
        idx = result.as_numpy("IDX")
        answers.append((response.id, result.as_numpy("OUT"),
                        None if idx is None else idx.tolist(), final))
    return answers


@pytest_twisted.ensureDeferred
async def test_a_stream_has_each_answer_of_each_request_in_order(front):
    """On a stream, repeat's request gets its four answers in order (OUT its element, IDX its
    index, triton_final_response false), then, asked for, the final answer; none's gets no
    answer, or the final one alone; an ordinary model's single answer is its last; an
    unknown model's error keeps its place; the stream ends once all are answered."""
    address, _ = front
    answers = await in_thread(stream, address, [
        ("repeat", 100, False), ("none", 0, True), ("double", 5, False), ("none", 0, False),
        ("missing", 0, False), ("repeat", 200, True)])
    expected: list = [("0", np.array([100 + i]), [i], False) for i in range(REPEATS)]
    expected += [("1", None, None, True), ("2", np.array([10, 12]), None, True), "missing"]
    expected += [("5", np.array([200 + i]), [i], False) for i in range(REPEATS)]
    expected += [("5", None, None, True)]
    assert len(answers) == len(expected), answers
    for answer, wanted in zip(answers, expected, strict=True):
        if isinstance(wanted, str):
            assert isinstance(answer, str) and wanted in answer, answer
            continue
        rid, out, idx, final = answer
        assert (rid, idx, final) == (wanted[0], wanted[2], wanted[3]), answer
        if wanted[1] is None:
            assert out is None, answer
        else:
            np.testing.assert_array_equal(out.reshape(-1), wanted[1])


@pytest_twisted.ensureDeferred
async def test_one_answer_alone_is_refused_in_tritons_words(front):
    """A unary gRPC inference of a decoupled model ends UNIMPLEMENTED, a REST one is 501,
    each in Triton's words; the front answers a stream of it after."""
    address, url = front

    def asked() -> tuple:
        client = grpcclient.InferenceServerClient(address)
        try:
            with pytest.raises(InferenceServerException) as unary:
                client.infer("repeat", inputs(grpcclient, "repeat", 0))
        finally:
            client.close()
        rest = httpclient.InferenceServerClient(url.split("://", 1)[1])
        try:
            with pytest.raises(InferenceServerException) as over_rest:
                rest.infer("repeat", inputs(httpclient, "repeat", 0))
        finally:
            rest.close()
        return unary.value, over_rest.value

    unary, over_rest = await in_thread(asked)
    assert unary.status() == str(grpc.StatusCode.UNIMPLEMENTED)
    assert unary.message() == ("ModelInfer RPC doesn't support models with decoupled "
                               "transaction policy")
    assert over_rest.status() == "501"
    assert "HTTP end point doesn't support models with decoupled transaction policy" in (
        over_rest.message())
    answers = await in_thread(stream, address, [("repeat", 7, False)])
    assert [a[2] for a in answers] == [[i] for i in range(REPEATS)]


@pytest.mark.parametrize("front", ["gateway", "router"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_a_client_saying_it_is_a_stream_is_not_taken_at_its_word(front):
    """X-KCoral-Decoupled is what a front says to its worker: a REST client that sends it to
    a gateway or a Router is refused as any REST inference of a decoupled model is (501, the
    request's id), not answered with all its answers as one."""
    _, url = front
    body = json.dumps({"inputs": [
        {"name": "IN", "shape": [REPEATS], "datatype": "INT32", "data": list(range(REPEATS))},
        {"name": "DELAY", "shape": [REPEATS], "datatype": "UINT32", "data": [0] * REPEATS},
    ]}).encode()
    answer = await request("POST", url + "/v2/models/repeat/infer", body=body, headers={
        "Content-Type": "application/json", "X-KCoral-Decoupled": "true",
        "X-Request-ID": "forged-1"})
    assert answer.code == 501, answer
    assert answer.request_id == "forged-1"
    assert "decoupled transaction policy" in answer.json["error"]


def cancelled_stream(address: str, count: int) -> str:
    """tritonclient's stream of C{count} requests of repeat, cancelled
    (stop_stream(cancel_requests=True)) once its first answer has come: that answer's id."""
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(address)
    try:
        client.start_stream(lambda result, error: got.put((result, error)))
        for index in range(count):
            client.async_stream_infer("repeat", inputs(grpcclient, "repeat", index),
                                      request_id=str(index))
        result, error = got.get(timeout=30)
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
    return error.message() if error is not None else result.get_response().id


@pytest_twisted.ensureDeferred
async def test_a_cancelled_stream_of_a_decoupled_model_leaves_the_front_serving(front):
    """A stream of 64 requests of repeat that tritonclient cancels once its first answer (the
    first request's) has come leaves the front serving: another stream is answered whole."""
    address, _ = front
    assert await in_thread(cancelled_stream, address, 64) == "0"
    answers = await in_thread(stream, address, [("repeat", 9, True), ("double", 1, False)])
    assert [(a[0], a[3]) for a in answers] == [("0", False)] * REPEATS + [("0", True), ("1", True)]


def through_shared_memory(address: str) -> tuple[list, list, np.ndarray]:
    """repeat's IN read out of a system shared-memory region, on a stream: its answers when its
    outputs come in them, then when OUT is asked into a region; and that region after."""
    import tritonclient.utils.shared_memory as shm

    key = f"/kcoral-decoupled-{os.getpid()}"
    given = shm.create_shared_memory_region("in", key + "-in", 4 * REPEATS)
    out = shm.create_shared_memory_region("out", key + "-out", 4 * REPEATS)
    client = grpcclient.InferenceServerClient(address)
    try:
        shm.set_shared_memory_region(given, [np.arange(30, 30 + REPEATS, dtype=np.int32)])
        client.register_system_shared_memory("in", key + "-in", 4 * REPEATS)
        client.register_system_shared_memory("out", key + "-out", 4 * REPEATS)
        answers = []
        for into_region in (False, True):
            got: queue.Queue = queue.Queue()
            tensors = inputs(grpcclient, "repeat", 0)
            tensors[0].set_shared_memory("in", 4 * REPEATS)
            asked = [grpcclient.InferRequestedOutput("OUT"), grpcclient.InferRequestedOutput("IDX")]
            if into_region:
                asked[0].set_shared_memory("out", 4 * REPEATS)
            client.start_stream(lambda result, error, got=got: got.put((result, error)))
            client.async_stream_infer("repeat", tensors, outputs=asked, request_id="s")
            client.stop_stream()
            answers.append([error.message() if error is not None else
                            result.as_numpy("OUT").tolist() for result, error in got.queue])
        # A copy: the view is of the mapping, unmapped below.
        return answers[0], answers[1], shm.get_contents_as_numpy(out, np.int32, [REPEATS]).copy()
    finally:
        client.unregister_system_shared_memory()
        client.close()
        shm.destroy_shared_memory_region(given)
        shm.destroy_shared_memory_region(out)


@pytest_twisted.ensureDeferred
async def test_a_decoupled_model_reads_shared_memory_and_answers_in_its_answers(
        processes, tmp_path):
    """A standalone server with --allow-client-shm: a decoupled model's input is read out of
    a region, each answer as from the wire; its outputs asked into a region are refused on the
    stream (one slice cannot hold several answers'), the region left as it was."""
    repository = export_models(tmp_path)
    address, _, _ = await start_grpc_front(processes, "server", server_args(
        "--model-repository", repository, "--grpc-port", "0", "--allow-client-shm"))
    in_answers, into_region, region = await in_thread(through_shared_memory, address)
    assert in_answers == [[30 + i] for i in range(REPEATS)]
    assert len(into_region) == 1 and "not written to shared memory" in into_region[0], into_region
    assert region.tolist() == [0] * REPEATS
