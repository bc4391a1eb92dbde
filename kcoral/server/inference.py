"""
A server's models on the Open Inference Protocol: what its repository
holds, answered from the manifests, and inferences run on its worker
threads under the same admission as runs (the same slots, queue and 503s).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from twisted.internet.defer import Deferred, inlineCallbacks, maybeDeferred, succeed
from twisted.logger import Logger
from zope.interface import implementer

from kcoral._version import __version__
from kcoral.common.offreactor import off_reactor
from kcoral.errors import (
    REST_DECOUPLED,
    BadRequest,
    DecoupledModel,
    KCoralError,
    LoadFailed,
    ModelNotReady,
    NotFound,
    ServerBusy,
    unknown_model,
    unreadable_version,
)
from kcoral.inference.front import (
    IInferenceFront,
    InferCall,
    model_config_of,
    model_metadata_of,
    server_metadata,
)
from kcoral.metrics import SECONDS_BUCKETS
from kcoral.models.statistics import Statistics
from kcoral.protocol.counts import MOST_VERSION, read_count
from kcoral.protocol.inference import encoded_size
from kcoral.protocol.sequence import controls_of_rest
from kcoral.protocol.tensors import InvalidInput
from kcoral.server.batcher import Batcher
from kcoral.server.control import ModelControl
from kcoral.server.models import (
    LOADING,
    READY,
    LoadedModel,
    ModelRepository,
    ModelStatus,
    ModelUnavailable,
    UnknownModel,
)
from kcoral.server.sequencer import MAX_SEQUENCES, Arrivals, Sequencer

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
        self.sequences_live = Gauge("kcoral_sequences_live",
                                    "Sequences whose state a sequence model holds", ["model"],
                                    registry=registry)


@attrs.frozen
class Slots:
    """
    How work reaches a server's device: C{admitted(rid)} fires once a
    request holds one of its admission slots, C{release()} gives one back
    unused, and C{in_thread(rid, f, *args)} runs C{f} on a worker thread
    with the slot, giving it back when done (the server's one path to its
    device, for runs and inferences alike).
    """

    admitted: Callable[[str], Deferred]
    release: Callable[[], None]
    in_thread: Callable[..., Deferred]


@implementer(IInferenceFront)
class ServerInference:
    """
    The models of C{repository} (None: a server without one, which serves
    none), ready once C{is_ready()} says the server is; C{busy()} notes an
    arrival and says why the server takes none now. A batched model's
    inferences go through its L{Batcher}, whose short batches wait up to
    C{batch_delay} seconds for more rows, and where up to C{most_waiting}
    batches' worth of them wait. A sequence model's steps go through its
    L{Sequencer}, which holds up to C{max_sequences} live sequences.
    """

    def __init__(self, repository: ModelRepository | None, *, is_ready: Callable[[], bool],
                 busy: Callable[[], ServerBusy | None], slots: Slots, clock,
                 metrics: InferenceMetrics, batch_delay: float = 0.0, most_waiting: int = 1024,
                 control: ModelControl | None = None, max_sequences: int = MAX_SEQUENCES):
        self._repository = repository
        self._control = control
        self._is_ready = is_ready
        self._busy = busy
        self._slots = slots
        self._clock = clock
        self._metrics = metrics
        self._batch_delay = batch_delay
        self._most_waiting = most_waiting
        #: The batcher of each model version's current load (one loaded
        #: again gets a new one; the old one finishes what it holds).
        self._batchers: dict[tuple[str, int], Batcher] = {}
        #: The sequencer of each sequence model version's current load.
        self._sequencers: dict[tuple[str, int], Sequencer] = {}
        self._arrivals = Arrivals()
        self._max_sequences = max_sequences
        #: Each model's counts, in the form of Triton's statistics extension.
        self.statistics = Statistics(clock)

    def _model(self, name: str, version: str | None):
        """The loaded model C{name}, of C{version} if given; its manifest or the error."""
        if self._repository is None:
            raise unknown_model(name, why="this server has no model repository")
        number = _version(version)
        try:
            return self._repository.get(name, number)
        except UnknownModel:
            raise unknown_model(name, version) from None
        except ModelUnavailable as e:
            if e.state == LOADING:
                raise ServerBusy(f"model {name!r} is {LOADING}", reason="model_loading") from None
            raise ModelNotReady(f"model {name!r} is {e.state}: {e.reason}",
                                reason="model_unavailable") from None

    def ready(self) -> Deferred:
        return succeed(self._is_ready())

    def metadata(self) -> Deferred:
        return succeed(server_metadata(__version__))

    def model_metadata(self, name, version) -> Deferred:
        def metadata() -> dict:
            value = model_metadata_of(self._model(name, version).manifest)
            if version is None:
                # The model as a whole: every version it serves now.
                value["versions"] = [m["version"] for m in self.index()
                                     if m["name"] == name and m["state"] == READY]
            return value
        return maybeDeferred(metadata)

    def model_config(self, name, version) -> Deferred:
        def configured() -> dict:
            model = self._model(name, version)
            return model_config_of(model.manifest, model.config)
        return maybeDeferred(configured)

    def model_ready(self, name, version) -> Deferred:
        def ready() -> bool:
            try:
                self._model(name, version)
            except (ModelNotReady, ServerBusy):
                return False
            return self._is_ready()
        return maybeDeferred(ready)

    def repository_index(self) -> Deferred:
        if self._control is None:
            return succeed([])
        return self._control.index().addCallback(lambda listed: [_indexed(m) for m in listed])

    def _states(self, name: str) -> dict:
        return {"models": [m for m in self.health() if m["name"] == name]}

    def load_model(self, name, config=None, files=None) -> Deferred:
        def load() -> Deferred:
            if self._control is None:
                raise LoadFailed(f"failed to load '{name[:64]}': this server has no model repository")
            return self._control.load(name, config, files)
        d = maybeDeferred(load)
        d.addCallback(lambda _: self._states(name))
        return d

    def unload_model(self, name) -> Deferred:
        def unload() -> dict:
            if self._control is None:
                raise BadRequest("this server has no model repository")
            self._control.unload(name)
            return self._states(name)
        return maybeDeferred(unload)

    def model_statistics(self, name, version) -> Deferred:
        def listed() -> dict:
            if name is None:
                served = [(m.name, str(m.version)) for m in
                          (self._repository.index() if self._repository is not None else ())
                          if m.state == READY]
            else:
                manifest = self._model(name, version).manifest
                served = [(manifest.name, str(manifest.version))]
            return {"model_stats": self.statistics.to_json(served)}
        return maybeDeferred(listed)

    def index(self) -> list[dict]:
        """Every model version it knows, its state and why, as it serves
        them now, without reading the disk (the repository index reads it
        for the folders it has not loaded)."""
        if self._repository is None:
            return []
        return [_indexed(m) for m in self._repository.index()]

    def health(self) -> list[dict]:
        """The index as /health lists it, with what a Router needs of a ready
        model: its max_batch_size, to keep its batches full, and its
        signature, to refuse another model of the same name elsewhere;
        whether its rows' outputs are the same bytes whatever their batch;
        and whether it keeps sequences' states, whose steps a front sends
        to the worker that holds them."""
        listed = self.index()
        for model in listed:
            if model["state"] == READY:
                assert self._repository is not None  # else nothing is listed
                loaded = self._repository.get(model["name"], int(model["version"]))
                model["max_batch_size"] = loaded.manifest.max_batch_size
                model["signature"] = loaded.manifest.signature
                model["batch_invariant"] = loaded.batch_invariant
                model["sequence"] = loaded.manifest.sequence is not None
        return listed

    @inlineCallbacks
    def infer(self, name, version, call: InferCall):
        clock, counted, arrived = self._clock, None, None
        started = clock.seconds()
        try:
            model = self._model(name, version)
            manifest = model.manifest
            counted = self.statistics.of(manifest.name, str(manifest.version))
            if manifest.decoupled and not call.decoupled:
                raise DecoupledModel(REST_DECOUPLED)
            refusal = self._busy()
            if refusal is not None:
                raise refusal
            if model.states is not None:
                arrived = self._arrivals.arrive(model)
            request = yield off_reactor(call.message.size, call.message.request)
            parsed = clock.seconds()
            try:
                # Off the reactor for a large body: a BYTES input's elements
                # are each measured against its max_length.
                rows = yield off_reactor(call.message.size, manifest.check, request.inputs)
            except InvalidInput as e:
                raise BadRequest(str(e)) from None
            if model.states is not None:
                # A large request is read in a thread: its step waits for
                # the steps that arrived before it, so that a sequence's
                # steps (on a stream, say) run in the order they were sent.
                assert arrived is not None  # taken as it arrived
                yield arrived.turn
                stepped = self._sequencer(model).step(
                    call.token, controls_of_rest(request.parameters), request.inputs, rows,
                    call.request_id)
                arrived.done()
                outputs = yield stepped
            elif manifest.max_batch_size:
                outputs = yield self._batcher(model).infer(request.inputs, rows, call.request_id,
                                                           formed=call.formed)
            else:
                outputs = yield self._alone(model, request.inputs, call.request_id)
            computed = clock.seconds()
            answer = yield off_reactor(sum(encoded_size(o) for o in outputs.values()),
                                       call.message.answer, manifest.name,
                                       str(manifest.version), request, outputs, manifest.decoupled)
            # Counted with its output, not as it was read: the batch's
            # execution is counted in the same turn of the reactor when the
            # answer is encoded on it, so that statistics read while
            # requests are in flight have as many inputs as executions and
            # outputs (perf_analyzer refuses any others).
            counted.add("compute_input", parsed - started)
            counted.add("compute_output", clock.seconds() - computed)
        except KCoralError as e:
            if not isinstance(e, NotFound):
                self._metrics.requests.labels(name, str(e.status)).inc()
            if counted is not None:
                self.statistics.answered(counted.name, counted.version, ok=False,
                                         seconds=clock.seconds() - started, rows=0)
            raise
        finally:
            if arrived is not None:
                # Failed or cancelled before its step: the next may go.
                arrived.done()
        self._metrics.requests.labels(name, "200").inc()
        self.statistics.answered(counted.name, counted.version, ok=True,
                                 seconds=clock.seconds() - started, rows=rows)
        return answer

    def _batcher(self, model: LoadedModel) -> Batcher:
        name, number = model.manifest.name, model.manifest.version
        batcher = self._batchers.get((name, number))
        if batcher is None or batcher.model is not model:
            self._drop_unserved_batchers(name)
            version = str(number)
            counted = self.statistics.of(name, version)

            def observe(rows: int, waited: list[float]) -> None:
                self._metrics.batch_size.labels(name).observe(rows)
                queued = self._metrics.queue_seconds.labels(name)
                for seconds in waited:
                    queued.observe(seconds)
                    counted.add("queue", seconds)

            def executed(rows: int, requests: int, seconds: float) -> None:
                self.statistics.executed(name, version, size=rows, requests=requests,
                                         seconds=seconds)

            batcher = self._batchers[(name, number)] = Batcher(
                model, admitted=lambda: self._slots.admitted(f"a batch of {name}"),
                release=self._slots.release, in_thread=self._slots.in_thread, clock=self._clock,
                delay=self._batch_delay if model.config.batch_delay_microseconds is None
                else model.config.batch_delay_microseconds / 1e6,
                observe=observe, executed=executed,
                most_waiting=self._most_waiting * model.manifest.max_batch_size)
        return batcher

    def _sequencer(self, model: LoadedModel) -> Sequencer:
        name, number = model.manifest.name, model.manifest.version
        sequencer = self._sequencers.get((name, number))
        if sequencer is None or sequencer.model is not model:
            if sequencer is not None:
                # Loaded again: the old load's states went with it.
                sequencer.close()
            version = str(number)
            gauge = self._metrics.sequences_live.labels(name)

            def executed(rows: int, seconds: float) -> None:
                self._metrics.batch_size.labels(name).observe(rows)
                self.statistics.executed(name, version, size=rows, requests=rows, seconds=seconds)

            sequencer = self._sequencers[(name, number)] = Sequencer(
                model, admitted=lambda: self._slots.admitted(f"a step of {name}"),
                release=self._slots.release, in_thread=self._slots.in_thread, clock=self._clock,
                most_live=self._max_sequences, live=gauge.inc, executed=executed)
        return sequencer

    def _drop_unserved_batchers(self, name: str) -> None:
        """Forget the batchers of C{name}'s loads no longer served (a batcher
        still running its queue lives on in its requests' callbacks until it
        is done), so that an old version's params are freed."""
        assert self._repository is not None  # a batched model came from it
        for key, batcher in list(self._batchers.items()):
            if key[0] != name:
                continue
            try:
                served = self._repository.get(name, key[1])
            except (UnknownModel, ModelUnavailable):
                served = None
            if served is not batcher.model:
                del self._batchers[key]

    @inlineCallbacks
    def _alone(self, model: LoadedModel, inputs, rid: str):
        """The outputs of a model that is not batched: each request its own execution."""
        name, version, arrived = model.manifest.name, str(model.manifest.version), self._clock.seconds()
        yield self._slots.admitted(rid)
        started = self._clock.seconds()
        self._metrics.queue_seconds.labels(name).observe(started - arrived)
        self.statistics.of(name, version).add("queue", started - arrived)
        self._metrics.batch_size.labels(name).observe(1)
        outputs = yield self._slots.in_thread(rid, model.run_batch, inputs, 1)
        self.statistics.executed(name, version, size=1, requests=1,
                                 seconds=self._clock.seconds() - started)
        return outputs


def _indexed(status: ModelStatus) -> dict:
    """One model version as the repository index lists it."""
    return {"name": status.name, "version": str(status.version), "state": status.state,
            "reason": status.reason}


def _version(version: str | None) -> int | None:
    if version is None:
        return None
    number = read_count(version, MOST_VERSION)
    if number is None:
        raise unreadable_version(version)
    return number
