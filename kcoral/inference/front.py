"""
What a front of the Open Inference Protocol does, whatever carries it: the
interface that the REST and gRPC adapters serve, and the answers about a
model that every front builds the same way from its manifest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
from twisted.internet.defer import Deferred
from zope.interface import Interface

from kcoral.errors import LoadFailed
from kcoral.inference.message import GrpcAnswer, IInferMessage
from kcoral.models.config import PLATFORM
from kcoral.models.config import config_of as model_config_of
from kcoral.models.manifest import ModelManifest, TensorSpec
from kcoral.protocol.inference import InferAnswer

__all__ = ["IInferenceFront", "InferAnswer", "InferCall", "load_config", "load_files",
           "model_config_of",
           "model_metadata_of", "server_metadata"]

#: The server's name in its metadata.
SERVER_NAME = "kcoral"
#: The parameter of a model load that carries its configuration.
CONFIG_PARAMETER = "config"
#: The prefix of the parameters of a model load that carry its files.
FILE_PARAMETER = "file:"
#: The longest name of one folder or file (Linux's NAME_MAX).
MAX_PATH_COMPONENT = 255
#: The deepest a file of a load may be (a bundle's are one folder deep, in
#: its version's).
MAX_PATH_DEPTH = 8
#: The most files one load may carry (a bundle of every version has a few
#: each).
MAX_LOAD_FILES = 1024
#: The protocol's extensions served, and only those: a client such as
#: perf_analyzer calls the routes of every extension it is told of.
EXTENSIONS = ("binary_tensor_data", "model_configuration", "model_repository", "sequence",
              "statistics", "system_shared_memory")


@attrs.frozen
class InferCall:
    """
    An inference as a front receives it: its C{message} (in the form it
    came in), the request id, and the headers to forward with it
    (C{traceparent} and the like); C{formed}: a front batcher formed it, and
    it runs without waiting for more rows; C{token}: the client token it
    came with (None: none), whose sequences it may step; C{decoupled}: it
    may be answered several times (it came on a stream), as a decoupled
    model answers, where any other call of a decoupled model is refused
    (L{kcoral.errors.DecoupledModel}).
    """

    message: IInferMessage
    request_id: str
    headers: dict[bytes, bytes] = attrs.field(factory=dict)
    formed: bool = False
    token: bytes | None = None
    decoupled: bool = False


class IInferenceFront(Interface):
    """
    A server, a gateway or a Router, as the inference protocol sees it.
    Every method returns a Deferred; a failure is a L{kcoral.errors.KCoralError}:
    L{NotFound} for an unknown model, L{BadRequest} for bad input,
    L{ServerBusy} (with its reason) when nothing can run it now,
    L{ProgramFailed} when its run failed, L{Unauthorized}. A version of None
    means the model's current one.
    """

    def ready() -> Deferred[bool]:
        """Whether it serves inferences now (it is live while it answers)."""

    def metadata() -> Deferred[dict]:
        """The server's metadata (L{server_metadata})."""

    def model_metadata(name: str, version: str | None) -> Deferred[dict]:
        """A model's metadata (L{model_metadata_of})."""

    def model_config(name: str, version: str | None) -> Deferred[dict]:
        """A model's configuration, as Triton's (L{model_config_of})."""

    def model_ready(name: str, version: str | None) -> Deferred[bool]:
        """Whether a model can run now."""

    def repository_index() -> Deferred[list[dict]]:
        """The models: C{[{"name", "version", "state", "reason"}]}."""

    def model_statistics(name: str | None, version: str | None) -> Deferred[dict]:
        """C{{"model_stats": [...]}}: every ready model's statistics (C{name}
        None), or one model's, in the form of Triton's statistics extension
        (L{kcoral.models.statistics})."""

    def load_model(name: str, config: str | None = None,
                   files: Mapping[str, bytes] | None = None) -> Deferred[dict]:
        """Load model C{name} (again) from the repository, or from C{files}
        (its folder's files by relative path) when given, on every member,
        configured by C{config} (Triton's ModelConfig as JSON) if given;
        C{{"models": [...]}}, its states as C{/health} lists them.
        L{LoadFailed} when it fails, and unless the model control mode is
        explicit."""

    def unload_model(name: str) -> Deferred[dict]:
        """Stop serving model C{name}, on every member; as L{load_model}."""

    def infer(name: str, version: str | None, call: InferCall) -> Deferred[InferAnswer | GrpcAnswer]:
        """The answer of one inference: in the form of its message where this
        answers it itself (a server), in REST's where it forwards it."""


def load_config(name: str, parameters: Mapping[str, object]) -> str | None:
    """
    The configuration that a load of model C{name} carries in its
    C{parameters} (None: none), whatever front took them: Triton's
    ModelConfig as JSON text in C{config}. L{LoadFailed} for a parameter
    that is neither it nor a file (L{load_files}), or a config that is not
    text.
    """
    for key in parameters:
        if key != CONFIG_PARAMETER and not key.startswith(FILE_PARAMETER):
            raise LoadFailed(f"failed to load '{name[:64]}': parameter {key[:64]!r} is not served "
                             f"(a load takes {CONFIG_PARAMETER!r} and {FILE_PARAMETER}<path>)")
    config = parameters.get(CONFIG_PARAMETER)
    if config is not None and not isinstance(config, str):
        raise LoadFailed(f"failed to load '{name[:64]}': {CONFIG_PARAMETER} must be text, "
                         "Triton's ModelConfig as JSON")
    return config


def load_files(name: str, parameters: Mapping[str, object],
               decode: Callable[[object], bytes]) -> dict[str, bytes]:
    """
    The model's files that a load of model C{name} carries in its
    C{parameters}, by path in the model's folder: each C{file:<path>}, its
    value read by C{decode} (REST sends base64 text, gRPC bytes; C{decode}
    raises ValueError for a value that is not a file's content).
    L{LoadFailed} in Triton's words for a path that could name a file
    outside the model's folder, or a value that is no file's content.
    """
    files = {}
    for key, value in parameters.items():
        if not key.startswith(FILE_PARAMETER):
            continue
        path = key[len(FILE_PARAMETER):]
        why = unsafe_path(path)
        if not why:
            try:
                files[path] = decode(value)
            except ValueError as e:
                why = str(e)
        if why:
            raise LoadFailed(f"failed to load '{name[:64]}': failed to poll from model "
                             f"repository: {key[:64]!r}: {why}")
    if len(files) > MAX_LOAD_FILES:
        raise LoadFailed(f"failed to load '{name[:64]}': failed to poll from model repository: "
                         f"{len(files)} files, over {MAX_LOAD_FILES}")
    return files


def unsafe_path(path: str) -> str:
    """Why a file's path in a load is refused ("" when it is not)."""
    parts = path.split("/")
    if not path or path.startswith("/"):
        return "a file's path must be relative to the model's folder"
    if ".." in parts:
        return "a file's path must not hold '..'"
    if not path.isascii():
        try:
            # JSON can carry a lone surrogate, which no file name holds.
            path.encode("utf-8")
        except UnicodeEncodeError:
            return "a file's path must be UTF-8 text"
    if any(len(part.encode("utf-8")) > MAX_PATH_COMPONENT for part in parts):
        return f"a component of a file's path is over {MAX_PATH_COMPONENT} bytes"
    if len(parts) > MAX_PATH_DEPTH:
        return f"a file's path is over {MAX_PATH_DEPTH} folders deep"
    if any(part in ("", ".") for part in parts) or "\0" in path:
        # Each path names one file once: no empty or "." component, no NUL
        # (which no file name on Linux holds).
        return "a file's path must name a file: no empty or '.' component, no NUL"
    return ""


def server_metadata(version: str) -> dict:
    """The server's metadata for a KCoral of C{version}."""
    return {"name": SERVER_NAME, "version": version, "extensions": list(EXTENSIONS)}


def _metadata(spec: TensorSpec) -> dict:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


def model_metadata_of(manifest: ModelManifest) -> dict:
    """A model's metadata: its shapes have -1 for the batch dimension."""
    return {"name": manifest.name, "versions": [str(manifest.version)], "platform": PLATFORM,
            "inputs": [_metadata(t) for t in manifest.inputs],
            "outputs": [_metadata(t) for t in manifest.outputs]}
