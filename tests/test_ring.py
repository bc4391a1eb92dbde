"""
The hash ring placement walks (L{kcoral.router.ring}): every member once, in
an order each content keeps, and one that a member joining or leaving
changes only where that member is.
"""

from __future__ import annotations

from kcoral.router.pool import Member, Node
from kcoral.router.ring import Ring


def members(count: int, node_id: str = "n") -> list[Member]:
    node = Node(node_id, "s1")
    return [Member(node, f"worker{i}", f"http://10.0.0.1:{8000 + i}") for i in range(count)]


def digest(i: int) -> str:
    return f"{i:064x}"


def test_a_walk_gives_every_member_once():
    """Walking from any content yields each member exactly once."""
    pool = members(7)
    ring = Ring(pool)
    for i in range(20):
        walked = list(ring.walk(digest(i)))
        assert sorted(m.name for m in walked) == sorted(m.name for m in pool)


def test_a_content_keeps_its_order_and_contents_spread():
    """The same content walks in the same order every time (and in a ring made again);
    many contents put every member first for some."""
    pool = members(4)
    ring = Ring(pool)
    assert list(ring.walk(digest(1))) == list(Ring(pool).walk(digest(1)))
    firsts = [next(ring.walk(digest(i))) for i in range(400)]
    shares = [firsts.count(m) / len(firsts) for m in pool]
    assert min(shares) > 0.1, shares


def test_a_member_leaving_moves_only_the_contents_it_came_first_for():
    """Content whose first member stays keeps it; content whose first member left
    goes to the member that came second for it."""
    pool = members(10)
    before = Ring(pool)
    after = Ring(pool)
    after.remove(pool[9])
    for i in range(200):
        order = list(before.walk(digest(i)))
        expected = order[0] if order[0] is not pool[9] else order[1]
        assert next(after.walk(digest(i))) is expected


def test_a_ring_changed_in_place_walks_as_one_made_anew():
    """Members added and removed one by one leave the ring that their set would make."""
    pool = members(6) + members(3, node_id="m")
    ring = Ring(pool[:4])
    for member in pool[4:]:
        ring.add(member)
    ring.remove(pool[1])
    ring.remove(pool[7])
    rest = [m for m in pool if m is not pool[1] and m is not pool[7]]
    for i in range(50):
        assert list(ring.walk(digest(i))) == list(Ring(rest).walk(digest(i)))
    assert sorted(ring.members, key=rest.index) == rest


def test_an_empty_ring_walks_nowhere():
    """A pool without members gives an empty walk."""
    assert list(Ring([]).walk(digest(0))) == []
