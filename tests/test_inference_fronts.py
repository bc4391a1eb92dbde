"""
The inference protocol's REST resource and gRPC service over loopback, in
process, for a fake front with one model, driven by tritonclient's HTTP and
gRPC clients, unchanged (in threads: they block).
"""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
import pytest_twisted
import treq
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from klein import Klein
from prometheus_client import CollectorRegistry
from tritonclient.utils import InferenceServerException
from twisted.internet import defer, threads
from twisted.logger import Logger
from twisted.web.client import ResponseNeverReceived
from zope.interface import implementer
from zope.interface.verify import verifyObject

from kcoral.errors import BadRequest, NotFound, ServerBusy
from kcoral.inference.front import (
    IInferenceFront,
    InferCall,
    model_config_of,
    model_metadata_of,
    server_metadata,
)
from kcoral.inference.h2front import GrpcFront
from kcoral.inference.rest import InferenceRoutes
from kcoral.metrics import HttpMetrics
from kcoral.models.manifest import ModelManifest
from kcoral.protocol.inference import encode_infer
from kcoral.protocol.tensors import InvalidInput
from kcoral.web import errors
from kcoral.web.auth import CLIENT_ROUTES, TokenGuard
from kcoral.web.front import Front
from kcoral.web.requestid import RequestIdResource
from kcoral.web.site import KCoralSite
from tests.httputil import request

MANIFEST = ModelManifest.from_json({
    "format": 1, "name": "double", "max_batch_size": 8, "batch_sizes": [8],
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
    "programs": [{"file": "program", "sha256": "0" * 64, "batch_sizes": [8]}],
    "params": None, "platforms": ["cpu"]})
TOKEN = "t0ken"


@implementer(IInferenceFront)
class DoubleFront:
    """One model, C{double}: 2*x, checked against its manifest; C{busy}: no member ready."""

    def __init__(self):
        self.busy = False
        self.calls: list[InferCall] = []
        #: The configuration of each load.
        self.configs: list[str | None] = []
        #: The files of each load.
        self.files: list[dict | None] = []

    def _model(self, name: str) -> ModelManifest:
        if name != MANIFEST.name:
            raise NotFound(f"no model {name!r}")
        return MANIFEST

    def ready(self):
        return defer.succeed(True)

    def metadata(self):
        return defer.succeed(server_metadata("9.9"))

    def model_metadata(self, name, version):
        return defer.maybeDeferred(lambda: model_metadata_of(self._model(name)))

    def model_config(self, name, version):
        return defer.maybeDeferred(lambda: model_config_of(self._model(name)))

    def model_ready(self, name, version):
        return defer.maybeDeferred(lambda: bool(self._model(name)) and not self.busy)

    def repository_index(self):
        return defer.succeed([{"name": "double", "version": "1", "state": "READY", "reason": ""}])

    def load_model(self, name, config=None, files=None):
        self._model(name)
        self.configs.append(config)
        self.files.append(files)
        return defer.succeed({"models": [{"name": name, "version": "1", "state": "READY"}]})

    def unload_model(self, name):
        self._model(name)
        return defer.succeed({"models": [{"name": name, "version": "1", "state": "UNAVAILABLE"}]})

    def model_statistics(self, name, version):
        self._model(name or "double")
        return defer.succeed({"model_stats": [{"name": "double", "version": "1",
                                               "inference_count": 3}]})

    def infer(self, name, version, call):
        return defer.maybeDeferred(self._infer, name, call)

    def _infer(self, name, call):
        manifest = self._model(name)
        self.calls.append(call)
        if self.busy:
            raise ServerBusy("no member has the model ready", reason="no_ready_node")
        request = call.message.request()
        try:
            manifest.check(request.inputs)
        except InvalidInput as e:
            raise BadRequest(str(e)) from None
        return encode_infer(name, "1", request, {"y": request.inputs["x"] * 2})


@attrs.frozen
class Served:
    front: DoubleFront
    http: str
    grpc: str
    guarded: bool

    @property
    def headers(self) -> dict | None:
        """What a client sends to be admitted."""
        return {"Authorization": f"Bearer {TOKEN}"} if self.guarded else None

    @property
    def metadata(self) -> dict | None:
        """What a gRPC client sends to be admitted (gRPC's metadata keys are lower case)."""
        return {"authorization": f"Bearer {TOKEN}"} if self.guarded else None


class NoOtherRoutes:
    """A service's own routes, when it has none: JSON 404s and 405s."""

    app = Klein()
    errors.install(app)


def mounted(front, guard=None) -> RequestIdResource:
    """The inference routes of C{front}, mounted as a service mounts them
    (its front applies the client guard)."""
    return RequestIdResource(Front(NoOtherRoutes().app.resource(), InferenceRoutes(front).handlers(),
                                   guard=guard))


@pytest_twisted.async_yield_fixture(params=[False, True], ids=["open", "guarded"])
async def served(request):
    """The fake front on a REST port and a gRPC port, guarded by a client token or not."""
    from twisted.internet import reactor

    front = DoubleFront()
    guard = TokenGuard.of([TOKEN], CLIENT_ROUTES) if request.param else None
    site = KCoralSite(mounted(front, guard),
                      metrics=HttpMetrics(CollectorRegistry(), frozenset({"/"})),
                      max_request_bytes=1 << 20, log=Logger(), client_guard=guard)
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    grpc_front = GrpcFront(front, reactor=reactor, guard=guard)
    grpc_front.startService()
    yield Served(front, f"127.0.0.1:{port.getHost().port}", f"127.0.0.1:{grpc_front.port}",
                 request.param)
    await grpc_front.stopService(grace=0)
    await port.stopListening()


def in_thread(f, *args):
    return defer.ensureDeferred(threads.deferToThread(f, *args))


def http_calls(url: str, headers: dict):
    client = httpclient.InferenceServerClient(url)
    try:
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        results = {
            "live": client.is_server_live(), "ready": client.is_server_ready(),
            "server": client.get_server_metadata(),
            "metadata": client.get_model_metadata("double", headers=headers),
            "versioned": client.get_model_metadata("double", "1", headers=headers),
            "config": client.get_model_config("double", headers=headers),
            "model_ready": client.is_model_ready("double", headers=headers),
            "index": client.get_model_repository_index(headers=headers),
            "stats": client.get_inference_statistics("double", headers=headers),
            "all_stats": client.get_inference_statistics(headers=headers),
            "load": client.load_model("double", headers=headers),
            "unload": client.unload_model("double", headers=headers),
        }
        for binary in (False, True):
            infer_input = httpclient.InferInput("x", [2, 4], "FP32")
            infer_input.set_data_from_numpy(x, binary_data=binary)
            outputs = [httpclient.InferRequestedOutput("y", binary_data=binary)]
            result = client.infer("double", [infer_input], outputs=outputs, request_id="r7",
                                  headers=headers)
            results[f"infer{binary}"] = (result.as_numpy("y"), result.get_response()["id"])
        return results
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_http_client(served):
    """tritonclient.http reads health, metadata, configuration, the index and inferences."""
    results = await in_thread(http_calls, served.http, served.headers)
    assert results["live"] and results["ready"] and results["model_ready"]
    assert results["server"] == {"name": "kcoral", "version": "9.9",
                                 "extensions": ["binary_tensor_data", "model_configuration",
                                                "model_repository", "sequence", "statistics",
                                                "system_shared_memory"]}
    assert results["metadata"] == results["versioned"] == model_metadata_of(MANIFEST)
    assert results["metadata"]["inputs"][0]["shape"] == [-1, 4]
    assert results["config"]["max_batch_size"] == 8
    assert results["config"]["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    assert results["index"] == [{"name": "double", "version": "1", "state": "READY", "reason": ""}]
    assert results["stats"] == results["all_stats"] == {"model_stats": [
        {"name": "double", "version": "1", "inference_count": 3}]}
    assert results["load"] is None and results["unload"] is None  # tritonclient: no error
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for binary in (False, True):
        y, rid = results[f"infer{binary}"]
        np.testing.assert_array_equal(y, 2 * x)
        assert rid == "r7"


def http_error(url: str, headers: dict | None, model: str, x: np.ndarray) -> InferenceServerException:
    client = httpclient.InferenceServerClient(url)
    try:
        infer_input = httpclient.InferInput("x", list(x.shape), "FP32")
        infer_input.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException) as caught:
            client.infer(model, [infer_input], headers=headers)
        return caught.value
    finally:
        client.close()


GOOD = np.ones((1, 4), np.float32)


@pytest_twisted.ensureDeferred
async def test_http_errors(served):
    """Unknown models are 404, bad inputs 400, no ready member 503, each with its message."""
    headers = served.headers
    error = await in_thread(http_error, served.http, headers, "nope", GOOD)
    assert error.status() == "404" and "no model 'nope'" in error.message()
    error = await in_thread(http_error, served.http, headers, "double", np.ones((1, 3), np.float32))
    assert error.status() == "400" and "shape" in error.message()
    served.front.busy = True
    error = await in_thread(http_error, served.http, headers, "double", GOOD)
    assert error.status() == "503" and "no member" in error.message()


@pytest_twisted.ensureDeferred
async def test_guard(served):
    """Without a token, a guarded front answers 401 / UNAUTHENTICATED and an open one serves."""
    if served.guarded:
        error = await in_thread(http_error, served.http, None, "double", GOOD)
        assert error.status() == "401" and "bearer token" in error.message()
        error = await in_thread(grpc_error, served.grpc, None, "double", GOOD)
        assert error.status() == "StatusCode.UNAUTHENTICATED" and "bearer token" in error.message()
        assert served.front.calls == []
    else:
        results = await in_thread(http_calls, served.http, None)
        assert results["model_ready"]
        results = await in_thread(grpc_calls, served.grpc, None)
        assert results["model_ready"]


@pytest_twisted.ensureDeferred
async def test_request_ids_and_error_bodies(served):
    """Every answer has an X-Request-ID (the client's when sane); errors are {"error": message}
    and a 503 has Retry-After."""
    served.front.busy = True
    headers = {b"X-Request-ID": [b"abc-1"], b"Authorization": [f"Bearer {TOKEN}".encode()]}
    data = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                   "data": [1, 2, 3, 4]}]}).encode()
    response = await treq.post(f"http://{served.http}/v2/models/double/infer", headers=headers,
                               data=data)
    body = json.loads(await response.content())
    assert response.code == 503
    assert body == {"error": "no member has the model ready"}
    assert response.headers.getRawHeaders(b"X-Request-ID") == [b"abc-1"]
    assert response.headers.getRawHeaders(b"Retry-After") == [b"1"]
    assert served.front.calls[-1].request_id == "abc-1"
    response = await treq.get(f"http://{served.http}/v2/nothing")
    assert response.code == 404
    assert "no route" in json.loads(await response.content())["error"]
    assert len(response.headers.getRawHeaders(b"X-Request-ID")[0]) == 32


def grpc_calls(url: str, headers: dict):
    client = grpcclient.InferenceServerClient(url)
    try:
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        infer_input = grpcclient.InferInput("x", [2, 4], "FP32")
        infer_input.set_data_from_numpy(x)
        result = client.infer("double", [infer_input], request_id="g7", headers=headers)
        return {
            "live": client.is_server_live(), "ready": client.is_server_ready(),
            "server": client.get_server_metadata(as_json=True),
            "metadata": client.get_model_metadata("double", headers=headers, as_json=True),
            "config": client.get_model_config("double", headers=headers, as_json=True),
            "model_ready": client.is_model_ready("double", headers=headers),
            "index": client.get_model_repository_index(headers=headers, as_json=True),
            "stats": client.get_inference_statistics("double", headers=headers, as_json=True),
            "load": client.load_model("double", headers=headers),
            "unload": client.unload_model("double", headers=headers),
            "infer": (result.as_numpy("y"), result.get_response().id),
        }
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_grpc_client(served):
    """tritonclient.grpc reads health, metadata, configuration, the index and inferences."""
    results = await in_thread(grpc_calls, served.grpc, served.metadata)
    assert results["live"] and results["ready"] and results["model_ready"]
    assert results["server"]["name"] == "kcoral"
    assert results["server"]["extensions"] == [
        "binary_tensor_data", "model_configuration", "model_repository", "sequence",
        "statistics", "system_shared_memory"]
    assert results["metadata"]["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
    config = results["config"]["config"]
    assert config["max_batch_size"] == 8
    assert config["input"][0]["data_type"] == "TYPE_FP32" and config["input"][0]["dims"] == ["4"]
    assert results["index"]["models"] == [{"name": "double", "version": "1", "state": "READY"}]
    [stats] = results["stats"]["model_stats"]
    assert (stats["name"], stats["version"], stats["inference_count"]) == ("double", "1", "3")
    y, rid = results["infer"]
    np.testing.assert_array_equal(y, 2 * np.arange(8, dtype=np.float32).reshape(2, 4))
    assert rid == "g7"


def grpc_error(url: str, headers: dict | None, model: str, x: np.ndarray) -> InferenceServerException:
    client = grpcclient.InferenceServerClient(url)
    try:
        infer_input = grpcclient.InferInput("x", list(x.shape), "FP32")
        infer_input.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException) as caught:
            client.infer(model, [infer_input], headers=headers)
        return caught.value
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_grpc_errors(served):
    """Unknown models are NOT_FOUND, bad inputs INVALID_ARGUMENT, no ready member UNAVAILABLE."""
    headers = served.metadata
    error = await in_thread(grpc_error, served.grpc, headers, "nope", GOOD)
    assert error.status() == "StatusCode.NOT_FOUND" and "no model 'nope'" in error.message()
    error = await in_thread(grpc_error, served.grpc, headers, "double", np.ones((1, 3), np.float32))
    assert error.status() == "StatusCode.INVALID_ARGUMENT" and "shape" in error.message()
    served.front.busy = True
    error = await in_thread(grpc_error, served.grpc, headers, "double", GOOD)
    assert error.status() == "StatusCode.UNAVAILABLE" and "no_ready_node" in error.message()


def loads(address: str, metadata: dict | None) -> dict:
    """Loads of double over gRPC: with a configuration, with a file, then with a file whose
    path climbs out of the model's folder, refused (status and message)."""
    client = grpcclient.InferenceServerClient(address)
    read: dict = {}
    try:
        client.load_model("double", headers=metadata, config='{"max_batch_size": "16"}')
        client.load_model("double", headers=metadata, files={"file:1/model.json": b"{}"})
        try:
            client.load_model("double", headers=metadata, files={"file:../x": b"{}"})
        except InferenceServerException as e:
            read["climbing"] = (e.status(), e.message())
        return read
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_a_load_carries_its_configuration_and_files_and_nothing_else(served):
    """A load's config and file: parameters reach the front (REST: base64, gRPC: bytes); any
    other parameter, a file's path that climbs, and a body that is not a load request, is 400
    (gRPC INTERNAL) in Triton's words, and the front serves on."""
    client = httpclient.InferenceServerClient(served.http)
    try:
        await in_thread(lambda: client.load_model("double", headers=served.headers,
                                                  config='{"max_batch_size": 4}',
                                                  files={"file:1/model.stablehlo": b"\0\xff"}))
    finally:
        client.close()
    read = await in_thread(loads, served.grpc, served.metadata)
    assert served.front.configs == ['{"max_batch_size": 4}', '{"max_batch_size": "16"}', None]
    assert served.front.files == [{"1/model.stablehlo": b"\0\xff"}, {}, {"1/model.json": b"{}"}]
    assert read["climbing"][0] == "StatusCode.INTERNAL"
    assert "failed to poll from model repository" in read["climbing"][1]
    url = f"http://{served.http}/v2/repository/models/double/load"
    for body in (b"{not json", b"[]", b'{"parameters": []}', b'{"parameters": {"config": 1}}',
                 b'{"parameters": {"config": "{}", "x": 1}}', b'{"parameters": {"file:a": 1}}',
                 b'{"parameters": {"file:a": "not base64!"}}', b" " * 10 + b"x" * (1 << 19)):
        answer = await request("POST", url, body=body, headers=served.headers)
        assert answer.code == 400 and answer.request_id, (body[:32], answer)
        assert answer.json["error"].startswith("failed to load 'double': "), answer.json
    assert len(served.front.configs) == 3
    results = await in_thread(http_calls, served.http, served.headers)
    assert results["model_ready"]


def test_fake_front_provides_the_interface():
    """The fake front is a whole IInferenceFront (so the tests above test the seam)."""
    assert verifyObject(IInferenceFront, DoubleFront())


@implementer(IInferenceFront)
class HangingFront(DoubleFront):
    """Inferences that never end: C{arrived} fires with each one's Deferred."""

    def __init__(self):
        super().__init__()
        self.arrived: defer.Deferred = defer.Deferred()
        self.cancelled: defer.Deferred = defer.Deferred()

    def infer(self, name, version, call):
        d = defer.Deferred(lambda _: self.cancelled.callback(None))
        self.arrived.callback(d)
        return d


@pytest_twisted.ensureDeferred
async def test_client_leaving_cancels_the_inference():
    """A REST client that goes away cancels the front's Deferred."""
    from twisted.internet import reactor

    front = HangingFront()
    site = KCoralSite(mounted(front), metrics=HttpMetrics(CollectorRegistry(), frozenset({"/"})),
                      max_request_bytes=1 << 20, log=Logger())
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    try:
        pending = treq.post(f"http://127.0.0.1:{port.getHost().port}/v2/models/double/infer",
                            data=b'{"inputs": []}')
        pending.addErrback(lambda failure: failure.trap(defer.CancelledError, ResponseNeverReceived))
        await front.arrived
        pending.cancel()
        await front.cancelled
    finally:
        await port.stopListening()


def grpc_tls_infer(url: str, ca: str, cert: str | None, key: str | None) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=ca,
                                              private_key=key, certificate_chain=cert)
    try:
        infer_input = grpcclient.InferInput("x", [1, 4], "FP32")
        infer_input.set_data_from_numpy(np.ones((1, 4), np.float32))
        return client.infer("double", [infer_input]).as_numpy("y")
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_grpc_over_mutual_tls(tmp_path):
    """With a certificate and a client CA, gRPC answers only clients whose certificate that CA
    signed, over TLS."""
    from twisted.internet import reactor

    from tests.tlsutil import TestCA

    ca = TestCA(tmp_path / "ca")
    served = ca.issue("server", dns=("localhost",))
    clients = TestCA(tmp_path / "clients", name="KCoral test client CA")
    client = clients.issue("client", dns=("client",), client=True)
    front = GrpcFront(DoubleFront(), reactor=reactor, host="127.0.0.1",
                      tls=(served.cert, served.key), client_ca=clients.path)
    front.startService()
    try:
        url = f"localhost:{front.port}"
        y = await in_thread(grpc_tls_infer, url, ca.path, client.cert, client.key)
        np.testing.assert_array_equal(y, np.full((1, 4), 2, np.float32))
        with pytest.raises(InferenceServerException):
            await in_thread(grpc_tls_infer, url, ca.path, None, None)
    finally:
        await front.stopService(grace=0)
