"""
Counts a client writes as text (header values, sizes, versions), read
strictly: ASCII digits and nothing else.

Python's C{int()} also takes a sign, surrounding spaces, underscores between
digits and the digits of every script (C{int("1_0") == 10}, C{int(" +7")
== 7}, C{int("١") == 1}), and C{str.isdigit} passes characters C{int()}
then refuses (C{"²"}). A count read through L{read_count} means what the bytes
say to every other reader: a proxy in front, a log, the client itself.
"""

from __future__ import annotations

#: Digits a count may have at most: bounds the work of reading one.
MOST_DIGITS = 32
#: The largest byte count read (a length within a body, an input's size).
MOST_BYTES = 1 << 62
#: The highest model version the services serve (nine digits).
MOST_VERSION = 999_999_999


def read_count(value: str | bytes | None, most: int) -> int | None:
    """C{value} as a count from 0 to C{most}, when it is 1 to L{MOST_DIGITS}
    ASCII digits alone; None for anything else (absent, empty, signed,
    spaced, underscored, other scripts' digits, too large)."""
    if isinstance(value, str):
        if not value.isascii():
            return None
        value = value.encode("ascii")
    # bytes.isdigit is 0-9 alone, unlike str.isdigit.
    if value is None or not 0 < len(value) <= MOST_DIGITS or not value.isdigit():
        return None
    number = int(value)
    return number if number <= most else None
