"""
A request body's intake, from its head to the body its handler reads
(L{kcoral.web.body.IBody}) or to its refusal: one state machine, fed by the
calls Twisted makes on the request (L{kcoral.web.request.KCoralRequest}),
with L{kcoral.web.bounds.BodyBounds} as its policy::

    the head's judgement starts it in one of:

    dropping, in memory (whole: processed in that state)
    spooling --whole--> flushing --spooled--> received
    streaming (processed from its head) --whole--> received
       |
       +--answered--> answered early
    refused (its head refused)

    refused, from: dropping, in memory, spooling, flushing, streaming,
                   received (refuse)
    every state --lost--> gone

From its head, a request is refused (its target, its announced length, a
guard), or its body is dropped as it arrives (no route reads it), kept in
memory, spooled to a file while it arrives (its request processed once
every write has ended: L{kcoral.web.spool}), or streamed: its request is
processed as soon as its head is whole, its body followed by readers while
it arrives, its client read only while one does. A body breaking its bounds
while it arrives is refused there, without reading the rest, as is one
whose spool fails or that arrives too slowly for the forward waiting on it;
one answered while it still arrives has the rest dropped, and its
connection closes.

Each transition runs to its end before another starts (a call made during
one waits for it), so a request is never processed from inside one: it
processes itself once the calls that say it may (L{Intake.head},
L{Intake.whole}) have returned, and a handler that answers at once finds
the intake between transitions. The head is judged outside the machine,
which it then starts in the state it chose (L{Intake.head}), and each chunk
of the body is taken by what its state set (L{_Sink}): see there why.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import attrs
from automat import TypeMachineBuilder, pep614
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IPushProducer
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers

from kcoral.errors import BadRequest, InternalError, KCoralError, RequestTimeout
from kcoral.web.body import PACE_BYTES_PER_SECOND, IBody, RequestBody
from kcoral.web.channel import KCoralChannel
from kcoral.web.family import guarded, takes_body
from kcoral.web.path import canonical, form_of
from kcoral.web.requestid import HEADER
from kcoral.web.responses import raw_error_response, raw_response
from kcoral.web.seams import withhold_continue
from kcoral.web.spool import UNREAD, Holds, Spool, SpoolWriter

#: Chunks of a body forwarded while it arrives smaller than this are joined
#: before it keeps them: each chunk it keeps is then at least this large
#: (but its last), so what objects cost beside their bytes stays negligible.
JOIN_BYTES = 64 << 10


class Taken(Protocol):
    """What the intake reads and sets of its request (Twisted's names, and
    KCoral's request id)."""

    content: Any
    path: bytes
    code: int
    startedWriting: int
    requestHeaders: Headers
    responseHeaders: Headers

    @property
    def request_id(self) -> str: ...

    def notifyFinish(self) -> Deferred[None]: ...

    def connectionLost(self, reason: Failure) -> None: ...

    def close_after_response(self) -> None: ...


class _Inputs(Protocol):
    def refuse(self, error: KCoralError) -> None:
        """Answer C{error}, reading no more of the body: it broke its bounds,
        its spool's write failed, or it arrives too slowly for the forward
        waiting on it."""

    def flush(self) -> Deferred[IBody]:
        """All of a spooled body arrived: fires with it once every write
        has ended."""

    def spooled(self, body: IBody) -> bool:
        """Every write of a spooled body has ended: C{body} is all of it.
        Whether its request is to be processed now."""

    def whole(self) -> None:
        """All of a streamed body arrived."""

    def answered(self) -> None:
        """A streamed request is finished."""

    def lost(self) -> None:
        """The connection is gone."""


# A body's chunks go where its state set (the core's sink), not through the
# machine: automat finds a transition by comparing the state and input with
# each of the machine's transitions in turn (each comparison a call in
# Python), and a large body arrives in thousands of chunks. So does the news
# that all of it arrived, where that changes nothing: a body dropped or kept
# in memory is processed in that state, and one refused, answered or gone is
# not. Likewise the head is judged outside it (a pure function of the head
# and the site), which starts the machine in the state it chose, and only a
# streamed request is told it was answered: a request kept in memory makes
# no transition. See doc/architecture.rst for what each cost.


def _ignored(core: _Core, inputs: _Inputs, data: bytes) -> None:
    """A chunk of a body refused, answered, or whose client is gone."""


def _dropped(core: _Core, inputs: _Inputs, data: bytes) -> None:
    core.within_bounds(inputs, data)


def _kept(core: _Core, inputs: _Inputs, data: bytes) -> None:
    if core.within_bounds(inputs, data):
        core.request.content.write(data)


def _written(core: _Core, inputs: _Inputs, data: bytes) -> None:
    if core.within_bounds(inputs, data):
        assert core.writer is not None  # made with the state
        core.writer.write(data)


def _followed(core: _Core, inputs: _Inputs, data: bytes) -> None:
    if not core.within_bounds(inputs, data):
        return
    core.join(data)
    if core.received >= core.expected:
        # Its last byte: the client is never held again, and its
        # connection's idle timeout is back on before Twisted's channel
        # sets it aside for the processing that follows.
        core.paced(True)


def _now(core: _Core, inputs: _Inputs) -> Deferred[bool]:
    return succeed(True)


def _not_now(core: _Core, inputs: _Inputs) -> Deferred[bool]:
    return succeed(False)


def _flushed(core: _Core, inputs: _Inputs) -> Deferred[bool]:
    # What its writes' end says is told once the flush's transition has
    # ended (they may have ended already): its request is then processed
    # outside any transition.
    return inputs.flush().addCallbacks(inputs.spooled, partial(core.spool_failed, inputs))


def _arrived(core: _Core, inputs: _Inputs) -> Deferred[bool]:
    inputs.whole()
    return succeed(False)


def _unheeded(core: _Core, inputs: _Inputs) -> None:
    """An answer that changes nothing of the body's intake."""


def _answered(core: _Core, inputs: _Inputs) -> None:
    inputs.answered()


@attrs.frozen
class _Sink:
    """Where a state has its body's chunks go (C{chunk}), what all of it
    having arrived does (C{whole}: fires with whether its request is to be
    processed now), and what its request's answer does (C{answered}: only a
    streamed body, which may still arrive, heeds it)."""

    chunk: Callable[[_Core, _Inputs, bytes], None]
    whole: Callable[[_Core, _Inputs], Deferred[bool]]
    answered: Callable[[_Core, _Inputs], None] = _unheeded


#: Refused, answered early, or its client gone.
_IGNORED = _Sink(_ignored, _not_now)
_DROPPED = _Sink(_dropped, _now)
_KEPT = _Sink(_kept, _now)
#: Spooling: processed once every write has ended (flushing).
_WRITTEN = _Sink(_written, _flushed)
#: Streaming: processed since its head.
_FOLLOWED = _Sink(_followed, _arrived, _answered)


@attrs.define(eq=False)
class _Core:
    """What the intake's states share: the request, its site, and where its
    body goes."""

    #: The request, held weakly: it holds its intake, and a cycle would make
    #: every request garbage that only the collector frees (measured: 23
    #: objects a request, and gen-0 collections five times as often). A body
    #: spooled or streamed holds it (L{Intake.head}): it has calls that may
    #: come after the request's own (its writes ending, its pace).
    request: Taken
    channel: KCoralChannel
    #: When its head was whole (the site's clock; None: not yet).
    started: float | None = None
    #: Its target, canonical (L{kcoral.web.path.canonical}).
    target: bytes = b""
    received: int = 0
    #: Bytes a streamed body announced.
    expected: int = 0
    holds: Holds | None = None
    writer: SpoolWriter | None = None
    #: The body spooled or streamed (one in memory is the request's content).
    body: IBody | None = None
    #: Where a streamed body's chunks go once joined (L{join}), and the small
    #: ones waiting to be joined.
    keep: Callable[[bytes], object] | None = None
    small: bytearray = attrs.Factory(bytearray)
    #: Where the body goes as it arrives (see L{_Sink}): set as the machine
    #: starts, and by each transition to a state that takes no more of it
    #: (flushing and received keep the sink of the state before them).
    sink: _Sink = _IGNORED

    @property
    def site(self) -> Any:
        return self.channel.site

    def within_bounds(self, inputs: _Inputs, data: bytes) -> bool:
        """Count C{data} against the body's bounds: False (and refused) if it breaks them."""
        self.received += len(data)
        site = self.site
        # The time its client was held (not read) is not the client's.
        held = self.holds.held_seconds() if self.holds is not None else 0.0
        assert self.started is not None  # a body follows its head
        error = site.bounds.refuse_received(self.received, site.clock.seconds() - self.started - held)
        if error is not None:
            inputs.refuse(error)
            return False
        return True

    def holding(self) -> Holds:
        """What holds (pauses) its client: writes that lag, a body nobody reads."""
        self.holds = Holds(IPushProducer(self.channel.transport, None), self.channel,
                           self.site.clock)
        return self.holds

    def join(self, data: bytes) -> None:
        """Hand C{data} on to the body, small chunks joined first: a budget
        counts bytes, and a client sending tiny TCP segments would otherwise
        have tens of bytes of object kept (or queued for writing) for each."""
        assert self.keep is not None  # streamed
        small = self.small
        if not small and len(data) >= JOIN_BYTES:
            self.keep(data)
            return
        small += data
        if len(small) >= JOIN_BYTES or self.received >= self.expected:
            self.keep(bytes(small))
            small.clear()

    def paced(self, following: bool) -> None:
        """Whether a reader follows the body as it arrives: if none does
        (none has started, or the one that did is paused), its client is
        held until one does."""
        assert self.holds is not None  # streamed bodies are held
        if following or self.received >= self.expected:
            self.holds.release(UNREAD)
        else:
            self.holds.hold(UNREAD)

    def let_go_of_body(self) -> None:
        """A body processed while it arrived is no longer needed."""
        self.discard_writes()
        assert self.body is not None
        self.body.close()

    def discard_writes(self) -> None:
        if self.writer is not None:
            self.writer.discard()
            self.writer = None

    def let_go_of_client(self) -> None:
        """The connection is gone: nothing is to be resumed, nor written."""
        if self.holds is not None:
            self.holds.drop()
        self.discard_writes()

    def refusal(self, error: KCoralError) -> tuple[int, bytes]:
        self.site.logger.warn("{request_id} refused: {message}",
                              request_id=self.request.request_id, message=error.message)
        return error.status, raw_error_response(error, self.request.request_id, self.request.path)

    def answer_refusal(self, status: int, response: bytes) -> None:
        """Answer C{response} (a whole HTTP response) at once, reading no more."""
        self.stop_reading(status)
        self.channel.refuse(response)

    def stop_reading(self, status: int) -> None:
        """What arrived is let go at once, and what still arrives is dropped."""
        # Read by the channel once gotLength returns: a client told to go on
        # with a body already refused would send it for nothing.
        withhold_continue(self.request.requestHeaders)
        self.sink = _IGNORED
        self.request.content = RequestBody()
        self.discard_writes()
        self.read_the_rest()
        self.site.metrics.observe(self.request.path or b"other", status, 0.0)

    def answer_refusal_while_processed(self, status: int, response: bytes) -> None:
        """As L{answer_refusal}, for a request processed while its body
        arrived: what it waits on (a forward of that body) is cancelled as
        if its client had left, and an answer already under way cannot be
        followed by another: the connection is cut instead."""
        self.stop_reading(status)
        channel, request = self.channel, self.request
        if request.startedWriting:
            channel.discard_input()
            assert channel.transport is not None
            channel.transport.abortConnection()
        else:
            channel.refuse(response)
            request.connectionLost(Failure(ConnectionDone(f"refused with {status}")))

    def read_the_rest(self) -> None:
        """Read (and drop) what its client still sends: a client held while
        its answer is sent, then closed on, would get a reset, not the answer."""
        if self.holds is not None:
            self.holds.release_all()

    def spool_failed(self, inputs: _Inputs, failure: Failure) -> bool:
        """A write of its spool failed: refused (so not to be processed)."""
        self.site.logger.failure("{request_id} could not spool its body",
                                 failure, request_id=self.request.request_id)
        inputs.refuse(InternalError("could not buffer the request body"))
        return False

    def turn_away(self, answer: bytes) -> None:
        """Answer C{answer}, as the request has it (status, headers), reading no more."""
        request = self.request
        request.responseHeaders.setRawHeaders(HEADER, [request.request_id.encode()])
        headers = [(name, value) for name, values in request.responseHeaders.getAllRawHeaders()
                   for value in values]
        self.answer_refusal(request.code, raw_response(request.code, headers, answer))

    def spool(self, inputs: _Inputs, spool: Spool, length: int | None) -> None:
        """The body goes to C{spool}'s file as it arrives."""
        self.writer = spool.writer(self.holding(), partial(self.spool_failed, inputs), length)
        self.sink = _WRITTEN

    def stream(self, inputs: _Inputs, spool: Spool, length: int) -> None:
        """The request is processed now, its body followed while it arrives:
        kept in memory while the spool's budget allows, else written to a
        file; read as fast as it is forwarded (nothing while it waits for a
        member, then at the member's pace)."""
        holds = self.holding()
        body = spool.kept(length)
        if body is None:
            self.writer = spool.writer(holds, partial(self.spool_failed, inputs), length)
            self.keep = self.writer.write
            body = self.writer.body
            assert body is not None  # of known length
        else:
            self.keep = body.arrived
        self.body = body
        self.expected = length
        holds.hold(UNREAD)
        body.paced = self.paced
        body.stalled = partial(inputs.refuse, RequestTimeout(
            f"request body arrives under {PACE_BYTES_PER_SECOND} bytes/s while forwarded"))
        self.sink = _FOLLOWED
        self.request.notifyFinish().addBoth(lambda _: self.let_go_of_body())


@attrs.frozen
class _Machine:
    """The intake's machine, and the states its head's judgement may start it in."""

    build: Callable[[_Core, Any], _Inputs]
    dropping: Any
    in_memory: Any
    spooling: Any
    streaming: Any
    refused: Any


def _machine() -> _Machine:
    machine = TypeMachineBuilder(_Inputs, _Core)

    dropping = machine.state("Dropping")
    in_memory = machine.state("InMemory")
    spooling = machine.state("Spooling")
    flushing = machine.state("Flushing")
    streaming = machine.state("Streaming")
    received = machine.state("Received")
    refused = machine.state("Refused")
    answered_early = machine.state("AnsweredEarly")
    gone = machine.state("Gone")

    @pep614(dropping.upon(_Inputs.refuse).to(refused))
    @pep614(in_memory.upon(_Inputs.refuse).to(refused))
    @pep614(spooling.upon(_Inputs.refuse).to(refused))
    @pep614(flushing.upon(_Inputs.refuse).to(refused))
    def refuse(inputs: _Inputs, core: _Core, error: KCoralError) -> None:
        core.answer_refusal(*core.refusal(error))

    @pep614(spooling.upon(_Inputs.flush).to(flushing))
    def flush(inputs: _Inputs, core: _Core) -> Deferred[IBody]:
        # The channel reads nothing more until this request is done: its
        # processing waits for the last writes.
        assert core.writer is not None  # made as it started spooling
        return core.writer.finish()

    @pep614(flushing.upon(_Inputs.spooled).to(received))
    def spooled(inputs: _Inputs, core: _Core, body: IBody) -> bool:
        core.writer = None
        core.body = body
        core.request.notifyFinish().addBoth(lambda _: body.close())
        return True

    @pep614(gone.upon(_Inputs.spooled).loop())
    def unwanted(inputs: _Inputs, core: _Core, body: IBody) -> bool:
        body.close()
        return False

    # A streamed request is processed since its head: its body is now all
    # here (and written to its file as the spool goes while readers follow).
    streaming.upon(_Inputs.whole).to(received).returns(None)

    # A streamed body's writes to its file may go on once it is whole, and
    # one failing refuses it then (a spooled body's have all ended before it
    # is received, and one kept in memory never leaves that state).
    @pep614(streaming.upon(_Inputs.refuse).to(refused))
    @pep614(received.upon(_Inputs.refuse).to(refused))
    def refuse_while_streamed(inputs: _Inputs, core: _Core, error: KCoralError) -> None:
        core.answer_refusal_while_processed(*core.refusal(error))

    @pep614(streaming.upon(_Inputs.answered).to(answered_early))
    def answered_early_(inputs: _Inputs, core: _Core) -> None:
        # The rest of the body cannot be told from a next request: it is
        # dropped, and the connection closes. Twisted's channel answers
        # "Expect: 100-continue" once gotLength returns, and this request may
        # be answered from within it: a stray 100 would follow the answer.
        withhold_continue(core.request.requestHeaders)
        core.sink = _IGNORED
        core.request.close_after_response()
        core.channel.discard_input()
        core.read_the_rest()

    # What its spool or its pace says once its answer is under way, or its
    # client gone, changes nothing.
    for state in (refused, answered_early, gone):
        state.upon(_Inputs.refuse).loop().returns(None)
    # Only a streamed body's sink tells its request's answer (one answered
    # before its body was whole has the rest dropped); once whole, it keeps
    # that sink, and the answer changes nothing.
    received.upon(_Inputs.answered).loop().returns(None)

    @pep614(dropping.upon(_Inputs.lost).to(gone))
    @pep614(in_memory.upon(_Inputs.lost).to(gone))
    @pep614(spooling.upon(_Inputs.lost).to(gone))
    @pep614(flushing.upon(_Inputs.lost).to(gone))
    @pep614(streaming.upon(_Inputs.lost).to(gone))
    @pep614(received.upon(_Inputs.lost).to(gone))
    @pep614(refused.upon(_Inputs.lost).to(gone))
    @pep614(answered_early.upon(_Inputs.lost).to(gone))
    @pep614(gone.upon(_Inputs.lost).loop())
    def lost(inputs: _Inputs, core: _Core) -> None:
        core.sink = _IGNORED
        core.let_go_of_client()

    return _Machine(machine.build(), dropping, in_memory, spooling, streaming, refused)


_MACHINE = _machine()


class Intake:
    """
    The intake of one request's body (C{request}, on C{channel}): what its
    handler reads (L{body}), and the target it is processed with. Its
    machine starts at the request's head, in the state the head's judgement
    chose; before that, there is nothing to take.
    """

    def __init__(self, request: Taken, channel: KCoralChannel):
        self._core = _Core(weakref.proxy(request), channel)
        self._inputs: _Inputs | None = None

    @property
    def target(self) -> bytes:
        return self._core.target

    @property
    def started(self) -> float | None:
        """When its head was whole (None: not yet)."""
        return self._core.started

    def body(self) -> IBody | None:
        """The body spooled or streamed; None: in the request's content."""
        return self._core.body

    def _start(self, state: Any) -> _Inputs:
        self._inputs = inputs = _MACHINE.build(self._core, state)
        return inputs

    def _refuse(self, error: KCoralError) -> bool:
        self._start(_MACHINE.refused)
        self._core.answer_refusal(*self._core.refusal(error))
        return False

    def head(self, request: Taken, length: int | None, method: bytes, uri: bytes) -> bool:
        """The head of C{request} is whole (C{length}: its announced body
        length, None: chunked): judged, its machine starts in the state
        where its body goes. Whether the request is processed now, while its
        body arrives."""
        core = self._core
        site = core.site
        core.started = site.clock.seconds()
        # The one path everything reads (the guard here, then the resources,
        # Klein and the metrics): Twisted parses it from the canonical target,
        # never from the raw one.
        try:
            request.path, core.target = canonical(uri)
        except BadRequest as e:
            request.path = form_of(uri)
            return self._refuse(e)
        error = site.bounds.refuse_length(length)
        if error is not None:
            return self._refuse(error)
        guard = site.client_guard
        if guard is not None and method == b"POST" and guarded(request.path):
            # Refused before a byte of its body is read, let alone spooled.
            answer = guard.refusal(request, request.request_id)
            if answer is not None:
                self._start(_MACHINE.refused)
                core.turn_away(answer)
                return False
        # Its content is this intake's to fill (Twisted's own would go to a
        # temporary file past 100 KiB, on the reactor).
        request.content = RequestBody()
        spool = site.spool
        if not takes_body(method, request.path):
            self._start(_MACHINE.dropping)
            core.sink = _DROPPED
        elif spool is None or (length is not None and length <= spool.threshold):
            self._start(_MACHINE.in_memory)
            core.sink = _KEPT
        elif length is not None and site.streams(method, request.path):
            core.request = request
            core.stream(self._start(_MACHINE.streaming), spool, length)
            return True
        else:
            core.request = request
            core.spool(self._start(_MACHINE.spooling), spool, length)
        return False

    def chunk(self, data: bytes) -> None:
        """C{data} of the body arrived: where its state has it go."""
        assert self._inputs is not None  # a body follows its head
        self._core.sink.chunk(self._core, self._inputs, data)

    def whole(self) -> Deferred[bool]:
        """All of the body arrived: fires with whether the request is to be
        processed now."""
        assert self._inputs is not None  # a body follows its head
        return self._core.sink.whole(self._core, self._inputs)

    def answered(self) -> None:
        """The request is finished (a streamed one drops the rest of its
        body; before its head, nothing was taken)."""
        if self._inputs is not None:
            self._core.sink.answered(self._core, self._inputs)

    def lost(self) -> None:
        """The connection is gone (before its request's head, nothing was taken)."""
        if self._inputs is not None:
            self._inputs.lost()
