"""
Pieces shared by the C{usage.Options} of every KCoral service: value checks,
environment fallbacks and options left out of C{--help}.
"""

from __future__ import annotations

import os

from twisted.python import usage


def non_negative(kind):
    def coerce(text: str):
        value = kind(text)
        if value < 0:
            raise ValueError(f"must not be negative, got {text}")
        return value
    coerce.coerceDoc = f"A non-negative {kind.__name__}."
    return coerce


def positive(kind):
    def coerce(text: str):
        value = kind(text)
        if value <= 0:
            raise ValueError(f"must be positive, got {text}")
        return value
    coerce.coerceDoc = f"A positive {kind.__name__}."
    return coerce


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"{text} is not a TCP port")
    return value


class KCoralOptions(usage.Options):
    """
    C{usage.Options} with two additions: options named in C{environment} fall
    back to that environment variable (command line beats environment beats
    default), and options named in C{hidden} are left out of C{--help}.
    """

    environment: dict[str, str] = {}
    hidden: frozenset[str] = frozenset()

    def getUsage(self, width=None):
        everything = self.longOpt
        self.longOpt = [o for o in everything if o.rstrip("=") not in self.hidden]
        try:
            return super().getUsage(width)
        finally:
            self.longOpt = everything

    def postOptions(self):
        for option, variable in self.environment.items():
            if self[option] is None and os.environ.get(variable):
                self[option] = os.environ[variable]

    def given(self, option: str) -> bool:
        """Whether C{option} was set on the command line or in the environment."""
        return self[option] != self.defaults.get(option)
