"""
The placement rules: which usable member gets a run next. Two implement
L{IPlacement}, chosen with C{--routing}:

L{LeastLoaded}, plain least-loaded placement: the member with the lowest
load (runs in flight over capacity) wins, ties going to the one picked
longest ago (round-robin). Kept for comparison.

L{Affinity}, the default: each run goes where it is expected to be done
soonest, by what the Router has measured (L{kcoral.router.residency}): the
cold cost of a member (the bytes of the run's inputs it lacks at the
measured bandwidth, plus the measured compile seconds if it lacks the
program or is still compiling it) plus its delay (a measured run's seconds
for each run it is busy with or that waits for it, per slot). That is
consistent hashing with bounded loads, the bound in seconds: a warm member
takes a program's runs while waiting behind them costs less than a cold
start elsewhere, so runs of a few milliseconds keep to their caches, and
runs as long as a compile spread to idle members. A member still compiling
the run's program (a run was placed there for it and has not answered) costs
what is left of that compile, so runs of a new program that arrive together
spread over idle members, and runs that arrive once the compile is under way
join it while waiting for it costs less than a compile elsewhere. Until a
run has been measured, waiting behind one counts nothing, and a compile
under way counts whole (else every run of a new program would join the
first compile, however long its runs).
Ties go to the least loaded, then to the warmest, then to the member that
comes first on the hash ring from the run's content (L{kcoral.router.ring}):
content no member holds has a stable home, and its next runs find their
caches there. Members are looked at in that order, and the first idle one
that has compiled the program and holds every input ends the search (none
could cost less, and ties go to the first): a run that finds one early costs
the same in a pool of ten or of hundreds.

When the cheapest member for a run is full, the run waits for it, for as
long as the wait was expected to save (the cheapest free member's cost less
the full one's), counted while a member stood free and no member took a run
(the scheduler's count); then it goes to the cheapest free member. Of the
waiting runs, the oldest whose cheapest member is free goes first, before
older ones that wait.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import attrs
from zope.interface import Interface, implementer

from kcoral.router.residency import Demand, Residency
from kcoral.router.ring import Ring

if TYPE_CHECKING:
    from kcoral.router.member import Member

@attrs.frozen
class Wait:
    """A member is free, but the run would rather wait up to C{seconds} more
    for a warmer one."""

    seconds: float


#: A run waiting for a member: what content it needs (None: not known), the
#: devices its program was exported for, and how long a member has stood
#: free for it while no member took a run, in seconds.
Run = tuple[Demand | None, int, float]


class IPlacement(Interface):
    def choose(ring: Ring, runs: Iterable[Run]) -> tuple[int, Member] | Wait | None:
        """
        Which of C{runs} (oldest first, read only as far as needed) runs
        now, and on which usable member of C{ring} (the pool's members) that
        owns as many devices as it needs: (its index, the member). A L{Wait}
        when a member is free but none of them should take it yet; None when
        no member has free capacity.
        """


@implementer(IPlacement)
class LeastLoaded:
    """The oldest run, on the least loaded member, ties round-robin."""

    def __init__(self) -> None:
        self._picks = itertools.count(1)

    def choose(self, ring: Ring, runs: Iterable[Run]) -> tuple[int, Member] | None:
        oldest = next(iter(runs), None)
        if oldest is None:
            return None
        near = beside(ring.members, oldest[0], oldest[1])
        if near is not None:
            return (0, near) if near.active < near.capacity else None
        best = self.least_loaded(_owning(ring.members, oldest[1], oldest[0]))
        return None if best is None else (0, best)

    def least_loaded(self, members: Iterable[Member]) -> Member | None:
        """The least loaded usable member with free capacity, now picked."""
        best: Member | None = None
        best_key = (math.inf, 0)
        for member in members:
            if member.active < member.capacity and member.usable:
                key = (member.active / member.capacity, member.picked)
                if key < best_key:
                    best, best_key = member, key
        if best is not None:
            best.picked = next(self._picks)
        return best


@implementer(IPlacement)
class Affinity:
    """
    Placement by cache residency, each run where it is expected to be done
    soonest (the module's rule). Of the runs offered, the oldest whose
    cheapest member is free goes first; failing that, the oldest that has
    waited as long as its wait was worth goes to its cheapest free member.
    """

    def __init__(self, residency: Residency):
        self._residency = residency
        self._least_loaded = LeastLoaded()

    def choose(self, ring: Ring, runs: Iterable[Run]) -> tuple[int, Member] | Wait | None:
        r = self._residency
        #: Runs offered before this one that wait for each full member.
        ahead: dict[Member, int] = {}
        cold: tuple[int, Member] | None = None
        patience: float | None = None
        for index, (demand, devices, waited) in enumerate(runs):
            if demand is None or demand.pinned:
                # Every member that has a model ready has compiled it, and
                # kept arrays have one member: where it goes is a question
                # of load alone.
                member = self._least_loaded.least_loaded(_owning(ring.members, devices, demand))
                if member is None:
                    break
                return index, member
            near = beside(ring.members, demand, devices)
            if near is not None:
                # Its outputs stay where the client's other arrays are,
                # which its next runs take together: it waits for that
                # member, as a run of those arrays would.
                if near.active >= near.capacity:
                    break
                return index, near
            found = self._cheapest(_free(ring.walk(demand.home), devices), demand, ahead)
            if found is None:
                # No free member owns the devices it needs: it holds up the
                # runs behind it, as a strict FIFO would, or it might never
                # run. Only a run that chose to wait lets younger ones by.
                break
            best, cost = found
            # A full member costs at least a run's seconds (a load of at
            # least one), and one that holds nothing of the run at least what
            # a free one that holds nothing costs: neither is worth waiting
            # for then, and the full members are not looked at.
            warm = None
            if cost > r.run_seconds.value:
                warm = self._cheapest(_full(ring.walk(demand.home), devices, demand), demand, ahead)
            if warm is not None and warm[1] < cost:
                ahead[warm[0]] = ahead.get(warm[0], 0) + 1
                left = cost - warm[1] - waited
                if left <= 0:
                    cold = cold or (index, best)
                else:
                    patience = left if patience is None else min(patience, left)
                continue
            return index, best
        if cold is not None:
            return cold
        return Wait(patience) if patience is not None else None

    def _cheapest(self, members: Iterable[Member], demand: Demand,
                  ahead: dict[Member, int]) -> tuple[Member, float] | None:
        """The member of C{members} (in the ring's order from the run's
        content) where C{demand} is expected to be done soonest, and its cost
        in seconds: the input bytes it lacks at the measured bandwidth, the
        compiling it would wait for (L{Residency.compile_cost}), and a
        measured run for each run a slot that it is busy with or that waits
        for it. Ties go to the least loaded, then to the warmest, then to the
        first. None when there is no member."""
        r = self._residency
        # Each member's cost is looked at once per run, in pools of hundreds:
        # what is the same for all of them is worked out first, a member that
        # holds nothing of the run costs the cold start, and an idle member
        # that holds all of it ends the search (no member costs less, and
        # ties go to the first).
        program, run_seconds, nbytes = demand.program, r.run_seconds.value, demand.nbytes
        cold = nbytes / r.bandwidth.value + r.compile_seconds.value
        best: tuple[Member, float] | None = None
        best_key = None
        for member in members:
            held = member.held
            active = member.active + ahead.get(member, 0) if ahead else member.active
            load = active / (member.capacity or 1)
            if held.holds_any(demand):
                compiled = held.compiled(program)
                stored = held.held_bytes(demand)
                if not active and compiled and stored == nbytes:
                    return member, 0.0
                cost = ((nbytes - stored) / r.bandwidth.value + r.compile_cost(held, program)
                        + load * run_seconds)
            else:
                compiled, stored, cost = False, 0, cold + load * run_seconds
            key = (cost, load, -compiled, -stored)
            if best_key is None or key < best_key:
                best, best_key = (member, cost), key
        return best


def beside(members: Iterable[Member], demand: Demand | None, devices: int) -> Member | None:
    """The member that holds the arrays C{demand} would keep its outputs
    beside, where it is usable and owns C{devices} devices, free or not;
    else None (gone, restarted: the run is placed like any other)."""
    if demand is None or demand.near is None:
        return None
    for member in members:
        if member.instance == demand.near and member.usable and member.fits(devices, demand):
            return member
    return None


def _free(members: Iterable[Member], devices: int) -> Iterator[Member]:
    """The usable members of C{members} with free capacity that own at least C{devices} devices."""
    for member in members:
        if member.active < member.capacity and member.devices >= devices and member.usable:
            yield member


def _full(members: Iterable[Member], devices: int, demand: Demand) -> Iterator[Member]:
    """The usable members of C{members} without free capacity that own at
    least C{devices} devices and hold some of C{demand}: those a run may
    wait for. A member of no capacity never frees, and is none of them."""
    for member in members:
        if 0 < member.capacity <= member.active and member.devices >= devices \
                and member.usable and member.held.holds_any(demand):
            yield member


def _owning(members: Sequence[Member], devices: int, demand: Demand | None) -> Sequence[Member]:
    """The members of C{members} that own at least C{devices} devices (and
    meet C{demand}'s other hard constraints: L{Member.fits})."""
    if devices <= 1 and (demand is None or not demand.pinned):
        return members
    return [m for m in members if m.fits(devices, demand)]


def _least_loaded(residency: Residency) -> LeastLoaded:
    return LeastLoaded()


#: The rules by their C{--routing} names, each made from the pool's residency.
ROUTINGS: dict[str, Callable[[Residency], IPlacement]] = {
    "affinity": Affinity, "least-loaded": _least_loaded}
