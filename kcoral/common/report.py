"""
The node report: what a supervisor tells the Router at registration and
every heartbeat, validated field by field (a report is untrusted input).
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

import attrs

from kcoral.common.cached import Cached, parse_cached
from kcoral.common.serverconfig import SANDBOX_MODES
from kcoral.protocol.counts import MOST_VERSION, read_count

#: The GPU target of a worker that runs on the host's CPU (all of a node's
#: CPU workers share its cores).
CPU_TARGET = "cpu"

MAX_WORKERS = 64
MAX_WORKER_CAPACITY = 1024
MAX_WORKER_DEVICES = 1024
MAX_RESTARTS = 10**9
MAX_TEXT = 200
#: Far beyond any Landlock ABI a kernel has (7 in Linux 6.18), within what
#: the Router shows.
MAX_LANDLOCK_ABI = 255


#: Models a worker serves and lists (its repository's folders past this are
#: not served), and the longest reason one gives for being unavailable: a
#: report of 64 workers stays within a Router's bound on node reports.
REPORTED_MODELS = 64
MAX_REASON = 400
MODEL_NAME = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")
READY = "READY"
#: A model that failed to load, or was unloaded.
UNAVAILABLE = "UNAVAILABLE"


class InvalidReport(ValueError):
    pass


_INSTANCE = re.compile(r"\A[0-9a-f]{16}\Z")
_SIGNATURE = re.compile(r"\A[0-9a-f]{64}\Z")


def parse_instance(value: object) -> str | None:
    """A worker's instance id as its health says it (None: it says none,
    or not in the form KCoral gives it)."""
    return value if isinstance(value, str) and _INSTANCE.match(value) else None


@attrs.frozen
class ModelState:
    """One model of a worker's repository: its version, C{READY} or not, and why not."""

    name: str
    version: str = "1"
    state: str = READY
    reason: str = ""
    #: The most rows of one batch (0: not batched).
    max_batch_size: int = 0
    #: The digest of its inputs' and outputs' names, datatypes and shapes
    #: (L{kcoral.models.manifest.ModelManifest.signature}); "" when not said.
    signature: str = ""
    #: It keeps a state per sequence (sequence batching): a front sends each
    #: sequence's steps to one worker.
    sequence: bool = False

    @property
    def ready(self) -> bool:
        return self.state == READY

    def to_json(self) -> dict:
        return attrs.asdict(self)


def parse_models(value: object, what: str) -> tuple[ModelState, ...]:
    """A worker's C{models} list, checked (it is untrusted)."""
    if not isinstance(value, list) or len(value) > REPORTED_MODELS:
        raise InvalidReport(f"{what} must list at most {REPORTED_MODELS} models")
    models = []
    for entry in value:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) \
                or not MODEL_NAME.match(entry["name"]):
            raise InvalidReport(f"{what}: each model needs a name of 1-64 of [A-Za-z0-9_.-]")
        version, state, reason = entry.get("version", "1"), entry.get("state", ""), entry.get("reason", "")
        if not (isinstance(version, str) and read_count(version, MOST_VERSION) is not None
                and isinstance(state, str) and 0 < len(state) <= 32
                and isinstance(reason, str) and len(reason) <= MAX_REASON):
            raise InvalidReport(f"{what}: model {entry['name']} has a malformed version, state or reason")
        most = entry.get("max_batch_size", 0)
        if type(most) is not int or not 0 <= most <= 1 << 16:
            raise InvalidReport(f"{what}: model {entry['name']} has a malformed max_batch_size")
        signature = entry.get("signature", "")
        if not (isinstance(signature, str) and (signature == "" or _SIGNATURE.match(signature))):
            raise InvalidReport(f"{what}: model {entry['name']} has a malformed signature")
        sequence = entry.get("sequence", False)
        if not isinstance(sequence, bool):
            raise InvalidReport(f"{what}: model {entry['name']}'s sequence must be true or false")
        models.append(ModelState(entry["name"], version, state, reason, most, signature, sequence))
    return tuple(models)


@attrs.frozen
class Sandbox:
    """How a worker confined itself, as its C{/health} says: its
    C{--sandbox} mode and the layers that are on (a Landlock ABI of 0: none)."""

    mode: str
    no_new_privs: bool
    seccomp: bool
    landlock_abi: int

    def to_json(self) -> dict:
        return attrs.asdict(self)


def parse_sandbox(value: object, what: str) -> Sandbox | None:
    """A worker's C{sandbox}, checked (it is untrusted); None when it says
    none (a server of a version before it did). Other keys are left out."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidReport(f"{what} must be an object")
    mode, no_new_privs, seccomp = value.get("mode"), value.get("no_new_privs"), value.get("seccomp")
    if mode not in SANDBOX_MODES or not isinstance(no_new_privs, bool) \
            or not isinstance(seccomp, bool):
        raise InvalidReport(f"{what} needs a mode of {', '.join(SANDBOX_MODES)}, and "
                            "no_new_privs and seccomp true or false")
    return Sandbox(mode, no_new_privs, seccomp,
                   _count(value.get("landlock_abi"), f"{what} landlock_abi", MAX_LANDLOCK_ABI))


@attrs.frozen
class WorkerReport:
    name: str
    url: str
    healthy: bool
    capacity: int
    active: int
    #: What its caches hold, when the worker says.
    cache: Cached | None = None
    #: The devices the worker owns: a program exported for more never goes there.
    devices: int = 1
    #: Times its supervisor has restarted it.
    restarts: int = 0
    #: Its repository's models and their states.
    models: tuple[ModelState, ...] = ()
    #: The id it drew when it started, which its kept arrays' ids start with.
    instance: str | None = None
    #: How it confined itself, when it says.
    sandbox: Sandbox | None = None

    def to_json(self) -> dict:
        json = attrs.asdict(self, filter=lambda field, value: field.name not in (
            "cache", "models", "sandbox"))
        if self.models:
            json["models"] = [m.to_json() for m in self.models]
        if self.cache is not None:
            json["cache"] = self.cache.to_json()
        if self.sandbox is not None:
            json["sandbox"] = self.sandbox.to_json()
        return json


@attrs.frozen
class NodeReport:
    session: str
    workers: tuple[WorkerReport, ...]
    gpu_target: str | None
    runtime: dict
    draining: bool = False

    def to_json(self) -> dict:
        return {"session": self.session, "workers": [w.to_json() for w in self.workers],
                "gpu_target": self.gpu_target, "runtime": self.runtime, "draining": self.draining}


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
        raise InvalidReport(f"{what} must be a string of 1 to {MAX_TEXT} characters")
    return value


def _count(value: object, what: str, limit: int, least: int = 0) -> int:
    if type(value) is not int or not least <= value <= limit:
        raise InvalidReport(f"{what} must be an integer in [{least}, {limit}]")
    return value


#: A host name the Router may connect to: DNS labels, an IPv4 address, or an
#: IPv6 literal (checked with ipaddress below).
_HOST = re.compile(r"\A[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?\Z")


def _url(value: object, what: str) -> str:
    """
    A worker's origin, C{http(s)://host:port} and nothing else: no userinfo,
    path, query or fragment, a port in 1-65535. The URL is rebuilt from its
    checked parts, because C{urlsplit} silently drops tabs and newlines and
    accepts spaces and escapes in host names, which the Router would
    otherwise carry into its logs and outgoing requests.
    """
    text = _text(value, what)
    try:
        parts = urlsplit(text)
        port = parts.port
        host = parts.hostname
    except ValueError:
        raise InvalidReport(f"{what} is not a URL") from None
    if parts.scheme not in ("http", "https") or not host or not port \
            or parts.path not in ("", "/") or parts.query or parts.fragment \
            or parts.username is not None or not text.isprintable() or " " in text:
        raise InvalidReport(f"{what} must be http(s)://host:port")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidReport(f"{what} has an invalid host") from None
        host = f"[{host}]"
    elif not _HOST.match(host):
        raise InvalidReport(f"{what} has an invalid host")
    return f"{parts.scheme}://{host}:{port}"


def _cache(value: object, what: str) -> Cached | None:
    if value is None:
        return None
    try:
        return parse_cached(value)
    except ValueError as e:
        raise InvalidReport(f"{what}: {e}") from None


def parse_report(body: object) -> NodeReport:
    if not isinstance(body, dict):
        raise InvalidReport("a node report must be a JSON object")
    workers = body.get("workers")
    if not isinstance(workers, list) or not 0 < len(workers) <= MAX_WORKERS:
        raise InvalidReport(f"'workers' must list 1 to {MAX_WORKERS} workers")
    parsed = []
    for i, w in enumerate(workers):
        if not isinstance(w, dict):
            raise InvalidReport(f"worker {i} must be an object")
        parsed.append(WorkerReport(
            name=_text(w.get("name"), f"worker {i} name"),
            url=_url(w.get("url"), f"worker {i} url"),
            healthy=w.get("healthy") is True,
            capacity=_count(w.get("capacity"), f"worker {i} capacity", MAX_WORKER_CAPACITY),
            active=_count(w.get("active", 0), f"worker {i} active", MAX_WORKER_CAPACITY),
            cache=_cache(w.get("cache"), f"worker {i} cache"),
            devices=_count(w.get("devices", 1), f"worker {i} devices", MAX_WORKER_DEVICES, 1),
            restarts=_count(w.get("restarts", 0), f"worker {i} restarts", MAX_RESTARTS),
            models=parse_models(w.get("models", []), f"worker {i} models"),
            instance=parse_instance(w.get("instance")),
            sandbox=parse_sandbox(w.get("sandbox"), f"worker {i} sandbox"),
        ))
    if len({w.name for w in parsed}) != len(parsed):
        raise InvalidReport("worker names must be unique")
    runtime = body.get("runtime") or {}
    if not isinstance(runtime, dict) or len(runtime) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= MAX_TEXT
            for k, v in runtime.items()):
        raise InvalidReport("'runtime' must map names to version strings")
    return NodeReport(
        session=_text(body.get("session"), "session"),
        workers=tuple(parsed),
        gpu_target=None if body.get("gpu_target") is None else _text(body["gpu_target"], "gpu_target"),
        runtime=dict(runtime),
        draining=body.get("draining") is True,
    )
