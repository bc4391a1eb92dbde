"""
The members of a pool: each node a Router (or an embedded gateway) knows,
in one of its states, and the workers (members) that take its runs. The
pool's state machine moves them; placement and the ring read them.
"""

from __future__ import annotations

import attrs
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from kcoral.common.report import ModelState, NodeReport, Sandbox
from kcoral.errors import NodeFailure
from kcoral.router.residency import Demand, Holdings

JOINING, READY, UNHEALTHY, DRAINING, INCOMPATIBLE, GONE = (
    "joining", "ready", "unhealthy", "draining", "incompatible", "gone")
STATES = (JOINING, READY, UNHEALTHY, DRAINING, INCOMPATIBLE, GONE)


@attrs.define(eq=False)
class Member:
    """One worker endpoint: the unit that receives programs."""

    node: Node
    name: str
    url: str
    capacity: int = 0
    healthy: bool = False
    #: Requests this Router has in flight on the member.
    active: int = 0
    #: Set when a connection failed; cleared by the node's next report.
    suspect: bool = False
    #: When the placement rule last picked this member (its own count).
    picked: int = 0
    #: What the Router believes the member holds in its caches.
    held: Holdings = attrs.Factory(Holdings)
    #: The devices it owns: runs of programs exported for more go elsewhere.
    devices: int = 1
    #: Times its supervisor has restarted it, as last reported.
    restarts: int = 0
    #: Its repository's models and their states, as last reported.
    models: tuple[ModelState, ...] = ()
    #: Those it reports ready, by name, each with its max_batch_size (the
    #: most rows the front merges): an inference of another model never goes there.
    ready_models: dict[str, int] = attrs.Factory(dict)
    #: Those of them that keep a state per sequence (sequence batching).
    sequence_models: frozenset[str] = frozenset()
    #: The instance id it reports: runs of the arrays it keeps go only here.
    instance: str | None = None
    #: How it confined itself, as last reported.
    sandbox: Sandbox | None = None

    def fits(self, devices: int, demand: Demand | None) -> bool:
        """Whether a run that needs C{devices} devices (and C{demand}'s model,
        the worker that holds its kept arrays, or the content it requires, if
        it names them) may go here: the hard constraints, beside capacity."""
        return self.devices >= devices and (demand is None or (
            (demand.model is None or demand.model in self.ready_models)
            and (demand.kept is None or demand.kept == self.instance)
            and self.held.holds_every(demand.required)))

    def serves(self, models: tuple[ModelState, ...]) -> None:
        """Its models are C{models} now (reported, or answered to a load)."""
        self.models = models
        self.ready_models = {m.name: m.max_batch_size for m in models if m.ready}
        self.sequence_models = frozenset(m.name for m in models if m.ready and m.sequence)

    @property
    def usable(self) -> bool:
        return self.node.state == READY and self.healthy and not self.suspect


@attrs.define(eq=False)
class Node:
    node_id: str
    #: The supervisor's session; None for static members (a gateway's own
    #: workers), which no supervisor reports over HTTP.
    session: str | None
    state: str = JOINING
    #: The last report of a reporting node (None for static members).
    report: NodeReport | None = None
    reported_at: float | None = None
    members: dict = attrs.Factory(dict)
    good: int = 0
    bad: int = 0
    reason: str = ""
    last_seen: float = 0.0
    gpu_target: str | None = None
    runtime: dict = attrs.Factory(dict)
    #: Forwards in flight on its members (L{running}): each one's answer,
    #: and the request to the member it waits for.
    runs: dict[Deferred, Deferred] = attrs.Factory(dict)

    def running(self, attempt: Deferred) -> Deferred:
        """
        C{attempt}, a forward in flight on one of its members, as the node
        lets it go on: it fails with L{NodeFailure} once L{abandon} gives
        the node up (the request to the member closed). Cancelling it
        cancels C{attempt}.
        """
        answer: Deferred = Deferred(lambda _: attempt.cancel())
        self.runs[answer] = attempt

        def settle(result):
            self.runs.pop(answer, None)
            # Once abandoned or cancelled, whatever the request ends with goes nowhere.
            if not answer.called:
                answer.callback(result)  # a Failure errbacks

        attempt.addBoth(settle)
        return answer

    def abandon(self, why: str) -> int:
        """Every run in flight here fails with L{NodeFailure} (C{why}), and
        its request to the member closes; returns how many there were."""
        runs, self.runs = self.runs, {}
        for answer, attempt in runs.items():
            answer.errback(Failure(NodeFailure(why)))
            attempt.cancel()
        return len(runs)

    @property
    def static(self) -> bool:
        """Static members are never stale: their supervisor is this process."""
        return self.session is None

    @property
    def healthy(self) -> bool:
        return any(m.healthy for m in self.members.values())

    @property
    def draining(self) -> bool:
        return self.report is not None and self.report.draining

    @property
    def active(self) -> int:
        return sum(m.active for m in self.members.values())

    @property
    def capacity(self) -> int:
        return sum(m.capacity for m in self.members.values() if m.healthy)
