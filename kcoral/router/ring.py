"""
The hash ring the affinity rule walks: every member of a pool at a few
points of a circle of 64-bit hashes, and each run's content at a point of
its own. Walking clockwise from the content's point gives every member once,
in an order that is the same for all runs of that content (consistent
hashing): placement looks at members in that order, ties go to the first,
and it stops at the first member no other could beat, so a run that finds
an idle warm member early costs the same in a pool of ten or of hundreds.
A member joining or leaving changes the order only where its points are.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kcoral.router.pool import Member

#: Points each member has on the ring: with one, the arcs that decide which
#: member comes first for new content differ several-fold in a large pool;
#: with a few, by tens of percent, and a walk still costs little.
POINTS = 8


class Ring:
    """The members of a pool on the ring; made again when they change."""

    __slots__ = ("_order", "_points", "members")

    def __init__(self, members: Iterable[Member]):
        self.members: list[Member] = list(members)
        points = sorted((_point(f"{m.node.node_id}\0{m.name}\0{i}"), n)
                        for n, m in enumerate(self.members) for i in range(POINTS))
        self._points = [point for point, _ in points]
        #: Twice round, so that a walk is one slice wherever it starts.
        self._order = [self.members[n] for _, n in points] * 2

    def walk(self, content: str) -> Iterator[Member]:
        """Every member once, clockwise from C{content}'s point."""
        start = bisect.bisect(self._points, _point(content))
        seen: set[Member] = set()
        everyone = len(self.members)
        for member in self._order[start:start + len(self._points)]:
            if member not in seen:
                seen.add(member)
                yield member
                if len(seen) == everyone:
                    return


# A dispatch walks from the same few contents again and again.
@functools.lru_cache(maxsize=4096)
def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
