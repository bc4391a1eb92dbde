"""
A request body's intake, from its head to the body its handler reads
(L{kcoral.web.body.IBody}) or to its refusal: one state machine, fed by the
calls Twisted makes on the request (L{kcoral.web.request.KCoralRequest}),
with L{kcoral.web.bounds.BodyBounds} as its policy::

    head --drop---> dropping ----------------------whole---+
      |                                                    |
      +--keep---> in memory ---------------------whole---+ |
      |                                                  v v
      +--spool--> spooling --whole--> flushing --spooled--> received
      |                                                    ^
      +--stream-> streaming ----------------------whole----+
      |              |
      |              +--answered--> answered early
      v
    refused, from: head (refuse, turn_away); dropping, in memory (refuse);
                   spooling (refuse, spool_failed); flushing, received
                   (spool_failed); streaming (refuse, spool_failed, stalled)

    every state --lost--> gone

From its head, a request is refused (its target, its announced length, a
guard), or its body is dropped as it arrives (no route reads it), kept in
memory, spooled to a file while it arrives (its request processed once
every write has ended: L{kcoral.web.spool}), or streamed: its request is
processed as soon as its head is whole, its body followed by readers while
it arrives, its client read only while one does. A body breaking its bounds
while it arrives is refused there, without reading the rest; one answered
while it still arrives has the rest dropped, and its connection closes.

Each transition runs to its end before another starts (a call made during
one waits for it), so a request is never processed from inside one: it
processes itself once the calls that say it may (L{Intake.head},
L{_Inputs.whole}) have returned, and a handler that answers at once finds
the intake between transitions. The head is judged, and each chunk of the
body taken, outside the machine, by what its state set (L{Intake.chunk}):
see there why.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
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
        """Answer C{error}, reading no more of the body."""

    def turn_away(self, answer: bytes) -> None:
        """Answer C{answer}, as the request has it (status, headers), reading no more."""

    def drop(self) -> None:
        """No route reads this body: it is read within its bounds, and dropped."""

    def keep(self) -> None:
        """The body is kept in memory as it arrives."""

    def spool(self, spool: Spool, length: int | None) -> None:
        """The body goes to C{spool}'s file as it arrives."""

    def stream(self, spool: Spool, length: int) -> None:
        """The request is processed now, its body followed while it arrives."""

    def whole(self) -> Deferred[bool]:
        """All of the body arrived: fires with whether the request is to be
        processed now (once a spooled body is all written)."""

    def spooled(self, body: IBody) -> None:
        """Every write of a spooled body has ended: C{body} is all of it."""

    def spool_failed(self, failure: Failure) -> None:
        """A spool's write failed."""

    def stalled(self) -> None:
        """A streamed body arrives too slowly for the forward waiting on it."""

    def answered(self) -> None:
        """A streamed request is finished."""

    def lost(self) -> None:
        """The connection is gone."""


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
    #: Fires once a spooled body is all written (L{_Inputs.whole}).
    ready: Deferred[bool] | None = None
    #: What takes each chunk of the body as it arrives, set by each state
    #: as it is entered (see L{Intake.chunk}).
    sink: Callable[[_Core, _Inputs, bytes], None] = attrs.field(default=lambda core, inputs, data: None)
    #: Told when the request is finished, once it is streamed (see L{Intake.answered}).
    on_answered: Callable[[], None] | None = None

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
        self.sink = _ignored
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

    def spool_failure(self, failure: Failure) -> KCoralError:
        self.site.logger.failure("{request_id} could not spool its body",
                                 failure, request_id=self.request.request_id)
        return InternalError("could not buffer the request body")


def _machine() -> Callable[[_Core], _Inputs]:
    machine = TypeMachineBuilder(_Inputs, _Core)

    head = machine.state("Head")
    dropping = machine.state("Dropping")
    in_memory = machine.state("InMemory")
    spooling = machine.state("Spooling")
    flushing = machine.state("Flushing")
    streaming = machine.state("Streaming")
    received = machine.state("Received")
    refused = machine.state("Refused")
    answered_early = machine.state("AnsweredEarly")
    gone = machine.state("Gone")

    @pep614(head.upon(_Inputs.refuse).to(refused))
    @pep614(dropping.upon(_Inputs.refuse).to(refused))
    @pep614(in_memory.upon(_Inputs.refuse).to(refused))
    @pep614(spooling.upon(_Inputs.refuse).to(refused))
    def refuse(inputs: _Inputs, core: _Core, error: KCoralError) -> None:
        core.answer_refusal(*core.refusal(error))

    @pep614(head.upon(_Inputs.turn_away).to(refused))
    def turn_away(inputs: _Inputs, core: _Core, answer: bytes) -> None:
        request = core.request
        request.responseHeaders.setRawHeaders(HEADER, [request.request_id.encode()])
        headers = [(name, value) for name, values in request.responseHeaders.getAllRawHeaders()
                   for value in values]
        core.answer_refusal(request.code, raw_response(request.code, headers, answer))

    @pep614(head.upon(_Inputs.drop).to(dropping))
    def drop(inputs: _Inputs, core: _Core) -> None:
        core.sink = _dropped

    @pep614(head.upon(_Inputs.keep).to(in_memory))
    def keep(inputs: _Inputs, core: _Core) -> None:
        core.sink = _kept

    @pep614(head.upon(_Inputs.spool).to(spooling))
    def spool(inputs: _Inputs, core: _Core, spool: Spool, length: int | None) -> None:
        core.writer = spool.writer(core.holding(), inputs.spool_failed, length)
        core.sink = _written

    @pep614(head.upon(_Inputs.stream).to(streaming))
    def stream(inputs: _Inputs, core: _Core, spool: Spool, length: int) -> None:
        # Kept in memory while the spool's budget allows, else written to a
        # file; read as fast as it is forwarded: nothing while it waits for
        # a member, then at the member's pace.
        holds = core.holding()
        body = spool.kept(length)
        if body is None:
            core.writer = spool.writer(holds, inputs.spool_failed, length)
            core.keep = core.writer.write
            body = core.writer.body
            assert body is not None  # of known length
        else:
            core.keep = body.arrived
        core.body = body
        core.expected = length
        holds.hold(UNREAD)
        body.paced = core.paced
        body.stalled = inputs.stalled
        core.sink = _followed
        core.on_answered = inputs.answered
        core.request.notifyFinish().addBoth(lambda _: core.let_go_of_body())

    @pep614(dropping.upon(_Inputs.whole).to(received))
    @pep614(in_memory.upon(_Inputs.whole).to(received))
    def arrived(inputs: _Inputs, core: _Core) -> Deferred[bool]:
        return succeed(True)

    @pep614(spooling.upon(_Inputs.whole).to(flushing))
    def flush(inputs: _Inputs, core: _Core) -> Deferred[bool]:
        # The channel reads nothing more until this request is done: its
        # processing may wait for the last writes.
        assert core.writer is not None  # made with the state
        core.ready = Deferred()
        core.writer.finish().addCallbacks(inputs.spooled, inputs.spool_failed)
        return core.ready

    @pep614(flushing.upon(_Inputs.spooled).to(received))
    def spooled(inputs: _Inputs, core: _Core, body: IBody) -> None:
        core.writer = None
        core.body = body
        core.request.notifyFinish().addBoth(lambda _: body.close())
        assert core.ready is not None  # made with the state
        core.ready.callback(True)

    @pep614(gone.upon(_Inputs.spooled).loop())
    def unwanted(inputs: _Inputs, core: _Core, body: IBody) -> None:
        body.close()

    @pep614(spooling.upon(_Inputs.spool_failed).to(refused))
    def failed(inputs: _Inputs, core: _Core, failure: Failure) -> None:
        core.writer = None
        core.answer_refusal(*core.refusal(core.spool_failure(failure)))

    @pep614(flushing.upon(_Inputs.spool_failed).to(refused))
    def failed_at_the_end(inputs: _Inputs, core: _Core, failure: Failure) -> None:
        failed(inputs, core, failure)
        assert core.ready is not None  # made with the state
        core.ready.callback(False)

    @pep614(streaming.upon(_Inputs.whole).to(received))
    @pep614(refused.upon(_Inputs.whole).loop())
    @pep614(answered_early.upon(_Inputs.whole).loop())
    @pep614(gone.upon(_Inputs.whole).loop())
    def processed_already(inputs: _Inputs, core: _Core) -> Deferred[bool]:
        # Streamed: processed since its head (its body is now all here, and
        # written to its file as the spool goes while readers follow); else
        # answered already, or its client gone.
        return succeed(False)

    @pep614(streaming.upon(_Inputs.refuse).to(refused))
    def refuse_while_streamed(inputs: _Inputs, core: _Core, error: KCoralError) -> None:
        core.answer_refusal_while_processed(*core.refusal(error))

    # Received with its writes still going: a streamed body (a spooled one's
    # have all ended before it is received).
    @pep614(streaming.upon(_Inputs.spool_failed).to(refused))
    @pep614(received.upon(_Inputs.spool_failed).to(refused))
    def failed_while_streamed(inputs: _Inputs, core: _Core, failure: Failure) -> None:
        core.writer = None
        core.answer_refusal_while_processed(*core.refusal(core.spool_failure(failure)))

    @pep614(streaming.upon(_Inputs.stalled).to(refused))
    def stalled(inputs: _Inputs, core: _Core) -> None:
        # It frees the member the forward holds.
        core.answer_refusal_while_processed(*core.refusal(RequestTimeout(
            f"request body arrives under {PACE_BYTES_PER_SECOND} bytes/s while forwarded")))

    @pep614(streaming.upon(_Inputs.answered).to(answered_early))
    def answered_early_(inputs: _Inputs, core: _Core) -> None:
        # The rest of the body cannot be told from a next request: it is
        # dropped, and the connection closes. Twisted's channel answers
        # "Expect: 100-continue" once gotLength returns, and this request may
        # be answered from within it: a stray 100 would follow the answer.
        withhold_continue(core.request.requestHeaders)
        core.sink = _ignored
        core.request.close_after_response()
        core.channel.discard_input()
        core.read_the_rest()

    for state in (refused, answered_early, gone):
        state.upon(_Inputs.spool_failed).loop().returns(None)
    for state in (received, refused, answered_early, gone):
        state.upon(_Inputs.stalled).loop().returns(None)
    # Only a streamed request is told it is answered (one answered before
    # its body was whole has the rest dropped), in whatever state it is by then.
    for state in (received, refused, answered_early, gone):
        state.upon(_Inputs.answered).loop().returns(None)

    @pep614(head.upon(_Inputs.lost).to(gone))
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
        core.sink = _ignored
        core.let_go_of_client()

    return machine.build()


_build = _machine()


# A body's chunks go to what its state set as the core's sink, not through
# the machine: automat finds a transition by comparing the state and input
# with each of the machine's transitions in turn (about 10 us here), and a
# large body arrives in thousands of chunks. The same holds of the head's
# judgement (a pure function of the head and the site) and of a request's
# answer (which only a streamed one heeds): a request kept in memory takes
# two transitions, where it took five, and measured 90 us of CPU a request
# through its site against 40 before the machine; now see doc/architecture.rst.

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


class Intake:
    """
    The intake of one request's body (C{request}, on C{channel}): the
    inputs above, what the request's handler reads (L{body}), and the
    target it is processed with.
    """

    def __init__(self, request: Taken, channel: KCoralChannel):
        self._core = _Core(weakref.proxy(request), channel)
        self.inputs = _build(self._core)

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

    def head(self, request: Taken, length: int | None, method: bytes, uri: bytes) -> bool:
        """The head of C{request} is whole (C{length}: its announced body
        length, None: chunked): judged, the body goes where it must. Whether
        the request is processed now, while its body arrives."""
        core, inputs = self._core, self.inputs
        site = core.site
        core.started = site.clock.seconds()
        # The one path everything reads (the guard here, then the resources,
        # Klein and the metrics): Twisted parses it from the canonical target,
        # never from the raw one.
        try:
            request.path, core.target = canonical(uri)
        except BadRequest as e:
            request.path = form_of(uri)
            inputs.refuse(e)
            return False
        error = site.bounds.refuse_length(length)
        if error is not None:
            inputs.refuse(error)
            return False
        guard = site.client_guard
        if guard is not None and method == b"POST" and guarded(request.path):
            # Refused before a byte of its body is read, let alone spooled.
            answer = guard.refusal(request, request.request_id)
            if answer is not None:
                inputs.turn_away(answer)
                return False
        # Its content is this intake's to fill (Twisted's own would go to a
        # temporary file past 100 KiB, on the reactor).
        request.content = RequestBody()
        spool = site.spool
        if not takes_body(method, request.path):
            inputs.drop()
        elif spool is None or (length is not None and length <= spool.threshold):
            inputs.keep()
        elif length is not None and site.streams(method, request.path):
            core.request = request
            inputs.stream(spool, length)
            return True
        else:
            core.request = request
            inputs.spool(spool, length)
        return False

    def chunk(self, data: bytes) -> None:
        """C{data} of the body arrived: where its state has it go."""
        self._core.sink(self._core, self.inputs, data)

    def answered(self) -> None:
        """The request is finished (a streamed one drops the rest of its body)."""
        if self._core.on_answered is not None:
            self._core.on_answered()
