"""
A node's configuration: its own settings (L{NodeConfig}, beside the
L{ServerConfig} its workers run with), and the node file.

The node file: C{kcoral server --config node.yaml} takes any server or node
option from a YAML file. Keys are the option names, with C{_} or C{-}; the
sections C{cache:} and C{supervisor:} group their options for readability. Precedence: command line, then
environment, then the file, then defaults.

It also takes the shape other node supervisors write:
C{model_repo}, C{base_port}, C{metrics_base_port}, C{global: {runtime:
{backend}, endpoints: {host}}} and C{workers:}. Relative paths in it are
relative to its own folder, so that a node started from anywhere finds its
models.
"""

from __future__ import annotations

import os

import attrs
import yaml
from twisted.python import usage

from kcoral.node.restart import RestartSettings
from kcoral.options import KCoralOptions


def default_front_processes() -> int:
    """
    One process serving the gateway's gRPC port for every four cores this
    process may run on, and at least one: the gateway alone, as on a small
    host, where the workers and the clients need the cores more (measured:
    C{doc/benchmarks.rst}, "Front processes").
    """
    return max(1, len(os.sched_getaffinity(0)) // 4)


@attrs.frozen
class NodeConfig:
    """A node's own settings (its workers take a L{ServerConfig}'s)."""

    cpu_workers: int = 1
    router: str | None = None
    node_id: str | None = None
    node_token: str | None = None
    advertise_host: str | None = None
    #: CA file to verify https Routers and workers with (default: the platform's roots).
    tls_ca: str | None = None
    #: The gateway's placement rule (L{kcoral.router.placement.ROUTINGS}).
    routing: str = "affinity"
    #: The gRPC port of worker 0 (worker i: + i; None: workers serve no gRPC).
    base_port: int | None = None
    #: The HTTP port of worker 0 (worker i: + i; None: after the gateway's).
    metrics_base_port: int | None = None
    #: The processes serving the gateway's gRPC port, the gateway among them
    #: (L{kcoral.node.front}).
    front_processes: int = attrs.field(factory=default_front_processes)
    restart: RestartSettings = attrs.Factory(RestartSettings)
    #: Variables of the node's environment its workers get beyond the
    #: allow-list (kcoral.node.environment).
    worker_env: tuple[str, ...] = ()
    #: A command line each worker's is run under (bubblewrap, nsjail, runsc).
    worker_wrapper: str | None = None

    @property
    def routers(self) -> tuple[str, ...]:
        """The Routers to report to: C{router} is a comma list."""
        return tuple(url.strip() for url in (self.router or "").split(",") if url.strip())


#: Section keys and the option prefix their keys take.
SECTIONS = {"cache": "cache-", "supervisor": ""}
_SECTION_ALIASES = {"cache-compile-entries": "compile-cache-entries",
                    "cache-compilation-dir": "compilation-cache-dir"}
#: Other names a node file may give a key (model_repo: the name other node supervisors use).
_KEY_ALIASES = {"model-repo": "model-repository", "allow-custom-calls": "allow-custom-call"}


#: The gateway's public ports on a node whose workers take theirs from
#: C{base_port} and C{metrics_base_port}, as other node supervisors do.
GATEWAY_GRPC_PORT = 8001
GATEWAY_HTTP_PORT = 8002
#: Options whose values are paths: relative ones in a node file are taken
#: from the node file's folder.
PATH_OPTIONS = frozenset({"model-repository", "cache-dir", "compilation-cache-dir", "tls-cert",
                          "tls-key", "tls-ca", "tls-client-ca", "client-tokens-file"})
#: C{global.runtime.backend}: the C{--gpus} each backend means.
BACKENDS = {"cpu": "none", "cuda": "all"}
#: The keys of the C{global:} section, and the option each one sets.
GLOBAL = {"runtime": {"backend": "gpus"}, "endpoints": {"host": "host"}}


class NodeFileError(usage.UsageError):
    pass


def _section(data: object, where: str) -> dict:
    if not isinstance(data, dict):
        raise NodeFileError(f"node file key {where!r} must be a mapping")
    return data


def _global(data: object) -> dict[str, tuple[str, object]]:
    """The options of the C{global:} section: its backend and host."""
    flat: dict[str, tuple[str, object]] = {}
    for key, value in _section(data, "global").items():
        if key not in GLOBAL:
            raise NodeFileError(f"unknown node file key {f'global.{key}'!r}")
        for inner, inner_value in _section(value, f"global.{key}").items():
            where = f"global.{key}.{inner}"
            option = GLOBAL[key].get(inner)
            if option is None:
                raise NodeFileError(f"unknown node file key {where!r}")
            if option == "gpus":
                if inner_value not in BACKENDS:
                    raise NodeFileError(f"node file key {where!r} must be one of "
                                        f"{', '.join(BACKENDS)}, got {inner_value!r}")
                inner_value = BACKENDS[inner_value]
            flat[option] = (where, inner_value)
    return flat


def _workers(data: object) -> dict[str, tuple[str, object]]:
    """
    The options of a C{workers:} list: C{{cpu: true}} entries are that many
    CPU workers; C{{gpus: [...]}} entries name each worker's GPUs, the same
    count to each (a worker's devices are a count the node applies to all).
    """
    if not isinstance(data, list) or not data:
        raise NodeFileError("node file key 'workers' must be a list of workers")
    groups: list[list[str]] = []
    for i, entry in enumerate(data):
        if entry == {"cpu": True}:
            groups.append([])
        elif isinstance(entry, dict) and set(entry) == {"gpus"} and isinstance(entry["gpus"], list) \
                and entry["gpus"] and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0
                                          for g in entry["gpus"]):
            groups.append([str(g) for g in entry["gpus"]])
        else:
            raise NodeFileError(f"node file key 'workers[{i}]' must be {{cpu: true}} or "
                                f"{{gpus: [index, ...]}}, got {entry!r}")
    if all(not group for group in groups):
        return {"gpus": ("workers", "none"), "cpu-workers": ("workers", len(groups))}
    if any(not group for group in groups) or len({len(group) for group in groups}) > 1:
        raise NodeFileError("node file key 'workers' mixes workers of different devices: "
                            "give every worker the same number of GPUs, or make all CPU workers")
    return {"gpus": ("workers", ",".join(g for group in groups for g in group)),
            "devices-per-worker": ("workers", len(groups[0]))}


def _flatten(data: dict, path: str) -> dict[str, tuple[str, object]]:
    flat: dict[str, tuple[str, object]] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise NodeFileError(f"{path}: key {key!r} is not a name")
        name = key.replace("_", "-")
        if name == "global":
            flat.update(_global(value))
        elif name == "workers":
            flat.update(_workers(value))
        elif name in SECTIONS and isinstance(value, dict):
            for inner, inner_value in value.items():
                option = SECTIONS[name] + str(inner).replace("_", "-")
                flat[_SECTION_ALIASES.get(option, option)] = (f"{key}.{inner}", inner_value)
        else:
            flat[_KEY_ALIASES.get(name, name)] = (key, value)
    return flat


def _typed(value: object, default: object, where: str) -> str:
    """The value as option text, after checking its YAML type."""
    if isinstance(default, bool) or value is None:
        raise NodeFileError(f"node file key {where!r} has no value")
    if isinstance(default, int) and (isinstance(value, bool) or not isinstance(value, int)):
        raise NodeFileError(f"node file key {where!r} must be an integer, got {value!r}")
    if isinstance(default, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise NodeFileError(f"node file key {where!r} must be a number, got {value!r}")
    if (default is None or isinstance(default, str)) and not isinstance(value, (str, int)) \
            or isinstance(value, bool):
        raise NodeFileError(f"node file key {where!r} must be a string, got {value!r}")
    return str(value)


def load(path: str, options: KCoralOptions, given: set[str]) -> set[str]:
    """Apply the node file at C{path} to every option not in C{given}; the
    options it set."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise NodeFileError(f"cannot read node file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise NodeFileError(f"node file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return set()
    if not isinstance(data, dict):
        raise NodeFileError(f"node file {path} must be a mapping of option names")
    known = {name.rstrip("=") for name in options.longOpt} - {"config", "help", "version"}
    flags = {name for name in known if name in options.longOpt}
    folder = os.path.dirname(os.path.abspath(path))
    applied = set()
    for option, (where, value) in _flatten(data, path).items():
        if option not in known:
            raise NodeFileError(f"unknown node file key {where!r}")
        if option in given:
            continue
        if option in flags:
            # A flag (an option that takes no value) is true or false in YAML.
            if not isinstance(value, bool):
                raise NodeFileError(f"node file key {where!r} must be true or false, got {value!r}")
            options[option] = int(value)
            applied.add(option)
            continue
        if isinstance(options[option], list):
            # An option given again and again (--load-model): a list, or one value.
            values = value if isinstance(value, list) else [value]
            if not values or not all(isinstance(v, str) and v for v in values):
                raise NodeFileError(f"node file key {where!r} must be a name or a list of names")
            options[option] = list(values)
            applied.add(option)
            continue
        text = _typed(value, options.defaults.get(option), where)
        if option in PATH_OPTIONS:
            text = os.path.join(folder, os.path.expanduser(text))
        coerce = options.coercions.get(option, str)
        try:
            options[option] = coerce(text)
        except ValueError as e:
            raise NodeFileError(f"node file key {where!r}: {e}") from None
        applied.add(option)
    return applied
