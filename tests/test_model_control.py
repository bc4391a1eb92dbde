"""
Model control with real processes and real JAX: a server and a node of two
CPU workers in C{--model-control-mode explicit}, loading and unloading
models on request (REST through C{Client}, and gRPC through tritonclient),
the gateway applying each request to both workers, a load with a
configuration, a failed load answered in Triton's words; the repository index of every model folder, loaded or
not, read when asked, as both of tritonclient's clients read it; a server
in poll mode following its repository as model folders come and go; and the
default mode, which refuses both.
"""

from __future__ import annotations

import os
import shutil

import attrs
import numpy as np
import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from tests.conftest import server_args, server_env
from tests.harness import SERVER_READY, kcoral_argv, until
from tests.httputil import request
from tests.test_models import (
    GATEWAY,
    START_TIMEOUT,
    grpc_address,
    grpc_control,
    infer_body,
    mlp,
    mlp_params,
    rows,
)

pytestmark = pytest.mark.integration

jax = pytest.importorskip("jax")
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")


@attrs.frozen
class Models:
    path: str
    params: dict
    #: A bundle of the model "other", outside the repository (for poll mode).
    spare: str


def export(folder: str, name: str, params: dict) -> None:
    import kcoral

    kcoral.export_bundle(mlp, params, np.zeros((1, 16), np.float32), dir=folder, name=name,
                         batch_sizes=[1, 8])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    """mlp and other (the same MLP, other weights) and a broken model; a spare bundle of other."""
    root = tmp_path_factory.mktemp("controlled")
    params = mlp_params(11)
    for name in ("mlp", "other"):
        export(str(root / name), name, params)
    (root / "broken").mkdir()
    (root / "broken" / "model.json").write_text("{not json")
    spare = tmp_path_factory.mktemp("spare") / "other"
    export(str(spare), "other", params)
    return Models(str(root), params, str(spare))


def states(index: list[dict]) -> dict[str, tuple[str, str]]:
    return {m["name"]: (m["state"], m.get("reason", "")) for m in index}


async def refused(url: str, model: str) -> str:
    """The message of an inference of C{model} refused at once with 400."""
    answer = await request("POST", f"{url}/v2/models/{model}/infer", body=infer_body(),
                           headers={"Content-Type": "application/json"})
    assert answer.code == 400, answer
    return answer.json["error"]


def triton_reads(url: str, grpc: str) -> dict:
    """What tritonclient's two clients read of a front: the repository index (name, version,
    state, reason), and the message of an inference of an unknown model."""
    from tritonclient.utils import InferenceServerException

    http = httpclient.InferenceServerClient(url.split("://", 1)[1])
    rpc = grpcclient.InferenceServerClient(grpc)
    x = httpclient.InferInput("input", [1, 16], "FP32")
    x.set_data_from_numpy(rows(1))
    given = grpcclient.InferInput("input", [1, 16], "FP32")
    given.set_data_from_numpy(rows(1))
    try:
        read = {"http": [(m["name"], m["version"], m["state"], m["reason"])
                         for m in http.get_model_repository_index()],
                # Its JSON leaves an empty reason out.
                "grpc": [(m["name"], m["version"], m["state"], m.get("reason", "")) for m in
                         rpc.get_model_repository_index(as_json=True)["models"]]}
        for name, client, tensor in (("http unknown", http, x), ("grpc unknown", rpc, given)):
            try:
                client.infer("nope", [tensor])
            except InferenceServerException as e:
                read[name] = e.message()
        return read
    finally:
        http.close()
        rpc.close()


async def check_explicit_control(url: str, grpc: str, models: Models) -> None:
    """Only --load-model's models at start; load, unload and their refusals, on every worker."""
    from kcoral import AsyncClient, BadRequest, NotFound

    x = rows(3, seed=5)
    expected = np.asarray(mlp(models.params, x))
    client = AsyncClient(url)
    try:
        at_start = states(await client.models())
        assert at_start["mlp"][0] == "READY" and at_start["other"] == ("UNAVAILABLE", "not loaded")
        assert "not loaded" in await refused(url, "other")
        await check_triton_reads(url, grpc, models)
        await check_configured_load(url, grpc, models)

        loaded = await client.load_model("other")
        assert {m["state"] for m in loaded["models"]} == {"READY"}, loaded
        # At once, on every worker: a few inferences, whichever worker takes each.
        for _ in range(6):
            got = await client.infer("other", x)
            np.testing.assert_allclose(got["output"], expected, rtol=1e-5, atol=1e-6)

        unloaded = await client.unload_model("other")
        assert {m["state"] for m in unloaded["models"]} == {"UNAVAILABLE"}, unloaded
        for _ in range(3):
            assert "unloaded" in await refused(url, "other")

        with pytest.raises(BadRequest, match="model.json") as broken:
            await client.load_model("broken")
        assert str(broken.value).startswith("failed to load 'broken'"), broken.value
        with pytest.raises(BadRequest) as unknown:
            await client.load_model("nope")
        assert unknown.value.status == 400 and not isinstance(unknown.value, NotFound)
        assert str(unknown.value).startswith("failed to load 'nope'"), unknown.value
        assert "no such model in the repository" in str(unknown.value)
        assert states(await client.models())["mlp"][0] == "READY"
    finally:
        await client.close()
    assert await deferToThread(grpc_control, grpc, "load", "other") is None
    assert await deferToThread(grpc_control, grpc, "unload", "other") is None
    status, message = await deferToThread(grpc_control, grpc, "load", "nope")
    assert status == "StatusCode.INTERNAL" and message.startswith("failed to load 'nope'"), message


def configured_load(url: str, grpc: str, params: dict) -> dict:
    """
    Through tritonclient's clients: mlp loaded with a configuration of a larger
    max_batch_size (quoted, as Triton's example sends it) over REST and runs 16 rows;
    configurations that cannot load (invalid JSON over REST, another model's over gRPC)
    fail in Triton's words and leave it served as it was; loaded again without one over
    gRPC, it is as its bundle says. What each client read, by step.
    """
    from tritonclient.utils import InferenceServerException

    http = httpclient.InferenceServerClient(url.split("://", 1)[1])
    rpc = grpcclient.InferenceServerClient(grpc)
    read: dict = {}
    try:
        http.load_model("mlp", config='{"max_batch_size": "16"}')
        read["http config"] = http.get_model_config("mlp")
        read["grpc config"] = rpc.get_model_config("mlp", as_json=True)["config"]
        x = rows(16, seed=3)
        tensor = httpclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        np.testing.assert_allclose(http.infer("mlp", [tensor]).as_numpy("output"),
                                   np.asarray(mlp(params, x)), rtol=1e-5, atol=1e-6)
        for name, load in (("http invalid", lambda: http.load_model("mlp", config='{"max_')),
                           ("grpc other", lambda: rpc.load_model("mlp", config='{"name": "x"}'))):
            try:
                load()
            except InferenceServerException as e:
                read[name] = (str(e.status()), e.message())
        read["after"] = http.get_model_config("mlp")["max_batch_size"]
        rpc.load_model("mlp")
        read["again"] = rpc.get_model_config("mlp").config.max_batch_size
        return read
    finally:
        http.close()
        rpc.close()


async def check_configured_load(url: str, grpc: str, models: Models) -> None:
    """A load with a configuration is applied, shown by config, and refused when it cannot be
    honoured, the model served unchanged (L{configured_load})."""
    read = await deferToThread(configured_load, url, grpc, models.params)
    assert read["http config"]["max_batch_size"] == 16, read
    assert read["grpc config"]["max_batch_size"] == 16, read
    status, message = read["http invalid"]
    assert status == "400" and message.startswith("failed to load 'mlp'"), read
    assert "not JSON" in message, message
    status, message = read["grpc other"]
    assert status == "StatusCode.INTERNAL" and message.startswith("failed to load 'mlp'"), read
    assert "name 'x' is not the model's, 'mlp'" in message, message
    assert read["after"] == 16 and read["again"] == 8, read


async def check_triton_reads(url: str, grpc: str, models: Models) -> None:
    """
    The repository index of both of tritonclient's clients lists every model folder,
    loaded or not, each version with its state and reason, read when asked: a folder moved
    in is listed at once (not loaded), and leaves the index once removed. An unknown
    model's message starts with Triton's words.
    """
    read = await deferToThread(triton_reads, url, grpc)
    at_start = [("broken", "1", "UNAVAILABLE", "not loaded"), ("mlp", "1", "READY", ""),
                ("other", "1", "UNAVAILABLE", "not loaded")]
    assert read["http"] == read["grpc"] == at_start, read
    for front in ("http unknown", "grpc unknown"):
        assert read[front].startswith("Request for unknown model: 'nope' is not found"), read

    late = os.path.join(models.path, "late")
    shutil.copytree(models.spare, late)
    try:
        read = await deferToThread(triton_reads, url, grpc)
    finally:
        shutil.rmtree(late)
    assert read["http"] == read["grpc"] == sorted(
        [*at_start, ("late", "1", "UNAVAILABLE", "not loaded")]), read
    read = await deferToThread(triton_reads, url, grpc)
    assert read["http"] == read["grpc"] == at_start, read


@pytest_twisted.ensureDeferred
async def test_a_server_loads_and_unloads_models_on_request(processes, models):
    """A server in explicit mode serves --load-model's models, then loads and unloads on request."""
    service = await processes.start_service(
        server_args("--model-repository", models.path, "--grpc-port", "0",
                    "--model-control-mode", "explicit", "--load-model", "mlp"),
        name="server", ready=SERVER_READY, env=server_env(), timeout=START_TIMEOUT)
    await check_explicit_control(service.url, await grpc_address(service.process), models)
    server = await request("GET", service.url + "/v2")
    assert "model_repository" in server.json["extensions"]


async def start_explicit_node(processes, repository: str, *args: str):
    """
    A node of two CPU workers serving C{repository} in explicit model
    control, C{mlp} loaded at start, with C{args} besides: (its process, its
    gateway's URL, its gRPC address) once the gateway counts both workers
    healthy.
    """
    child = processes.spawn(kcoral_argv(
        "server", "--port", "0", "--grpc-port", "0", "--gpus", "none", "--cpu-workers", "2",
        "--health-interval-seconds", "0.5", "--model-repository", repository, *args,
        "--model-control-mode", "explicit", "--load-model", "mlp"), name="node", env=server_env())
    url = (await child.wait_for_line(GATEWAY, START_TIMEOUT)).group("url")
    for i in range(2):
        await child.wait_for_line(rf"worker{i} is ready at ", START_TIMEOUT)
    grpc = await grpc_address(child)

    async def ready():
        health = (await request("GET", url + "/health", timeout=10)).json
        return health["status"] == "ok" and all(w["healthy"] for w in health["workers"])
    await until(ready, "the gateway ready with both workers", 60)
    return child, url, grpc


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_a_node_loads_and_unloads_on_every_worker(processes, models):
    """Through a node's gateway, a load or unload applies to both workers before it answers."""
    child, url, grpc = await start_explicit_node(processes, models.path)
    await check_explicit_control(url, grpc, models)
    assert len(child.matching(r"\[worker\d\] .*model other is unloaded")) >= 2


@pytest_twisted.ensureDeferred
async def test_without_explicit_control_load_and_unload_are_refused(processes, models):
    """In the default mode every model is loaded, and load and unload are 400 naming the mode."""
    from kcoral import AsyncClient, BadRequest

    service = await processes.start_service(
        server_args("--model-repository", models.path), name="server", ready=SERVER_READY,
        env=server_env(), timeout=START_TIMEOUT)
    client = AsyncClient(service.url)
    try:
        assert states(await client.models())["other"][0] == "READY"
        for verb in ("load_model", "unload_model"):
            with pytest.raises(BadRequest, match="--model-control-mode explicit"):
                await getattr(client, verb)("other")
    finally:
        await client.close()


@pytest_twisted.ensureDeferred
async def test_poll_mode_follows_the_repository(processes, models, tmp_path):
    """In poll mode a model folder moved in is loaded and served; one removed is no longer listed."""
    from kcoral import AsyncClient

    repository = tmp_path / "repository"
    shutil.copytree(os.path.join(models.path, "mlp"), repository / "mlp")
    service = await processes.start_service(
        server_args("--model-repository", str(repository), "--model-control-mode", "poll",
                    "--repository-poll-seconds", "0.2"),
        name="server", ready=SERVER_READY, env=server_env(), timeout=START_TIMEOUT)
    client = AsyncClient(service.url)
    try:
        assert set(states(await client.models())) == {"mlp"}
        # Moved in whole: never a half-copied folder.
        shutil.copytree(models.spare, tmp_path / "staged")
        os.rename(tmp_path / "staged", repository / "other")

        async def listed(name: str, state: str | None):
            return states(await client.models()).get(name, (None,))[0] == state or None
        await until(lambda: listed("other", "READY"), "other loaded by the poll", 60)
        x = rows(2, seed=9)
        got = await client.infer("other", x)
        np.testing.assert_allclose(got["output"], np.asarray(mlp(models.params, x)),
                                   rtol=1e-5, atol=1e-6)
        shutil.rmtree(repository / "other")
        await until(lambda: listed("other", None), "other gone after the poll", 30)
    finally:
        await client.close()
