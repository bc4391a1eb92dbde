"""
The pool: the nodes a Router (or an embedded gateway) knows, their workers,
and the state machine that decides which of them take work. Driven by
reports (L{Pool.report}) and by a periodic L{Pool.observe}; time comes from
an injected clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from twisted.logger import Logger

from kcoral.common.report import CPU_TARGET, ModelState, NodeReport, WorkerReport
from kcoral.router.member import (
    DRAINING,
    GONE,
    INCOMPATIBLE,
    JOINING,
    READY,
    STATES,
    UNHEALTHY,
    Member,
    Node,
)
from kcoral.router.placement import ROUTINGS, Run, Wait
from kcoral.router.residency import Demand, Residency
from kcoral.router.ring import Ring
from kcoral.router.signatures import ModelSignatures

log = Logger()

class SessionConflict(Exception):
    """Another live supervisor already holds this node id."""


class PoolFull(Exception):
    """The pool tracks as many nodes as it may; a new node id is refused."""


#: Node records a pool keeps at most (live, or gone and not yet forgotten):
#: without a node token anyone who reaches the Router can register ids.
MAX_NODES = 10_000

#: Default of C{--silent-node-seconds}: runs in flight on a node whose
#: reports stopped this long ago end with a 502.
SILENT_NODE_SECONDS = 30.0


class Pool:
    def __init__(self, clock, *, max_status_age_seconds: float = 5.0, unhealthy_threshold: int = 3,
                 recovery_threshold: int = 2, node_retention_seconds: float = 600.0,
                 on_change: Callable[[], None] = lambda: None, max_nodes: int = MAX_NODES,
                 routing: str = "affinity", silent_node_seconds: float = SILENT_NODE_SECONDS):
        self._clock = clock
        self.max_status_age = max_status_age_seconds
        self.unhealthy_threshold = unhealthy_threshold
        self.recovery_threshold = recovery_threshold
        self.retention = node_retention_seconds
        self.silent_node_seconds = silent_node_seconds
        self.on_change = on_change
        self.max_nodes = max_nodes
        self.nodes: dict[str, Node] = {}
        #: (gpu_target, runtime) of the pool, from its first ready node.
        self.target: tuple | None = None
        #: Where content is; reported entries outlive learned ones by a report's age.
        self.residency = Residency(clock, grace_seconds=max_status_age_seconds)
        #: Which member with free capacity runs what.
        self.placement = ROUTINGS[routing](self.residency)
        #: The signature each ready model name stands for, and who claimed it.
        self.signatures = ModelSignatures(self._present, lambda: self.ring.members)
        #: Every member, usable or not, on the ring placement walks.
        self.ring = Ring()
        #: The capacity of the healthy members; None once a report or a
        #: departure may have changed it.
        self._capacity: int | None = None

    # -- reports ------------------------------------------------------------

    def _fresh(self, node: Node) -> bool:
        if node.static:
            return True
        return node.reported_at is not None and \
            self._clock.seconds() - node.reported_at <= self.max_status_age

    def report(self, node_id: str, report: NodeReport) -> Node:
        """A supervisor's report (registration or heartbeat) of C{node_id}."""
        node = self.nodes.get(node_id)
        if node is not None and node.session != report.session:
            if node.state != GONE and self._fresh(node):
                raise SessionConflict(f"node id {node_id} is in use by a live supervisor")
            if node.active == 0:
                node = None
            else:
                # The old session still has requests in flight: keep their
                # members' accounting, start the node over.
                node.session, node.state, node.good, node.bad = report.session, JOINING, 0, 0
        if node is None:
            node = self._join(node_id, report.session, report.workers, report.gpu_target)
        node.report, node.reported_at = report, self._clock.seconds()
        self._update(node, report.workers, report.gpu_target, report.runtime)
        if report.draining and node.state != DRAINING:
            self._move(node, DRAINING, "it reported that it is draining")
        self._changed()
        return node

    def set_static(self, node_id: str, workers: Sequence[WorkerReport], *,
                   gpu_target: str | None, runtime: dict) -> Node:
        """
        The members of C{node_id} as this process knows them first hand (a
        gateway's own workers, whose supervisor probes them): never stale,
        with no session to conflict with.
        """
        node = self.nodes.get(node_id)
        if node is None:
            node = self._join(node_id, None, workers, gpu_target)
        self._update(node, workers, gpu_target, runtime)
        self._changed()
        return node

    def _join(self, node_id: str, session: str | None, workers: Sequence[WorkerReport],
              gpu_target: str | None) -> Node:
        if node_id not in self.nodes and len(self.nodes) >= self.max_nodes:
            raise PoolFull(f"the Router tracks {len(self.nodes)} nodes, the most it may; "
                           f"gone ones are forgotten after {self.retention:g} s")
        old = self.nodes.get(node_id)
        if old is not None:
            self._off_ring(*old.members.values())
        node = self.nodes[node_id] = Node(node_id, session)
        log.info("node {node_id} joined with {workers} worker(s), target {target}",
                 node_id=node_id, workers=len(workers), target=gpu_target)
        return node

    def _update(self, node: Node, workers: Sequence[WorkerReport], gpu_target: str | None,
                runtime: dict) -> None:
        node.last_seen = self._clock.seconds()
        node.gpu_target, node.runtime = gpu_target, runtime
        for gone in set(node.members) - {w.name for w in workers}:
            if node.members[gone].active == 0:
                self._off_ring(node.members.pop(gone))
            else:
                node.members[gone].healthy = False
        for worker in workers:
            member = node.members.get(worker.name)
            if member is None:
                member = node.members[worker.name] = Member(node, worker.name, worker.url)
                self.ring.add(member)
            elif member.url != worker.url or not worker.healthy:
                # A restarted worker may have a new address: keep the same
                # Member, whose leases still count (and release) its requests,
                # but not what its caches held.
                member.url = worker.url
                member.held.clear()
            member.capacity, member.healthy, member.suspect = worker.capacity, worker.healthy, False
            self.residency.reported(member.held, worker.cache)
            member.devices = worker.devices
            member.restarts = worker.restarts
            if worker.healthy or worker.instance is None or worker.instance != member.instance:
                # A worker that missed a probe is reported without its models;
                # its instance the same, it still has them, and the sequences
                # placed on it stay there (kcoral.router.sequences).
                self.serve(member, worker.models)
            member.instance = worker.instance
            member.sandbox = worker.sandbox

    def serve(self, member: Member, models: tuple[ModelState, ...]) -> None:
        """C{member}'s models are C{models} now (reported, or answered to a
        load), each ready one whose name another member serves with another
        signature refused (L{ModelSignatures.admit})."""
        member.serves(self.signatures.admit(member, models))

    def leave(self, node_id: str, session: str) -> bool:
        node = self.nodes.get(node_id)
        if node is None or node.session != session:
            return False
        node.last_seen = self._clock.seconds()
        for member in node.members.values():
            member.healthy = False
        self._capacity = None
        self._move(node, GONE, "its supervisor deregistered")
        return True

    # -- observation --------------------------------------------------------

    def _move(self, node: Node, state: str, reason: str) -> None:
        if node.state != state:
            log.info("node {node_id}: {old} -> {new} ({reason})", node_id=node.node_id,
                     old=node.state, new=state, reason=reason)
            node.state, node.reason = state, reason

    def _compatible(self, node: Node) -> str | None:
        """Why C{node} cannot join the pool, or None when it can."""
        key = (node.gpu_target, tuple(sorted(node.runtime.items())))
        if self.target is None:
            self.target = key
            return None
        if key[0] != self.target[0]:
            return f"its gpu_target {key[0]} differs from the pool's {self.target[0]}"
        if key[1] != self.target[1]:
            return f"its runtime {dict(key[1])} differs from the pool's {dict(self.target[1])}"
        return None

    def observe(self) -> None:
        """One status check of every node (every status-check interval)."""
        now = self._clock.seconds()
        for node in list(self.nodes.values()):
            if node.state == GONE:
                if node.active == 0 and now - node.last_seen >= self.retention:
                    self._forget(node)
                    log.info("node {node_id} forgotten", node_id=node.node_id)
                continue
            fresh = self._fresh(node)
            if not fresh and node.runs:
                self._end_silent_runs(node, now)
            if not fresh and node.active == 0 and node.reported_at is not None \
                    and now - node.reported_at >= self.retention:
                self._forget(node)
                log.info("node {node_id} forgotten after {seconds:.0f}s without a report",
                         node_id=node.node_id, seconds=now - node.reported_at)
                continue
            if node.state == DRAINING:
                if fresh and not node.draining:
                    self._move(node, JOINING, "it stopped draining")
                continue
            if fresh and node.healthy:
                node.good, node.bad = node.good + 1, 0
            else:
                node.good, node.bad = 0, node.bad + 1
                why = "its last report is stale" if not fresh else "it reports no healthy worker"
            if node.state == READY and node.bad >= self.unhealthy_threshold:
                self._move(node, UNHEALTHY, why)
            elif node.state in (JOINING, UNHEALTHY, INCOMPATIBLE) and node.good >= self.recovery_threshold:
                problem = self._compatible(node)
                if problem is None:
                    self._move(node, READY, f"{node.good} good observations")
                else:
                    self._move(node, INCOMPATIBLE, problem)
        if self.target is not None and not any(
                n.state == READY or n.active for n in self.nodes.values()):
            self.target = None
        self.on_change()

    def _end_silent_runs(self, node: Node, now: float) -> None:
        """
        End the runs in flight on C{node} once its reports have stopped for
        C{silent_node_seconds}. A peer that stopped answering TCP is found by
        the connection's keepalive, but a frozen host (its processes
        stopped, or a machine hung above its network stack) still
        acknowledges every probe: only the silence of its supervisor shows
        it, and without this its runs would wait for their clients' own
        timeouts, which a long program may not have.
        """
        if node.reported_at is None:
            return
        silent = now - node.reported_at
        if silent >= self.silent_node_seconds:
            count = node.abandon(f"node {node.node_id} sent no report for {silent:.0f} s "
                                 f"while the run was in flight; it may have run")
            log.warn("node {node_id}: no report for {seconds:.0f} s: {count} run(s) in flight "
                     "there end with 502", node_id=node.node_id, seconds=silent, count=count)

    def _forget(self, node: Node) -> None:
        del self.nodes[node.node_id]
        self._off_ring(*node.members.values())
        self._capacity = None

    def _off_ring(self, *members: Member) -> None:
        for member in members:
            self.ring.remove(member)
            self.signatures.forget(member)

    def _present(self, member: Member) -> bool:
        node = member.node
        return (self.nodes.get(node.node_id) is node and node.state != GONE
                and node.members.get(member.name) is member)

    def _changed(self) -> None:
        """A report changed what members there are, or their health or capacity."""
        self._capacity = None
        self.on_change()

    # -- scheduling ---------------------------------------------------------

    def choose(self, runs: Iterable[Run]) -> tuple[int, Member] | Wait | None:
        """Which of C{runs} (oldest first, read only as far as needed) runs
        next, and where, by the pool's placement rule
        (L{kcoral.router.placement.IPlacement.choose})."""
        return self.placement.choose(self.ring, runs)

    def pick(self, demand: Demand | None = None, devices: int = 1,
             waited: float = 0.0) -> Member | Wait | None:
        """Where one run of C{demand}, exported for C{devices} devices and
        waiting for C{waited} seconds, goes now: a member with free capacity
        that owns as many devices, a L{Wait} for a warmer one, or None when
        there is none."""
        choice = self.choose(((demand, devices, waited),))
        return choice[1] if isinstance(choice, tuple) else choice

    def holder(self, instance: str) -> Member | None:
        """The member that reports instance id C{instance}, if any does."""
        for node in self.nodes.values():
            for member in node.members.values():
                if member.instance == instance:
                    return member
        return None

    def holds(self, digests: Sequence[str]) -> bool:
        """Whether a usable member is believed to hold every one of C{digests}."""
        return any(m.usable and m.held.holds_every(digests) for m in self.ring.members)

    def member_capacity(self) -> int:
        """The requests every healthy member may have in flight, its node
        ready or not: the connections the Router may hold open to members."""
        if self._capacity is None:
            self._capacity = sum(m.capacity for node in self.nodes.values()
                                 for m in node.members.values() if m.healthy)
        return self._capacity

    def serves(self, model: str) -> bool:
        """Whether a usable member has C{model} ready."""
        return any(model in m.ready_models and m.usable for m in self.ring.members)

    def batch_lanes(self, model: str | None) -> int:
        """How many batches of C{model} may run side by side: one for each
        usable member that has it ready, save that the CPU workers of a node
        are one (they share its cores, which each execution spreads over)."""
        return len({m.node.node_id if m.node.gpu_target == CPU_TARGET else (m.node.node_id, m.name)
                    for m in self.ring.members if m.usable and model in m.ready_models})

    def most_devices(self) -> int | None:
        """The most devices a healthy member of a ready node owns; None when
        there is no such member."""
        return max((m.devices for n in self.ready_nodes() for m in n.members.values() if m.healthy),
                   default=None)

    def ready_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.state == READY]

    def capacity(self) -> int:
        return sum(m.capacity for n in self.ready_nodes() for m in n.members.values() if m.healthy)

    def active(self) -> int:
        return sum(n.active for n in self.nodes.values())

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATES, 0)
        for node in self.nodes.values():
            counts[node.state] += 1
        return counts
