"""
Sequence batching: the live sequences of one sequence model on one worker,
and the order their steps run in.

A sequence is named by its client's token and its id; it holds a slot of
the model's L{StateTable}, where its state stays on the device between
steps. Its steps run one at a time, in the order they arrived. With the
C{direct} strategy each step is an execution of its own; with C{oldest},
an execution takes the first step of each waiting sequence, oldest
first, up to C{max_batch_size} of them (whose inputs have the same
dimensions past the first), each row with its own state: the device does
the work of many sequences in the time of about one.

Executions of a model run one at a time, as its table is written by each.
A sequence idle C{max_idle_seconds} (none of its steps waiting or running)
is freed; a step of a sequence not live, without START, is refused in
Triton's words. Everything here runs on the reactor's thread except the
executions, which run on a worker thread with an admission slot.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping

import attrs
import numpy as np
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.errors import BadRequest, ProgramFailed, ServerBusy
from kcoral.models.manifest import OLDEST
from kcoral.protocol.sequence import SequenceControls
from kcoral.server.models import LoadedModel
from kcoral.server.statetable import StateLost, StateTable

log = Logger()

#: The live sequences a worker holds of one model, unless told otherwise.
MAX_SEQUENCES = 1024


@attrs.define(eq=False)
class _Step:
    controls: SequenceControls
    inputs: Mapping[str, np.ndarray]
    #: What must match for steps to share an execution: every input's dimensions past the first.
    kind: tuple
    answer: Deferred
    request_id: str


@attrs.define(eq=False)
class _Sequence:
    key: tuple
    slot: int
    steps: deque[_Step] = attrs.field(factory=deque)
    #: One of its steps is executing.
    running: bool = False
    #: Its last step so far ends it: only a START may follow.
    ending: bool = False
    #: No step of it has run yet: its slot holds no state of its own.
    fresh: bool = True
    #: The timer that frees it once it has been idle long enough.
    idle_timer: IDelayedCall | None = None


class Sequencer:
    """
    The live sequences of the sequence C{model} (its C{states} table
    loaded), at most C{most_live} of them. C{admitted()} fires once an
    execution holds an admission slot (C{release()} gives one back
    unused); C{in_thread(rid, f, *args)} runs C{f} on a worker thread with
    that slot and releases it when done. C{live(change)} is told each
    sequence started (+1) and freed (-1); C{executed(rows, seconds)} how
    long each execution ran.
    """

    def __init__(self, model: LoadedModel, *, admitted: Callable[[], Deferred],
                 release: Callable[[], None], in_thread: Callable[..., Deferred], clock,
                 most_live: int = MAX_SEQUENCES,
                 live: Callable[[int], None] = lambda change: None,
                 executed: Callable[[int, float], None] = lambda rows, seconds: None):
        assert model.states is not None and model.manifest.sequence is not None
        self.model = model
        self._table: StateTable = model.states
        self._spec = model.manifest.sequence
        self._most_rows = model.manifest.max_batch_size if self._spec.batching == OLDEST else 1
        self._admitted = admitted
        self._release = release
        self._in_thread = in_thread
        self._clock = clock
        self._most_live = most_live
        self._live_changed = live
        self._executed = executed
        self._sequences: dict[tuple, _Sequence] = {}
        #: Slots given back, the lowest reused first so the table stays small.
        self._free: list[int] = []
        self._next_slot = 0
        #: The sequences with a step waiting and none running, in the order they got it.
        self._waiting: deque[_Sequence] = deque()
        #: An execution holds a slot or runs: the next waits for it.
        self._busy = False

    @property
    def live(self) -> int:
        """How many sequences it holds."""
        return len(self._sequences)

    def step(self, token: bytes | None, controls: SequenceControls,
             inputs: Mapping[str, np.ndarray], rows: int, request_id: str) -> Deferred:
        """
        The outputs by name of one step of the sequence C{controls} names
        for the client of C{token} (C{inputs}: C{rows} rows, checked
        against the model), once the steps before it have run. A START
        starts the sequence (a live one of the same id from its initial
        state again); an END frees it after its step. Fails at once with a
        L{BadRequest} in Triton's words, or L{ServerBusy}
        C{sequences_full} when a new sequence would pass C{most_live}.
        Cancelling it does not take it back: a sequence's steps all run, in
        order, or its state would not be the one its client expects.
        """
        name = self.model.manifest.name
        try:
            controls.require(name, rows)
        except BadRequest:
            return fail()
        key = (token, controls.id)
        sequence = self._sequences.get(key)
        if not controls.start and (sequence is None or sequence.ending):
            return fail(controls.not_started(name))
        if sequence is None:
            if len(self._sequences) >= self._most_live:
                # The reason in the message too: Triton's clients read the message alone.
                return fail(ServerBusy(f"sequences_full: {len(self._sequences)} sequences of "
                                       f"{name} are live, the most this worker holds "
                                       f"(--max-sequences)", reason="sequences_full"))
            sequence = self._sequences[key] = _Sequence(key, self._slot())
            self._live_changed(+1)
        if sequence.idle_timer is not None:
            sequence.idle_timer.cancel()
            sequence.idle_timer = None
        sequence.ending = controls.end
        step = _Step(controls, inputs, tuple(a.shape[1:] for a in inputs.values()),
                     Deferred(), request_id)
        sequence.steps.append(step)
        if not sequence.running and len(sequence.steps) == 1:
            self._waiting.append(sequence)
        self._next()
        return step.answer

    def close(self) -> None:
        """Free every sequence (the model is no longer served): their idle
        timers stop, and their steps still waiting fail."""
        for sequence in list(self._sequences.values()):
            for step in sequence.steps:
                _answer(step, Failure(ProgramFailed(f"model {self.model.manifest.name} was "
                                                    "unloaded: its sequences ended")))
            sequence.steps.clear()
            self._free_sequence(sequence)
        self._waiting.clear()

    def _slot(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self._next_slot += 1
        return self._next_slot - 1

    def _free_sequence(self, sequence: _Sequence) -> None:
        if self._sequences.get(sequence.key) is not sequence:
            return
        del self._sequences[sequence.key]
        if sequence.idle_timer is not None and sequence.idle_timer.active():
            sequence.idle_timer.cancel()
        sequence.idle_timer = None
        heapq.heappush(self._free, sequence.slot)
        self._live_changed(-1)

    def _idled(self, sequence: _Sequence) -> None:
        sequence.idle_timer = None
        # The id quoted: a client's string may hold a line break.
        log.info("sequence {id!r} of {name} was idle {seconds}s: its state is freed",
                 id=sequence.key[1], name=self.model.manifest.name,
                 seconds=self._spec.max_idle_seconds)
        self._free_sequence(sequence)

    def _next(self) -> None:
        """Ask for an admission slot for the next execution, once at a time."""
        if self._busy or not self._waiting:
            return
        self._busy = True
        self._admitted().addCallbacks(self._granted, self._refused)

    def _refused(self, failure: Failure) -> None:
        # The server's queue is full or timed out: the steps waiting now
        # would have met the same. Their sequences stay as they were, but
        # for those that never ran a step, which never started.
        self._busy = False
        while self._waiting:
            sequence = self._waiting.popleft()
            while sequence.steps:
                _answer(sequence.steps.popleft(), failure)
            if sequence.fresh:
                self._free_sequence(sequence)
            else:
                self._settled(sequence)

    def _granted(self, _) -> None:
        if not self._waiting:
            self._busy = False
            self._release()
            return
        batch = [self._waiting.popleft()]
        kind = batch[0].steps[0].kind
        passed: list[_Sequence] = []
        while self._waiting and len(batch) < self._most_rows:
            sequence = self._waiting.popleft()
            (batch if sequence.steps[0].kind == kind else passed).append(sequence)
        self._waiting.extendleft(reversed(passed))
        steps = []
        for sequence in batch:
            sequence.running = True
            steps.append(sequence.steps.popleft())
        started = self._clock.seconds()
        ran = self._in_thread(steps[0].request_id, _run, self._table,
                              [s.slot for s in batch], steps)
        ran.addBoth(self._ran, batch, steps, started)

    def _ran(self, result, batch: list[_Sequence], steps: list[_Step], started: float) -> None:
        # The admission slot is free again (in_thread gave it back), and a
        # failure is already the KCoralError its steps answer with.
        self._busy = False
        if result is _LOST:
            result = Failure(ProgramFailed(
                f"a step of {self.model.manifest.name} failed, and with it the state of every "
                "live sequence: they must start again"))
            for sequence in list(self._sequences.values()):
                for step in sequence.steps:
                    _answer(step, result)
                sequence.steps.clear()
                self._free_sequence(sequence)
            self._waiting.clear()
        else:
            self._executed(len(steps), self._clock.seconds() - started)
        for i, (sequence, step) in enumerate(zip(batch, steps)):
            sequence.running = False
            failed = isinstance(result, Failure)
            _answer(step, result if failed else result[i])
            sequence.fresh = sequence.fresh and failed
            if (step.controls.end or sequence.fresh) and not sequence.steps:
                self._free_sequence(sequence)
            else:
                self._settled(sequence)
        self._next()

    def _settled(self, sequence: _Sequence) -> None:
        """After a step of a live C{sequence}: its next one waits its turn,
        or it idles."""
        if self._sequences.get(sequence.key) is not sequence:
            return
        if sequence.steps:
            self._waiting.append(sequence)
        else:
            sequence.idle_timer = self._clock.callLater(self._spec.max_idle_seconds,
                                                        self._idled, sequence)


class Arrivals:
    """
    The order in which requests of each sequence model arrived, kept until
    each is handed to its L{Sequencer}: a request read in a thread (a large
    one) may be read after one that came later, and a sequence's steps
    must run in the order they were sent (a stream's, say).
    """

    def __init__(self):
        #: Each model's last arrival not yet handed on.
        self._last: dict[int, _Arrival] = {}

    def arrive(self, model: LoadedModel) -> _Arrival:
        """A request of C{model} arrived: its turn comes once every earlier
        one is L{_Arrival.done}."""
        key = id(model)

        def forget() -> None:
            if self._last.get(key) is arrival:
                del self._last[key]

        arrival = _Arrival(self._last.get(key), forget)
        self._last[key] = arrival
        return arrival


class _Arrival:
    def __init__(self, before: _Arrival | None, forget: Callable[[], None]):
        self._forget = forget
        self._done = self._started = False
        #: Fires once it is done after its turn: the next arrival's turn.
        self._finished: Deferred = Deferred()
        #: Fires once every request of its model that arrived before it is done.
        self.turn: Deferred = Deferred()
        if before is None:
            self._start()
        else:
            before._finished.addCallback(lambda _: self._start())

    def _start(self) -> None:
        self._started = True
        if not self.turn.called:  # else cancelled: its client went away
            self.turn.callback(None)
        if self._done:
            self._finish()

    def done(self) -> None:
        """Handed on, or failed (then perhaps before its turn): the next
        arrival's turn, once this one's has come."""
        if self._done:
            return
        self._done = True
        if self._started:
            self._finish()

    def _finish(self) -> None:
        self._finished.callback(None)
        self._forget()


def _answer(step: _Step, result) -> None:
    """Answer C{step} with C{result} (outputs, or a Failure), unless its
    client went away (its answer was cancelled)."""
    if not step.answer.called:
        step.answer.callback(result)


#: What L{_run} returns when the step lost every sequence's state.
_LOST = object()


def _run(table: StateTable, slots: list[int], steps: list[_Step]):
    """Each step's outputs of one execution of their rows (on a worker thread)."""
    names = [spec.name for spec in table.manifest.inputs]
    inputs = {name: np.concatenate([s.inputs[name] for s in steps]) for name in names}
    controls = _controls(table, steps)
    try:
        outputs = table.run(slots, [s.controls.start for s in steps], controls, inputs)
    except StateLost:
        return _LOST
    return [{name: output[i:i + 1] for name, output in outputs.items()} for i in range(len(steps))]


def _controls(table: StateTable, steps: list[_Step]) -> dict[str, np.ndarray]:
    """The model's controls for C{steps}, a row each."""
    assert table.manifest.sequence is not None
    values = {"START": lambda c: int(c.start), "END": lambda c: int(c.end), "READY": lambda c: 1,
              "CORRID": lambda c: c.correlation}
    controls = {}
    for spec in table.manifest.sequence.controls:
        value = values[spec.name]
        # A uint32 CORRID holds the id's low 32 bits.
        mask = (1 << (8 * spec.dtype.itemsize)) - 1
        controls[spec.name] = np.array([[value(s.controls) & mask] for s in steps], spec.dtype)
    return controls
