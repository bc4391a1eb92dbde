"""
Dynamic batching: concurrent inferences of one model run as one execution.

Requests wait in arrival order (L{BatchQueue}). Once the model may run (its
batch holds an admission slot, like a run), the batch takes the requests at
the head of the queue whose dimensions past the first match the oldest's,
as many as fit in C{max_batch_size} rows. A batch
short of C{max_batch_size} waits until its oldest request has waited
C{delay} seconds (0: it goes with what is queued), and goes at once when
it fills. A batch that holds a request a Router's or a gateway's front
batcher formed (sent because this worker was free) never waits: it goes
as soon as it holds a slot, with what is queued, so the delay is paid at
most once on the way. The model pads it to its next compiled batch size; each request
gets exactly its own rows, equal to running alone within the model's
rounding (a row-wise model's rows do not depend on each other, but XLA's
kernels round differently by batch size), or the same bytes with
C{--batch-invariant}. A request whose client left
before its batch started is dropped from it.

Everything here runs on the reactor's thread except the execution, which
runs on a worker thread with its slot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
import numpy as np
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.common.queue import BatchQueue
from kcoral.errors import ServerBusy
from kcoral.server.models import LoadedModel

log = Logger()


@attrs.define(eq=False)
class _Request:
    inputs: Mapping[str, np.ndarray]
    rows: int
    #: What must match for requests to share a batch: every input's dimensions past the first.
    kind: tuple
    answer: Deferred
    arrived: float
    request_id: str
    #: Formed by a front batcher: its batch goes without waiting for more rows.
    formed: bool


class Batcher:
    """
    The batches of one batched C{model}. C{admitted()} fires once a batch
    holds an admission slot (C{release()} gives one back unused);
    C{in_thread(rid, f, *args)} runs C{f} on a worker thread with that slot
    and releases it when done. At most C{most_waiting} requests wait. C{observe(rows, waited)} is told each
    executed batch's rows and how long each of its requests waited, as it
    starts; C{executed(rows, requests, seconds)} how long it ran, once it ran.
    """

    def __init__(self, model: LoadedModel, *, admitted: Callable[[], Deferred],
                 release: Callable[[], None], in_thread: Callable[..., Deferred], clock,
                 delay: float = 0.0, most_waiting: int = 1024,
                 observe: Callable[[int, list[float]], None] = lambda rows, waited: None,
                 executed: Callable[[int, int, float], None] = lambda rows, requests, seconds: None):
        self.model = model
        self._most = model.manifest.max_batch_size
        self._admitted = admitted
        self._release = release
        self._in_thread = in_thread
        self._clock = clock
        self._delay = delay
        self._observe = observe
        self._executed = executed
        self._queue: BatchQueue[_Request] = BatchQueue(most_waiting)
        #: Whether a slot has been asked for and not yet used.
        self._asking = False
        #: The timer of a slot held while a short batch waits for more rows.
        self._waiting: IDelayedCall | None = None

    def infer(self, inputs: Mapping[str, np.ndarray], rows: int, request_id: str,
              formed: bool = False) -> Deferred:
        """
        The outputs by name of one request's C{inputs} (C{rows} rows, checked
        against the model), run in a batch; C{formed}: a front batcher formed
        it, and its batch does not wait for more rows. Cancelling it before
        its batch starts takes it out of the queue. Past C{most_waiting}
        requests waiting, it fails at once with L{ServerBusy} C{queue_full}.
        """
        if self._queue.full:
            return fail(ServerBusy(f"{len(self._queue)} inferences of {self.model.manifest.name} "
                                   "are already waiting", reason="queue_full"))
        request = _Request(inputs, rows, tuple(a.shape[1:] for a in inputs.values()),
                           Deferred(lambda d: self._cancelled(request)), self._clock.seconds(),
                           request_id, formed)
        self._queue.append(request)
        if self._waiting is not None and not self._may_grow():
            self._waiting.cancel()
            self._waiting = None
            self._start()
        self._ask()
        return request.answer

    def _cancelled(self, request: _Request) -> None:
        if not self._queue.remove(request):
            return  # already in a batch on the device: its answer is dropped
        log.info("{request_id} dropped: the client went away before its batch ran",
                 request_id=request.request_id)

    def _ask(self) -> None:
        """Ask for a slot for the next batch, once at a time."""
        if self._asking or self._waiting is not None or not self._queue:
            return
        self._asking = True
        self._admitted().addCallbacks(self._granted, self._refused)

    def _refused(self, failure: Failure) -> None:
        # The server's queue is full or timed out: every request waiting now
        # would have met the same.
        self._asking = False
        for request in self._queue.drain():
            request.answer.errback(failure)

    def _granted(self, _) -> None:
        self._asking = False
        if not self._queue:
            self._release()
            return
        left = self._queue.oldest.arrived + self._delay - self._clock.seconds()
        if left > 0 and self._may_grow():
            self._waiting = self._clock.callLater(left, self._waited)
            return
        self._start()

    def _waited(self) -> None:
        self._waiting = None
        if self._queue:
            self._start()
        else:
            self._release()

    def _may_grow(self) -> bool:
        """Whether the next batch may wait for more requests: it is short of
        max_batch_size rows, no request already waits behind it (which
        would have joined it if it could), and a front batcher formed none
        of its requests."""
        head = self._queue.head(self._most)
        return (sum(r.rows for r in head) < self._most and len(head) == len(self._queue)
                and not any(r.formed for r in head))

    def _start(self) -> None:
        """Run the next batch with the slot held."""
        batch = self._queue.take(self._most)
        now = self._clock.seconds()
        rows = sum(r.rows for r in batch)
        self._observe(rows, [now - r.arrived for r in batch])
        ran = self._in_thread(batch[0].request_id, _run, self.model, [r.inputs for r in batch],
                              [r.rows for r in batch])
        ran.addBoth(self._ran, batch, now)
        # The next batch may take another slot while this one runs.
        self._ask()

    def _ran(self, result, batch: list[_Request], started: float) -> None:
        # The slot is free again (in_thread gave it back), and a failure is
        # already the KCoralError its requests answer with.
        if not isinstance(result, Failure):
            self._executed(sum(r.rows for r in batch), len(batch), self._clock.seconds() - started)
        for i, request in enumerate(batch):
            if request.answer.called:
                continue  # its client went away while it ran
            if isinstance(result, Failure):
                request.answer.errback(result)
            else:
                request.answer.callback(result[i])
        self._ask()


def _run(model: LoadedModel, inputs: list[Mapping[str, np.ndarray]],
         rows: list[int]) -> list[dict[str, np.ndarray]]:
    """Each request's outputs of one execution of their rows together (on a worker thread)."""
    if len(inputs) == 1:
        return [model.run_batch(inputs[0], rows[0])]
    names = [spec.name for spec in model.manifest.inputs]
    joined = {name: np.concatenate([i[name] for i in inputs]) for name in names}
    outputs = model.run_batch(joined, sum(rows))
    answers, start = [], 0
    for count in rows:
        answers.append({name: output[start:start + count] for name, output in outputs.items()})
        start += count
    return answers
