"""
Pieces shared by the C{usage.Options} of every KCoral service: value checks,
environment fallbacks and options left out of C{--help}.
"""

from __future__ import annotations

import os
import sys

from twisted.python import usage


def non_negative(kind):
    def coerce(text: str):
        value = kind(text)
        if not value >= 0:  # also refuses nan
            raise ValueError(f"must not be negative, got {text}")
        return value
    coerce.coerceDoc = f"A non-negative {kind.__name__}."
    return coerce


def positive(kind):
    def coerce(text: str):
        value = kind(text)
        if not value > 0:  # also refuses nan
            raise ValueError(f"must be positive, got {text}")
        return value
    coerce.coerceDoc = f"A positive {kind.__name__}."
    return coerce


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"{text} is not a TCP port")
    return value


#: Listening on a Twisted server endpoint string (the Router, a standalone
#: server, a node's gateway). Twisted parses it, TLS files included.
LISTEN = ["listen", None, None,
          "A Twisted server endpoint string to listen on instead of --host, --port, --tls-cert "
          "and --tls-key, e.g. ssl:9443:interface=0.0.0.0:privateKey=key.pem:certKey=cert.pem."]


def check_listen(options) -> None:
    if options["listen"] and (options["tls-cert"] or options["tls-key"]):
        raise usage.UsageError("--listen takes the place of --tls-cert and --tls-key: name the "
                               "certificate in the endpoint string (certKey=..., privateKey=...)")


class _NamedParameter(usage.CoerceParameter):
    """Names the option when its value is refused (Twisted's message does not)."""

    def dispatch(self, parameterName, value):
        try:
            super().dispatch(parameterName, value)
        except usage.UsageError as e:
            why = str(e).removeprefix("Parameter type enforcement failed: ")
            raise usage.UsageError(f"--{parameterName}: {why}") from None


class KCoralOptions(usage.Options):
    """
    C{usage.Options} with two additions: options named in C{environment} fall
    back to that environment variable (command line beats environment beats
    default), and options named in C{hidden} are left out of C{--help}.
    """

    environment: dict[str, str] = {}
    hidden: frozenset[str] = frozenset()

    def __init__(self):
        super().__init__()
        for name, handler in self._dispatch.items():
            if type(handler) is usage.CoerceParameter:
                self._dispatch[name] = _NamedParameter(self, handler.coerce)

    def getUsage(self, width=None):
        everything = self.longOpt
        self.longOpt = [o for o in everything if o.rstrip("=") not in self.hidden]
        try:
            return super().getUsage(width)
        finally:
            self.longOpt = everything

    def parseOptions(self, options=None):
        argv = sys.argv[1:] if options is None else options
        #: Options named on the command line (they beat every other source).
        self.named = {a[2:].split("=", 1)[0] for a in argv if a.startswith("--") and len(a) > 2}
        super().parseOptions(options)

    def from_environment(self) -> set[str]:
        """Fill unset options from their environment variables; the names filled."""
        filled = set()
        for option, variable in self.environment.items():
            if option not in self.named and os.environ.get(variable):
                self[option] = os.environ[variable]
                filled.add(option)
        return filled

    def postOptions(self):
        self.from_environment()

    def given(self, option: str) -> bool:
        """Whether C{option} was set by the user (not left at its default)."""
        return option in getattr(self, "named", ()) or self[option] != self.defaults.get(option)
