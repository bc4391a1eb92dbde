"""
One model name, one signature, across a pool. Members report each ready
model with the digest of its inputs and outputs; the first member to report
a name (and version) ready claims it for its signature, and a member that
later reports the same name with another signature has it refused there:
UNAVAILABLE, with the reason, logged, and never given an inference. A
client that read the model's metadata from one member must never get a 400
(or a wrong answer) from another by the luck of placement.

A claim lasts while a member in the pool serves the model ready with that
signature; then the next member to report the name claims it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
from twisted.logger import Logger

from kcoral.common.report import ModelState
from kcoral.router.member import Member

log = Logger()

#: A model as the index names it: its name and version.
Key = tuple[str, str]


def _where(member: Member) -> str:
    return f"{member.node.node_id}/{member.name}"


class ModelSignatures:
    """
    The signature each ready model name stands for in a pool, and a member
    that serves it; C{present} says whether a member is still one of the
    pool's, C{members} gives them all.
    """

    def __init__(self, present: Callable[[Member], bool], members: Callable[[], Iterable[Member]]):
        self._present = present
        self._members = members
        self._claims: dict[Key, tuple[str, Member]] = {}

    def admit(self, member: Member, models: tuple[ModelState, ...]) -> tuple[ModelState, ...]:
        """C{models} as C{member} reports them, each ready one whose name
        other present members serve with another signature made UNAVAILABLE
        with the reason."""
        admitted = []
        for model in models:
            if not (model.ready and model.signature):
                admitted.append(model)
                continue
            key = (model.name, model.version)
            claim = self._claim(key, member, model.signature)
            if claim is None:
                self._claims[key] = (model.signature, member)
                admitted.append(model)
                continue
            signature, claimant = claim
            if signature == model.signature:
                admitted.append(model)
                continue
            reason = (f"{_where(member)} serves another model named {model.name} version "
                      f"{model.version} (signature {model.signature[:12]}) than "
                      f"{_where(claimant)} ({signature[:12]}), which the pool had first: "
                      f"refused on {_where(member)}, so that one name is one model")
            if not any(m.name == model.name and m.version == model.version and m.reason == reason
                       for m in member.models):
                log.error("model {name} version {version} refused: {reason}", name=model.name,
                          version=model.version, reason=reason)
            admitted.append(attrs.evolve(model, state="UNAVAILABLE", reason=reason))
        return tuple(admitted)

    def forget(self, member: Member) -> None:
        """C{member} left the pool: its claims go with it."""
        for key, (_, claimant) in list(self._claims.items()):
            if claimant is member:
                del self._claims[key]

    def _claim(self, key: Key, member: Member, signature: str) -> tuple[str, Member] | None:
        """The signature C{key} stands for and a member that serves it; None
        when no present member but C{member} serves it. A claim outlives the
        member that made it while another serves its signature: a member
        that changes its own model does not change the name's."""
        claim = self._claims.get(key)
        if claim is not None:
            claimed, claimant = claim
            if claimant is member and claimed == signature:
                return claim  # its own heartbeat: the common case, at no cost
            if claimant is not member and self._serves(claimant, key, claimed):
                return claim
        for other in self._members():
            if other is not member and self._present(other):
                for model in other.models:
                    if (model.name, model.version) == key and model.ready and model.signature:
                        self._claims[key] = (model.signature, other)
                        return self._claims[key]
        self._claims.pop(key, None)
        return None

    def _serves(self, claimant: Member, key: Key, signature: str) -> bool:
        return self._present(claimant) and any(
            (m.name, m.version) == key and m.ready and m.signature == signature
            for m in claimant.models)
