"""
The placement rule: which member with free capacity gets the next run.

The least loaded member (runs in flight over capacity) wins. Ties go to the
member that the run's program (its digest) hashes highest on, by rendezvous
hashing: while there is no load to spread, one program's runs stay where its
upload and compile caches are. Round-robin would send a client's references
to a member that lacks them, a 409 and a resend on every other run. A run
whose program is not known goes to the tied member picked longest ago.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kcoral.router.pool import Member


class LeastLoaded:
    """The rule above; it numbers its picks to break ties by age."""

    def __init__(self) -> None:
        self._picks = itertools.count(1)

    def pick(self, free: Iterable[Member], program: str | None) -> Member | None:
        """The member of C{free} (each with free capacity) to run C{program}
        next, or None when there is none."""
        least: float | None = None
        tied: list[Member] = []
        for member in free:
            load = member.active / member.capacity
            if least is None or load < least:
                least, tied = load, [member]
            elif load == least:
                tied.append(member)
        if not tied:
            return None
        # Hashed only among the least loaded: this runs for every request.
        best = min(tied, key=lambda m: (-affinity(program, m) if program else 0, m.picked))
        best.picked = next(self._picks)
        return best


def affinity(program: str, member: Member) -> int:
    """A stable, evenly spread preference of C{program} for C{member}."""
    text = f"{program}\0{member.node.node_id}\0{member.name}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")
