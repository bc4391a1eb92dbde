"""
The inference protocol on a Router and on a gateway: each inference placed
like a run (the same queue, leases, placement, forwarder and 503s), only on
members that report its model ready, and forwarded in the protocol's own
REST form; a model's metadata and configuration asked of one such member;
the repository index the union of what the members report.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from twisted.internet.defer import Deferred, gatherResults, inlineCallbacks, maybeDeferred, succeed
from twisted.logger import Logger
from zope.interface import implementer

from kcoral._version import __version__
from kcoral.common.report import MODEL_NAME, UNAVAILABLE, ModelState
from kcoral.errors import ModelNotReady, NotFound, ServerBusy, error_from_answer
from kcoral.inference.front import IInferenceFront, InferCall, server_metadata
from kcoral.models.statistics import summed
from kcoral.router.batching import FrontBatcher, forwarded
from kcoral.router.forward import Forwarder
from kcoral.router.member import Member
from kcoral.router.pool import Pool
from kcoral.tracing import NO_TRACING, ITracing

log = Logger()


def _path(name: str, version: str | None, tail: str = "") -> bytes:
    """The path of model C{name} (a checked name), of C{version} if given."""
    base = f"/v2/models/{name}" + ("" if version is None else f"/versions/{version}")
    return (base + tail).encode("ascii")


@implementer(IInferenceFront)
class RouterInference:
    """
    The models of C{pool}'s members, served through C{forwarder}; C{get}
    (treq's) asks one member for a model's metadata; C{is_ready} says
    whether the front takes work at all.
    """

    def __init__(self, *, pool: Pool, forwarder: Forwarder, get: Callable[..., Deferred],
                 is_ready: Callable[[], bool], clock, most_waiting: int,
                 tracing: ITracing = NO_TRACING):
        self._pool = pool
        self._batcher = FrontBatcher(forwarder, clock, most_waiting)
        self._get = get
        self._is_ready = is_ready
        self._tracing = tracing

    def _ready_members(self, name: str, version: str | None) -> list[Member]:
        """
        The usable members that have the model ready. NotFound when no
        member has it at all (ready or not); L{ModelNotReady} when every
        member that lists it serves and says it failed (waiting would not
        help); none while a member may still come to serve it.
        """
        if not MODEL_NAME.match(name) or (version is not None and not (
                version.isdigit() and len(version) <= 9)):
            raise NotFound(f"unknown model {name[:64]!r}")
        listed: list[tuple[Member, ModelState]] = []
        for node in self._pool.nodes.values():
            for member in node.members.values():
                for state in member.models:
                    if state.name == name and (version is None or state.version == version):
                        listed.append((member, state))
        if not listed:
            raise NotFound(f"unknown model {name!r}" + (f" version {version}" if version else ""))
        ready = [member for member, state in listed if state.ready and member.usable]
        if not ready and all(member.usable and state.state == UNAVAILABLE
                             for member, state in listed):
            reason = next((state.reason for _, state in listed if state.reason), "no reason given")
            raise ModelNotReady(f"model {name!r} is {UNAVAILABLE} on every member: {reason}",
                                reason="model_unavailable")
        return ready

    def _holder(self, name: str, version: str | None) -> Member:
        ready = self._ready_members(name, version)
        if not ready:
            raise ServerBusy(f"model {name!r} is loading: no member has it ready yet",
                             reason="model_loading")
        return min(ready, key=lambda m: m.active / (m.capacity or 1))

    @inlineCallbacks
    def _ask(self, name: str, version: str | None, tail: str):
        """The JSON a member that has the model ready answers for its C{tail} route."""
        member = self._holder(name, version)
        response = yield self._get(member.url + _path(name, version, tail).decode())
        content = yield response.content()
        if response.code != 200:
            raise error_from_answer(response.code, content)
        return json.loads(content)

    def ready(self) -> Deferred:
        return succeed(self._is_ready())

    def metadata(self) -> Deferred:
        return succeed(server_metadata(__version__))

    def model_metadata(self, name, version) -> Deferred:
        return maybeDeferred(lambda: self._ask(name, version, ""))

    def model_config(self, name, version) -> Deferred:
        return maybeDeferred(lambda: self._ask(name, version, "/config"))

    def model_ready(self, name, version) -> Deferred:
        return maybeDeferred(lambda: bool(self._ready_members(name, version)))

    def repository_index(self) -> Deferred:
        # A model ready anywhere is ready here; else the first reason given.
        models: dict[tuple[str, str], dict] = {}
        for node in self._pool.nodes.values():
            for member in node.members.values():
                for state in member.models:
                    key = (state.name, state.version)
                    if key not in models or state.ready and member.usable:
                        models[key] = {"name": state.name, "version": state.version,
                                       "state": state.state if member.usable else "UNAVAILABLE",
                                       "reason": state.reason}
        return succeed([models[key] for key in sorted(models)])

    def model_statistics(self, name, version) -> Deferred:
        return maybeDeferred(lambda: self._statistics(name, version))

    @inlineCallbacks
    def _statistics(self, name: str | None, version: str | None):
        """The sum of every usable member's statistics, of C{name} or of all."""
        if name is not None:
            self._ready_members(name, version)  # NotFound for a model no member lists
        path = "/v2/models/stats" if name is None else _path(name, version, "/stats").decode()
        urls = sorted({member.url for node in self._pool.nodes.values()
                       for member in node.members.values() if member.usable})
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
        # A model no member lists is unknown (404); one listed but ready on
        # no member the scheduler refuses at once (503 no_ready_node).
        ready = self._ready_members(name, version)
        most_rows = min((m.ready_models.get(name, 0) for m in ready), default=0)
        request = forwarded(_path(name, version, "/infer"), call)
        span = self._tracing.start("kcoral.router.infer", request.requestHeaders,
                                   request_id=call.request_id)
        d = self._batcher.infer(request, call, name, most_rows, span)
        d.addBoth(span.ended)
        return d
