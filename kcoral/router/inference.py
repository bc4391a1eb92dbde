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

from twisted.internet.defer import Deferred, inlineCallbacks, maybeDeferred, succeed
from twisted.web.http_headers import Headers
from zope.interface import implementer

from kcoral._version import __version__
from kcoral.common.report import MODEL_NAME
from kcoral.errors import NotFound, ServerBusy, error_from_answer
from kcoral.inference.front import IInferenceFront, InferCall, server_metadata
from kcoral.router.batching import FrontBatcher, forwarded
from kcoral.router.forward import Forwarder
from kcoral.router.member import Member
from kcoral.router.pool import Pool
from kcoral.tracing import NO_TRACING, ITracing
from kcoral.web.family import (
    MODEL_CONFIG,
    MODEL_INFER,
    MODEL_METADATA,
    VERSION_CONFIG,
    VERSION_INFER,
    VERSION_METADATA,
    Route,
)


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
                 tracing: ITracing = NO_TRACING):
        self._pool = pool
        self._batcher = FrontBatcher(forwarder, clock, most_waiting)
        self._get = get
        self._is_ready = is_ready
        self._tracing = tracing

    def _ready_members(self, name: str, version: str | None) -> list[Member]:
        """The usable members that have the model ready; NotFound when no
        member has it at all (ready or not)."""
        if not MODEL_NAME.match(name) or (version is not None and not (
                version.isdigit() and len(version) <= 9)):
            raise NotFound(f"unknown model {name[:64]!r}")
        listed = False
        ready = []
        for node in self._pool.nodes.values():
            for member in node.members.values():
                for state in member.models:
                    if state.name == name and (version is None or state.version == version):
                        listed = True
                        if state.ready and member.usable:
                            ready.append(member)
        if not listed:
            raise NotFound(f"unknown model {name!r}" + (f" version {version}" if version else ""))
        return ready

    def _holder(self, name: str, version: str | None) -> Member:
        ready = self._ready_members(name, version)
        if not ready:
            raise ServerBusy(f"no member has model {name!r} ready", reason="no_ready_node")
        return min(ready, key=lambda m: m.active / (m.capacity or 1))

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

    def infer(self, name, version, call: InferCall) -> Deferred:
        return maybeDeferred(lambda: self._infer(name, version, call))

    def _infer(self, name: str, version: str | None, call: InferCall) -> Deferred:
        # A model no member lists is unknown (404); one listed but ready on
        # no member the scheduler refuses at once (503 no_ready_node).
        ready = self._ready_members(name, version)
        most_rows = min((m.ready_models.get(name, 0) for m in ready), default=0)
        request = forwarded(_path((MODEL_INFER, VERSION_INFER), name, version).encode(), call)
        span = self._tracing.start("kcoral.router.infer",
                                   Headers({name: [value] for name, value in call.headers.items()}),
                                   request_id=call.request_id)
        d = self._batcher.infer(request, call, name, most_rows, span)
        d.addBoth(span.ended)
        return d
