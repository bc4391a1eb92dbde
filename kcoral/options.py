"""
Pieces shared by the C{usage.Options} of every KCoral service: value checks,
environment fallbacks, options left out of C{--help}, and the link between
options and the frozen config of a service, which holds every default.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import attrs
from twisted.python import usage

from kcoral.common import keepalive
from kcoral.logs import LOG_FORMATS, log_under_twistd
from kcoral.tracing import TRACING_MODES

C = TypeVar("C")


@attrs.frozen
class Bounded:
    """
    The value check of a number option: a C{kind} (C{int}, C{float}) above
    zero or, with C{zero}, at least zero. C{coerceDoc} is the line that
    C{usage.Options} shows in C{--help}.
    """

    kind: type
    zero: bool
    #: The largest value taken, if any (a kernel's limit, say).
    most: Any = None

    @property
    def coerceDoc(self) -> str:
        most = "" if self.most is None else f", at most {self.most}"
        return f"A {'non-negative' if self.zero else 'positive'} {self.kind.__name__}{most}."

    def __call__(self, text: str) -> Any:
        value = self.kind(text)
        # The comparisons are written so that nan fails them too.
        if self.zero and not value >= 0:
            raise ValueError(f"must not be negative, got {text}")
        if not self.zero and not value > 0:
            raise ValueError(f"must be positive, got {text}")
        if self.most is not None and not value <= self.most:
            raise ValueError(f"must be at most {self.most}, got {text}")
        return value


@attrs.frozen
class OneOf:
    """The value check of an option that takes one of C{values}."""

    values: tuple[str, ...]

    @property
    def coerceDoc(self) -> str:
        return f"One of: {', '.join(self.values)}."

    def __call__(self, text: str) -> str:
        if text not in self.values:
            raise ValueError(f"must be one of {', '.join(self.values)}, got {text!r}")
        return text


#: The options every service has for its logs and traces: (config field, help, check).
OBSERVING: list[tuple[Any, ...]] = [
    ("log_format", "Log lines as text, or as JSON objects (one a line).", OneOf(LOG_FORMATS)),
    ("tracing", ("Record spans of each run with OpenTelemetry (pip install 'kcoral[otel]'): "
                 "logged, or exported over OTLP/HTTP (OTEL_EXPORTER_OTLP_ENDPOINT)."),
     OneOf(TRACING_MODES)),
]


def non_negative(kind: type) -> Bounded:
    return Bounded(kind, zero=True)


def positive(kind: type) -> Bounded:
    return Bounded(kind, zero=False)


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"{text} is not a TCP port")
    return value


#: TCP keepalive of a service's connections between hosts (kcoral.common.keepalive).
KEEPALIVE: list[tuple[Any, ...]] = [
    ("keepalive_idle_seconds", "Silence on a connection before the kernel probes its peer.",
     Bounded(int, zero=False, most=keepalive.MOST_SECONDS)),
    ("keepalive_interval_seconds", "Seconds between keepalive probes.",
     Bounded(int, zero=False, most=keepalive.MOST_SECONDS)),
    ("keepalive_count", "Unanswered keepalive probes that end a connection.",
     Bounded(int, zero=False, most=keepalive.MOST_COUNT)),
]


#: Listening on a Twisted server endpoint string (the Router, a standalone
#: server, a node's gateway). Twisted parses it, TLS files included.
LISTEN = ("A Twisted server endpoint string to listen on instead of --host, --port, --tls-cert "
          "and --tls-key, e.g. ssl:9443:interface=0.0.0.0:privateKey=key.pem:certKey=cert.pem.")
TLS_CERT = "PEM certificate (chain): listen with TLS."
TLS_KEY = "PEM private key of --tls-cert (default: inside --tls-cert)."
TLS_CA = "PEM CA to verify https peers with (default: the system's roots)."
ROUTING = ("Placement of runs: affinity (on a worker that holds their program and inputs, "
           "within a bound on load) or least-loaded.")
#: Client authentication (the Router, a standalone server).
CLIENT_TOKEN = "Token clients must present to run and list nodes [env: KCORAL_CLIENT_TOKEN]."
CLIENT_TOKENS_FILE = "File of client tokens, one a line (# comments), read again on SIGHUP."
TLS_CLIENT_CA = "PEM CA that must sign clients' certificates (mutual TLS; needs --tls-cert)."
#: The options of client authentication, and their environment.
CLIENT_AUTH_OPTIONS = ("client-token", "client-tokens-file", "tls-client-ca")


class SettingError(usage.UsageError):
    """A setting that names what is not there (a folder, a file): said in
    one line, without the hint to read C{--help}, which would not help."""


def check_listen(options) -> None:
    if options["listen"] and (options["tls-cert"] or options["tls-key"]):
        raise usage.UsageError("--listen takes the place of --tls-cert and --tls-key: name the "
                               "certificate in the endpoint string (certKey=..., privateKey=...)")
    if options["tls-client-ca"] and not options["tls-cert"]:
        raise usage.UsageError("--tls-client-ca needs --tls-cert (with --listen, name the CAs "
                               "in the endpoint string: caCertsDir=...)")


def option_name(field: str) -> str:
    """The option of a config field: C{max_request_bytes} is C{max-request-bytes}."""
    return field.replace("_", "-")


def default(config: type, field: str) -> Any:
    """The default of C{field} in the frozen config class C{config}."""
    value: Any = attrs.fields_dict(config)[field].default
    return value.factory() if isinstance(value, attrs.Factory) else value  # type: ignore[arg-type]


def parameter(config: type, field: str, doc: str,
              coerce: Callable[[str], Any] | None = None) -> list[Any]:
    """The C{optParameters} row of C{field}'s option, its default from C{config}."""
    row = [option_name(field), None, default(config, field), doc]
    return row if coerce is None else row + [coerce]


def options_of(config: Any, fields: Iterable[str]) -> list[str]:
    """The command line that gives C{fields} of C{config} (an instance) as
    they are, the way L{config_from} reads them: a flag named when set and
    left out when not, a field that is None left out."""
    argv: list[str] = []
    for field in fields:
        value = getattr(config, field)
        if isinstance(value, bool):
            argv += [f"--{option_name(field)}"] if value else []
        elif value is not None:
            argv += [f"--{option_name(field)}", str(value)]
    return argv


def config_from(config: type[C], options: usage.Options, **overrides: Any) -> C:
    """An instance of C{config} with every field that has an option taken from it."""
    values = {f.name: options[option_name(f.name)] for f in attrs.fields(cast(Any, config))
              if option_name(f.name) in options.defaults}
    values.update(overrides)
    return config(**values)


@attrs.frozen
class _Naming:
    """C{coerce}, naming the option when it refuses a value (Twisted's
    message does not: it catches only C{ValueError}, so this one passes)."""

    name: str
    coerce: Callable[[str], Any]

    @property
    def coerceDoc(self) -> str:
        return getattr(self.coerce, "coerceDoc", "")

    def __call__(self, text: str) -> Any:
        try:
            return self.coerce(text)
        except ValueError as e:
            raise usage.UsageError(f"--{self.name}: {e}") from None


class KCoralOptions(usage.Options):
    """
    C{usage.Options} with two additions: options named in C{environment} fall
    back to that environment variable (command line beats environment beats
    default), and options named in C{hidden} are left out of C{--help}.
    """

    environment: dict[str, str] = {}
    hidden: frozenset[str] = frozenset()
    optParameters: list[list[Any]] = []
    #: The value check of each option that has one (a node file's values go
    #: through them too).
    coercions: dict[str, Callable[[str], Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "optParameters" in cls.__dict__:
            cls.coercions = {row[0]: row[4] for row in cls.optParameters if len(row) > 4}
            cls.optParameters = [row[:4] + [_Naming(row[0], row[4])] if len(row) > 4 else row
                                 for row in cls.optParameters]

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
        if "log-format" in self:
            log_under_twistd(self)

    def from_environment(self) -> set[str]:
        """Fill unset options from their environment variables; the names filled."""
        filled = set()
        for option, variable in self.environment.items():
            if option not in self.named and os.environ.get(variable):
                coerce = self.coercions.get(option, str)
                try:
                    self[option] = coerce(os.environ[variable])
                except ValueError as e:
                    raise usage.UsageError(f"{variable}: {e}") from None
                filled.add(option)
        return filled

    def postOptions(self):
        self.from_environment()

    def given(self, option: str) -> bool:
        """Whether C{option} was set by the user (not left at its default)."""
        return option in getattr(self, "named", ()) or self[option] != self.defaults.get(option)
