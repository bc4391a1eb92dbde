"""
Where the steps of a sequence go, on a Router and on a gateway.

A sequence model's worker keeps each live sequence's state, so every step
of a sequence must reach the worker that ran its START, whichever front
takes it, and with no store that the fronts share. Its worker is therefore
derived from what each step carries: of the members that serve the model
(L{candidates}), the one of highest random weight for the sequence's key,
the client's token (a digest of it), the model's name and the sequence's id
(rendezvous hashing, L{rendezvous}). Every front that knows the same
members picks the same one, in whatever order it lists them; when a member
leaves, only its own sequences move (lost with it anyway), and a member that
joins takes only the sequences it now wins, about one in as many as there
are members. Ids are per client token: two clients' sequences of one id are
two keys.

The members are those that report the model ready, belong to a node the
front counts as ready and name their instance: what their supervisors
report, the same on every front, and not what one front's own connections
met. A member this front suspects, or whose supervisor reports it unhealthy
but still names its instance (a worker that missed probes, stopped or
slow), keeps its sequences, whose steps and STARTs wait for it: were they
placed elsewhere meanwhile, a START there would leave the sequence's older
state on the worker, for a front that did not see that START to step once
the worker answers again. A supervisor forgets a worker's instance once the
worker exits. A step is never run twice: it is pinned to its worker's
instance, and a forward lost after it was sent is the client's 502.

A sequence can still lose its worker: the worker died or restarted (a new
instance), or the members changed so that the hash now picks another. The
front remembers the instance it placed each START on (L{Sequences}, at
most L{MOST_REMEMBERED}, the least recently stepped forgotten first), and
refuses a later step that would now go to another member or instance with
L{SequenceLost} (410 C{sequence_lost}), never sending it to a worker that
would start it from an empty state. A front that did not see the START
(another Router, or one that forgot it) sends the step where the hash says,
and a worker that does not hold the sequence refuses a step without START in
Triton's words (400): no step runs on a state it was not meant for, either
way.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable

import attrs
from twisted.internet.defer import Deferred, DeferredLock

from kcoral.errors import SequenceLost
from kcoral.protocol.sequence import SequenceControls, owner_of
from kcoral.router.member import READY, Member

#: The START placements a front remembers: past that, the least recently
#: stepped sequence is forgotten (its loss is then the worker's 400).
MOST_REMEMBERED = 65536


@attrs.frozen
class SequenceKey:
    """One client's sequence of one model: C{owner}, the digest of its
    client's token (None: no token); C{id} as the client gave it."""

    owner: bytes | None
    model: str
    id: int | str

    @classmethod
    def of(cls, token: bytes | None, model: str, controls: SequenceControls) -> SequenceKey:
        assert controls.id is not None  # a request that names no sequence has no key
        return cls(owner_of(token), model, controls.id)

    @property
    def point(self) -> int:
        """The 64-bit hash the rendezvous weighs members by: an integer id
        and the string of its digits are different sequences."""
        kind = b"i" if isinstance(self.id, int) else b"s"
        return int.from_bytes(hashlib.blake2b(b"\0".join((
            self.owner or b"", self.model.encode(), kind, str(self.id).encode())),
            digest_size=8).digest(), "big")

    def __str__(self) -> str:
        return f"sequence {str(self.id)[:64]} of model {self.model!r}"


def candidates(members: Iterable[Member], model: str, version: str | None) -> list[Member]:
    """The members of C{members} a sequence of C{model} (of C{version}, None:
    any) may be placed on: of a ready node, naming their instance (healthy
    or not: alive), with the model ready."""
    return [member for member in members
            if member.node.state == READY and member.instance is not None
            and model in member.sequence_models
            and (version is None or any(state.name == model and state.version == version
                                        and state.ready for state in member.models))]


def rendezvous(key: SequenceKey, members: Iterable[Member]) -> Member | None:
    """The member of C{members} of highest weight for C{key} (None: none),
    a member's weight a hash of the key and the member's node id and name."""
    point = key.point
    best: Member | None = None
    best_weight = -1
    for member in members:
        # A member's own hash is worked out once; each step then costs a
        # few integer operations a member, not a hash of its name.
        weight = _mix(_member_point(member.node.node_id, member.name) ^ point)
        if weight > best_weight:
            best, best_weight = member, weight
    return best


@functools.lru_cache(maxsize=65536)
def _member_point(node_id: str, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{node_id}\0{name}".encode(), digest_size=8).digest(),
                          "big")


_MASK = (1 << 64) - 1


def _mix(value: int) -> int:
    """MurmurHash3's 64-bit finalizer: every bit of C{value} moves about
    half of the result's, so that a member's weights for different keys are
    as if drawn at random."""
    value = ((value ^ (value >> 33)) * 0xFF51AFD7ED558CCD) & _MASK
    value = ((value ^ (value >> 33)) * 0xC4CEB9FE1A85EC53) & _MASK
    return value ^ (value >> 33)


@attrs.frozen
class _Placed:
    """Where a front placed a sequence's START: the member and its instance."""

    node_id: str
    name: str
    instance: str

    @classmethod
    def on(cls, member: Member) -> _Placed:
        assert member.instance is not None  # a candidate names its instance
        return cls(member.node.node_id, member.name, member.instance)

    def __str__(self) -> str:
        return f"{self.node_id}/{self.name} (instance {self.instance})"


class Sequences:
    """
    The sequences whose START this front placed, each where it went (at
    most C{most}): where each step of a sequence goes, and when.

    A sequence's steps are forwarded one at a time, each once the one before
    it is answered: its worker runs them in the order they reach it, and
    steps sent at once (a stream's) would race each other there on their
    own connections.
    """

    def __init__(self, most: int = MOST_REMEMBERED):
        self._most = most
        self._placed: OrderedDict[SequenceKey, _Placed] = OrderedDict()
        #: The sequences with a step forwarded or waiting to be, each its turns.
        self._turns: dict[SequenceKey, DeferredLock] = {}

    def in_turn(self, key: SequenceKey, step: Callable[[], Deferred]) -> Deferred:
        """What C{step()} answers, called once every step of C{key} before
        it has been answered. Cancelled while it waits, it is never called."""
        turns = self._turns.get(key)
        if turns is None:
            turns = self._turns[key] = DeferredLock()

        def done(result):
            if not turns.locked and not turns.waiting and self._turns.get(key) is turns:
                del self._turns[key]
            return result

        return turns.run(step).addBoth(done)

    def __len__(self) -> int:
        return len(self._placed)

    def place(self, key: SequenceKey, controls: SequenceControls,
              members: Iterable[Member]) -> Member | None:
        """
        The member that step C{controls} of sequence C{key} goes to, of the
        candidate C{members} (None: there is none yet); L{SequenceLost} for
        a step of a sequence whose START went to another member or instance.
        A START is remembered where it goes, and an END forgets its sequence.
        """
        member = rendezvous(key, members)
        placed = None if member is None else _Placed.on(member)
        if controls.start:
            self._placed.pop(key, None)
            if placed is not None and not controls.end:
                self._placed[key] = placed
                if len(self._placed) > self._most:
                    self._placed.popitem(last=False)
            return member
        started = self._placed.pop(key, None) if controls.end else self._placed.get(key)
        if started is None or started == placed:
            if started is not None and not controls.end:
                self._placed.move_to_end(key)
            return member
        now = "no member serves it now" if placed is None else f"it would now go to {placed}"
        raise SequenceLost(f"{key} was started on worker {started}, which no longer holds it: "
                           f"{now}; start the sequence again")
