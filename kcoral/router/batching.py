"""
Batching at the front: the inferences of one batched model that a Router
or a gateway forwards at the same time go to a worker as one request.

Each forwarded request costs the front far more CPU (its HTTP request to
the worker, the answer's parsing, placement) than reading and splitting
its tensors; merging also hands the worker's batcher whole batches.

Inferences wait in arrival order, one queue per model path (its name and
version). Free capacity is the trigger: the queue holds at most one
request for a lease at a time, and once a member has a free slot (the
scheduler grants the lease), what arrived in the same turn of the reactor
joins, and the batch takes the head of the queue: the requests whose
inputs have the same names, datatypes and dimensions past the first as
the oldest's, and that name the same outputs, as many as fit in the
model's C{max_batch_size} rows. None is taken past one that does not fit,
so no client's requests are reordered.

Once the front is busy, a model has at most as many batches in flight as
it has lanes (L{Pool.batch_lanes}): one per worker that has it ready,
except that the CPU workers of one node make one lane. They share the
host's cores, and one execution already spreads over all of them, so a
second batch at the same time only competes with the first; held back
instead, the requests that arrive meanwhile make the next batch larger,
and each forwarded batch costs the front and the worker the same whatever
its rows. The batches' size tells how busy: only a batch of at least
C{LANE_SHARE} of the model's C{max_batch_size} rows holds a lane. Smaller
ones (a few clients, the cores not all in use) go to free slots as they
come, since holding them back would only add to their latency. The next
lease is asked for as soon as a lane is free, or once the batch in it has
been on its way for C{LANE_HOLD_SECONDS}: a worker that hangs, or a model
that runs that long, then no longer holds back the others.

A merged request carries every input as a binary tensor and asks for
every output in binary; each client's answer is encoded from its own rows
as the worker encodes an answer, the same bytes as the worker would answer
for those rows (a merged
answer over C{ON_REACTOR_BYTES} is split in a thread, as a worker encodes a
large answer). A
request that cannot merge (a model of no batch dimension, a body larger
than C{ON_REACTOR_BYTES}, which it would parse on the reactor, a body that
does not parse, parameters beyond C{binary_data_output}, more rows than a
batch takes) goes alone, as it came. A merged request answered with an
error that may be one member's doing (a 4xx: its inputs do not fit the
model; a 500: they fail it; a 507: their outputs do not fit the worker's
memory) is sent again member by member, once, so that each gets its own
answer and one client's request never fails the others; any other failure
(no capacity, the node lost) is what each member would have met, and each
gets it. A client that leaves while its request waits is dropped
from the queue; one that leaves while its batch runs has its rows
dropped, and the batch is cancelled once all of its clients left.

A sequence model's steps (each pinned to the worker that holds its
sequence, L{kcoral.router.sequences}) are never merged: the worker batches
them itself, each row with its own sequence's state. The steps of one such
model on one worker share one slot of it instead (a lane), up to a batch of
them at once, so that the worker has the waiting steps of many sequences to
run as one execution.

Each request waits at most the scheduler's queue wait timeout from its own
arrival. When the queue's lease times out, only those whose own time is up
fail; the lease is asked for again for those that arrived since.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
from twisted.internet.base import DelayedCall
from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.common.offreactor import off_reactor
from kcoral.common.queue import BatchQueue
from kcoral.errors import (
    BadRequest,
    InternalError,
    KeptMemoryFull,
    ProgramFailed,
    ServerBusy,
    error_from_answer,
)
from kcoral.inference.front import InferAnswer, InferCall
from kcoral.inference.message import GrpcAnswer, RestMessage
from kcoral.logs import debug_enabled
from kcoral.protocol.counts import MOST_BYTES, read_count
from kcoral.protocol.decoupled import DECOUPLED_HEADER
from kcoral.protocol.inference import (
    ON_REACTOR_BYTES,
    InferRequest,
    merge_infer,
    parse_answer,
)
from kcoral.router.call import Call
from kcoral.router.forward import Forwarder
from kcoral.router.residency import Demand
from kcoral.router.scheduler import Lease
from kcoral.tracing import ISpan
from kcoral.web.body import MemoryBody
from kcoral.web.family import FORMED_BATCH_HEADER, INFERENCE, INFERENCE_HEADER_LENGTH

log = Logger()

_BINARY = b"application/octet-stream"
_JSON = b"application/json"

#: The share of a model's rows from which a batch holds a lane, and how
#: long at most (see the module's docstring).
LANE_SHARE = 0.1
LANE_HOLD_SECONDS = 1.0


def forwarded(path: bytes, call: InferCall) -> Call:
    """The call that forwards C{call} to C{path}, but for the headers of the
    body it is sent with (L{_with_body})."""
    # Sent because a worker is free: the worker's own wait for more rows
    # would only be a second delay on a batch already formed.
    headers = {**call.headers, FORMED_BATCH_HEADER: b"true"}
    if call.decoupled:
        # Answered on a stream: a decoupled model's answers may come back.
        headers[DECOUPLED_HEADER] = b"true"
    return Call(INFERENCE, path, call.request_id, tuple(headers.items()))


def _with_body(request: Call, body: RestMessage) -> tuple[Call, bytes | memoryview]:
    """C{request} with the headers of C{body}, and the body's bytes."""
    headers = {**dict(request.headers), b"Content-Type": _JSON if body.header_length is None else _BINARY}
    if body.header_length is not None:
        headers[INFERENCE_HEADER_LENGTH] = b"%d" % body.header_length
    return attrs.evolve(request, headers=tuple(headers.items())), body.body


@attrs.define(eq=False)
class _Waiting:
    """One client's inference, from its arrival to its answer."""

    request: Call
    call: InferCall
    #: Its parsed inputs and outputs; None when it goes alone, as it came.
    parsed: InferRequest | None
    #: What must match for requests to merge (None: it merges with none).
    kind: tuple | None
    rows: int
    span: ISpan
    queue: _Queue
    arrived: float
    answer: Deferred = attrs.field(init=False)
    #: Its own wait timeout, from its arrival, while it waits in its queue.
    expiry: DelayedCall = attrs.field(init=False)
    #: The batch it went in, once forwarded.
    batch: _Batch | None = None


@attrs.define(eq=False)
class _Batch:
    members: list[_Waiting]
    forward: Deferred | None = None
    #: While it holds one of its queue's lanes: when it lets go of it unanswered.
    lane: DelayedCall | None = None


@attrs.define(eq=False)
class _Queue:
    """The inferences of one model path waiting for a slot."""

    path: bytes
    demand: Demand
    most_rows: int
    waiting: BatchQueue[_Waiting]
    #: Whether a lease has been asked for and not yet used, and since when.
    asking: bool = False
    asked: float = 0.0
    #: Its batches that hold a lane (forwarded, not yet answered).
    in_flight: int = 0


@attrs.define(eq=False)
class _Lane:
    """
    Steps of one sequence model on one worker that share one slot there:
    the slot's C{lease} once granted, the steps that ride it or wait for
    it (C{riders}), and what each waiting one is told when it is granted
    or refused.
    """

    demand: Demand
    lease: Lease | None = None
    riders: int = 0
    failure: Failure | None = None
    waiting: list[Deferred] = attrs.Factory(list)

    def ride(self) -> Deferred[Lease]:
        """A hold on the lane's slot, once it has one."""
        if self.lease is not None:
            return succeed(self.lease.share())
        if self.failure is not None:
            return fail(self.failure)
        d: Deferred[Lease] = Deferred(self.waiting.remove)
        self.waiting.append(d)
        return d

    def granted(self, lease: Lease) -> None:
        self.lease = lease
        waiting, self.waiting = self.waiting, []
        for d in waiting:
            d.callback(lease.share())

    def refused(self, failure: Failure) -> None:
        self.failure = failure
        waiting, self.waiting = self.waiting, []
        for d in waiting:
            d.errback(failure)


def _kind(request: InferRequest, most_rows: int) -> tuple[tuple | None, int]:
    """What a request must share with others to merge (None: it cannot), and its rows."""
    shapes = [array.shape for array in request.inputs.values()]
    rows = shapes[0][0] if all(shapes) else 0
    if (set(request.parameters) - {"binary_data_output"} or not 1 <= rows <= most_rows
            or any(shape[0] != rows for shape in shapes)):
        return None, rows
    inputs = tuple((name, array.dtype, array.shape[1:]) for name, array in request.inputs.items())
    return (inputs, tuple(output.name for output in request.outputs)), rows


class FrontBatcher:
    """
    Forwards inferences with C{forwarder}, merged where they can be; at
    most C{most_waiting} wait per model path, past that 503 C{queue_full}.
    """

    def __init__(self, forwarder: Forwarder, clock, most_waiting: int):
        self._forwarder = forwarder
        self._scheduler = forwarder.scheduler
        self._pool = forwarder.scheduler.pool
        self._clock = clock
        self._most_waiting = most_waiting
        self._queues: dict[bytes, _Queue] = {}
        #: The lanes of sequence models' steps, by worker instance and model.
        self._lanes: dict[tuple[str | None, str | None], list[_Lane]] = {}

    def infer(self, request: Call, call: InferCall, model: str, most_rows: int,
              span: ISpan) -> Deferred[InferAnswer | GrpcAnswer]:
        """
        The answer to C{call}, forwarded alone as C{request} (to a model's
        C{/infer} route), of C{model}, which takes C{most_rows} rows a batch
        (0: it has no batch dimension); its forward traced in C{span}.
        Fails with the L{KCoralError} the worker answered or the forward met.
        """
        queue = self._queues.get(request.path)
        if queue is None:
            queue = self._queues[request.path] = _Queue(request.path, Demand.of_model(model),
                                                        most_rows, BatchQueue(self._most_waiting))
        queue.most_rows = most_rows
        if queue.waiting.full:
            raise ServerBusy(f"{len(queue.waiting)} inferences of this model are already waiting",
                             reason="queue_full")
        parsed, kind, rows = None, None, 0
        # The front parses only what it can parse on the reactor without
        # holding up other clients; merging a larger body would save little
        # next to the cost of its bytes, so it goes alone, as it came.
        if most_rows > 0 and call.message.size <= ON_REACTOR_BYTES:
            try:
                parsed = call.message.request()
                kind, rows = _kind(parsed, most_rows)
            except BadRequest:
                # The worker answers it, alone, in its REST form; a gRPC
                # message that has none is refused here, as it is read.
                call = attrs.evolve(call, message=call.message.rest())
        waiting = _Waiting(request, call, parsed, kind, rows, span, queue,
                           self._clock.seconds())
        waiting.answer = Deferred(lambda d: self._cancelled(waiting))
        waiting.expiry = self._clock.callLater(self._scheduler.queue.timeout_seconds,
                                               self._expired, waiting)
        queue.waiting.append(waiting)
        self._ask(queue)
        return waiting.answer

    def step(self, request: Call, message: RestMessage, demand: Demand, most: int,
             span: ISpan) -> Deferred[InferAnswer]:
        """
        The answer to a sequence's step, whose C{demand} pins it to the
        worker that holds the sequence, forwarded alone as C{request} with
        C{message}. The steps of one model on one worker share a slot there
        (a L{_Lane}), up to C{most} at once: the worker runs those that wait
        as one execution, and a slot each would hold back the steps that
        make its batches.
        """
        request, body = _with_body(request, message)
        lane = self._lane(demand, most)
        d = lane.ride()
        d.addCallback(lambda lease: self._forwarder.forward(
            request, MemoryBody(bytes(body)), demand, 1, span, lease=lease, waited=True))
        d.addBoth(self._alighted, lane)
        return d.addCallback(_answer_of)

    def _lane(self, demand: Demand, most: int) -> _Lane:
        """A lane of C{demand}'s model and worker with room for one more
        step, counted in it: one there is, or a new one that asks for a slot."""
        lanes = self._lanes.setdefault((demand.kept, demand.model), [])
        for lane in lanes:
            if lane.riders < max(most, 1):
                lane.riders += 1
                return lane
        lane = _Lane(demand, riders=1)
        lanes.append(lane)
        arrived = self._clock.seconds()

        def granted(lease: Lease) -> None:
            self._forwarder.observe_wait(self._clock.seconds() - arrived)
            lane.granted(lease)
            if not lane.riders:  # every step waiting for it went away
                self._close(lane)

        def refused(failure: Failure) -> None:
            self._close(lane)
            lane.refused(failure)

        self._scheduler.acquire(demand).addCallbacks(granted, refused)
        return lane

    def _alighted(self, result, lane: _Lane):
        """A step of C{lane} is answered (or went away): a lane with no step
        left lets its slot go."""
        lane.riders -= 1
        if not lane.riders and lane.lease is not None:
            self._close(lane)
        return result

    def _close(self, lane: _Lane) -> None:
        lanes = self._lanes.get((lane.demand.kept, lane.demand.model), [])
        if lane in lanes:
            lanes.remove(lane)
            if not lanes:
                del self._lanes[(lane.demand.kept, lane.demand.model)]
        if lane.lease is not None:
            lane.lease.release()

    def _ask(self, queue: _Queue) -> None:
        """Ask for a lease for the queue's next batch, once at a time, while
        the model has a lane free."""
        if (queue.asking or not queue.waiting
                or queue.in_flight >= max(self._pool.batch_lanes(queue.demand.model), 1)):
            return
        queue.asking, queue.asked = True, self._clock.seconds()
        self._scheduler.acquire(queue.demand).addCallbacks(
            self._granted, self._refused, callbackArgs=(queue,), errbackArgs=(queue,))

    def _granted(self, lease: Lease, queue: _Queue) -> None:
        # Requests whose bytes the reactor read in this same turn join first.
        self._clock.callLater(0, self._form, queue, lease)

    def _refused(self, failure: Failure, queue: _Queue) -> None:
        queue.asking = False
        now, timeout = self._clock.seconds(), self._scheduler.queue.timeout_seconds
        if now - queue.asked >= timeout:
            # The lease's own wait timed out: it was asked for on behalf of
            # the requests then waiting, whose time is up too; those that
            # arrived since have time left, and the lease is asked for again.
            for request in [r for r in queue.waiting if now - r.arrived >= timeout]:
                self._expired(request)
            self._ask(queue)
        else:
            # No member, a draining front, the front's queue full: every
            # request waiting now would meet the same.
            for request in queue.waiting.drain():
                request.expiry.cancel()
                request.answer.errback(failure)
        self._tidy(queue)

    def _expired(self, waiting: _Waiting) -> None:
        """C{waiting} has waited its queue wait timeout: it is refused."""
        if waiting.expiry.active():
            waiting.expiry.cancel()
        waiting.queue.waiting.remove(waiting)
        waiting.answer.errback(self._scheduler.timed_out())
        self._tidy(waiting.queue)

    def _form(self, queue: _Queue, lease: Lease) -> None:
        queue.asking = False
        batch = _Batch([])
        try:
            if queue.waiting:
                self._take(queue, batch)
                self._send(batch, lease)
        except Exception:
            # A fault of this module's: the requests it took get a 500 and
            # the lease goes back, so that nothing waits forever.
            log.failure("a batch of {path} could not be sent", path=queue.path)
            _fail(batch.members, InternalError("the inference could not be forwarded"))
        finally:
            if batch.forward is None:
                lease.release()
            self._ask(queue)
            self._tidy(queue)

    def _take(self, queue: _Queue, batch: _Batch) -> None:
        """Take the next batch into C{batch}: the queue's head, as far as
        its requests merge and fit."""
        now = self._clock.seconds()
        for request in queue.waiting.take(queue.most_rows):
            request.expiry.cancel()
            batch.members.append(request)
            request.batch = batch
            self._forwarder.observe_wait(now - request.arrived)

    def _send(self, batch: _Batch, lease: Lease | None = None) -> None:
        """Forward C{batch} with C{lease}, or, without one, as a request
        sent again, whose wait was observed when it was first taken."""
        first = batch.members[0]
        if len(batch.members) == 1:
            request, body = _with_body(first.request, first.call.message.rest())
        else:
            request, body = _with_body(first.request, RestMessage(*merge_infer(
                [m.parsed for m in batch.members], first.kind[1])))  # type: ignore[misc, index]
            if debug_enabled():
                log.debug("{request_id} carries the inferences {ids}", request_id=first.call.request_id,
                          ids=[m.call.request_id for m in batch.members])
        batch.forward = self._forwarder.forward(request, MemoryBody(bytes(body)), first.queue.demand,
                                                1, first.span, lease=lease, waited=lease is None)
        if lease is not None and sum(m.rows for m in batch.members) >= LANE_SHARE * first.queue.most_rows:
            batch.lane = self._clock.callLater(LANE_HOLD_SECONDS, self._free_lane, batch)
            first.queue.in_flight += 1
        batch.forward.addBoth(self._answered, batch).addErrback(self._broken, batch)

    def _broken(self, failure: Failure, batch: _Batch) -> None:
        """A fault of this module's while answering C{batch}: its members
        still waiting for it get a 500."""
        log.failure("the answer to a batch could not be handed over", failure)
        _fail([m for m in batch.members if m.batch is batch],
              InternalError("the inference's answer could not be handed over"))

    def _free_lane(self, batch: _Batch) -> None:
        """C{batch} lets go of its lane: the next batch may take it."""
        queue = batch.members[0].queue
        batch.lane = None
        queue.in_flight -= 1
        self._ask(queue)
        self._tidy(queue)

    def _answered(self, result, batch: _Batch) -> Deferred | None:
        if batch.lane is not None:
            batch.lane.cancel()
            self._free_lane(batch)
        live = [m for m in batch.members if not m.answer.called]
        if isinstance(result, Failure):
            _fail(live, result)
        elif len(batch.members) == 1:
            for member in live:
                _settle(member, _answer_of, result)
        elif result.code == 200:
            # A large answer is split in a thread, as a worker encodes it.
            members = batch.members
            return off_reactor(len(result.body), _split, result, members).addCallbacks(
                _hand_over, _fail_each, callbackArgs=(members,), errbackArgs=(members,))
        elif _one_members(result.code):
            for member in live:
                log.info("{request_id} sent alone: its batch was answered {status}",
                         request_id=member.call.request_id, status=result.code)
                member.batch = _Batch([member])
                self._send(member.batch)
        else:
            _fail(live, error_from_answer(result.code, result.body))
        return None

    def _cancelled(self, waiting: _Waiting) -> None:
        batch = waiting.batch
        if batch is None:
            if not waiting.queue.waiting.remove(waiting):
                return
            waiting.expiry.cancel()
            log.info("{request_id} dropped: the client went away before its batch was sent",
                     request_id=waiting.call.request_id)
            self._tidy(waiting.queue)
        elif batch.forward is not None and all(
                m is waiting or m.answer.called for m in batch.members):
            batch.forward.cancel()

    def _tidy(self, queue: _Queue) -> None:
        """Forget a queue with nothing waiting, asked for nor in flight."""
        if (not queue.waiting and not queue.asking and not queue.in_flight
                and self._queues.get(queue.path) is queue):
            del self._queues[queue.path]


def _one_members(status: int) -> bool:
    """Whether a merged request's error C{status} may be one member's doing:
    a 4xx (its inputs do not fit the model), a 500 (its inputs fail the
    model) or a 507 (its outputs do not fit the worker's memory). A 503 or a
    lost node is the capacity's, and what each member would have met."""
    return 400 <= status < 500 or status in (ProgramFailed.status, KeptMemoryFull.status)


def _fail(members: list[_Waiting], error: Exception | Failure) -> None:
    """Fail the answers of C{members} that have not fired with C{error}."""
    for member in members:
        if not member.answer.called:
            member.answer.errback(error)


def _settle(member: _Waiting, answer: Callable[..., InferAnswer], *args) -> None:
    """Fire C{member}'s answer with what C{answer(*args)} returns or raises
    (a failure that is no KCoral error is the client's 500)."""
    try:
        value = answer(*args)
    except Exception:
        member.answer.errback()
    else:
        member.answer.callback(value)


def _split(answer, members: list[_Waiting]) -> list[InferAnswer | GrpcAnswer | Failure]:
    """Each member's answer (or its failure) from its own rows of the merged
    C{answer}; L{ProgramFailed} when the answer does not parse or has other
    than their rows."""
    name, version, outputs = parse_answer(answer.body, _header_length(answer))
    total = sum(m.rows for m in members)
    if any(not o.shape or o.shape[0] != total for o in outputs.values()):
        raise ProgramFailed(f"the model answered outputs of other than {total} rows")
    answers: list[InferAnswer | GrpcAnswer | Failure] = []
    start = 0
    for member in members:
        rows = {key: output[start:start + member.rows] for key, output in outputs.items()}
        start += member.rows
        assert member.parsed is not None  # a merged request's members were parsed
        try:
            # In the form the member's inference came in: a gRPC one's
            # answer is its message, with no REST body made for it.
            answers.append(member.call.message.answer(name, version, member.parsed, rows))
        except Exception:
            answers.append(Failure())
    return answers


def _hand_over(answers: list[InferAnswer | GrpcAnswer | Failure], members: list[_Waiting]) -> None:
    """Fire the answers of C{members} that still wait for one."""
    for member, answer in zip(members, answers, strict=True):
        if not member.answer.called:
            if isinstance(answer, Failure):
                member.answer.errback(answer)
            else:
                member.answer.callback(answer)


def _fail_each(failure: Failure, members: list[_Waiting]) -> None:
    """A merged answer that is malformed fails each member alike; any other
    failure is this module's fault, and goes on."""
    failure.trap(ProgramFailed)
    _fail(members, failure)


def _header_length(answer) -> int | None:
    """The length of the JSON header of a worker's binary answer; a
    malformed one is the worker's failure."""
    length = answer.headers.get(INFERENCE_HEADER_LENGTH)
    if length is None:
        return None
    counted = read_count(length, MOST_BYTES)
    if counted is None:
        raise ProgramFailed(f"the worker answered a malformed header length: {length[:64]!r}")
    return counted


def _answer_of(answer) -> InferAnswer:
    """A member's answer to one request, as it came, or the error it says."""
    if answer.code != 200:
        raise error_from_answer(answer.code, answer.body)
    return InferAnswer(body=answer.body, header_length=_header_length(answer))
