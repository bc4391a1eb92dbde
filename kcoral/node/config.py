"""
A node's configuration: its own settings (L{NodeConfig}, beside the
L{ServerConfig} its workers run with), and the node file.

The node file: C{kcoral server --config node.yaml} takes any server or node
option from a YAML file. Keys are the option names, with C{_} or C{-}; the
sections C{cache:} and C{supervisor:} group their options for readability. Precedence: command line, then
environment, then the file, then defaults.
"""

from __future__ import annotations

import attrs
import yaml
from twisted.python import usage

from kcoral.node.restart import RestartSettings
from kcoral.options import KCoralOptions


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
    restart: RestartSettings = attrs.Factory(RestartSettings)

    @property
    def routers(self) -> tuple[str, ...]:
        """The Routers to report to: C{router} is a comma list."""
        return tuple(url.strip() for url in (self.router or "").split(",") if url.strip())


#: Section keys and the option prefix their keys take.
SECTIONS = {"cache": "cache-", "supervisor": ""}
_SECTION_ALIASES = {"cache-compile-entries": "compile-cache-entries",
                    "cache-compilation-dir": "compilation-cache-dir"}
#: Other names a node file may give a key (model_repo: the name other node supervisors use).
_KEY_ALIASES = {"model-repo": "model-repository"}


class NodeFileError(usage.UsageError):
    pass


def _flatten(data: dict, path: str) -> dict[str, tuple[str, object]]:
    flat: dict[str, tuple[str, object]] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise NodeFileError(f"{path}: key {key!r} is not a name")
        name = key.replace("_", "-")
        if name in SECTIONS and isinstance(value, dict):
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


def load(path: str, options: KCoralOptions, given: set[str]) -> None:
    """Apply the node file at C{path} to every option not in C{given}."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise NodeFileError(f"cannot read node file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise NodeFileError(f"node file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return
    if not isinstance(data, dict):
        raise NodeFileError(f"node file {path} must be a mapping of option names")
    known = {name.rstrip("=") for name in options.longOpt} - {"config", "help", "version"}
    flags = {name for name in known if name in options.longOpt}
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
            continue
        text = _typed(value, options.defaults.get(option), where)
        coerce = options.coercions.get(option, str)
        try:
            options[option] = coerce(text)
        except ValueError as e:
            raise NodeFileError(f"node file key {where!r}: {e}") from None
