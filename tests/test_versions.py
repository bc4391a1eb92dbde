"""
Model versions: the layout and version policy read from a model folder
(numbered version folders, config.json), and, with real processes and real
JAX, a new version swapped in under a loop of inferences: no failed
request, each answer wholly one version's, traffic moving to the new
version only once it is ready.
"""

from __future__ import annotations

import json
import os
import shutil
import threading

import numpy as np
import pytest
import pytest_twisted
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.threads import deferToThread

from kcoral.models.versions import (
    VersionError,
    VersionPolicy,
    is_model,
    listed_versions,
    parse_policy,
    served_versions,
    stamp,
)
from tests.conftest import server_args, server_env
from tests.harness import SERVER_READY, kcoral_argv, until
from tests.httputil import request
from tests.test_models import GATEWAY, START_TIMEOUT, mlp, mlp_params, rows

httpclient = pytest.importorskip("tritonclient.http")


def bundle(folder, *versions: int) -> None:
    """Placeholder bundles (a model.json each) of C{versions} in C{folder}."""
    for version in versions:
        os.makedirs(os.path.join(folder, str(version)), exist_ok=True)
        with open(os.path.join(folder, str(version), "model.json"), "w") as f:
            f.write("{}")


@pytest.mark.parametrize("config, policy", [
    ({}, VersionPolicy()),
    ({"version_policy": {"latest": {"num_versions": 2}}}, VersionPolicy("latest", 2)),
    ({"version_policy": {"latest": {}}}, VersionPolicy("latest", 1)),
    ({"version_policy": {"all": {}}}, VersionPolicy("all")),
    ({"version_policy": {"specific": {"versions": [1, 3]}}},
     VersionPolicy("specific", versions=frozenset({1, 3}))),
    ({"max_batch_size": 8}, VersionPolicy()),
])
def test_version_policies(config, policy):
    """config.json's version_policy in Triton's three forms; without one, the latest version."""
    assert parse_policy(config) == policy


@pytest.mark.parametrize("config", [
    [], {"version_policy": {"latest": {"num_versions": 0}}}, {"version_policy": {"newest": {}}},
    {"version_policy": {"specific": {"versions": []}}},
    {"version_policy": {"specific": {"versions": ["1"]}}},
    {"version_policy": {"all": {}, "latest": {}}}, {"version_policy": {"all": {"x": 1}}},
])
def test_bad_version_policies_say_what_is_wanted(config):
    """A version_policy that is none of Triton's forms is refused, naming config.json."""
    with pytest.raises(VersionError, match="config.json"):
        parse_policy(config)


@given(st.sets(st.integers(1, 50), max_size=8), st.integers(1, 10),
       st.sets(st.integers(1, 50), min_size=1, max_size=5))
def test_each_policy_selects_among_what_there_is(available, count, specific):
    """latest N is the N highest, all is every one, specific those named that exist; lowest first."""
    ordered = sorted(available)
    assert VersionPolicy("latest", count).select(list(available)) == ordered[-count:]
    assert VersionPolicy("all").select(list(available)) == ordered
    assert VersionPolicy("specific", versions=frozenset(specific)).select(list(available)) \
        == sorted(available & specific)


def test_numbered_folders_and_their_policy(tmp_path):
    """Numbered folders holding a bundle are versions; config.json picks those served."""
    model = tmp_path / "m"
    bundle(model, 1, 2, 10)
    (model / "3").mkdir()  # no bundle: not a version
    (model / "notes").mkdir()
    assert is_model(str(model))
    assert served_versions(str(model)) == {10: str(model / "10")}
    (model / "config.json").write_text(json.dumps({"version_policy": {"all": {}}}))
    assert list(served_versions(str(model))) == [1, 2, 10]
    (model / "config.json").write_text(json.dumps({"version_policy": {"specific": {"versions": [7]}}}))
    with pytest.raises(VersionError, match="no version"):
        served_versions(str(model))


def test_a_plain_bundle_is_its_own_version(tmp_path):
    """A folder with its model.json directly in it is one version, the one its manifest says."""
    (tmp_path / "model.json").write_text("{}")
    assert served_versions(str(tmp_path)) == {None: str(tmp_path)}
    assert not is_model(str(tmp_path / "missing"))


@pytest.mark.parametrize("config, manifest, versions", [
    (None, None, [10]),
    ({"version_policy": {"all": {}}}, None, [1, 2, 10]),
    ({"version_policy": {"specific": {"versions": [7]}}}, None, [1]),
    ("{not json", None, [1]),
    (None, '{"version": 3}', [3]),
    (None, "{}", [1]),
    (None, '{"version": "3"}', [1]),
    (None, "[3", [1]),
])
def test_the_versions_listed_before_a_load(tmp_path, config, manifest, versions):
    """A model not loaded is listed with the versions a load would serve: its policy's among
    its numbered folders, or its one bundle's, as its manifest says; 1 where unreadable."""
    if manifest is None:
        bundle(tmp_path, 1, 2, 10)
    else:
        (tmp_path / "model.json").write_text(manifest)
    if config is not None:
        (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    assert listed_versions(str(tmp_path)) == versions


def test_the_stamp_changes_with_a_new_version_or_policy(tmp_path):
    """A new version folder, or a new config.json, changes the model's stamp."""
    bundle(tmp_path, 1)
    first = stamp(str(tmp_path))
    bundle(tmp_path, 2)
    second = stamp(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert len({first, second, stamp(str(tmp_path))}) == 3


# -- a version swapped in under load --------------------------------------------------------

def export(folder, params) -> None:
    import kcoral

    kcoral.export_bundle(mlp, params, np.zeros((1, 16), np.float32), dir=str(folder), name="mlp",
                         batch_sizes=[1, 8])


class Loop:
    """Inferences one after another, in a thread, until stopped: each
    answer's version and outputs, and every error."""

    def __init__(self, address: str, x: np.ndarray):
        self.address, self.x = address, x
        self.answers: list[tuple[str, np.ndarray]] = []
        self.errors: list[Exception] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        client = httpclient.InferenceServerClient(self.address, network_timeout=60)
        try:
            while not self.stopping.is_set():
                given = httpclient.InferInput("input", list(self.x.shape), "FP32")
                given.set_data_from_numpy(self.x, binary_data=True)
                try:
                    result = client.infer("mlp", [given])
                except Exception as e:
                    self.errors.append(e)
                    continue
                self.answers.append((result.get_response()["model_version"],
                                     result.as_numpy("output")))
        finally:
            client.close()


async def start_front(processes, repository, node: bool, health_seconds: float = 0.5) -> str:
    """A server, or a node of two workers probed every C{health_seconds}, in poll mode on
    C{repository}; its URL."""
    polled = ("--model-repository", str(repository), "--model-control-mode", "poll",
              "--repository-poll-seconds", "0.2")
    if not node:
        service = await processes.start_service(server_args(*polled), name="server",
                                                ready=SERVER_READY, env=server_env(),
                                                timeout=START_TIMEOUT)
        return service.url
    child = processes.spawn(kcoral_argv("server", "--port", "0", "--gpus", "none", "--cpu-workers",
                                        "2", "--health-interval-seconds", str(health_seconds),
                                        *polled),
                            name="node", env=server_env())
    url = (await child.wait_for_line(GATEWAY, START_TIMEOUT)).group("url")

    async def ready():
        return (await request("GET", url + "/v2/models/mlp/versions/1/ready")).code == 200 or None
    await until(ready, "version 1 ready through the gateway", START_TIMEOUT)
    return url


@pytest.mark.slow
@pytest.mark.parametrize("node", [False, True], ids=["server", "node"])
@pytest_twisted.ensureDeferred
async def test_a_new_version_takes_traffic_once_ready_with_no_failed_request(processes, tmp_path,
                                                                             node):
    """A server (or a node's gateway) in poll mode serving version 1 under a loop of
    inferences: version 2 moved in is loaded beside it; no request fails, each answer is
    wholly version 1's or 2's, and once version 2 answers, version 1 (the policy serves the
    latest) leaves the index. A server moves its traffic once, at a single point."""
    repository = tmp_path / "repository"
    old, new = mlp_params(1), mlp_params(2)
    export(repository / "mlp" / "1", old)
    export(tmp_path / "staged", new)
    url = await start_front(processes, repository, node)
    versioned = await request("GET", url + "/v2/models/mlp/versions/1/ready")
    assert versioned.code == 200

    x = rows(2, seed=3)
    expected = {"1": np.asarray(mlp(old, x)), "2": np.asarray(mlp(new, x))}
    loop = Loop(url.split("://", 1)[1], x)
    running = deferToThread(loop.run)
    try:
        await until(lambda: len(loop.answers) >= 5 or None, "answers of version 1", 60)
        os.rename(tmp_path / "staged", repository / "mlp" / "2")
        await until(lambda: any(v == "2" for v, _ in loop.answers[-3:]) or None,
                    "answers of version 2", 120)
        seen = len(loop.answers)
        await until(lambda: len(loop.answers) >= seen + 5 or None, "more answers", 60)
    finally:
        loop.stopping.set()
        await running
    assert not loop.errors, loop.errors[:3]
    versions = [v for v, _ in loop.answers]
    assert set(versions) == {"1", "2"}, versions
    if not node:
        # One worker moves its traffic once: every answer of version 1 comes first.
        assert versions == sorted(versions), versions
    for version, y in loop.answers:
        np.testing.assert_allclose(y, expected[version], rtol=1e-5, atol=1e-6)

    async def only_version_2():
        index = await request("POST", url + "/v2/repository/index", body=b"{}")
        listed = [(m["name"], m["version"], m["state"]) for m in index.json]
        return listed == [("mlp", "2", "READY")] or None
    await until(only_version_2, "version 2 alone in the index", 30)
    assert (await request("GET", url + "/v2/models/mlp/versions/2/ready")).code == 200
    assert (await request("GET", url + "/v2/models/mlp/versions/1/ready")).code != 200
    shutil.rmtree(repository)


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_a_gateways_index_is_never_older_than_its_answers(processes, tmp_path):
    """On a node of two workers in poll mode whose workers are probed only every 10 s, as
    soon as an inference answers from version 2 the gateway's index lists version 2 READY
    (each worker asked, not their last reports), and version 2 is ready there at once."""
    repository = tmp_path / "repository"
    export(repository / "mlp" / "1", mlp_params(1))
    export(tmp_path / "staged", mlp_params(2))
    url = await start_front(processes, repository, node=True, health_seconds=10)
    address = url.split("://", 1)[1]
    x = rows(1, seed=5)
    assert (await deferToThread(infer_version, address, x))[0] == "1"
    os.rename(tmp_path / "staged", repository / "mlp" / "2")

    async def answered_by_2():
        return (await deferToThread(infer_version, address, x))[0] == "2" or None
    await until(answered_by_2, "an answer of version 2", 120)
    index = await request("POST", url + "/v2/repository/index", body=b"{}")
    assert ("mlp", "2", "READY") in [(m["name"], m["version"], m["state"]) for m in index.json], \
        index.json
    assert (await request("GET", url + "/v2/models/mlp/versions/2/ready")).code == 200
    assert (await deferToThread(infer_version, address, x, "2"))[0] == "2"


def infer_version(address: str, x: np.ndarray, version: str = "") -> tuple[str, np.ndarray]:
    client = httpclient.InferenceServerClient(address, network_timeout=60)
    try:
        given = httpclient.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x, binary_data=True)
        result = client.infer("mlp", [given], model_version=version)
        return result.get_response()["model_version"], result.as_numpy("output")
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_every_version_of_an_all_policy_is_served_and_addressed(processes, tmp_path):
    """With version_policy all, both versions are listed and ready; a request without a
    version goes to the highest, one to /versions/1 to version 1."""
    repository = tmp_path / "repository"
    params = {"1": mlp_params(1), "2": mlp_params(2)}
    for version, weights in params.items():
        export(repository / "mlp" / version, weights)
    (repository / "mlp" / "config.json").write_text(json.dumps({"version_policy": {"all": {}}}))
    service = await processes.start_service(
        server_args("--model-repository", str(repository)), name="server", ready=SERVER_READY,
        env=server_env(), timeout=START_TIMEOUT)
    index = await request("POST", service.url + "/v2/repository/index", body=b"{}")
    assert [(m["version"], m["state"]) for m in index.json] == [("1", "READY"), ("2", "READY")]
    metadata = await request("GET", service.url + "/v2/models/mlp")
    assert metadata.json["versions"] == ["1", "2"]
    x = rows(2, seed=4)
    address = service.url.split("://", 1)[1]
    for asked, answered in (("", "2"), ("1", "1"), ("2", "2")):
        version, y = await deferToThread(infer_version, address, x, asked)
        assert version == answered
        np.testing.assert_allclose(y, np.asarray(mlp(params[answered], x)), rtol=1e-5, atol=1e-6)
    assert (await request("GET", service.url + "/v2/models/mlp/versions/3/ready")).code == 404
