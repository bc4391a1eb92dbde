"""
Model control attacked: loads with a hostile configuration or hostile
files, and names that would forge log lines, against a real standalone
server and a real node's gateway in explicit model control, over REST and
gRPC. Each is refused in Triton's words (HTTP 400 / gRPC INTERNAL, 'failed
to load'), the model served before is served unchanged, and the front
answers a plain inference correctly after.

tests/test_model_config.py and tests/test_load_files.py hold the parsers'
own properties and the ordinary loads; this module the same inputs through
real fronts.
"""

from __future__ import annotations

import base64
import json

import grpc
import numpy as np
import pytest
import pytest_twisted
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException
from twisted.internet import threads

from kcoral.inference.front import MAX_LOAD_FILES
from kcoral.inference.h2front import SERVICE
from kcoral.models.config import MAX_CONFIG_BYTES
from tests.conftest import server_args
from tests.test_models import start_grpc_front
from tests.test_shared_memory import export_simple

TOKEN = "l0ad-t0ken"
HEADERS = {"authorization": f"Bearer {TOKEN}"}


@pytest_twisted.async_fixture(scope="module", params=["server", "gateway"])
async def front(request: pytest.FixtureRequest, module_processes, tmp_path_factory):
    """A standalone server, or a node's gateway before two CPU workers, in
    explicit model control with Triton's C{simple} loaded, guarded by a
    client token: its REST host:port, its gRPC address, its process."""
    root = tmp_path_factory.mktemp("load-attacks")
    args = server_args("--model-repository", export_simple(root), "--grpc-port", "0",
                       "--client-token", TOKEN, "--model-control-mode", "explicit",
                       "--load-model", "simple")
    address, url, process = await start_grpc_front(module_processes, request.param, args)
    return url.removeprefix("http://"), address, process


def _served_unchanged(rest: str, grpc_address: str, config: dict) -> None:
    """C{simple} is configured as C{config} says and answers correctly, over REST and gRPC."""
    for module, address in ((httpclient, rest), (grpcclient, grpc_address)):
        client = module.InferenceServerClient(address)
        try:
            inputs = [module.InferInput("INPUT0", [1, 16], "INT32"),
                      module.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[0].set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
            inputs[1].set_data_from_numpy(np.ones((1, 16), np.int32))
            result = client.infer("simple", inputs, headers=dict(HEADERS))
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(1, 17).reshape(1, 16))
        finally:
            client.close()
    client = httpclient.InferenceServerClient(rest)
    try:
        assert client.get_model_config("simple", headers=dict(HEADERS)) == config
    finally:
        client.close()


def _config(rest: str) -> dict:
    client = httpclient.InferenceServerClient(rest)
    try:
        return client.get_model_config("simple", headers=dict(HEADERS))
    finally:
        client.close()


def _load_refused(client, words: str, **load) -> None:
    """A load of C{simple} with C{load} is refused: HTTP 400 / gRPC INTERNAL, C{words} in it."""
    with pytest.raises(InferenceServerException) as raised:
        client.load_model("simple", headers=dict(HEADERS), **load)
    assert raised.value.status() in ("400", "StatusCode.INTERNAL"), raised.value
    assert words in raised.value.message(), raised.value.message()


#: Configurations no front may apply, and a word of why.
HOSTILE_CONFIGS = [
    ('{"max_batch_size": 99999999999999999999}', "out of range"),
    ('{"max_batch_size": ' + "9" * 5000 + "}", "not JSON"),
    ("[" * 30000 + "]" * 30000, "not JSON"),
    ('{"input": [{"dims": ' + "[" * 20000 + "]" * 20000 + "}]}", "not JSON"),
    ('{"name": "' + "a" * MAX_CONFIG_BYTES + '"}', "over"),
    ('{"max_batch_size": "many"}', "not a ModelConfig"),
    ('{"max_batch_size": true}', "not a ModelConfig"),
    ('{"input": {"name": 1}}', "not a ModelConfig"),
    ('{"no_such_field": 1}', "not a ModelConfig"),
    ('{"instance_group": [{"count": 64}]}', "not served"),
    ('{"max_batch_size": 70000}', "max_batch_size must be"),
    ('{"name": "other"}', "not the model's"),
    ('{"input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [-9223372036854775808]}]}',
     "the model's own"),
    ('{"dynamic_batching": {"max_queue_delay_microseconds": "18446744073709551615"}}', "over"),
    ('{"sequence_batching": {"direct": {}}}', "sequence"),
    ('"text"', "JSON object"),
]


def _hostile_configs(rest: str, grpc_address: str) -> None:
    clients = [httpclient.InferenceServerClient(rest, network_timeout=120),
               grpcclient.InferenceServerClient(grpc_address)]
    try:
        for client in clients:
            for config, words in HOSTILE_CONFIGS:
                _load_refused(client, "failed to load 'simple'", config=config)
                _load_refused(client, words, config=config)
    finally:
        for client in clients:
            client.close()
    # A lone surrogate, which JSON may escape and no UTF-8 (a protobuf string) holds.
    status, answer = _post_load(rest, {"config": '{"name": "\ud800"}'})
    assert status == 400 and answer["error"].startswith("failed to load 'simple'"), answer


@pytest_twisted.ensureDeferred
async def test_hostile_configurations_leave_the_model_as_it_was(front):
    """Loads whose configuration overflows an integer, nests deep, is over
    its bound, holds wrong types, unknown or unserved fields, another
    model's name or tensors, a lone surrogate, or is not an object, over
    REST and gRPC: each
    'failed to load' naming why; the model is served as before, its
    configuration unchanged."""
    before = await threads.deferToThread(_config, front[0])
    await threads.deferToThread(_hostile_configs, front[0], front[1])
    await threads.deferToThread(_served_unchanged, front[0], front[1], before)


def _post_load(rest: str, parameters: dict) -> tuple[int, dict]:
    """A REST load of C{simple} with C{parameters} as sent: its status and JSON body."""
    import http.client

    connection = http.client.HTTPConnection(rest, timeout=120)
    try:
        connection.request("POST", "/v2/repository/models/simple/load",
                           json.dumps({"parameters": parameters}),
                           {**HEADERS, "Content-Type": "application/json"})
        answer = connection.getresponse()
        body = answer.read()
        assert answer.getheader("X-Request-Id"), body
        return answer.status, json.loads(body)
    finally:
        connection.close()


def _hostile_files(rest: str, grpc_address: str) -> None:
    content = base64.b64encode(b"{}").decode()
    for path, words in (("/etc/passwd", "relative"), ("1/../../x", "'..'"), ("..", "'..'"),
                        ("1/" + "k" * 256, "over 255 bytes"), ("1/a\0b", "NUL"), ("1//x", "empty"),
                        ("1/./x", "'.'"), ("1/\ud800", "UTF-8 text"), ("1/\udcff", "UTF-8 text"),
                        ("/".join(["d"] * 200), "deep")):
        status, answer = _post_load(rest, {f"file:{path}": content})
        assert status == 400, (path, status, answer)
        assert answer["error"].startswith("failed to load 'simple'") and words in answer["error"], answer
    status, answer = _post_load(rest, {f"file:1/f{i}": content for i in range(MAX_LOAD_FILES + 1)})
    assert status == 400 and f"over {MAX_LOAD_FILES}" in answer["error"], answer
    status, answer = _post_load(rest, {"file:1/model.json": "not base64 !"})
    assert status == 400 and "failed to load 'simple'" in answer["error"], answer
    client = grpcclient.InferenceServerClient(grpc_address)
    try:
        for path in ("/etc/passwd", "..", "1/a\0b", "1/" + "k" * 256):
            _load_refused(client, "failed to poll from model repository", files={f"file:{path}": b"{}"})
        _load_refused(client, "failed to load 'simple'", files={"file:1/model.json": b"\xff" * 64})
    finally:
        client.close()

    @settings(max_examples=40, deadline=None)
    @given(paths=st.lists(st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40)
                          | st.sampled_from(["..", "/", "1/..", "1/model.json", "config.json"]),
                          min_size=1, max_size=4),
           data=st.binary(max_size=64))
    def fuzzed(paths, data):
        status, answer = _post_load(rest, {f"file:{p}": base64.b64encode(data).decode() for p in paths})
        assert status == 400 and answer["error"].startswith("failed to load 'simple'"), answer

    fuzzed()


@pytest_twisted.ensureDeferred
async def test_hostile_files_leave_the_model_as_it_was(front):
    """Loads with files at absolute paths, climbing, with components over
    255 bytes, a NUL, empty or '.' components, lone surrogates, too deep,
    too many, contents that are not base64 or no bundle, and fuzzed paths
    and contents, over REST and gRPC: each 'failed to load' (a path in
    Triton's 'failed to poll from model repository'); the model is served
    as before."""
    before = await threads.deferToThread(_config, front[0])
    await threads.deferToThread(_hostile_files, front[0], front[1])
    await threads.deferToThread(_served_unchanged, front[0], front[1], before)


def _named_with_breaks(grpc_address: str) -> None:
    name = "x\nERROR [kcoral.forged] a line of the client's"
    channel = grpc.insecure_channel(grpc_address)
    load = service_pb2.RepositoryModelLoadRequest(model_name="simple")
    load.parameters["file:1/a\nERROR [kcoral.forged] b"].bytes_param = b"{}"
    load.parameters["config"].string_param = '{"name": "\\nERROR [kcoral.forged] c"}'
    calls = [
        ("ModelInfer", service_pb2.ModelInferRequest(model_name=name), service_pb2.ModelInferResponse),
        ("ModelConfig", service_pb2.ModelConfigRequest(name=name), service_pb2.ModelConfigResponse),
        ("ModelMetadata", service_pb2.ModelMetadataRequest(name=name), service_pb2.ModelMetadataResponse),
        ("ModelReady", service_pb2.ModelReadyRequest(name=name), service_pb2.ModelReadyResponse),
        ("ModelStatistics", service_pb2.ModelStatisticsRequest(name=name),
         service_pb2.ModelStatisticsResponse),
        ("RepositoryModelLoad", service_pb2.RepositoryModelLoadRequest(model_name=name),
         service_pb2.RepositoryModelLoadResponse),
        ("RepositoryModelLoad", load, service_pb2.RepositoryModelLoadResponse),
        ("RepositoryModelUnload", service_pb2.RepositoryModelUnloadRequest(model_name=name),
         service_pb2.RepositoryModelUnloadResponse),
    ]
    try:
        for method, message, answer in calls:
            call = channel.unary_unary(f"/{SERVICE}/{method}",
                                       request_serializer=type(message).SerializeToString,
                                       response_deserializer=answer.FromString)
            try:
                call(message, metadata=list(HEADERS.items()), timeout=30)
            except grpc.RpcError as e:
                assert e.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE), e
    finally:
        channel.close()


@pytest_twisted.ensureDeferred
async def test_names_with_line_breaks_forge_no_log_line(front):
    """gRPC names are any text: a model's name, a file's path and a
    configuration holding a line break, in every method that takes one, are
    refused (or answered), and the front's log has no line of the client's."""
    since = front[2].mark()
    await threads.deferToThread(_named_with_breaks, front[1])
    await threads.deferToThread(_served_unchanged, front[0], front[1],
                                await threads.deferToThread(_config, front[0]))
    assert not front[2].matching(r"^\S*\s*ERROR \[kcoral\.forged\]", since)
