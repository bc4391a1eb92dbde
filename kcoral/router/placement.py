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
C{ceil(c * (runs in flight + 1) / members)}, so a popular program spreads
over more members instead of queueing on one while another idles. A
program no member holds goes where it hashes highest (rendezvous hashing),
among the least loaded: its next runs find their caches there. When the
members warmer than every free one are full, a run waits for one of them as
long as the cold placement would cost (the bytes to move at the measured
bandwidth, plus the measured compile seconds if the program is not there)
and no longer, unless the expected wait alone is longer: then it goes cold
at once.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
from zope.interface import Interface, implementer

from kcoral.router.residency import Demand, Residency

if TYPE_CHECKING:
    from kcoral.router.pool import Member

#: How far above the average load the bound lets one member go.
LOAD_FACTOR = 1.25


@attrs.frozen
class Wait:
    """A member is free, but the run would rather wait up to C{seconds} more
    for a warmer one."""

    seconds: float


class IPlacement(Interface):
    def pick(members: Sequence[Member], demand: Demand | None, waited: float) -> Member | Wait | None:
        """
        The member of C{members} (the usable ones, full or not) to run
        C{demand} (None: its program is not known) on now, after it has
        waited C{waited} seconds; a L{Wait} when it should wait longer
        although a member is free; None when no member has free capacity.
        """


@implementer(IPlacement)
class LeastLoaded:
    """The least loaded member, ties round-robin."""

    def __init__(self) -> None:
        self._picks = itertools.count(1)

    def pick(self, members: Sequence[Member], demand: Demand | None,
             waited: float = 0.0) -> Member | None:
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
    """Placement by cache residency within a bound on load (the module's rule)."""

    def __init__(self, residency: Residency, load_factor: float = LOAD_FACTOR):
        self._residency = residency
        self._load_factor = load_factor
        self._least_loaded = LeastLoaded()

    def pick(self, members: Sequence[Member], demand: Demand | None,
             waited: float = 0.0) -> Member | Wait | None:
        if demand is None:
            return self._least_loaded.pick(members, None)
        bound = math.ceil(self._load_factor * (sum(m.active for m in members) + 1)
                          / max(len(members), 1))
        best: Member | None = None
        best_key: tuple = ()
        warmest: tuple = (False, -1)
        for member in members:
            if member.free > 0 and member.active >= bound:
                continue  # the bound passes it over, warm or not
            warmth = (demand.program in member.held.programs, member.held.held_bytes(demand))
            warmest = max(warmest, warmth)
            if member.free > 0:
                key = (warmth, -member.active / member.capacity, _affinity(demand.program, member))
                if best is None or key > best_key:
                    best, best_key = member, key
        if best is None:
            # Every free member is at the bound: the bound never leaves a run
            # waiting while a member is free.
            return self._least_loaded.pick(members, demand)
        if best_key[0] >= warmest:
            return best
        patience = self._cold_cost(demand, best) - waited
        if patience <= 0 or self._residency.run_seconds.value > patience:
            return best
        return Wait(patience)

    def _cold_cost(self, demand: Demand, member: Member) -> float:
        """Seconds that placing C{demand} on C{member} costs in transfers and compiles."""
        r = self._residency
        missing = demand.nbytes - member.held.held_bytes(demand)
        compile = 0.0 if demand.program in member.held.programs else r.compile_seconds.value
        return missing / r.bandwidth.value + compile


def _affinity(program: str, member: Member) -> int:
    """A stable, evenly spread preference of C{program} for C{member}."""
    text = f"{program}\0{member.node.node_id}\0{member.name}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")


def _least_loaded(residency: Residency) -> LeastLoaded:
    return LeastLoaded()


#: The rules by their C{--routing} names, each made from the pool's residency.
ROUTINGS: dict[str, Callable[[Residency], IPlacement]] = {
    "affinity": Affinity, "least-loaded": _least_loaded}
