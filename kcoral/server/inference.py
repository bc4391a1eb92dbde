"""
A server's models on the Open Inference Protocol: what its repository
holds, answered from the manifests, and inferences run on its worker
threads under the same admission as runs (the same slots, queue and 503s).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from twisted.internet.defer import Deferred, fail, inlineCallbacks, succeed
from twisted.logger import Logger
from zope.interface import implementer

from kcoral._version import __version__
from kcoral.errors import BadRequest, KCoralError, NotFound, ServerBusy
from kcoral.inference.front import (
    IInferenceFront,
    InferAnswer,
    InferCall,
    model_config_of,
    model_metadata_of,
    server_metadata,
)
from kcoral.metrics import SECONDS_BUCKETS
from kcoral.models.manifest import InvalidInput
from kcoral.protocol.inference import encode_infer, parse_infer
from kcoral.server.models import ModelRepository, ModelUnavailable, UnknownModel

log = Logger()

#: Executed batch sizes: powers of two up to the largest max_batch_size served.
BATCH_BUCKETS = tuple(float(1 << i) for i in range(17))


class InferenceMetrics:
    """The inference series of one server."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("kcoral_inference_requests", "Inferences answered, by model and code",
                                ["model", "code"], registry=registry)
        self.batch_size = Histogram("kcoral_inference_batch_size", "Rows of each executed batch",
                                    ["model"], buckets=BATCH_BUCKETS, registry=registry)
        self.queue_seconds = Histogram("kcoral_inference_queue_seconds",
                                       "Time inferences waited for a slot", ["model"],
                                       buckets=SECONDS_BUCKETS, registry=registry)


@implementer(IInferenceFront)
class ServerInference:
    """
    The models of C{repository} (None: a server without one, which serves
    none), ready once C{is_ready()} says the server is. C{in_slot(rid, f,
    *args)} runs C{f} on a worker thread once the run holds an admission
    slot, and fires with its result: the server's one path to its device.
    """

    def __init__(self, repository: ModelRepository | None, *, is_ready: Callable[[], bool],
                 busy: Callable[[], ServerBusy | None],
                 in_slot: Callable[..., Deferred], clock, metrics: InferenceMetrics):
        self._repository = repository
        self._is_ready = is_ready
        self._busy = busy
        self._in_slot = in_slot
        self._clock = clock
        self._metrics = metrics

    def _model(self, name: str, version: str | None):
        """The loaded model C{name}, of C{version} if given; its manifest or the error."""
        if self._repository is None:
            raise NotFound(f"unknown model {name!r}: this server has no model repository")
        number = _version(version)
        try:
            return self._repository.get(name, number)
        except UnknownModel:
            raise NotFound(f"unknown model {name!r}" + (f" version {version}" if version else "")) \
                from None
        except ModelUnavailable as e:
            raise ServerBusy(f"model {name!r} is unavailable: {e.reason}",
                             reason="model_unavailable") from None

    def _answer(self, f, *args) -> Deferred:
        try:
            return succeed(f(*args))
        except KCoralError as e:
            return fail(e)

    def ready(self) -> Deferred:
        return succeed(self._is_ready())

    def metadata(self) -> Deferred:
        return succeed(server_metadata(__version__))

    def model_metadata(self, name, version) -> Deferred:
        return self._answer(lambda: model_metadata_of(self._model(name, version).manifest))

    def model_config(self, name, version) -> Deferred:
        return self._answer(lambda: model_config_of(self._model(name, version).manifest))

    def model_ready(self, name, version) -> Deferred:
        def ready() -> bool:
            try:
                self._model(name, version)
            except ServerBusy:
                return False
            return self._is_ready()
        return self._answer(ready)

    def repository_index(self) -> Deferred:
        return succeed(self.index())

    def index(self) -> list[dict]:
        """The repository index: every model, its state and why."""
        if self._repository is None:
            return []
        return [{"name": m.name, "version": str(m.version), "state": m.state, "reason": m.reason}
                for m in self._repository.index()]

    @inlineCallbacks
    def infer(self, name, version, call: InferCall):
        counted = name
        try:
            model = self._model(name, version)
            refusal = self._busy()
            if refusal is not None:
                raise refusal
            arrived = self._clock.seconds()
            answer = yield self._in_slot(call.request_id, self._run, model, call,
                                         lambda: self._metrics.queue_seconds.labels(counted).observe(
                                             self._clock.seconds() - arrived))
        except KCoralError as e:
            if not isinstance(e, NotFound):
                self._metrics.requests.labels(counted, str(e.status)).inc()
            raise
        self._metrics.requests.labels(counted, "200").inc()
        return answer

    def _run(self, model, call: InferCall, started: Callable[[], None]) -> InferAnswer:
        """One inference, on a worker thread: parsed, run and encoded there
        (a large body's decoding never holds the reactor)."""
        started()
        manifest = model.manifest
        request = parse_infer(call.body, call.header_length)
        try:
            outputs = model.infer(request.inputs)
        except InvalidInput as e:
            raise BadRequest(str(e)) from None
        self._metrics.batch_size.labels(manifest.name).observe(
            next(iter(outputs.values())).shape[0] if manifest.max_batch_size else 1)
        return encode_infer(manifest.name, str(manifest.version), request, outputs)


def _version(version: str | None) -> int | None:
    if version is None:
        return None
    if not version.isdigit() or len(version) > 9:
        raise NotFound(f"unknown model version {version[:32]!r}")
    return int(version)
