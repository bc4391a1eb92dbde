"""
A model's versions in its repository folder, laid out as Triton lays them
out: the folder holds one bundle (its C{model.json} directly in it), or
numbered subfolders (C{1/}, C{2/}, ...), each a bundle of that version. An
optional C{config.json} beside them may set Triton's C{version_policy}:
C{{"latest": {"num_versions": N}}} (the default, N = 1), C{{"all": {}}} or
C{{"specific": {"versions": [...]}}}; its other fields are those a load's
configuration sets (L{kcoral.models.config.read_config}).

Everything here reads the disk: call it off the reactor.
"""

from __future__ import annotations

import json
import os

import attrs

from kcoral.models.manifest import MANIFEST, MAX_MANIFEST_BYTES

#: The optional file of a model's settings (its version policy).
CONFIG = "config.json"
#: The most bytes of a config.json read.
MAX_CONFIG_BYTES = 64 * 1024
#: The highest version number served (a folder name of at most 9 digits).
MAX_VERSION = 10**9 - 1


class VersionError(ValueError):
    """A model folder whose versions or policy cannot be read; says why."""


@attrs.frozen
class VersionPolicy:
    """Which of a model's versions are served: the C{latest} N, C{all}, or C{specific} ones."""

    kind: str = "latest"
    count: int = 1
    versions: frozenset[int] = frozenset()

    def to_json(self) -> dict:
        """The policy as Triton's configuration writes it."""
        if self.kind == "all":
            return {"all": {}}
        if self.kind == "specific":
            return {"specific": {"versions": sorted(self.versions)}}
        return {"latest": {"num_versions": self.count}}

    def select(self, available: list[int]) -> list[int]:
        """The versions of C{available} that this policy serves, lowest first."""
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[-self.count:]


def _positive(value: object) -> bool:
    return type(value) is int and 1 <= value <= MAX_VERSION


def parse_policy(value: object, where: str = CONFIG) -> VersionPolicy:
    """The policy of a parsed config.json's C{version_policy} (absent: latest
    1); C{where} the configuration is, for the error's message."""
    if not isinstance(value, dict):
        raise VersionError(f"{where} must be a JSON object")
    policy = value.get("version_policy")
    if policy is None:
        return VersionPolicy()
    if not isinstance(policy, dict) or len(policy) != 1:
        raise VersionError(f"{where}: version_policy must be one of latest, all, specific")
    [(kind, setting)] = policy.items()
    if kind == "all" and setting == {}:
        return VersionPolicy("all")
    if kind == "latest" and isinstance(setting, dict) and set(setting) <= {"num_versions"}:
        count = setting.get("num_versions", 1)
        if _positive(count):
            return VersionPolicy("latest", count)
    if kind == "specific" and isinstance(setting, dict) and set(setting) == {"versions"} \
            and isinstance(setting["versions"], list) and setting["versions"] \
            and all(_positive(v) for v in setting["versions"]):
        return VersionPolicy("specific", versions=frozenset(setting["versions"]))
    raise VersionError(f"{where}: version_policy must be {{\"latest\": {{\"num_versions\": N}}}}, "
                       "{\"all\": {}} or {\"specific\": {\"versions\": [N, ...]}}")


def read_config_json(folder: str) -> object:
    """The parsed C{config.json} of the model folder C{folder} (None: it has none)."""
    path = os.path.join(folder, CONFIG)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise VersionError(f"{CONFIG}: {e.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise VersionError(f"{CONFIG} is over {MAX_CONFIG_BYTES} bytes")
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise VersionError(f"{CONFIG} is not JSON") from None


def read_policy(folder: str) -> VersionPolicy:
    """The version policy of the model folder C{folder}."""
    value = read_config_json(folder)
    return VersionPolicy() if value is None else parse_policy(value)


def numbered(folder: str) -> dict[int, str]:
    """The numbered version folders of C{folder} that hold a bundle, by version."""
    found = {}
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.isdigit() and len(entry.name) <= 9 and int(entry.name) >= 1 \
                        and entry.is_dir() and os.path.isfile(os.path.join(entry.path, MANIFEST)):
                    found[int(entry.name)] = entry.path
    except OSError:
        return {}
    return found


def is_model(folder: str) -> bool:
    """Whether C{folder} holds a model: a bundle, or numbered version folders of bundles."""
    return os.path.isfile(os.path.join(folder, MANIFEST)) or bool(numbered(folder))


def served_versions(folder: str, policy: VersionPolicy | None = None) -> dict[int | None, str]:
    """
    The bundle folders of the versions the model folder C{folder} serves,
    by version: the versions its policy (C{policy}, else its config.json's)
    selects among its numbered folders, or its one bundle (key None: the
    version its manifest says). Numbered folders win over a bundle beside
    them.
    """
    versions = numbered(folder)
    if not versions:
        return {None: folder}
    chosen = (policy or read_policy(folder)).select(list(versions))
    if not chosen:
        raise VersionError(f"no version of {sorted(versions)} is one of the version_policy's")
    return {v: versions[v] for v in chosen}


def listed_versions(folder: str) -> list[int]:
    """
    The versions of the model folder C{folder} that a load would serve, as
    the repository index lists a model not loaded: those its policy selects
    among its numbered folders, or its one bundle's; version 1 where they
    cannot be read, as a load that fails there reports it.
    """
    try:
        served = served_versions(folder)
    except VersionError:
        return [1]
    if None in served:
        return [_manifest_version(folder)]
    return sorted(v for v in served if v is not None)


def _manifest_version(folder: str) -> int:
    """The version that the bundle in C{folder} says (1 unless it says
    another), without reading or checking the rest of it."""
    try:
        # O_NONBLOCK: a FIFO in the folder must not hang the reader.
        fd = os.open(os.path.join(folder, MANIFEST), os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            value = json.loads(f.read(MAX_MANIFEST_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return 1
    version = value.get("version", 1) if isinstance(value, dict) else 1
    return version if type(version) is int and 1 <= version < 1 << 31 else 1


def stamp(folder: str) -> tuple:
    """What changes when a model folder's bundles or policy do: each
    manifest's and the config's modified time and size."""
    paths = [os.path.join(folder, CONFIG), os.path.join(folder, MANIFEST),
             *(os.path.join(path, MANIFEST) for path in numbered(folder).values())]
    stamps = []
    for path in sorted(paths):
        try:
            found = os.stat(path)
        except OSError:
            continue
        stamps.append((os.path.relpath(path, folder), found.st_mtime_ns, found.st_size))
    return tuple(stamps)
