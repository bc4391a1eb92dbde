"""
The inference protocol on a Router and on a gateway: each inference placed
like a run (the same queue, leases, placement, forwarder and 503s), only on
members that report its model ready, and forwarded in the protocol's own
REST form; a sequence's steps each to the worker that holds the sequence
(L{kcoral.router.sequences}), in turn; a model's metadata and configuration asked of one such member;
the repository index the union of the members' own, asked of each when a
client asks for it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable

import attrs
from twisted.internet.defer import (
    Deferred,
    FirstError,
    gatherResults,
    inlineCallbacks,
    maybeDeferred,
    succeed,
)
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from zope.interface import implementer

from kcoral._version import __version__
from kcoral.common.report import MODEL_NAME, UNAVAILABLE, ModelState, parse_models
from kcoral.errors import (
    BadRequest,
    KCoralError,
    LoadFailed,
    ModelNotReady,
    ProgramFailed,
    SequenceLost,
    ServerBusy,
    error_from_answer,
    unknown_model,
    unreadable_version,
)
from kcoral.inference.front import (
    CONFIG_PARAMETER,
    FILE_PARAMETER,
    IInferenceFront,
    InferCall,
    server_metadata,
)
from kcoral.models.statistics import summed
from kcoral.protocol.counts import MOST_VERSION, read_count
from kcoral.protocol.inference import ON_REACTOR_BYTES
from kcoral.protocol.sequence import OWNER_HEADER, SequenceControls
from kcoral.router.batching import FrontBatcher, forwarded
from kcoral.router.forward import Forwarder
from kcoral.router.member import Member
from kcoral.router.pool import Pool
from kcoral.router.residency import Demand
from kcoral.router.sequences import SequenceKey, Sequences, candidates
from kcoral.tracing import NO_TRACING, ISpan, ITracing
from kcoral.web.family import (
    MODEL_CONFIG,
    MODEL_INFER,
    MODEL_LOAD,
    MODEL_METADATA,
    MODEL_STATISTICS,
    MODEL_UNLOAD,
    REPOSITORY_INDEX,
    STATISTICS,
    VERSION_CONFIG,
    VERSION_INFER,
    VERSION_METADATA,
    VERSION_STATISTICS,
    Route,
)

log = Logger()

#: How long a member may take to answer the repository index before its
#: last report stands for it: a member that hangs must not hang the index.
INDEX_SECONDS = 5.0
#: A member's health, whose models are what a report of it says.
HEALTH = "/health"


def _path(routes: tuple[Route, Route], name: str, version: str | None) -> str:
    """The path of model C{name} (a checked name) on the first of C{routes},
    or, of C{version}, on the second."""
    current, versioned = routes
    if version is None:
        return current.path(model=name)
    return versioned.path(model=name, version=version)


@implementer(IInferenceFront)
class RouterInference:
    """
    The models of C{pool}'s members, served through C{forwarder}; C{get}
    (treq's) asks one member for a model's metadata; C{is_ready} says
    whether the front takes work at all.
    """

    def __init__(self, *, pool: Pool, forwarder: Forwarder, get: Callable[..., Deferred],
                 is_ready: Callable[[], bool], clock, most_waiting: int,
                 tracing: ITracing = NO_TRACING, post: Callable[..., Deferred] | None = None):
        self._pool = pool
        self._clock = clock
        self._batcher = FrontBatcher(forwarder, clock, most_waiting)
        self._sequences = Sequences()
        self._get = get
        self._post = post
        self._is_ready = is_ready
        self._tracing = tracing

    def _ready_members(self, name: str, version: str | None) -> list[Member]:
        """
        The usable members that have the model ready. NotFound when no
        member has it at all (ready or not); L{ModelNotReady} when every
        member that lists it serves and says it failed (waiting would not
        help); none while a member may still come to serve it.
        """
        if version is not None and read_count(version, MOST_VERSION) is None:
            raise unreadable_version(version)
        if not MODEL_NAME.match(name):
            raise unknown_model(name, version)
        listed: list[tuple[Member, ModelState]] = []
        for node in self._pool.nodes.values():
            for member in node.members.values():
                for state in member.models:
                    if state.name == name and (version is None or state.version == version):
                        listed.append((member, state))
        if not listed:
            raise unknown_model(name, version)
        ready = [member for member, state in listed if state.ready and member.usable]
        if not ready and all(member.usable and state.state == UNAVAILABLE
                             for member, state in listed):
            reason = next((state.reason for _, state in listed if state.reason), "no reason given")
            raise ModelNotReady(f"model {name!r} is {UNAVAILABLE} on every member: {reason}",
                                reason="model_unavailable")
        return ready

    def _serving_members(self, name: str, version: str | None) -> list[Member]:
        """The members that have the model ready; L{ServerBusy} (503, to
        retry) while none has yet, some loading it or starting."""
        ready = self._ready_members(name, version)
        if not ready:
            raise ServerBusy(f"model {name!r} is loading: no member has it ready yet",
                             reason="model_loading")
        return ready

    def _holder(self, name: str, version: str | None) -> Member:
        return min(self._serving_members(name, version), key=lambda m: m.active / (m.capacity or 1))

    @inlineCallbacks
    def _ask(self, name: str, version: str | None, routes: tuple[Route, Route]):
        """The JSON a member that has the model ready answers on one of C{routes}."""
        member = self._holder(name, version)
        response = yield self._get(member.url + _path(routes, name, version))
        content = yield response.content()
        if response.code != 200:
            raise error_from_answer(response.code, content)
        return json.loads(content)

    def ready(self) -> Deferred:
        return succeed(self._is_ready())

    def metadata(self) -> Deferred:
        return succeed(server_metadata(__version__))

    def model_metadata(self, name, version) -> Deferred:
        return maybeDeferred(lambda: self._ask(name, version, (MODEL_METADATA, VERSION_METADATA)))

    def model_config(self, name, version) -> Deferred:
        return maybeDeferred(lambda: self._ask(name, version, (MODEL_CONFIG, VERSION_CONFIG)))

    def model_ready(self, name, version) -> Deferred:
        def ready() -> bool:
            try:
                return bool(self._ready_members(name, version))
            except ModelNotReady:
                return False  # a model that failed or was unloaded: known, not ready
        return maybeDeferred(ready)

    def repository_index(self) -> Deferred:
        """
        The union of the members' indexes, each asked now: a worker serves a
        new version before its next report says so, and an index read from
        reports would be older than the answers a client gets. What each
        member's C{/health} says of its models at the same time becomes what
        the front knows of it, as a report would, so that a version the
        index lists ready is served here at once. A member that is not
        usable, or does not answer both in time, counts as its last report
        says.
        """
        members = [member for node in self._pool.nodes.values() for member in node.members.values()]
        d = gatherResults([self._member_index(member) for member in members])
        d.addCallback(lambda indexes: _union(zip(members, indexes, strict=True)))
        return d

    def _member_index(self, member: Member) -> Deferred[tuple[ModelState, ...]]:
        """C{member}'s repository index, or its last report's models."""
        if not member.usable or self._post is None:
            return succeed(member.models)

        def reported(failure) -> tuple[ModelState, ...]:
            why = failure.value.subFailure.value if failure.check(FirstError) else failure.value
            log.info("{member}'s repository index is its last report's: {why}",
                     member=member.name, why=why)
            return member.models

        d = self._asked_index(member).addTimeout(INDEX_SECONDS, self._clock)
        return d.addErrback(reported)

    @inlineCallbacks
    def _asked_index(self, member: Member):
        """C{member}'s index and its C{/health}'s models, asked at once (a
        timeout cancels both); the models become what the front knows of it."""
        assert self._post is not None  # else it is not asked
        index, health = yield gatherResults([
            _json_of(self._post(member.url + REPOSITORY_INDEX.path(), data=b"")),
            _json_of(self._get(member.url + HEALTH))], consumeErrors=True)
        listed = parse_models(index, f"{member.name}'s repository index")
        models = parse_models(health["models"], f"{member.name}'s models")
        self._pool.serve(member, models)
        return listed

    def load_model(self, name, config=None, files=None) -> Deferred:
        # Each member reads the configuration and checks the files, as it
        # would alone.
        def body() -> bytes:
            parameters = {FILE_PARAMETER + path: base64.b64encode(data).decode()
                          for path, data in (files or {}).items()}
            if config is not None:
                parameters[CONFIG_PARAMETER] = config
            return json.dumps({"parameters": parameters}).encode() if parameters else b""
        # A body of files may be as large as a request: made off the reactor.
        d = deferToThread(body) if files else maybeDeferred(body)
        d.addCallback(lambda data: self._control(name, "load", data))
        return d

    def unload_model(self, name) -> Deferred:
        return maybeDeferred(lambda: self._control(name, "unload"))

    def _usable_members(self) -> list[Member]:
        return [member for node in self._pool.nodes.values()
                for member in node.members.values() if member.usable]

    @inlineCallbacks
    def _control(self, name: str, verb: str, body: bytes = b""):
        """Load or unload model C{name} on every usable member, at once,
        sending each C{body}; the states they answer, or one error naming
        each member that failed (a load that a member refused:
        L{LoadFailed})."""
        if not MODEL_NAME.match(name):
            if verb == "load":
                raise LoadFailed(f"failed to load '{name[:64]}': no such model in the repository")
            raise unknown_model(name)
        members = self._usable_members()
        if not members:
            raise ServerBusy("no member is ready to " + verb + f" model {name!r}",
                             reason="no_ready_node")
        outcomes = yield gatherResults([maybeDeferred(self._member_control, member, name, verb, body)
                                        .addErrback(lambda f: f.value) for member in members])
        failed = [(member, e) for member, e in zip(members, outcomes, strict=True)
                  if isinstance(e, Exception)]
        if failed:
            first = failed[0][1]
            cls = type(first) if isinstance(first, KCoralError) else ProgramFailed
            if verb == "load" and isinstance(first, BadRequest):
                cls = LoadFailed  # the member's refusal, in Triton's words
            raise cls(f"failed to {verb} '{name}' on {len(failed)} of {len(members)} member(s): "
                      + "; ".join(f"{m.node.node_id}/{m.name}: {e}" for m, e in failed))
        return {"models": [state.to_json() for states in outcomes for state in states]}

    @inlineCallbacks
    def _member_control(self, member: Member, name: str, verb: str, body: bytes):
        """The model's states on C{member} once it has loaded or unloaded
        it; what the member answers also becomes what the front knows of it,
        so that inferences follow at once, before its next report."""
        assert self._post is not None  # a Router's fronts are given one
        url = member.url + {"load": MODEL_LOAD, "unload": MODEL_UNLOAD}[verb].path(model=name)
        response = yield self._post(url, data=body)
        content = yield response.content()
        if response.code != 200:
            raise error_from_answer(response.code, content)
        try:
            states = parse_models(json.loads(content)["models"], f"{member.name}'s {verb} answer")
        except (ValueError, KeyError, TypeError) as e:
            raise ProgramFailed(f"{member.name} answered the {verb} of {name!r} with {e}") from None
        self._pool.serve(member, tuple(m for m in member.models if m.name != name) + states)
        return states

    def model_statistics(self, name, version) -> Deferred:
        return maybeDeferred(lambda: self._statistics(name, version))

    @inlineCallbacks
    def _statistics(self, name: str | None, version: str | None):
        """The sum of every usable member's statistics, of C{name} or of all."""
        if name is not None:
            self._ready_members(name, version)  # NotFound for a model no member lists
        path = STATISTICS.path() if name is None else _path(
            (MODEL_STATISTICS, VERSION_STATISTICS), name, version)
        urls = sorted({member.url for member in self._usable_members()})
        answers = yield gatherResults([self._member_statistics(url + path) for url in urls])
        return {"model_stats": summed(answer for answer in answers if answer is not None)}

    @inlineCallbacks
    def _member_statistics(self, url: str):
        """A member's statistics, checked; None (and a log line) when it has
        none to give: the others' sum is still worth answering."""
        try:
            response = yield self._get(url)
            content = yield response.content()
            if response.code != 200:
                raise error_from_answer(response.code, content)
            # Summed alone first: a malformed answer fails here, not in the sum.
            return summed([json.loads(content)["model_stats"]])
        except Exception as e:
            log.info("statistics of {url} left out: {why}", url=url, why=e)
            return None

    def infer(self, name, version, call: InferCall) -> Deferred:
        return maybeDeferred(lambda: self._infer(name, version, call))

    def _infer(self, name: str, version: str | None, call: InferCall) -> Deferred:
        # A model no member lists is unknown (404), one every member failed
        # to load is refused (400), one no member has ready yet is busy (503).
        ready = self._serving_members(name, version)
        if any(name in member.sequence_models for member in ready):
            return call.message.sequence().addCallback(
                lambda controls: self._step(name, version, call, controls))
        most_rows = min((m.ready_models.get(name, 0) for m in ready), default=0)
        request = forwarded(_path((MODEL_INFER, VERSION_INFER), name, version).encode(), call)
        span = self._span(call)
        if most_rows == 0 or call.message.size > ON_REACTOR_BYTES:
            # It goes alone (the batcher merges only what it parses on the
            # reactor), in its REST form: made now, off the reactor if large.
            d = call.message.rest_formed().addCallback(lambda rest: self._batcher.infer(
                request, attrs.evolve(call, message=rest), name, most_rows, span))
        else:
            d = self._batcher.infer(request, call, name, most_rows, span)
        d.addBoth(span.ended)
        return d

    def _span(self, call: InferCall) -> ISpan:
        """The span of C{call}'s forward, within its client's trace."""
        return self._tracing.start("kcoral.router.infer",
                                   Headers({name: [value] for name, value in call.headers.items()}),
                                   request_id=call.request_id)

    def _step(self, name: str, version: str | None, call: InferCall,
              controls: SequenceControls) -> Deferred:
        """The answer to C{call}, a step of a sequence of model C{name}, from
        the worker that holds the sequence (L{kcoral.router.sequences})."""
        if controls.id is None:
            # Refused here, in its worker's words: it belongs to no sequence.
            controls.require(name, 1)
        key = SequenceKey.of(call.token, name, controls)
        return self._sequences.in_turn(key, lambda: self._forward_step(name, version, call, key,
                                                                       controls))

    def _forward_step(self, name: str, version: str | None, call: InferCall, key: SequenceKey,
                      controls: SequenceControls, again: bool = False) -> Deferred:
        member = self._sequences.place(key, controls, candidates(self._pool.ring.members, name,
                                                                 version))
        if member is None:
            raise ServerBusy(f"no member has model {name!r} ready for {key}",
                             reason="no_ready_node")
        demand = attrs.evolve(Demand.of_model(name), kept=member.instance, sequence=str(key))
        request = forwarded(_path((MODEL_INFER, VERSION_INFER), name, version).encode(), call)
        if key.owner is not None:
            # The worker keys its sequences by their client, whose token it never sees.
            request = attrs.evolve(request, headers=(*request.headers, (OWNER_HEADER, key.owner)))
        span = self._span(call)
        d = call.message.rest_formed().addCallback(
            lambda rest: self._batcher.step(request, rest, demand,
                                            member.ready_models.get(name, 1), span))
        d.addBoth(span.ended)
        if controls.start and not again:
            d.addErrback(self._start_again, name, version, call, key, controls)
        return d

    def _start_again(self, failure: Failure, name: str, version: str | None, call: InferCall,
                     key: SequenceKey, controls: SequenceControls) -> Deferred:
        """A START whose worker went while it waited for a slot ran nowhere:
        placed again, once, it starts the sequence where it now belongs."""
        failure.trap(SequenceLost)
        return self._forward_step(name, version, call, key, controls, again=True)


@inlineCallbacks
def _json_of(asked: Deferred):
    """The JSON of a member's answer to a request C{asked}; its error
    unless it is a 200."""
    response = yield asked
    content = yield response.content()
    if response.code != 200:
        raise error_from_answer(response.code, content)
    return json.loads(content)


def _union(indexes: Iterable[tuple[Member, tuple[ModelState, ...]]]) -> list[dict]:
    """
    A front's repository index from its members': a model version ready on
    a usable member is ready; else it is as the first member that lists it
    says (UNAVAILABLE where that member is not usable). A member refused a
    model for another signature than the pool's counts as not serving it,
    and the model's entry says why where it gives no other reason (only the
    pool's refusals leave a signature on a model that is not ready: a worker
    signs only those it has ready).
    """
    models: dict[tuple[str, int], dict] = {}
    refused: dict[tuple[str, int], str] = {}
    for member, index in indexes:
        refusals = {(m.name, int(m.version)): m for m in member.models if m.signature and not m.ready}
        for key, refusal in refusals.items():
            refused.setdefault(key, refusal.reason)
        for state in index:
            key = (state.name, int(state.version))
            state = refusals.get(key, state)
            if key not in models or state.ready and member.usable:
                models[key] = {"name": state.name, "version": state.version,
                               "state": state.state if member.usable else UNAVAILABLE,
                               "reason": state.reason}
    for key, reason in refused.items():
        if key in models and not models[key]["reason"]:
            models[key]["reason"] = reason
    return [models[key] for key in sorted(models)]
