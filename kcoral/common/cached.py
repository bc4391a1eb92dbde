"""
What a worker reports its caches hold (the programs it has compiled, the
content-addressed inputs it keeps), bounded, so that a Router can place runs
where their content already is.
"""

from __future__ import annotations

import attrs

from kcoral.protocol.wire import is_digest

#: Entries a worker reports, most recently used first: a report stays small
#: (a node of 64 workers stays under the Router's report limit) and the
#: Router's per-member state bounded.
MAX_PROGRAMS = 16
MAX_CONTENTS = 32
#: The largest input size a report or a header may state (1 TiB).
MAX_BYTES = 1 << 40


@attrs.frozen
class Cached:
    """What one worker reports holding: program digests and content digests
    with their sizes, and the mean seconds its compiles took (None before
    its first)."""

    programs: tuple[str, ...] = ()
    contents: tuple[tuple[str, int], ...] = ()
    compile_seconds: float | None = None

    def to_json(self) -> dict:
        return {"programs": list(self.programs), "contents": [list(c) for c in self.contents],
                "compile_seconds": self.compile_seconds}


def parse_cached(value: object) -> Cached:
    """A worker's C{cache} report, checked (it is untrusted); ValueError says why not."""
    if not isinstance(value, dict):
        raise ValueError("must be an object")
    programs = value.get("programs", [])
    contents = value.get("contents", [])
    seconds = value.get("compile_seconds")
    if not isinstance(programs, list) or len(programs) > MAX_PROGRAMS \
            or not all(is_digest(p) for p in programs):
        raise ValueError(f"'programs' must list at most {MAX_PROGRAMS} digests")
    if not isinstance(contents, list) or len(contents) > MAX_CONTENTS or not all(
            isinstance(c, list) and len(c) == 2 and is_digest(c[0]) and _size(c[1])
            for c in contents):
        raise ValueError(f"'contents' must list at most {MAX_CONTENTS} [digest, bytes] pairs")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not 0 <= seconds < 86400):
        raise ValueError("'compile_seconds' must be a number of seconds")
    return Cached(tuple(programs), tuple((d, n) for d, n in contents),
                  None if seconds is None else float(seconds))


def _size(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_BYTES
