"""
One model name, one signature, across a pool. Members report each ready
model with the digest of its inputs and outputs; the first member to report
a name (and version) ready claims it for its signature, and a member that
later reports the same name with another signature has it refused there:
UNAVAILABLE, with the reason, logged, and never given an inference. A
client that read the model's metadata from one member must never get a 400
(or a wrong answer) from another by the luck of placement.

A claim lasts while its member is in the pool and reports the model ready
with that signature; then the next member to report the name claims it.
"""

from __future__ import annotations

from collections.abc import Callable

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
    The signature each ready model name stands for in a pool, and the
    member that claimed it; C{present} says whether a member is still one
    of the pool's.
    """

    def __init__(self, present: Callable[[Member], bool]):
        self._present = present
        self._claims: dict[Key, tuple[str, Member]] = {}

    def admit(self, member: Member, models: tuple[ModelState, ...]) -> tuple[ModelState, ...]:
        """C{models} as C{member} reports them, each ready one whose name a
        present member claimed first for another signature made UNAVAILABLE
        with the reason; the claims of C{member} follow its report."""
        ready = {(m.name, m.version): m.signature for m in models if m.ready and m.signature}
        for key, (signature, claimant) in list(self._claims.items()):
            if claimant is member and ready.get(key) != signature:
                del self._claims[key]
        admitted = []
        for model in models:
            key = (model.name, model.version)
            if key not in ready:
                admitted.append(model)
                continue
            claim = self._claims.get(key)
            if claim is None or not self._holds(*claim, key):
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

    def _holds(self, signature: str, claimant: Member, key: Key) -> bool:
        return self._present(claimant) and any(
            (m.name, m.version) == key and m.ready and m.signature == signature
            for m in claimant.models)
