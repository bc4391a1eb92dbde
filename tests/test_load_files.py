"""
A load with files (C{file:<path>} parameters): the paths a front takes and
those it refuses in Triton's words, whatever the path (hypothesis); the
private folder they are written to; and, with real processes and JAX, a
model sent whole through tritonclient's two clients to a server and to a
node's gateway (every worker loads it), checked like any bundle (a forged
program is refused naming its target), bounded by --max-request-bytes, the
folder gone after each load and the service serving on.
"""

from __future__ import annotations

import hashlib
import json
import os

import attrs
import numpy as np
import pytest
import pytest_twisted
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.threads import deferToThread

from kcoral.errors import LoadFailed
from kcoral.inference.front import MAX_LOAD_FILES, MAX_PATH_COMPONENT, load_files, unsafe_path
from kcoral.server.sentfiles import PREFIX, SentFilesError, sent_folder
from tests.conftest import server_args, server_env
from tests.harness import SERVER_READY
from tests.test_model_control import start_explicit_node
from tests.test_models import START_TIMEOUT, grpc_address, mlp, mlp_params, rows

POLL = "failed to load 'sent': failed to poll from model repository: "
#: The bound on a request in the servers started here.
MOST_BYTES = 4 << 20


def as_is(value: object) -> bytes:
    assert isinstance(value, bytes)
    return value


@pytest.mark.parametrize("path, reason", [
    ("A" * 256, "a component of a file's path is over 255 bytes"),
    ("1/" + "é" * 128, "a component of a file's path is over 255 bytes"),
    ("/etc/passwd", "a file's path must be relative to the model's folder"),
    ("1/../../x", "a file's path must not hold '..'"),
    ("", "a file's path must be relative to the model's folder"),
    ("1//model.json", "a file's path must name a file"),
    ("1/./model.json", "a file's path must name a file"),
    ("1/model.json/", "a file's path must name a file"),
    ("a\0b", "a file's path must name a file"),
    ("1/\ud800", "a file's path must be UTF-8 text"),
    ("1/\udcff", "a file's path must be UTF-8 text"),
])
def test_a_path_that_could_leave_the_model_folder_fails_in_tritons_words(path, reason):
    """A file's path that is absolute, climbs, has an over-long or empty component, a NUL or
    a lone surrogate (JSON escapes one; no file name holds it): 'failed to poll from model
    repository', the parameter and why."""
    with pytest.raises(LoadFailed) as refused:
        load_files("sent", {"config": "{}", "file:" + path: b"a"}, as_is)
    assert refused.value.message.startswith(f"{POLL}{('file:' + path)[:64]!r}: {reason}")


def test_a_value_that_is_no_files_content_fails_naming_why():
    """A file whose value its front cannot read (REST: not base64) fails the load naming it."""
    def refuse(value: object) -> bytes:
        raise ValueError("a file's content is not base64")
    with pytest.raises(LoadFailed) as refused:
        load_files("sent", {"file:1/model.json": "?"}, refuse)
    assert refused.value.message == f"{POLL}'file:1/model.json': a file's content is not base64"


@given(st.text(max_size=300))
def test_a_path_is_taken_only_inside_the_model_folder(path):
    """Whatever the path: refused in Triton's words, or taken as it is, naming one file
    strictly inside the model's folder, each of its names at most 255 bytes."""
    try:
        files = load_files("sent", {"file:" + path: b"x"}, as_is)
    except LoadFailed as e:
        assert e.message.startswith(POLL) and unsafe_path(path)
        return
    assert files == {path: b"x"}
    root = "/models/sent"
    assert os.path.normpath(os.path.join(root, path)).startswith(root + "/")
    assert all(0 < len(part.encode("utf-8", "surrogatepass")) <= MAX_PATH_COMPONENT
               for part in path.split("/"))


@given(st.dictionaries(st.text(max_size=40).map(lambda path: "file:" + path),
                       st.one_of(st.binary(max_size=16), st.text(max_size=16), st.integers(),
                                 st.none()), max_size=8))
def test_whatever_the_parameters_a_load_takes_its_files_or_refuses_them(parameters):
    """Any file: parameters, of any value: the files exactly as sent, or LoadFailed in
    Triton's words; never another error."""
    try:
        files = load_files("sent", parameters, as_bytes)
    except LoadFailed as e:
        assert e.message.startswith(POLL)
        return
    assert files == {key[len("file:"):]: value for key, value in parameters.items()}


@given(st.integers(0, 3 * MAX_LOAD_FILES // 2))
def test_a_load_carries_at_most_so_many_files(count):
    """Up to MAX_LOAD_FILES files are taken; more fail the load saying how many."""
    parameters = {f"file:{i}/model.json": b"" for i in range(count)}
    if count <= MAX_LOAD_FILES:
        assert len(load_files("sent", parameters, as_is)) == count
    else:
        with pytest.raises(LoadFailed, match=f"{count} files, over {MAX_LOAD_FILES}"):
            load_files("sent", parameters, as_is)


def as_bytes(value: object) -> bytes:
    if not isinstance(value, bytes):
        raise ValueError("a file's content must be bytes")
    return value


names = st.text(st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)),
                min_size=1, max_size=20).filter(lambda name: name not in (".", ".."))


@given(st.dictionaries(st.lists(names, min_size=1, max_size=3).map("/".join),
                       st.binary(max_size=64), max_size=6))
def test_the_sent_folder_holds_the_files_then_goes(tmp_path_factory, files):
    """The files are written, each at its path, in a new folder of the given one, which is
    removed after, even when two paths collide (a file and a folder of one name: the files
    cannot be written, and it says which)."""
    parent = tmp_path_factory.mktemp("cache")
    try:
        with sent_folder(files, str(parent)) as folder:
            assert os.path.dirname(folder) == str(parent)
            assert os.path.basename(folder).startswith(PREFIX)
            for path, data in files.items():
                with open(os.path.join(folder, path), "rb") as file:
                    assert file.read() == data
    except SentFilesError as e:
        assert any(other.startswith(path + "/") for path in files for other in files), e
    assert os.listdir(parent) == []


# -- real servers ----------------------------------------------------------------------------

jax = pytest.importorskip("jax")
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")


@attrs.frozen
class Sent:
    """The repository (mlp alone) and, outside it, the files of model sent: two versions of
    it (other weights each) and a version whose program is forged."""

    path: str
    params: dict[int, dict]
    files: dict[str, dict[str, bytes]]


def bundle_files(folder: str) -> dict[str, bytes]:
    files = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as file:
            files[name] = file.read()
    return files


@pytest.fixture(scope="module")
def sent(tmp_path_factory) -> Sent:
    import kcoral
    from tests.forged import custom_call, forge

    root = tmp_path_factory.mktemp("repository")
    outside = tmp_path_factory.mktemp("sent")
    x = np.zeros((1, 16), np.float32)
    kcoral.export_bundle(mlp, mlp_params(11), x, dir=str(root / "mlp"), name="mlp",
                         batch_sizes=[1, 8])
    params = {1: mlp_params(21), 2: mlp_params(22)}
    files = {}
    for version, weights in params.items():
        kcoral.export_bundle(mlp, weights, x, dir=str(outside / str(version)), name="sent",
                             batch_sizes=[1, 8])
        files[str(version)] = bundle_files(str(outside / str(version)))
    forged = dict(files["1"])
    manifest = json.loads(forged["model.json"])
    program = forge(custom_call("xla_ffi_python_cpu_callback", 1 << 40), "cuda branch")
    forged[manifest["programs"][0]["file"]] = program
    manifest["programs"][0]["sha256"] = hashlib.sha256(program).hexdigest()
    forged["model.json"] = json.dumps(manifest).encode()
    files["forged"] = forged
    return Sent(str(root), params, files)


def as_version(files: dict[str, bytes], version: int) -> dict[str, bytes]:
    """A bundle's files as version C{version} of a model's folder, as a load sends them."""
    return {f"file:{version}/{name}": data for name, data in files.items()}


def infer(http, x: np.ndarray) -> np.ndarray:
    tensor = httpclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return http.infer("sent", [tensor]).as_numpy("output")


def files_loads(url: str, grpc: str, sent: Sent) -> dict:
    """
    Through tritonclient's clients: model sent, in no folder of the repository, loaded from
    files over REST (version 1, with a configuration) and run; loaded again over gRPC
    (version 2), run; its forged version, a hostile path, colliding paths and a file over
    the request bound each refused, and version 2 served still. What each read, by step.
    """
    from tritonclient.utils import InferenceServerException

    http = httpclient.InferenceServerClient(url.split("://", 1)[1], network_timeout=120)
    rpc = grpcclient.InferenceServerClient(grpc)
    x = rows(5, seed=7)
    read: dict = {}

    def refused(name: str, load) -> None:
        try:
            load()
        except InferenceServerException as e:
            read[name] = (str(e.status()), e.message())

    try:
        http.load_model("sent", config='{"max_batch_size": 8}', files=as_version(sent.files["1"], 1))
        read["config 1"] = http.get_model_config("sent")["max_batch_size"]
        read["rows 1"] = [infer(http, x) for _ in range(4)]
        rpc.load_model("sent", files=as_version(sent.files["2"], 2))
        read["rows 2"] = [infer(http, x) for _ in range(4)]
        read["index"] = [(m["name"], m["version"], m["state"])
                         for m in rpc.get_model_repository_index(as_json=True)["models"]]
        refused("forged", lambda: rpc.load_model("sent", files=as_version(sent.files["forged"], 3)))
        refused("climbing", lambda: http.load_model("sent", files={"file:1/../../x": b"x"}))
        refused("colliding", lambda: http.load_model(
            "sent", files={"file:1/model.json": b"{}", "file:1/model.json/x": b"{}"}))
        big = {"file:1/model.json": b"\0" * MOST_BYTES}
        refused("http big", lambda: http.load_model("sent", files=big))
        refused("grpc big", lambda: rpc.load_model("sent", files=big))
        read["rows after"] = infer(http, x)
        read["ready"] = rpc.is_server_ready() and http.is_model_ready("mlp")
        return read
    finally:
        http.close()
        rpc.close()


async def check_files_loads(url: str, grpc: str, sent: Sent, caches: str) -> None:
    """L{files_loads}' steps read what a load with files promises; no load's folder is left
    in the caches."""
    read = await deferToThread(files_loads, url, grpc, sent)
    x = rows(5, seed=7)
    assert read["config 1"] == 8
    for version in (1, 2):
        for got in read[f"rows {version}"]:
            np.testing.assert_allclose(got, np.asarray(mlp(sent.params[version], x)),
                                       rtol=1e-5, atol=1e-6)
    assert ("sent", "2", "READY") in read["index"], read["index"]
    status, message = read["forged"]
    assert status == "StatusCode.INTERNAL" and message.startswith("failed to load 'sent'")
    assert "'xla_ffi_python_cpu_callback'" in message, message
    status, message = read["climbing"]
    assert status == "400" and message.startswith(POLL + "'file:1/../../x'"), message
    status, message = read["colliding"]
    # A gateway names each worker that refused it, each in those words.
    assert status == "400" and message.startswith("failed to load 'sent'"), message
    assert "failed to poll from model repository: '1/model.json/x'" in message, message
    assert read["http big"][0] == "413", read["http big"]
    assert read["grpc big"][0] == "StatusCode.RESOURCE_EXHAUSTED", read["grpc big"]
    np.testing.assert_allclose(read["rows after"], np.asarray(mlp(sent.params[2], x)),
                               rtol=1e-5, atol=1e-6)
    assert read["ready"]
    left = [os.path.join(folder, name) for folder, names, _ in os.walk(caches)
            for name in names if name.startswith(PREFIX)]
    assert left == []


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_server_loads_a_model_sent_in_files(processes, sent, tmp_path):
    """A server in explicit mode loads a model from the files its load sends (REST and gRPC),
    checked as any bundle, bounded, and serves on after each refusal."""
    caches = str(tmp_path / "cache")
    service = await processes.start_service(
        server_args("--model-repository", sent.path, "--grpc-port", "0", "--cache-dir", caches,
                    "--max-request-bytes", str(MOST_BYTES),
                    "--model-control-mode", "explicit", "--load-model", "mlp"),
        name="server", ready=SERVER_READY, env=server_env(), timeout=START_TIMEOUT)
    await check_files_loads(service.url, await grpc_address(service.process), sent, caches)


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_node_sends_the_files_to_every_worker(processes, sent, tmp_path):
    """Through a node's gateway, a load with files reaches both workers, each loading the
    model from them, before it answers."""
    caches = str(tmp_path / "cache")
    child, url, grpc = await start_explicit_node(
        processes, sent.path, "--cache-dir", caches, "--max-request-bytes", str(MOST_BYTES))
    await check_files_loads(url, grpc, sent, caches)
    for version in (1, 2):
        assert len(child.matching(rf"\[worker\d\] .*model sent version {version} is ready")) == 2
