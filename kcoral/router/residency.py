"""
Cache residency: what each member holds (the programs it has compiled, the
content-addressed inputs its upload cache keeps) and what a run needs.

A member's holdings come from two sources. Its worker reports them in its
health (L{Cached}, bounded to the most recently used entries), relayed by its
supervisor; and the Router learns from its own placements, because a run
that succeeded on a member left its program compiled and its inputs cached
there. A new report replaces what earlier reports said: an eviction or a
restart removes entries. What the Router learned itself survives a report for
a grace period, since the report may have been probed before the run ended;
a 409 from the member forgets what it names at once, and a restarted worker
(a new URL, or unhealthy) starts empty.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import attrs
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kcoral.common.cached import MAX_BYTES, MAX_CONTENTS, Cached
from kcoral.errors import BadRequest
from kcoral.protocol.counts import read_count
from kcoral.protocol.wire import (
    MAX_INPUTS_LISTED,
    WireError,
    holder_of,
    holder_of_all,
    is_digest,
    kept_ids,
)

#: Entries the Router keeps per member, reported and learned together.
MAX_HELD = 4 * MAX_CONTENTS


@attrs.frozen
class Demand:
    """What a run needs where it runs: its program and content-addressed
    inputs (digest, bytes), as its headers name them."""

    program: str
    inputs: tuple[tuple[str, int], ...] = ()
    #: The model an inference runs: only members that report it ready take it.
    model: str | None = None
    #: The instance id of the worker that holds the state the run uses:
    #: kept arrays (C{arrays}, their ids) or a sequence's (C{sequence}, how
    #: logs and errors name it). Only that member takes it, and never twice.
    kept: str | None = None
    arrays: tuple[str, ...] = ()
    sequence: str | None = None
    #: Content a member believed to hold it said it lacks (a 409): only a
    #: member believed to hold all of it takes the run again.
    required: tuple[str, ...] = ()
    #: The instance id of the worker beside whose arrays a run that names
    #: none would keep its outputs: a preference, while it has a free slot.
    near: str | None = None

    @classmethod
    def of(cls, program: bytes | None, inputs: bytes | None,
           kept: bytes | None = None, near: bytes | None = None) -> Demand | None:
        """The demand the C{X-KCoral-Program}, C{X-KCoral-Inputs},
        C{X-KCoral-Kept} and C{X-KCoral-Near} headers state; None when they
        name neither a program digest nor kept arrays. An input entry, or a
        near id, that does not parse is left out: placement by content or
        beside arrays is a preference, never a refusal (the worker checks
        the frame itself). Kept arrays are a hard constraint, read whether
        the program is named or not (a run placed elsewhere would be told
        its arrays are lost): L{ArraysApart} when they name several
        workers, L{BadRequest} for an id that is none."""
        try:
            arrays = kept_ids(kept)
        except WireError as e:
            raise BadRequest(str(e)) from None
        holder = holder_of_all(arrays)
        digest = (program or b"").decode("ascii", "replace")
        if not is_digest(digest):
            if holder is None:
                return None
            # Placed by its arrays alone. Its program, for the residency it
            # shares with runs, stands for them, as a model's name does for
            # an inference: a digest no program has.
            return cls(_digest_of(f"kept:{holder}"), kept=holder, arrays=arrays)
        named: list[tuple[str, int]] = []
        for entry in (inputs or b"").decode("ascii", "replace").split(",")[:MAX_INPUTS_LISTED]:
            content, _, size = entry.strip().partition("=")
            nbytes = read_count(size, MAX_BYTES)
            if is_digest(content) and nbytes is not None:
                named.append((content, nbytes))
        beside = holder_of(near.decode("ascii", "replace").strip()) if near and not arrays else None
        return cls(digest, tuple(named), kept=holder, arrays=arrays, near=beside)

    @classmethod
    def of_model(cls, name: str) -> Demand:
        """What an inference of model C{name} needs: a member that has it
        ready. Its program, for the residency it shares with runs, is the
        digest of the model's name."""
        return cls(_digest_of(f"model:{name}"), model=name)

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.inputs)

    @property
    def pinned(self) -> bool:
        """Whether a hard constraint picks its members (a model, kept
        arrays, content a member lacked): where it goes among them is a
        question of load alone."""
        return self.model is not None or self.kept is not None or bool(self.required)

    @property
    def home(self) -> str:
        """What the run hashes by where nothing holds it: its largest input
        (variants of one program spread by their weights), else its program."""
        return max(self.inputs, key=lambda entry: entry[1])[0] if self.inputs else self.program


def _digest_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


#: When a reported entry was learned: before anything the Router learned.
_REPORTED = float("-inf")


class Holdings:
    """What the Router believes one member holds, each entry with when it was
    learned from a placement (reported ones: never)."""

    __slots__ = ("compiling", "contents", "programs")

    def __init__(self) -> None:
        self.programs: dict[str, float] = {}
        self.contents: dict[str, tuple[int, float]] = {}
        #: Programs a run was placed on the member for while it did not hold
        #: them, not yet answered, and when: the member is compiling them, so
        #: a second run placed there waits for what is left of that compile.
        self.compiling: dict[str, float] = {}

    def compiled(self, program: str) -> bool:
        return program in self.programs and program not in self.compiling

    def held_bytes(self, demand: Demand) -> int:
        contents = self.contents
        return sum(size for digest, size in demand.inputs if digest in contents)

    def holds_any(self, demand: Demand) -> bool:
        """Whether it holds (or is compiling) the program or any input of C{demand}."""
        if demand.program in self.programs:
            return True
        contents = self.contents
        for digest, _ in demand.inputs:
            if digest in contents:
                return True
        return False

    def holds_all(self, demand: Demand) -> bool:
        return demand.program in self.programs and all(d in self.contents for d, _ in demand.inputs)

    def holds_every(self, digests: Iterable[str]) -> bool:
        """Whether it holds every one of C{digests}, programs or inputs."""
        return all(d in self.contents or d in self.programs for d in digests)

    def learn(self, demand: Demand, now: float) -> None:
        """A run of C{demand} succeeded on the member at C{now}."""
        self.programs.pop(demand.program, None)
        self.programs[demand.program] = now
        for digest, size in demand.inputs:
            self.contents.pop(digest, None)
            self.contents[digest] = (size, now)
        _trim(self.programs)
        _trim(self.contents)

    def replace(self, cached: Cached, now: float, grace: float) -> None:
        """The member's own report: it replaces everything but what was
        learned within C{grace} seconds before C{now}."""
        since = now - grace
        programs = dict.fromkeys(reversed(cached.programs), _REPORTED)
        contents = {d: (n, _REPORTED) for d, n in reversed(cached.contents)}
        for program, at in self.programs.items():
            if at > since:
                programs[program] = at
        for digest, (size, at) in self.contents.items():
            if at > since:
                contents[digest] = (size, at)
        self.programs, self.contents = programs, contents
        for program in cached.programs:
            self.compiling.pop(program, None)

    def forget(self, digests: Iterable[str]) -> None:
        for digest in digests:
            self.programs.pop(digest, None)
            self.contents.pop(digest, None)

    def clear(self) -> None:
        self.programs.clear()
        self.contents.clear()
        self.compiling.clear()


def _trim(entries: dict) -> None:
    # Dicts keep insertion order: the first entries are the least recent.
    while len(entries) > MAX_HELD:
        del entries[next(iter(entries))]


class Estimate:
    """An exponentially weighted mean of observations; C{initial}, a guess,
    until the first, which replaces it."""

    __slots__ = ("_measured", "_weight", "value")

    def __init__(self, initial: float, weight: float = 0.2):
        self.value = initial
        self._weight = weight
        self._measured = False

    @property
    def measured(self) -> bool:
        """Whether C{value} is an observation's, not the initial guess."""
        return self._measured

    def observe(self, value: float) -> None:
        if self._measured:
            self.value += self._weight * (value - self.value)
        else:
            self.value, self._measured = value, True


#: Bodies smaller than this say little about bandwidth: their time is mostly
#: the run's.
MEASURED_BODY_BYTES = 1 << 20


class Residency:
    """
    Where content is, as this Router knows it, and what moving it costs: the
    bandwidth to members and their compile and run seconds, as measured.
    Counts placements that found their content (hits) and what that saved.
    """

    def __init__(self, clock, *, grace_seconds: float = 5.0):
        self._clock = clock
        self.grace = grace_seconds
        #: Bytes a second a run's body reaches a member at (its whole
        #: forward, so an underestimate: a cold placement looks no cheaper
        #: than it is).
        self.bandwidth = Estimate(1e8)  # a Python proxy's pace, until measured
        self.compile_seconds = Estimate(1.0)
        #: Seconds a run holds a member's slot when its inputs were there
        #: already (small bodies): what a run queued behind it waits. Until
        #: one is measured, waiting counts nothing: runs keep to their
        #: content, and only a compile under way spreads them.
        self.run_seconds = Estimate(0.0)
        #: Placements that found all their content (by the Router's belief), or not.
        self.hits = 0
        self.misses = 0
        self.saved_bytes = 0
        self.saved_compiles = 0

    def compile_cost(self, held: Holdings, program: str) -> float:
        """The seconds of compiling a run of C{program} waits for on the
        member holding C{held}: none where it is compiled, what is left of
        the compile under way where one is (once a run has been measured:
        before, the waits behind runs that it is weighed against count
        nothing, and the whole compile is counted), else a whole compile."""
        if held.compiled(program):
            return 0.0
        started = held.compiling.get(program)
        whole = self.compile_seconds.value
        if started is None or not self.run_seconds.measured:
            return whole
        return max(0.0, whole - (self._clock.seconds() - started))

    def reported(self, held: Holdings, cached: Cached | None) -> None:
        """A member's report; without a C{cache} part it replaces nothing."""
        if cached is None:
            return
        held.replace(cached, self._clock.seconds(), self.grace)
        if cached.compile_seconds is not None:
            self.compile_seconds.observe(cached.compile_seconds)

    def placed(self, held: Holdings, demand: Demand | None) -> bool:
        """
        A run of C{demand} is placed on the member holding C{held}: a hit if
        it held all the run needs (returned). From now on the member counts as holding
        its inputs, so the next run of the same weights goes there rather
        than to a second cold member while the first is still uploading
        them; its program counts as compiling there until that run answers
        (a second run would wait for that compile). An answer that says
        otherwise (a 409) corrects it. An inference is none of this: every
        member that has its model ready has compiled it and holds its params.
        """
        if demand is None or demand.model is not None:
            return False
        hit = held.holds_all(demand)
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        self.saved_bytes += held.held_bytes(demand)
        self.saved_compiles += demand.program in held.programs
        now = self._clock.seconds()
        if demand.program not in held.programs:
            held.compiling[demand.program] = now
            _trim(held.compiling)
        held.learn(demand, now)
        return hit

    def settled(self, held: Holdings, demand: Demand | None, code: int, missing: list[str],
                seconds: float, sent_bytes: int) -> None:
        """
        A run of C{demand} answered C{code} after C{seconds} on the member
        holding C{held}, having been sent C{sent_bytes}: a 200 left its
        content there, a 409 says what is not (C{missing}).
        """
        if demand is not None and demand.model is not None:
            return  # its seconds are a batch's share, not a run's
        if code == 409:
            held.forget(missing)
        if demand is None:
            return
        # The first answer for a program placed cold ends its compile there.
        compiled_here = demand.program in held.compiling
        held.compiling.pop(demand.program, None)
        if code != 200:
            return
        held.learn(demand, self._clock.seconds())
        if sent_bytes < MEASURED_BODY_BYTES:
            if not compiled_here:  # a compile's seconds are not a run's
                # The reactor's clock is the wall clock, which can step back:
                # a negative run would make a busy member cheaper than an idle one.
                self.run_seconds.observe(max(0.0, seconds))
        elif seconds > 0:
            self.bandwidth.observe(sent_bytes / seconds)


class ResidencyCollector:
    """The placement series of a Router's C{/metrics}, read at scrape time."""

    def __init__(self, residency: Residency):
        self._residency = residency

    def collect(self):
        r = self._residency
        placements = CounterMetricFamily(
            "kcoral_placements", "Runs placed on a member that held their program and every "
            "referenced input (hit), or not (miss)", labels=["cache"])
        placements.add_metric(["hit"], r.hits)
        placements.add_metric(["miss"], r.misses)
        saved = CounterMetricFamily("kcoral_placement_saved_bytes",
                                    "Input bytes that runs found on the member they were placed on")
        saved.add_metric([], r.saved_bytes)
        compiles = CounterMetricFamily("kcoral_placement_saved_compiles",
                                       "Runs placed on a member that had compiled their program")
        compiles.add_metric([], r.saved_compiles)
        bandwidth = GaugeMetricFamily("kcoral_placement_bandwidth_bytes_per_second",
                                      "Measured bandwidth of large run bodies to members")
        bandwidth.add_metric([], r.bandwidth.value)
        return [placements, saved, compiles, bandwidth]
