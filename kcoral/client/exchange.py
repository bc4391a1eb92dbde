"""
The client's side of a run, written once for both clients: which content to
send inline, what each server is known to hold, the resend after 409 and the
retries after 503. L{exchange} is a generator that yields L{Send} and L{Sleep}
steps; the blocking and the Twisted client each drive it with their own I/O.

Content of L{REFERENCE_FIRST_BYTES} or more goes by reference first, even
to a server not known to hold it: another client may have sent it already.
Behind a Router, the run goes to a member that holds it; a server that does
not answers 409, and it goes inline then, once.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Generator, Iterable, Sequence
from typing import Any

import attrs
import numpy as np
from twisted.application.internet import backoffPolicy
from zope.interface import Interface, implementer

from kcoral.client.remote import IArrayOwner, RemoteArray
from kcoral.errors import (
    ArrayLost,
    ArraysApart,
    KCoralError,
    KeptMemoryFull,
    MissingContent,
    ServerBusy,
    error_from_answer,
)
from kcoral.program import Program
from kcoral.protocol.wire import (
    CACHE_THRESHOLD_BYTES,
    DEVICES_HEADER,
    INPUTS_HEADER,
    KEPT_HEADER,
    MAX_INPUTS_LISTED,
    MAX_KEPT_LISTED,
    NEAR_HEADER,
    PROGRAM_HEADER,
    REDISPATCH_HEADER,
    REQUEST_CONTENT_TYPE,
    Reference,
    decode_outputs,
    encode_request,
    holder_of,
    holder_of_all,
    sha256,
    wire_array,
)
from kcoral.tracing import current_traceparent
from kcoral.web.family import ARRAYS_NAMED, RUN_ROUTE

#: Delays between retries of a busy answer: capped, jittered exponential.
BUSY_BACKOFF = backoffPolicy(initialDelay=0.05, maxDelay=5.0, factor=2.0)

#: Content at least this large (an array, a program) is sent by reference
#: until the server says it lacks it: where a fleet of clients shares its
#: content, the bytes cross the network about once per worker that needs
#: them, not once per client. Below it a 409's round trip costs more than
#: the bytes it could save.
REFERENCE_FIRST_BYTES = 1 << 20


@attrs.frozen
class Send:
    parts: list
    length: int
    headers: dict
    #: The route it is posted to.
    path: str = RUN_ROUTE.label
    #: Whether a client that consents to a second run sends it again after
    #: losing it: a run is a pure function of its inputs; a deletion is not
    #: (a second would find its arrays gone).
    repeatable: bool = True


@attrs.frozen
class Sleep:
    seconds: float


@attrs.frozen
class Response:
    """An answer, or C{status} None when the connection could not be made
    (the request never left: retried like a busy answer)."""

    status: int | None
    body: bytes = b""
    retry_after: float | None = None
    problem: str = ""
    #: The length of an inference answer's JSON part, before its binary tensors.
    header_length: int | None = None


class ICall(Interface):
    """One request a client makes with the exchange: a run or an inference."""

    def send(referenced: set[str], request_id: str | None, redispatch: bool) -> Send:
        """The request, sending inline the content whose digest
        C{referenced} does not name."""

    def reference_first() -> set[str]:
        """The content sent by reference before the server is known to
        hold it (L{REFERENCE_FIRST_BYTES} or more)."""

    def content_digests() -> set[str]:
        """The content the server holds once it answered 200."""

    def outputs(response: Response) -> Any:
        """What the call returns, from its 200 answer."""

    def spare(error: KCoralError) -> bool:
        """Whether C{error}, its answer, is about what it asked only in
        passing (L{RunCall.orphans} gone already, no room beside
        L{RunCall.near}): it leaves that out, to be sent again."""


@implementer(ICall)
@attrs.define
class RunCall:
    """
    A run of a program (L{ICall}). An input that is a kept array has its
    L{Reference} in C{references} (its entry of C{arrays} is a placeholder
    never sent); the outputs C{keep} flags stay on the worker, as
    L{RemoteArray}s of C{owner}; the kept arrays of C{free} are freed once
    it succeeded.
    """

    program: Program
    arrays: list[np.ndarray]
    digests: list[str | None]
    key_types: list[str | None]
    references: list[Reference | None]
    keep: tuple[bool, ...]
    owner: IArrayOwner | None
    free: tuple[str, ...] = ()
    #: Arrays of the same worker that nothing refers to any more, freed in
    #: passing with the run; unlike C{free}'s, one found gone already is
    #: left out, and the run sent again.
    orphans: tuple[str, ...] = ()
    #: A kept array beside which a run that names none keeps its outputs,
    #: where its worker has room: the client's arrays stay together.
    near: str | None = None

    @classmethod
    def prepare(cls, program: Program, args: tuple, kwargs: dict, *, keep=False, free=None,
                owner: IArrayOwner | None = None) -> RunCall:
        """Check and flatten the inputs, hashing the large ones (may block);
        C{keep} is checked against the program's outputs (L{keep_flags}),
        C{free} is a structure of L{RemoteArray}s (or None)."""
        import jax

        flags = keep_flags(keep, program.exported.out_tree)
        freed = jax.tree.leaves(free)
        if not all(isinstance(leaf, RemoteArray) for leaf in freed):
            raise TypeError("free takes kept arrays (RemoteArray), or a structure of them")
        leaves, tree = jax.tree.flatten((tuple(args), dict(kwargs)))
        references = [leaf.reference if isinstance(leaf, RemoteArray) else None for leaf in leaves]
        # Kept inputs are checked against the signature by stand-ins of their types.
        inputs = program.inputs_of([leaf.placeholder() if r is not None else leaf
                                    for leaf, r in zip(leaves, references)], tree)
        arrays = [a if r is not None else wire_array(a)
                  for a, r in zip(inputs.arrays, references, strict=True)]
        digests = [sha256(a) if r is None and a.nbytes >= CACHE_THRESHOLD_BYTES else None
                   for a, r in zip(arrays, references)]
        call = cls(program, arrays, digests, inputs.key_types, references, flags, owner,
                   tuple(dict.fromkeys(leaf.id for leaf in freed)))
        # Refused here rather than by the worker: no request reaches them together.
        error = apart(call.kept)
        if error is not None:
            raise error
        return call

    @property
    def nbytes(self) -> int:
        return len(self.program.serialized) + sum(
            a.nbytes for a, r in zip(self.arrays, self.references) if r is None)

    def send(self, referenced: set[str], request_id: str | None, redispatch: bool = False) -> Send:
        program = None if self.program.digest in referenced else self.program.serialized
        inputs = [(a, d, d is None or d not in referenced) if r is None else r
                  for a, d, r in zip(self.arrays, self.digests, self.references)]
        parts, length = encode_request(self.program.digest, program, inputs, self.key_types,
                                       keep=self.keep, free=self.free + self.orphans)
        headers = {"Content-Type": REQUEST_CONTENT_TYPE, PROGRAM_HEADER: self.program.digest,
                   DEVICES_HEADER: str(self.program.nr_devices)}
        if self.inputs_header:
            headers[INPUTS_HEADER] = self.inputs_header
        kept = self.kept
        if kept:
            # The worker checks every id the body names; a Router needs one
            # to find that worker, and a few to find a lost one early. All of
            # them could pass the 16 KiB a request head may take.
            headers[KEPT_HEADER] = ",".join(kept[:MAX_KEPT_LISTED])
        if self.near is not None and not kept:
            headers[NEAR_HEADER] = self.near
        if request_id:
            headers["X-Request-ID"] = request_id
        # A second run of one that keeps outputs would leave the first's on
        # the worker; of one that frees arrays, would find them gone.
        repeatable = not (self.free or self.orphans or any(self.keep))
        if redispatch and repeatable:
            headers[REDISPATCH_HEADER] = "true"
        traceparent = current_traceparent()
        if traceparent:
            headers["traceparent"] = traceparent
        return Send(parts, length, headers, repeatable=repeatable)

    @property
    def kept(self) -> list[str]:
        """The kept arrays the run names, those it frees too, in order."""
        return sorted({r.kept for r in self.references if r is not None} | set(self.free)
                      | set(self.orphans))

    @property
    def holder(self) -> str | None:
        """The worker of the kept arrays it names (None: it names none)."""
        return holder_of_all(self.kept)

    def spare(self, error: KCoralError) -> bool:
        if isinstance(error, KeptMemoryFull) and self.near is not None:
            self.near = None  # anywhere there is room
            return True
        lost = error.lost if isinstance(error, ArrayLost) else []
        if not lost or not set(lost) <= set(self.orphans):
            return False
        self.orphans = tuple(kept for kept in self.orphans if kept not in lost)
        return True

    @property
    def inputs_header(self) -> str:
        """The C{X-KCoral-Inputs} value: where a Router should place this run."""
        named = {d: a.nbytes for a, d in zip(self.arrays, self.digests) if d is not None}
        largest = sorted(named.items(), key=lambda entry: -entry[1])[:MAX_INPUTS_LISTED]
        return ",".join(f"{digest}={size}" for digest, size in largest)

    def content_digests(self) -> set[str]:
        return {self.program.digest} | {d for d in self.digests if d is not None}

    def reference_first(self) -> set[str]:
        large = {d for a, d in zip(self.arrays, self.digests)
                 if d is not None and a.nbytes >= REFERENCE_FIRST_BYTES}
        if len(self.program.serialized) >= REFERENCE_FIRST_BYTES:
            large.add(self.program.digest)
        return large

    def outputs(self, response: Response):
        """The run's outputs, in the program's structure, from its answer:
        L{RemoteArray}s where it kept them."""
        outputs, key_types = decode_outputs(response.body)
        return self.program.unflatten_outputs([self._leaf(o) for o in outputs], key_types)

    def _leaf(self, output: np.ndarray | Reference):
        if isinstance(output, np.ndarray):
            return output
        assert self.owner is not None, "a run that keeps outputs has an owner"
        return RemoteArray(output, self.owner)


def keep_flags(keep, outputs) -> tuple[bool, ...]:
    """
    Whether each flat output of a program whose outputs have the structure
    C{outputs} (a treedef) stays on the worker: C{keep} is one bool for all,
    or a structure of bools that is a prefix of theirs (C{(False, True)} for
    a program that returns a pair, a bool standing for all the outputs under
    it). A TypeError for a leaf that is no bool, a ValueError for a
    structure that does not fit.
    """
    if isinstance(keep, (bool, np.bool_)):
        return (bool(keep),) * outputs.num_leaves
    if isinstance(keep, tuple) and all(type(flag) is bool for flag in keep):
        # A loop's keep=(True, False), the same on every step: worked out once.
        return _spread(keep, outputs)
    return _spread.__wrapped__(keep, outputs)


@functools.lru_cache(maxsize=256)
def _spread(keep, outputs) -> tuple[bool, ...]:
    import jax

    flags = jax.tree.leaves(keep)
    if not all(isinstance(flag, (bool, np.bool_)) for flag in flags):
        raise TypeError(f"keep takes True, False or a structure of them, not {keep!r}")
    try:
        spread = jax.tree.broadcast(keep, jax.tree.unflatten(outputs, [0] * outputs.num_leaves))
    except ValueError:
        raise ValueError(f"keep={keep!r} does not fit the program's outputs, {outputs}: give "
                         f"True, False, or a prefix of their structure with a bool at each "
                         f"leaf") from None
    return tuple(bool(flag) for flag in jax.tree.leaves(spread))


def apart(ids: Iterable[str]) -> ArraysApart | None:
    """The error for kept arrays of C{ids} held by several workers (None
    when they are together): which are where, and what to do."""
    where: dict[str | None, list[str]] = {}
    for kept in dict.fromkeys(ids):
        where.setdefault(holder_of(kept), []).append(kept)
    if len(where) < 2:
        return None
    listed = "; ".join(f"{', '.join(held[:4])}{' ...' if len(held) > 4 else ''} on worker {holder}"
                       for holder, held in where.items())
    return ArraysApart(
        f"the run's kept arrays are on different workers ({listed}), and a run takes them "
        f"where they are, on one worker: put them together (client.put(tree) keeps a whole "
        f"tree on one worker, client.put(x, near=array) keeps x beside array), or fetch one "
        f"and pass its bytes", details={"workers": dict(where)})


def deletions(ids: Sequence[str]) -> list[Send]:
    """The requests (C{DELETE}) that free the kept arrays of C{ids}: one
    for each worker that holds some, of up to L{MAX_KEPT_LISTED} of them."""
    held: dict[str | None, list[str]] = {}
    for kept in dict.fromkeys(ids):
        held.setdefault(holder_of(kept), []).append(kept)
    return [Send([], 0, {KEPT_HEADER: ",".join(ids[i:i + MAX_KEPT_LISTED])}, path=ARRAYS_NAMED.label,
                 repeatable=False)
            for ids in held.values()
            for i in range(0, len(ids), MAX_KEPT_LISTED)]


def deletion_error(errors: list[KCoralError], spared: Iterable[str] = ()) -> KCoralError | None:
    """What a delete whose requests (one a worker, all sent) were refused
    with C{errors} raises: one L{ArrayLost} naming every array gone, where
    that is all they say; else the first other error. None where the only
    arrays gone are of C{spared} (freed in passing: gone is as good)."""
    others = [e for e in errors if not isinstance(e, ArrayLost)]
    if others:
        return others[0]
    spared = set(spared)
    lost = [kept for e in errors if isinstance(e, ArrayLost) for kept in e.lost
            if kept not in spared]
    if not lost:
        return None
    return ArrayLost(f"no worker holds kept array(s) {', '.join(lost[:8])} (deleted, expired, "
                     f"or its worker restarted); the others are freed", details={"lost": lost})


def error_of(response: Response, request_id: str | None = None) -> KCoralError:
    """The error an answer that is not 200 stands for (one that never came:
    busy), naming C{request_id} where the answer does not."""
    if response.status is None:
        return ServerBusy(f"could not reach the server: {response.problem}", reason="unreachable",
                          request_id=request_id)
    return error_from_answer(response.status, response.body, request_id)


def exchange(call: ICall, held: set[str], *, busy_timeout: float,
             request_id: str | None = None, redispatch: bool = False,
             clock=time.monotonic) -> Generator[Send | Sleep, Response | None, Any]:
    """
    Run C{call}; C{held} is the set of digests this server is known to hold,
    updated as answers arrive; with C{redispatch} the request allows a
    second run where its node is lost. Returns the outputs in the program's structure.
    The driver answers each L{Send} with its L{Response}, each L{Sleep}
    with None once the time has passed.
    """
    give_up = clock() + busy_timeout
    # The client names every request, so that an error it raises names the
    # request in the services' logs, whatever form the error body takes.
    request_id = request_id or uuid.uuid4().hex
    resent = False
    attempt = 0
    while True:
        referenced = held if resent else held | call.reference_first()
        response = yield call.send(referenced, request_id, redispatch)
        assert response is not None
        if response.status == 200:
            held.update(call.content_digests())
            return call.outputs(response)
        error = error_of(response, request_id)
        if call.spare(error):
            continue
        if isinstance(error, MissingContent) and not resent:
            # The server lacks content we thought it held (a restart, an
            # eviction, another node behind a Router) or sent by reference
            # first: send it inline, once, and the rest of the run's content
            # with it. Behind a Router the resend may reach another worker,
            # which could lack what the first one held: a resend by
            # reference could be refused again.
            held.difference_update(call.content_digests())
            resent = True
            continue
        if isinstance(error, ServerBusy):
            delay = max(BUSY_BACKOFF(attempt), response.retry_after or 0.0)
            if clock() + delay <= give_up:
                attempt += 1
                yield Sleep(delay)
                continue
        raise error
