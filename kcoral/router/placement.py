"""
The placement rules: which usable member gets a run next. Two implement
L{IPlacement}, chosen with C{--routing}:

L{LeastLoaded}, plain least-loaded placement: the member with the lowest
load (runs in flight over capacity) wins, ties going to the one picked
longest ago (round-robin). Kept for comparison.

L{Affinity}, the default: the member that holds the run's program and the
most bytes of its inputs (L{kcoral.router.residency}) wins, among those with
free capacity and under a bound on load: consistent hashing with bounded
loads, where no member takes a run that would put it above
C{ceil(c * (runs in flight + 1) / members)} (when every free member is
there, the least loaded ones may), so a popular program spreads over more
members instead of queueing on one while another idles. Content
no member holds goes where it hashes highest (rendezvous hashing), among
the least loaded: its next runs find their caches there. When a full
member is warmer than every free one, the run waits for a warm member as
long as the cold placement would cost (the bytes it lacks at the measured
bandwidth, plus the measured compile seconds if the program is not there),
then goes cold: a wait that long at most doubles the cost of the cold
choice, and a shorter one saves it whole. Of the waiting runs, the oldest
that a free member is warm for goes first, before older ones that would
be cold there.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import attrs
from zope.interface import Interface, implementer

from kcoral.router.residency import Demand, Residency

if TYPE_CHECKING:
    from kcoral.router.pool import Member

#: How far above the average load the bound lets one member go: at 1, a
#: member takes a second run only once the average load reaches more than
#: one (with 1.25, two runs of one program shared one of two idle workers).
LOAD_FACTOR = 1.0


@attrs.frozen
class Wait:
    """A member is free, but the run would rather wait up to C{seconds} more
    for a warmer one."""

    seconds: float


#: A run waiting for a member: what content it needs (None: not known), the
#: devices its program was exported for, and how long a free member has
#: been left for it, in seconds.
Run = tuple[Demand | None, int, float]


class IPlacement(Interface):
    def choose(members: Sequence[Member], runs: Sequence[Run]) -> tuple[int, Member] | Wait | None:
        """
        Which of C{runs} (oldest first) runs now, and on which of C{members}
        (the usable ones, full or not) that owns as many devices as it
        needs: (its index, the member). A L{Wait}
        when a member is free but none of them should take it yet; None when
        no member has free capacity.
        """


@implementer(IPlacement)
class LeastLoaded:
    """The oldest run, on the least loaded member, ties round-robin."""

    def __init__(self) -> None:
        self._picks = itertools.count(1)

    def choose(self, members: Sequence[Member], runs: Sequence[Run]) -> tuple[int, Member] | None:
        if not runs:
            return None
        best = self.least_loaded(_owning(members, runs[0][1]))
        return None if best is None else (0, best)

    def least_loaded(self, members: Iterable[Member]) -> Member | None:
        """The least loaded member with free capacity, now picked."""
        best: Member | None = None
        best_key = (math.inf, 0)
        for member in members:
            if member.free > 0:
                key = (member.active / member.capacity, member.picked)
                if key < best_key:
                    best, best_key = member, key
        if best is not None:
            best.picked = next(self._picks)
        return best


@implementer(IPlacement)
class Affinity:
    """
    Placement by cache residency within a bound on load (the module's rule).
    Of the runs offered, the oldest that has a free member as warm as any
    goes first; failing that, the oldest that has waited as long as its cold
    placement costs goes cold.
    """

    def __init__(self, residency: Residency, load_factor: float = LOAD_FACTOR):
        self._residency = residency
        self._load_factor = load_factor
        self._least_loaded = LeastLoaded()

    def choose(self, members: Sequence[Member], runs: Sequence[Run]) -> tuple[int, Member] | Wait | None:
        # No member above ceil(c times the average load), counting this run.
        bound = math.ceil(self._load_factor * (sum(m.active for m in members) + 1)
                          / max(len(members), 1))
        free = [m for m in members if m.free > 0]
        if not free:
            return None
        under = [m for m in free if m.active + 1 <= bound]
        # Full members count as warm places to wait for; a free one over the
        # bound does not: the bound passes it over.
        full_all = [m for m in members if m.free <= 0]
        cold: tuple[int, Member] | None = None
        patience: float | None = None
        for index, (demand, devices, waited) in enumerate(runs):
            # The bound never leaves a run waiting while a member is free.
            eligible = _owning(under, devices) or _lightest(_owning(free, devices))
            if not eligible:
                # No free member owns the devices it needs: it holds up the
                # runs behind it, as a strict FIFO would, or it might never
                # run. Only a run that chose to wait lets younger ones by.
                break
            if demand is None:
                member = self._least_loaded.least_loaded(eligible)
                assert member is not None
                return index, member
            full = _owning(full_all, devices)
            best, warmth = _warmest(eligible, demand, with_hash=True)
            _, elsewhere = _warmest(full, demand) if full else (None, (False, -1))
            if warmth >= elsewhere:
                return index, best
            left = self._cold_cost(demand, best) - waited
            if left <= 0:
                cold = cold or (index, best)
            else:
                patience = left if patience is None else min(patience, left)
        if cold is not None:
            return cold
        return Wait(patience) if patience is not None else None

    def _cold_cost(self, demand: Demand, member: Member) -> float:
        """Seconds that placing C{demand} on C{member} costs in transfers and compiles."""
        r = self._residency
        missing = demand.nbytes - member.held.held_bytes(demand)
        compile = 0.0 if demand.program in member.held.programs else r.compile_seconds.value
        return missing / r.bandwidth.value + compile


def _lightest(members: Sequence[Member]) -> list[Member]:
    """The members of C{members} with the lowest load."""
    least = min((m.active / m.capacity for m in members), default=0.0)
    return [m for m in members if m.active / m.capacity == least]


def _owning(members: Sequence[Member], devices: int) -> Sequence[Member]:
    """The members of C{members} that own at least C{devices} devices."""
    return members if devices <= 1 else [m for m in members if m.devices >= devices]


def _warmest(members: Sequence[Member], demand: Demand,
             with_hash: bool = False) -> tuple[Member, tuple[bool, int]]:
    """The member of C{members} holding the program and the most bytes of
    C{demand}'s inputs, and that warmth; ties go to the least loaded, then,
    C{with_hash}, to where the program hashes highest."""
    best, best_key = members[0], None
    for member in members:
        held = member.held
        key = ((demand.program in held.programs, held.held_bytes(demand)),
               -member.active / max(member.capacity, 1),
               _affinity(demand.home, member) if with_hash else 0)
        if best_key is None or key > best_key:
            best, best_key = member, key
    assert best_key is not None
    return best, best_key[0]


def _affinity(content: str, member: Member) -> int:
    """A stable, evenly spread preference of C{content} (a digest) for C{member}."""
    text = f"{content}\0{member.node.node_id}\0{member.name}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")


def _least_loaded(residency: Residency) -> LeastLoaded:
    return LeastLoaded()


#: The rules by their C{--routing} names, each made from the pool's residency.
ROUTINGS: dict[str, Callable[[Residency], IPlacement]] = {
    "affinity": Affinity, "least-loaded": _least_loaded}
