"""
Integration tests of named models (SPEC 11.1 and 11.2) with real processes on
loopback and real JAX: a bundle written by C{kcoral.export_bundle} (an MLP,
batch sizes 1 and 8) beside a broken model folder, served from
C{--model-repository} by a standalone server, by a node of two CPU workers
(its node file naming the repository with seed 004's C{model_repo} key), and
by two nodes behind a Router; each front driven over REST and gRPC by
tritonclient's own clients, unchanged (in threads: they block), and by plain
HTTP requests where status codes and headers matter. A server and a node
started batch invariant give each row the bytes it gets alone.

Each topology is started once for the module; its tests share it.
"""

from __future__ import annotations

import json
import re
import time

import attrs
import numpy as np
import pytest
import pytest_twisted
import yaml
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.threads import deferToThread

from tests.conftest import server_args, server_env
from tests.harness import SERVER_READY, ChildProcess, kcoral_argv, until
from tests.httputil import request
from tests.rowcheck import assert_within_rounding
from tests.test_node_multi import Node as MultiNode
from tests.test_node_multi import assert_reaped, scrape
from tests.test_routed import start_node as start_routed_node
from tests.test_routed import start_router, until_ready

pytestmark = pytest.mark.integration

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

#: The gRPC line of the process itself (not a worker's, prefixed "[workerN]").
GRPC = re.compile(r"^(?!.*\[worker\d+\]).*serving the inference protocol over gRPC on "
                  r"(?P<host>[\d.]+):(?P<port>\d+)")
GATEWAY = re.compile(r"kcoral gateway listening on (?P<url>https?://\S+)")
START_TIMEOUT = 120.0
ROWS = (3, 8)


def mlp(p, x):
    return jnp.tanh(x @ p["w1"]) @ p["w2"]


# -- the model repository ----------------------------------------------------------------

@attrs.frozen
class Repository:
    path: str
    params: dict

    def expected(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(mlp(self.params, x))


def mlp_params(seed: int) -> dict:
    """Weights of the MLP (16 -> 32 -> 8) drawn from C{seed}."""
    rng = np.random.default_rng(seed)
    return {"w1": rng.standard_normal((16, 32)).astype(np.float32) / 4,
            "w2": rng.standard_normal((32, 8)).astype(np.float32) / 4}


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Repository:
    """A repository with the MLP bundle (16 -> 32 -> 8, batch sizes 1 and 8) and a broken model."""
    import kcoral

    root = tmp_path_factory.mktemp("models")
    params = mlp_params(7)
    kcoral.export_bundle(mlp, params, np.zeros((1, 16), np.float32), dir=str(root / "mlp"),
                         name="mlp", batch_sizes=[1, 8])
    (root / "broken").mkdir()
    (root / "broken" / "model.json").write_text("{this is not JSON")
    return Repository(str(root), params)


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)


# -- clients (blocking: each call runs in a thread) -----------------------------------------

def http_infer(address: str, x: np.ndarray, binary: bool, model: str = "mlp") -> np.ndarray:
    client = httpclient.InferenceServerClient(address, network_timeout=60)
    try:
        given = httpclient.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x, binary_data=binary)
        wanted = httpclient.InferRequestedOutput("output", binary_data=binary)
        return client.infer(model, [given], outputs=[wanted]).as_numpy("output")
    finally:
        client.close()


def grpc_infer(address: str, x: np.ndarray, model: str = "mlp") -> np.ndarray:
    client = grpcclient.InferenceServerClient(address)
    try:
        given = grpcclient.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        return client.infer(model, [given], client_timeout=60).as_numpy("output")
    finally:
        client.close()


def http_checks(address: str) -> dict:
    """What tritonclient.http reads of a front, by call."""
    client = httpclient.InferenceServerClient(address, network_timeout=60)
    try:
        return {"live": client.is_server_live(), "ready": client.is_server_ready(),
                "server": client.get_server_metadata(),
                "metadata": client.get_model_metadata("mlp"),
                "config": client.get_model_config("mlp"),
                "model_ready": client.is_model_ready("mlp"),
                "index": client.get_model_repository_index()}
    finally:
        client.close()


def grpc_checks(address: str) -> dict:
    """What tritonclient.grpc reads of a front, by call (as JSON)."""
    client = grpcclient.InferenceServerClient(address)
    try:
        return {"live": client.is_server_live(), "ready": client.is_server_ready(),
                "server": client.get_server_metadata(as_json=True),
                "metadata": client.get_model_metadata("mlp", as_json=True),
                "config": client.get_model_config("mlp", as_json=True)["config"],
                "model_ready": client.is_model_ready("mlp"),
                "index": client.get_model_repository_index(as_json=True).get("models", [])}
    finally:
        client.close()


def grpc_error(address: str, model: str, x: np.ndarray, name: str = "input",
               datatype: str = "FP32") -> InferenceServerException:
    client = grpcclient.InferenceServerClient(address)
    try:
        given = grpcclient.InferInput(name, list(x.shape), datatype)
        given.set_data_from_numpy(x)
        client.infer(model, [given], client_timeout=60)
    except InferenceServerException as e:
        return e
    finally:
        client.close()
    raise AssertionError(f"{model} {name} {x.shape} {datatype}: no error")


def grpc_control(address: str, verb: str, model: str) -> tuple[str, str] | None:
    """Load or unload over gRPC; the error's status and message, None when it succeeded."""
    client = grpcclient.InferenceServerClient(address)
    try:
        getattr(client, f"{verb}_model")(model)
    except InferenceServerException as e:
        return str(e.status()), e.message()
    finally:
        client.close()
    return None


def check_http_reads(got: dict, *, broken: bool = True) -> None:
    assert got["live"] is True and got["ready"] is True and got["model_ready"] is True
    assert got["server"]["name"] == "kcoral"
    metadata = got["metadata"]
    assert metadata["name"] == "mlp"
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
        ("input", "FP32", [-1, 16])]
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["outputs"]] == [
        ("output", "FP32", [-1, 8])]
    config = got["config"]
    assert config["name"] == "mlp" and config["max_batch_size"] == 8
    assert [(t["name"], t["data_type"], list(t["dims"])) for t in config["input"]] == [
        ("input", "TYPE_FP32", [16])]
    check_index(got["index"], broken=broken)


def check_index(index: list, *, broken: bool = True) -> None:
    by_name = {entry["name"]: entry for entry in index}
    assert by_name["mlp"]["state"] == "READY", index
    if broken:
        assert by_name["broken"]["state"] == "UNAVAILABLE", index
        assert "model.json" in by_name["broken"].get("reason", ""), index


def check_grpc_reads(got: dict) -> None:
    assert got["live"] is True and got["ready"] is True and got["model_ready"] is True
    assert got["server"]["name"] == "kcoral"
    metadata = got["metadata"]
    assert metadata["name"] == "mlp"
    assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]])
            for t in metadata["inputs"]] == [("input", "FP32", [-1, 16])]
    config = got["config"]
    assert config["name"] == "mlp" and int(config["max_batch_size"]) == 8
    assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["input"]] == [
        ("input", "TYPE_FP32", [16])]
    assert {m["name"]: m.get("state") for m in got["index"]}["mlp"] == "READY", got["index"]


async def check_inferences(repository: Repository, http: str, grpc: str) -> None:
    """JSON and binary REST and gRPC inferences of 3 and 8 rows equal the MLP run here."""
    for n in ROWS:
        x = rows(n, seed=n)
        expected = repository.expected(x)
        for binary in (False, True):
            got = await deferToThread(http_infer, http, x, binary)
            assert got.shape == (n, 8) and got.dtype == np.float32
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        got = await deferToThread(grpc_infer, grpc, x)
        assert got.shape == (n, 8) and got.dtype == np.float32
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def total(samples: dict, name: str, **labels) -> float:
    """The sum of C{name}'s samples whose labels include C{labels}."""
    return sum(value for (n, keys), value in samples.items()
               if n == name and set(labels.items()) <= set(keys))


async def grpc_address(child: ChildProcess) -> str:
    found = await child.wait_for_line(GRPC, START_TIMEOUT)
    return f"127.0.0.1:{found.group('port')}"


async def start_grpc_front(group, kind: str, args: list[str], argv=kcoral_argv
                           ) -> tuple[str, str, ChildProcess]:
    """C{kcoral ARGS} (the command line C{argv(*ARGS)}) as a standalone
    server (C{kind} "server") or as a node's gateway before two CPU workers
    ("gateway"), in C{group}: its gRPC address, its URL and its process,
    once it is ready."""
    if kind == "server":
        service = await group.start_service(args, name="server", ready=SERVER_READY,
                                            env=server_env(), argv=argv)
        return await grpc_address(service.process), service.url, service.process
    child = group.spawn(argv(*args, "--cpu-workers", "2", "--health-interval-seconds", "0.5"),
                        name="node", env=server_env())
    url = (await child.wait_for_line(GATEWAY, START_TIMEOUT)).group("url")
    address = await grpc_address(child)

    async def ready():
        return (await request("GET", url + "/readyz", timeout=10)).code == 200 or None
    await until(ready, "the gateway ready", START_TIMEOUT)
    return address, url, child


def infer_body(name: str = "input", shape=(1, 16), datatype: str = "FP32", data=None) -> bytes:
    count = int(np.prod(shape))
    return json.dumps({"id": "req-7", "inputs": [{
        "name": name, "shape": list(shape), "datatype": datatype,
        "data": data if data is not None else [0.5] * count}]}).encode()


@attrs.frozen
class Merged:
    """Requests sent one at a time, then all at once, to a front."""

    alone: list        # each request's outputs, sent alone
    together: list     # each request's outputs, sent with the others
    refused: list      # the answers to the bad requests sent with the others
    executions: float  # the executions of the model the workers ran for them
    rows: float        # the rows of those executions


async def alone_then_together(url: str, inputs: list, bad: tuple[bytes, ...] = ()) -> Merged:
    """Infer each of C{inputs} alone, then all of them (and the bodies C{bad}) at once."""
    from kcoral import AsyncClient

    client = AsyncClient(url)
    try:
        alone = [await client.infer("mlp", x) for x in inputs]
        _, before = await scrape(url)
        refusals = [Deferred.fromCoroutine(request("POST", url + "/v2/models/mlp/infer",
                                                   body=body)) for body in bad]
        together = await gatherResults([client.infer("mlp", x, request_id=f"together-{i}")
                                        for i, x in enumerate(inputs)])
        refused = await gatherResults(refusals)
        _, after = await scrape(url)
    finally:
        await client.close()

    def added(name: str) -> float:
        return total(after, name, model="mlp") - total(before, name, model="mlp")
    return Merged(alone, together, refused, added("kcoral_inference_batch_size_count"),
                  added("kcoral_inference_batch_size_sum"))


def model_health(health: dict) -> dict:
    """The /health entry of model mlp."""
    return {model["name"]: model for model in health["models"]}["mlp"]


# -- a standalone server ----------------------------------------------------------------------

@attrs.define
class Front:
    url: str       # http://host:port
    grpc: str      # host:port
    process: ChildProcess

    @property
    def http(self) -> str:
        return self.url.split("://", 1)[1]


@pytest_twisted.async_fixture(scope="module")
async def server(module_processes, repository) -> Front:
    service = await module_processes.start_service(
        server_args("--model-repository", repository.path, "--grpc-port", "0"),
        name="server", ready=SERVER_READY, env=server_env(), timeout=START_TIMEOUT)
    return Front(service.url, await grpc_address(service.process), service.process)


@pytest_twisted.async_fixture(scope="module")
async def invariant_server(module_processes, repository) -> str:
    """A standalone server started with --batch-invariant: its URL."""
    service = await module_processes.start_service(
        server_args("--model-repository", repository.path, "--batch-invariant"),
        name="invariant-server", ready=SERVER_READY, env=server_env(), timeout=START_TIMEOUT)
    assert service.process.matching(r"model mlp version 1 is ready, batch-invariant"), service.process.tail()
    return service.url


@pytest_twisted.ensureDeferred
async def test_server_reads_and_infers(server, repository):
    """A standalone server answers tritonclient's reads and inferences (REST JSON and binary,
    gRPC) equal to the MLP, compiled before it was ready, counted by model."""
    ready = await request("GET", server.url + "/readyz")
    assert ready.code == 200
    health = (await request("GET", server.url + "/health")).json
    check_index(health["models"])
    check_http_reads(await deferToThread(http_checks, server.http))
    check_grpc_reads(await deferToThread(grpc_checks, server.grpc))
    _, before = await scrape(server.url)
    compiles = total(before, "kcoral_compile_seconds_count")
    assert compiles >= 1  # both batch sizes compiled before /readyz said 200
    await check_inferences(repository, server.http, server.grpc)
    _, after = await scrape(server.url)
    assert total(after, "kcoral_compile_seconds_count") == compiles
    counted = (total(after, "kcoral_inference_requests_total", model="mlp")
               - total(before, "kcoral_inference_requests_total", model="mlp"))
    assert counted == 3 * len(ROWS), counted
    # The broken model is logged with its reason, and is not ready; mlp serves anyway.
    assert server.process.matching(r"broken.*model\.json"), server.process.tail()
    assert (await request("GET", server.url + "/v2/models/broken/ready")).code != 200
    # A valid REST inference echoes the request's id.
    answer = await request("POST", server.url + "/v2/models/mlp/infer", body=infer_body(),
                           headers={"Content-Type": "application/json"})
    assert answer.code == 200, answer
    assert answer.json["id"] == "req-7" and answer.request_id
    [output] = answer.json["outputs"]
    assert output["name"] == "output" and output["shape"] == [1, 8]
    np.testing.assert_allclose(np.asarray(output["data"], np.float32).reshape(1, 8),
                               repository.expected(np.full((1, 16), 0.5, np.float32)),
                               rtol=1e-5, atol=1e-6)


BAD_REQUESTS = [
    ("wrong input name", "mlp", infer_body(name="x"), 400),
    ("wrong shape", "mlp", infer_body(shape=(2, 15)), 400),
    ("batch over max_batch_size", "mlp", infer_body(shape=(9, 16)), 400),
    ("FP64 for an FP32 input", "mlp", infer_body(datatype="FP64"), 400),
    ("unknown model", "nope", infer_body(), 404),
]


def concurrent_rows(seed: int, count: int) -> list:
    """The inputs of C{count} clients, each with rows of its own (1 to 3 of them)."""
    return [rows(1 + i % 3, seed=seed + i) for i in range(count)]


def check_batched(merged: Merged, inputs: list) -> None:
    """Every row of C{inputs} ran, in fewer executions than requests."""
    assert merged.rows == sum(len(x) for x in inputs)
    assert merged.executions < len(inputs), merged.executions


@pytest_twisted.ensureDeferred
async def test_concurrent_inferences_are_batched_and_each_gets_its_own_rows(server):
    """Sixteen clients at once, each with rows of its own (1 to 3 of them): fewer executions
    than requests, and each answer equal to the same rows sent alone within the model's
    rounding; /health says the server is not batch invariant."""
    inputs = concurrent_rows(100, 16)
    merged = await alone_then_together(server.url, inputs)
    for one, batched in zip(merged.alone, merged.together):
        assert_within_rounding(batched["output"], one["output"])
    check_batched(merged, inputs)
    health = (await request("GET", server.url + "/health")).json
    assert model_health(health)["batch_invariant"] is False


@pytest_twisted.ensureDeferred
async def test_batch_invariant_server_gives_each_row_the_bytes_it_gets_alone(invariant_server):
    """A server started with --batch-invariant batches sixteen clients at once and gives
    each the same bytes as its rows sent alone; its /health says so for the model."""
    inputs = concurrent_rows(100, 16)
    merged = await alone_then_together(invariant_server, inputs)
    for one, batched in zip(merged.alone, merged.together):
        assert one["output"].tobytes() == batched["output"].tobytes()
    check_batched(merged, inputs)
    health = (await request("GET", invariant_server + "/health")).json
    assert model_health(health)["batch_invariant"] is True


@pytest_twisted.ensureDeferred
async def test_server_refuses_bad_inferences(server, repository):
    """Bad inputs are 400 / INVALID_ARGUMENT, an unknown model 404 / NOT_FOUND in Triton's
    words, each with a request id and an {"error": message} body; the server stays ready."""
    for what, model, body, code in BAD_REQUESTS:
        answer = await request("POST", f"{server.url}/v2/models/{model}/infer", body=body,
                               headers={"Content-Type": "application/json"})
        assert answer.code == code, (what, answer)
        assert answer.request_id, (what, answer.headers)
        error = answer.json["error"]
        assert isinstance(error, str) and error, (what, answer.body)

    x = rows(1)
    cases = [("x", "mlp", x, "FP32", "INVALID_ARGUMENT"),
             ("input", "mlp", rows(2)[:, :15].copy(), "FP32", "INVALID_ARGUMENT"),
             ("input", "mlp", rows(9), "FP32", "INVALID_ARGUMENT"),
             ("input", "mlp", x.astype(np.float64), "FP64", "INVALID_ARGUMENT"),
             ("input", "nope", x, "FP32", "NOT_FOUND")]
    for name, model, data, datatype, status in cases:
        error = await deferToThread(grpc_error, server.grpc, model, data, name, datatype)
        assert status in str(error.status()), (name, model, data.shape, datatype, error)
    assert error.message().startswith("Request for unknown model: 'nope' is not found"), error

    ready = await request("GET", server.url + "/readyz")
    assert ready.code == 200
    got = await deferToThread(http_infer, server.http, x, True)
    np.testing.assert_allclose(got, repository.expected(x), rtol=1e-5, atol=1e-6)


@pytest_twisted.ensureDeferred
async def test_non_finite_floats_travel_in_binary_and_are_refused_in_json(server):
    """A NaN output asked for as JSON is 400 asking for binary, and comes back in binary; JSON
    inputs of NaN or 1e400 are 400; the server answers strict JSON and stays ready."""
    x = rows(1)
    x[0, 0] = np.nan  # binary input: NaN travels; the MLP's outputs all become NaN
    header = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                          "parameters": {"binary_data_size": x.nbytes}}]}
    for binary, code in ((False, 400), (True, 200)):
        header["parameters"] = {"binary_data_output": binary}
        text = json.dumps(header).encode()
        answer = await request("POST", f"{server.url}/v2/models/mlp/infer", body=text + x.tobytes(),
                               headers={"Content-Type": "application/octet-stream",
                                        "Inference-Header-Content-Length": str(len(text))})
        assert answer.code == code, answer
        if binary:
            length = int(answer.header("Inference-Header-Content-Length"))
            assert np.isnan(np.frombuffer(answer.body[length:], np.float32)).all()
        else:
            assert "ask for it as binary data" in answer.json["error"], answer
    for value in ("NaN", "1e400"):
        body = infer_body().replace(b"0.5]", value.encode() + b"]")
        answer = await request("POST", f"{server.url}/v2/models/mlp/infer", body=body,
                               headers={"Content-Type": "application/json"})
        assert answer.code == 400 and answer.request_id, (value, answer)
    assert (await request("GET", server.url + "/readyz")).code == 200


@pytest_twisted.ensureDeferred
async def test_counts_that_int_would_take_are_refused(server):
    """An Inference-Header-Content-Length of 1_0 or +10 is 400, a version of other digits than
    ASCII's or that int() would read (1_0, +1) refused with 400, never read as a number; the
    server stays ready."""
    text = infer_body()
    for length in ("1_0", "+10", "١٠"):
        answer = await request("POST", f"{server.url}/v2/models/mlp/infer", body=text,
                               headers={"Content-Type": "application/json",
                                        "Inference-Header-Content-Length": length})
        assert answer.code == 400 and "count of bytes" in answer.json["error"], (length, answer)
    # Superscript one and Arabic-Indic one: no path may hold them (400, the
    # canonical path's refusal); ASCII that int() would read: no version
    # string Triton takes (400, in its words).
    for version, code in (("%C2%B9", 400), ("%D9%A1", 400), ("1_0", 400), ("+1", 400)):
        answer = await request("GET", f"{server.url}/v2/models/mlp/versions/{version}")
        assert answer.code == code, (version, answer)
        if version.isascii() and not version.startswith("%"):
            assert "failed to get model version" in answer.json["error"], (version, answer)
    assert (await request("GET", server.url + "/v2/models/mlp/versions/1")).code == 200
    assert (await request("GET", server.url + "/readyz")).code == 200


async def check_refused_at_once(front: Front) -> None:
    """
    The broken model is refused at once on every path, with its state and
    reason: REST 400 (no Retry-After), gRPC FAILED_PRECONDITION, and
    C{Client.infer} a L{BadRequest} naming its request; an unknown model is
    C{NotFound} (404) with its request id, in Triton's words.
    """
    from kcoral import AsyncClient, BadRequest, NotFound, ServerBusy

    started = time.monotonic()
    refused = await request("POST", front.url + "/v2/models/broken/infer", body=infer_body(),
                            headers={"Content-Type": "application/json"})
    assert refused.code == 400 and refused.request_id, refused
    message = refused.json["error"]
    assert "'broken'" in message and "UNAVAILABLE" in message and "model.json" in message, message
    assert not refused.headers.getRawHeaders(b"Retry-After"), refused
    error = await deferToThread(grpc_error, front.grpc, "broken", rows(1))
    assert "FAILED_PRECONDITION" in str(error.status()), error
    assert "UNAVAILABLE" in error.message() and "model.json" in error.message(), error

    client = AsyncClient(front.url)
    try:
        with pytest.raises(BadRequest) as failed:
            await client.infer("broken", rows(1))
        assert not isinstance(failed.value, ServerBusy)
        assert failed.value.status == 400 and failed.value.request_id, failed.value
        assert "model.json" in str(failed.value) and failed.value.request_id in str(failed.value)
        with pytest.raises(NotFound) as unknown:
            await client.infer("nope", rows(1), request_id="unknown-1")
        assert unknown.value.status == 404 and unknown.value.request_id == "unknown-1"
        assert unknown.value.message == "Request for unknown model: 'nope' is not found"
    finally:
        await client.close()
    # Nothing waited in a queue or for a retry.
    assert time.monotonic() - started < 20


def grpc_statistics(address: str, model: str) -> dict:
    client = grpcclient.InferenceServerClient(address)
    try:
        return client.get_inference_statistics(model, as_json=True)
    finally:
        client.close()


async def check_statistics(front: Front) -> dict:
    """
    Two inferences of 3 rows through C{front} count 6 rows and 2 successes,
    each with its queue and compute times, in Triton's form, read by
    C{Client.model_statistics} and by tritonclient over gRPC; the list of
    every model's holds mlp and not the broken model. The statistics after.
    """
    from kcoral import AsyncClient

    client = AsyncClient(front.url)
    try:
        [before] = (await client.model_statistics("mlp"))["model_stats"]
        for seed in (1, 2):
            await client.infer("mlp", rows(3, seed=seed))
        [after] = (await client.model_statistics("mlp"))["model_stats"]
        every = await client.model_statistics()
    finally:
        await client.close()
    assert (after["name"], after["version"]) == ("mlp", "1")
    assert after["inference_count"] - before["inference_count"] == 6
    assert 1 <= after["execution_count"] - before["execution_count"] <= 2
    stats, was = after["inference_stats"], before["inference_stats"]
    for duration in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert stats[duration]["count"] - was[duration]["count"] == 2, (duration, before, after)
    assert stats["success"]["ns"] - was["success"]["ns"] \
        >= stats["compute_infer"]["ns"] - was["compute_infer"]["ns"] > 0
    assert after["last_inference"] >= before["last_inference"] and after["last_inference"] > 0
    assert any(b["batch_size"] == 3 for b in after["batch_stats"]), after["batch_stats"]
    assert [m["name"] for m in every["model_stats"]] == ["mlp"], every
    [by_grpc] = (await deferToThread(grpc_statistics, front.grpc, "mlp"))["model_stats"]
    assert int(by_grpc["inference_count"]) >= after["inference_count"], (by_grpc, after)
    server = await request("GET", front.url + "/v2")
    assert "statistics" in server.json["extensions"], server.json
    return after


@pytest_twisted.ensureDeferred
async def test_server_counts_statistics(server):
    """A standalone server counts each model's statistics where it runs them."""
    await check_statistics(server)


@pytest_twisted.ensureDeferred
async def test_statistics_read_while_an_inference_waits_have_equal_compute_counts(
        module_processes, repository):
    """Statistics read while an inference waits for its batch count as many
    compute inputs as executions and outputs (perf_analyzer refuses others)."""
    from kcoral import AsyncClient

    service = await module_processes.start_service(
        server_args("--model-repository", repository.path,
                    "--max-batch-delay-microseconds", "1500000"),
        name="slow-batch-server", ready=SERVER_READY, env=server_env(), timeout=START_TIMEOUT)
    client = AsyncClient(service.url)
    try:
        answer = client.infer("mlp", rows(1))
        snapshots = []
        while not answer.called:
            [stats] = (await client.model_statistics("mlp"))["model_stats"]
            snapshots.append({d: stats["inference_stats"][d]["count"]
                              for d in ("compute_input", "compute_infer", "compute_output")})
        await answer
        [stats] = (await client.model_statistics("mlp"))["model_stats"]
    finally:
        await client.close()
    assert len(snapshots) > 1, snapshots
    assert all(len(set(counts.values())) == 1 for counts in snapshots), snapshots
    assert stats["inference_stats"]["compute_input"]["count"] == 1, stats


@pytest_twisted.ensureDeferred
async def test_server_refuses_a_broken_model_at_once(server):
    """A standalone server refuses a model that failed to load at once, with its reason."""
    await check_refused_at_once(server)


# -- a node of two CPU workers, from a node file ----------------------------------------------

@attrs.define
class NodeFront(Front):
    workers: int = 2


async def start_node(module_processes, path, settings: dict, name: str) -> NodeFront:
    """A node of two CPU workers from a node file of C{settings}, written at C{path}."""
    path.write_text(yaml.safe_dump({"host": "127.0.0.1", "gpus": "none", "cpu_workers": 2,
                                    **settings}))
    child = module_processes.spawn(kcoral_argv("server", "--config", str(path), "--port", "0",
                                    "--grpc-port", "0", "--health-interval-seconds", "0.5"),
                        name=name, env=server_env())
    try:
        url = (await child.wait_for_line(GATEWAY, START_TIMEOUT)).group("url")
        for i in range(2):
            await child.wait_for_line(rf"worker{i} is ready at ", START_TIMEOUT)
        grpc = await grpc_address(child)

        async def ready():
            return (await request("GET", url + "/readyz", timeout=10)).code == 200
        await until(ready, "the gateway ready", 60)
    except Exception:
        await child.stop()
        raise
    return NodeFront(url, grpc, child)


@pytest_twisted.async_fixture(scope="module")
async def node(module_processes, repository, tmp_path_factory) -> NodeFront:
    """A node of two CPU workers whose node file names the repository with C{model_repo}."""
    return await start_node(module_processes, tmp_path_factory.mktemp("node") / "node.yaml",
                            {"model_repo": repository.path}, "node")


@pytest_twisted.async_fixture(scope="module")
async def invariant_node(module_processes, repository, tmp_path_factory) -> NodeFront:
    """A node of two CPU workers whose node file says C{batch_invariant: true}."""
    return await start_node(module_processes, tmp_path_factory.mktemp("inode") / "node.yaml",
                            {"model_repo": repository.path, "batch_invariant": True},
                            "invariant-node")


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_node_serves_models_through_its_gateway(node, repository):
    """A two-worker node (node file key model_repo) is ready on its gateway and each worker,
    infers through the gateway over REST and gRPC, and merges every worker's metrics."""
    health = (await request("GET", node.url + "/health", timeout=10)).json
    workers = {w["name"]: w["url"] for w in health["workers"]}
    assert sorted(workers) == ["worker0", "worker1"], health
    for name, url in workers.items():
        answer = await request("GET", url + "/readyz", timeout=10)
        assert answer.code == 200, (name, answer)
        index = await request("POST", url + "/v2/repository/index", body=b"{}")
        assert index.code == 200, (name, index)
        check_index(index.json)
    assert (await request("GET", node.url + "/readyz")).code == 200

    check_http_reads(await deferToThread(http_checks, node.http))
    check_grpc_reads(await deferToThread(grpc_checks, node.grpc))
    await check_inferences(repository, node.http, node.grpc)

    text, samples = await scrape(node.url)
    assert 'worker="worker0"' in text and 'worker="worker1"' in text
    assert total(samples, "kcoral_inference_requests_total", model="mlp") >= 3 * len(ROWS)


#: Requests that cannot merge with the others: more rows than a batch, another datatype.
UNMERGEABLE = (infer_body(shape=(9, 16)), infer_body(datatype="FP64"))


@pytest_twisted.ensureDeferred
async def test_gateway_merges_concurrent_inferences_and_each_gets_its_own_rows(node):
    """Thirty-two clients at once through the gateway, each with rows of its own, and
    among them requests that cannot merge (more rows than a batch, another datatype):
    each good answer equal to its rows sent alone within the model's rounding, each bad
    one its own 400, and the workers ran fewer executions than requests."""
    inputs = concurrent_rows(200, 32)
    merged = await alone_then_together(node.url, inputs, UNMERGEABLE)
    for one, batched in zip(merged.alone, merged.together):
        assert_within_rounding(batched["output"], one["output"])
    assert [answer.code for answer in merged.refused] == [400, 400], merged.refused
    assert merged.executions < len(inputs), merged.executions


@pytest_twisted.ensureDeferred
async def test_batch_invariant_gateway_gives_each_row_the_bytes_it_gets_alone(invariant_node):
    """Through the gateway of a node whose node file says batch_invariant, thirty-two
    clients at once (and two requests that cannot merge) are merged into fewer executions,
    and each good answer is the same bytes as its rows sent alone; each worker's /health
    says the model is batch invariant."""
    inputs = concurrent_rows(200, 32)
    merged = await alone_then_together(invariant_node.url, inputs, UNMERGEABLE)
    for one, batched in zip(merged.alone, merged.together):
        assert one["output"].tobytes() == batched["output"].tobytes()
    assert [answer.code for answer in merged.refused] == [400, 400], merged.refused
    assert merged.executions < len(inputs), merged.executions
    health = (await request("GET", invariant_node.url + "/health", timeout=10)).json
    for worker in health["workers"]:
        answer = (await request("GET", worker["url"] + "/health", timeout=10)).json
        assert model_health(answer)["batch_invariant"] is True, worker


@pytest_twisted.ensureDeferred
async def test_gateway_sums_its_workers_statistics(node):
    """The gateway's statistics of a model are the sum of its workers' own."""
    await check_statistics(node)
    health = (await request("GET", node.url + "/health", timeout=10)).json
    workers = [(await request("GET", w["url"] + "/v2/models/mlp/stats")).json["model_stats"][0]
               for w in health["workers"]]
    [total] = (await request("GET", node.url + "/v2/models/mlp/stats")).json["model_stats"]
    assert total["inference_count"] == sum(w["inference_count"] for w in workers) > 0
    assert total["inference_stats"]["success"] == {
        "count": sum(w["inference_stats"]["success"]["count"] for w in workers),
        "ns": sum(w["inference_stats"]["success"]["ns"] for w in workers)}
    assert total["last_inference"] == max(w["last_inference"] for w in workers)


@pytest_twisted.ensureDeferred
async def test_gateway_refuses_a_broken_model_at_once_and_logs_a_refusal_once(node):
    """The gateway refuses a model every worker failed to load at once, with its reason;
    a request a worker refuses is logged once by the worker and once by the gateway."""
    await check_refused_at_once(node)
    answer = await request("POST", node.url + "/v2/models/mlp/infer",
                           body=infer_body(shape=(9, 16)),
                           headers={"Content-Type": "application/json", "X-Request-ID": "once-1"})
    assert answer.code == 400, answer
    await node.process.wait_for_line(r"\[worker\d\] .*once-1 answered 400", 30)
    gateway = [line for line in node.process.matching("once-1") if "[worker" not in line]
    assert len(gateway) == 1, node.process.matching("once-1")
    assert len(node.process.matching("once-1")) == 2, node.process.matching("once-1")


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_a_gateway_pays_the_batch_delay_once(module_processes, repository,
                                                   tmp_path_factory):
    """A lone inference through a node's gateway goes to a free worker and
    runs at once, without the workers' batch delay; sent straight to a
    worker, it waits the delay."""
    from kcoral import AsyncClient

    delay = 3.0
    slow = await start_node(module_processes, tmp_path_factory.mktemp("dnode") / "node.yaml",
                            {"model_repo": repository.path,
                             "max_batch_delay_microseconds": int(delay * 1e6)}, "delay-node")
    health = (await request("GET", slow.url + "/health", timeout=10)).json
    worker = health["workers"][0]["url"]
    taken = {}
    for url in (slow.url, worker):
        client = AsyncClient(url)
        try:
            started = time.monotonic()
            await client.infer("mlp", rows(1))
            taken[url] = time.monotonic() - started
        finally:
            await client.close()
    assert taken[slow.url] < delay / 2 <= delay <= taken[worker], taken


@pytest_twisted.ensureDeferred
async def test_node_exits_0_on_sigterm(node):
    """SIGTERM to a node serving models drains it, exits with status 0 and leaves no worker."""
    node.process.signal("TERM")
    assert await node.process.exited(60) == 0, node.process.tail()
    assert node.process.output.exit_signal is None
    await assert_reaped([MultiNode(node.process, node.url, 2)])


# -- a Router in front of two nodes -----------------------------------------------------------

@attrs.define
class Routed:
    router: Front
    nodes: dict


@pytest_twisted.async_fixture(scope="module")
async def routed(module_processes, repository, tmp_path_factory) -> Routed:
    """A Router (with gRPC) and two nodes: n0 given the repository on its command line, n1 in
    its node file (key model_repository)."""
    path = tmp_path_factory.mktemp("n1") / "node.yaml"
    path.write_text(yaml.safe_dump({"model_repository": repository.path}))
    router = await start_router(module_processes, "--grpc-port", "0")
    nodes = await gatherResults([
        Deferred.fromCoroutine(start_routed_node(module_processes, router.url, node_id, *extra))
        for node_id, extra in (("n0", ("--model-repository", repository.path)),
                               ("n1", ("--config", str(path))))], consumeErrors=True)
    await until_ready(router, "n0", "n1", timeout=START_TIMEOUT)
    return Routed(Front(router.url, await grpc_address(router.process), router.process),
                  {n.node_id: n for n in nodes})


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_router_serves_models_of_its_nodes(routed, repository):
    """A Router with two nodes lists their models, infers through them over REST and gRPC
    equal to the MLP, and answers 404 for a model no node has, in Triton's words."""
    router = routed.router

    async def both_ready():
        health = (await request("GET", router.url + "/health", timeout=10)).json
        return health if health["nodes"]["ready"] == 2 else None
    await until(both_ready, "the Router's /health: 2 ready nodes", 60)

    answer = await request("GET", router.url + "/v1/nodes", timeout=10)
    assert answer.code == 200
    assert sorted(node["node_id"] for node in answer.json["nodes"]) == ["n0", "n1"]
    for node in answer.json["nodes"]:
        for worker in node["workers"]:
            states = {m["name"]: m["state"] for m in worker["models"]}
            assert states.get("mlp") == "READY" and states.get("broken") == "UNAVAILABLE", worker

    index = await request("POST", router.url + "/v2/repository/index", body=b"{}")
    assert index.code == 200, index
    check_index(index.json)

    check_http_reads(await deferToThread(http_checks, router.http))
    check_grpc_reads(await deferToThread(grpc_checks, router.grpc))
    await check_inferences(repository, router.http, router.grpc)

    missing = await request("POST", router.url + "/v2/models/nope/infer", body=infer_body(),
                            headers={"Content-Type": "application/json"})
    assert missing.code == 404 and missing.request_id, missing
    assert missing.json["error"] == "Request for unknown model: 'nope' is not found", missing
    error = await deferToThread(grpc_error, router.grpc, "nope", rows(1))
    assert "NOT_FOUND" in str(error.status()), error
    assert error.message().startswith("Request for unknown model: 'nope' is not found"), error
    # A member's 400 reaches the client as it is.
    over = await request("POST", router.url + "/v2/models/mlp/infer",
                         body=infer_body(shape=(9, 16)), headers={"Content-Type": "application/json"})
    assert over.code == 400 and over.request_id, over
    error = await deferToThread(grpc_error, router.grpc, "mlp", rows(9))
    assert "INVALID_ARGUMENT" in str(error.status()), error
    # Every member says "broken" failed to load: refused at once, not queued (below).
    await check_refused_at_once(router)
    await check_statistics(router)
    assert (await request("GET", router.url + "/readyz")).code == 200


@pytest_twisted.ensureDeferred
async def test_a_node_serving_another_mlp_is_refused_under_one_router(routed, repository,
                                                                        module_processes, tmp_path):
    """A third node whose mlp has another signature has it refused: logged, unavailable with
    the reason on its worker, said in the index, and every inference lands where it fits."""
    import kcoral

    router = routed.router
    other = tmp_path / "models"
    kcoral.export_bundle(lambda p, x: x @ p["w"], {"w": np.ones((12, 4), np.float32)},
                         np.zeros((1, 12), np.float32), dir=str(other / "mlp"), name="mlp",
                         batch_sizes=[1])
    mark = router.process.mark()
    late = await start_routed_node(module_processes, router.url, "n2",
                                   "--model-repository", str(other))
    try:
        await router.process.wait_for_line(
            r"model mlp version 1 refused: n2/worker0 serves another model", 60, since=mark)

        async def refused_on_n2():
            nodes = {n["node_id"]: n for n in
                     (await request("GET", router.url + "/v1/nodes", timeout=10)).json["nodes"]}
            [model] = nodes["n2"]["workers"][0]["models"] if "n2" in nodes else [None]
            return model if model and model["state"] == "UNAVAILABLE" else None
        model = await until(refused_on_n2, "n2's mlp unavailable at the Router", 60)
        assert "n2/worker0 serves another model named mlp" in model["reason"], model

        index = await request("POST", router.url + "/v2/repository/index", body=b"{}")
        mlp = {entry["name"]: entry for entry in index.json}["mlp"]
        assert mlp["state"] == "READY" and mlp["reason"] == model["reason"], index.json
        # Each inference fits the metadata the clients read: none reaches n2.
        for _ in range(8):
            x = rows(3)
            got = await deferToThread(http_infer, router.http, x, False)
            np.testing.assert_allclose(got, repository.expected(x), rtol=1e-5, atol=1e-6)
    finally:
        await late.process.stop()


async def test_router_applies_model_control_to_every_node(routed):
    """A load through the Router goes to every node's worker, and its refusal (400, gRPC
    INTERNAL, in Triton's words) names each one with its reason (these nodes load every
    model at start: no load on request)."""
    from kcoral import AsyncClient, BadRequest

    client = AsyncClient(routed.router.url)
    try:
        with pytest.raises(BadRequest) as refused:
            await client.load_model("mlp")
    finally:
        await client.close()
    message = str(refused.value)
    assert message.startswith("failed to load 'mlp' on 2 of 2 member(s)"), message
    assert "n0/worker0" in message and "n1/worker0" in message, message
    assert "--model-control-mode explicit" in message, message
    status, message = await deferToThread(grpc_control, routed.router.grpc, "load", "mlp")
    assert status == "StatusCode.INTERNAL" and message.startswith("failed to load 'mlp'"), message
