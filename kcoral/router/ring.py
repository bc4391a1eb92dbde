"""
The hash ring the affinity rule walks: every member of a pool at a few
points of a circle of 64-bit hashes, and each run's content at a point of
its own. Walking clockwise from the content's point gives every member once,
in an order that is the same for all runs of that content (consistent
hashing): placement looks at members in that order, and ties go to the
first. A member joining or leaving changes the order only where its points
are, and the ring is changed in place, not made again.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kcoral.router.member import Member

#: Points each member has on the ring: with one, the arcs that decide which
#: member comes first for new content differ several-fold in a large pool;
#: with a few, by tens of percent, and a walk still costs little.
POINTS = 8


class Ring:
    """The members of a pool on the ring, kept as they join and leave."""

    __slots__ = ("_order", "_points", "members")

    def __init__(self, members: Iterable[Member] = ()):
        self.members: list[Member] = []
        #: The points, ascending, and the member at each.
        self._points: list[int] = []
        self._order: list[Member] = []
        for member in members:
            self.add(member)

    def add(self, member: Member) -> None:
        # One insertion per point, not a new ring sorted again: thousands of
        # members that join at once (a Router restarted) each move pointers
        # once, where a sort for each would hash and compare every point.
        for point in _member_points(member):
            at = bisect.bisect(self._points, point)
            self._points.insert(at, point)
            self._order.insert(at, member)
        self.members.append(member)

    def remove(self, member: Member) -> None:
        for point in _member_points(member):
            at = bisect.bisect_left(self._points, point)
            while self._order[at] is not member:  # another member's equal point
                at += 1
            del self._points[at], self._order[at]
        self.members.remove(member)

    def walk(self, content: str) -> Iterator[Member]:
        """Every member once, clockwise from C{content}'s point."""
        order, everyone = self._order, len(self.members)
        start = bisect.bisect(self._points, _content_point(content))
        seen: set[Member] = set()
        # From start - len to start: the negative indices are the points
        # from start to the end, then come those before it.
        for at in range(start - len(order), start):
            member = order[at]
            if member not in seen:
                seen.add(member)
                yield member
                if len(seen) == everyone:
                    return


def _member_points(member: Member) -> list[int]:
    return [_hash(f"{member.node.node_id}\0{member.name}\0{i}") for i in range(POINTS)]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


#: A dispatch walks from the same few contents again and again.
_content_point = functools.lru_cache(maxsize=4096)(_hash)
