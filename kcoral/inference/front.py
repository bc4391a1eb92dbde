"""
What a front of the Open Inference Protocol does, whatever carries it: the
interface that the REST and gRPC adapters serve, and the answers about a
model that every front builds the same way from its manifest.
"""

from __future__ import annotations

import attrs
from twisted.internet.defer import Deferred
from zope.interface import Interface

from kcoral.inference.message import GrpcAnswer, IInferMessage
from kcoral.models.manifest import ModelManifest, TensorSpec
from kcoral.protocol.inference import InferAnswer
from kcoral.protocol.tensors import config_type

__all__ = ["IInferenceFront", "InferAnswer", "InferCall", "model_config_of", "model_metadata_of",
           "server_metadata"]

#: The server's name in its metadata.
SERVER_NAME = "kcoral"
#: The model platform that metadata and configurations name.
PLATFORM = "jax"
#: The protocol's extensions served, and only those: a client such as
#: perf_analyzer calls the routes of every extension it is told of.
EXTENSIONS = ("binary_tensor_data", "model_configuration", "model_repository", "statistics")


@attrs.frozen
class InferCall:
    """
    An inference as a front receives it: its C{message} (in the form it
    came in), the request id, and the headers to forward with it
    (C{traceparent} and the like); C{formed}: a front batcher formed it, and
    it runs without waiting for more rows.
    """

    message: IInferMessage
    request_id: str
    headers: dict[bytes, bytes] = attrs.field(factory=dict)
    formed: bool = False


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

    def load_model(name: str) -> Deferred[dict]:
        """Load model C{name} (again) from the repository, on every member;
        C{{"models": [...]}}, its states as C{/health} lists them. Refused
        (L{BadRequest}) unless the model control mode is explicit."""

    def unload_model(name: str) -> Deferred[dict]:
        """Stop serving model C{name}, on every member; as L{load_model}."""

    def infer(name: str, version: str | None, call: InferCall) -> Deferred[InferAnswer | GrpcAnswer]:
        """The answer of one inference: in the form of its message where this
        answers it itself (a server), in REST's where it forwards it."""


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


def _config(spec: TensorSpec, batched: bool) -> dict:
    # Triton's dims leave out the batch dimension of a batched model.
    dims = spec.shape[1:] if batched else spec.shape
    return {"name": spec.name, "data_type": config_type(spec.datatype), "dims": list(dims)}


def model_config_of(manifest: ModelManifest) -> dict:
    """A model's configuration as Triton's tools read it (perf_analyzer needs
    C{max_batch_size}, C{input} and C{output}); every key is a field of
    Triton's C{ModelConfig} message, so the gRPC front sends the same."""
    batched = manifest.max_batch_size > 0
    config = {"name": manifest.name, "platform": PLATFORM,
              "max_batch_size": manifest.max_batch_size,
              "input": [_config(t, batched) for t in manifest.inputs],
              "output": [_config(t, batched) for t in manifest.outputs]}
    if batched:
        # Workers batch concurrent inferences of a batched model.
        config["dynamic_batching"] = {}
    return config
