"""
Sphinx configuration of the KCoral documentation site (C{make docs}).

The site is built from this repository alone: no intersphinx, no theme to
download, and the option and metric references are generated from the code
by the extensions in C{_ext/}.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "KCoral"
author = "the KCoral developers"
copyright = "the KCoral developers"

extensions = [
    "sphinx.ext.autodoc",
    "kcoral_options",
    "kcoral_metrics",
]

exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []
html_theme_options = {"description": "Run exported JAX programs on a pool of GPU machines",
                      "fixed_sidebar": True}

autodoc_member_order = "bysource"
autodoc_default_options = {"show-inheritance": True}
# Signatures name the types they take; types of other projects have no page
# here (nothing is fetched), so they are written out, not linked.
nitpick_ignore_regex = [
    ("py:class", r"(numpy|np|jax|twisted|collections\.abc|typing)\..*"),
]

# kcoral's docstrings are written in epytext (Twisted's style); autodoc reads
# reST. These are the pieces of epytext they use.
_INLINE = [
    (re.compile(r"C\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}"), "``{}``"),
    (re.compile(r"L\{([^{}]+)\}"), ":py:obj:`{}`"),
    (re.compile(r"I\{([^{}]+)\}"), "*{}*"),
    (re.compile(r"B\{([^{}]+)\}"), "**{}**"),
]
_FIELDS = {"return": "returns", "raise": "raises"}
_FIELD = re.compile(r"^(\s*)@(\w+)(\s+[^:]+)?:")


def _inline(template: str):
    def markup(match: re.Match) -> str:
        # reST ends inline markup only before a space or punctuation: markup
        # followed by a letter ("C{Exported}s") is closed by an escaped space.
        following = match.string[match.end():match.end() + 1]
        return template.format(match.group(1)) + ("\\ " if following.isalnum() else "")
    return markup


def _field(match: re.Match) -> str:
    indent, name, argument = match.group(1), match.group(2), match.group(3) or ""
    return f"{indent}:{_FIELDS.get(name, name)}{argument}:"


def epytext_to_rest(app, what, name, obj, options, lines: list[str]) -> None:
    """Turn the epytext of one docstring into reST, in place."""
    for index, line in enumerate(lines):
        for pattern, template in _INLINE:
            line = pattern.sub(_inline(template), line)
        lines[index] = _FIELD.sub(_field, line)


def setup(app) -> None:
    app.connect("autodoc-process-docstring", epytext_to_rest)
