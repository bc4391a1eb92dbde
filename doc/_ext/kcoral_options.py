"""
C{.. kcoral-options:: COMMAND}: every option of C{kcoral COMMAND}, read from
its C{usage.Options} (the classes the C{kcoral} command and the twistd
plugins parse with), so that the guides cannot drift from the code.

Each option becomes a Sphinx C{option} of the program C{kcoral COMMAND},
with its help text, its value check, its default and its environment
variable. With C{:hidden:}, only the options left out of C{--help} (a node's
supervisor options) are listed; without it, only the others.
"""

from __future__ import annotations

import re
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles
from twisted.python import reflect, usage

from kcoral.cli import CommandOptions


def options_class(command: str) -> type[usage.Options]:
    """The C{usage.Options} of C{kcoral COMMAND}."""
    for name, _short, parser, _doc in CommandOptions.subCommands:
        if name == command:
            return parser
    raise ValueError(f"kcoral has no command {command!r}")


def _rows(parser: type[usage.Options], attribute: str) -> list[list[Any]]:
    rows: list[list[Any]] = []
    # How usage.Options itself gathers them: over the class and its bases.
    reflect.accumulateClassList(parser, attribute, rows)
    return rows


def _size(value: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift and value % (1 << shift) == 0:
            return f" ({value >> shift} {unit})"
    return ""


def _default(value: Any, name: str) -> str:
    shown = f"``{value}``"
    if name.endswith("-bytes") and isinstance(value, int):
        shown += _size(value)
    return shown


#: The "[env: NAME]" of a help text, said again by the Environment line.
_ENV_NOTE = re.compile(r"\s*\[env: [^\]]*\]")


def _sentence(text: str) -> str:
    text = " ".join(text.split())
    return text if not text or text.endswith(".") else text + "."


def _parameter(row: list[Any], environment: dict[str, str]) -> list[str]:
    name, short, value, doc = (list(row) + [None] * 4)[:4]
    coerce = row[4] if len(row) > 4 else None
    metavar = f"<{name.rsplit('-', 1)[-1]}>"
    flags = f"-{short} {metavar}, --{name} {metavar}" if short else f"--{name} {metavar}"
    if name in environment:
        doc = _ENV_NOTE.sub("", doc or "")
    text = [_sentence(doc or ""), _sentence(getattr(coerce, "coerceDoc", ""))]
    if value is not None:
        text.append(f"Default: {_default(value, name)}.")
    if name in environment:
        text.append(f"Environment: ``{environment[name]}`` (the command line wins).")
    return [f".. option:: {flags}", "", "   " + " ".join(t for t in text if t), ""]


def option_lines(command: str, hidden: bool) -> list[str]:
    """The reST of the options of C{kcoral COMMAND}: those left out of
    C{--help} if C{hidden}, else the others."""
    parser = options_class(command)
    left_out = getattr(parser, "hidden", frozenset())
    lines = [f".. program:: kcoral {command}", ""]
    parameters = _rows(parser, "optParameters")
    for row in parameters:
        if (row[0] in left_out) == hidden:
            lines += _parameter(row, getattr(parser, "environment", {}))
    # Flags, from optFlags and opt_ methods alike, as usage.Options lists
    # them; less its own --help and --version, which every command has.
    instance = parser()
    for name in instance.longOpt:
        # Parameters are listed as "name=".
        if name.endswith("=") or name in ("help", "version") or (name in left_out) != hidden:
            continue
        lines += [f".. option:: --{name}", "", "   " + _sentence(instance.docs.get(name) or ""), ""]
    return lines


class KCoralOptionsDirective(SphinxDirective):
    required_arguments = 1
    option_spec = {"hidden": directives.flag}

    def run(self) -> list:
        try:
            lines = option_lines(self.arguments[0], "hidden" in self.options)
        except ValueError as e:
            raise self.error(str(e)) from None
        content = StringList(lines, source=f"<kcoral-options {self.arguments[0]}>")
        # The options join the section the directive is in.
        holder = nodes.section()
        holder.document = self.state.document
        nested_parse_with_titles(self.state, content, holder)
        return holder.children


def setup(app) -> dict:
    app.add_directive("kcoral-options", KCoralOptionsDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
