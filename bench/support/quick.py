"""The ``--quick`` option of the benchmarks that are otherwise only long:
a short run of the same code, that ``make bench`` makes of each."""

from __future__ import annotations

import argparse


def parse_quick(parser: argparse.ArgumentParser, argv: list[str] | None = None,
                **quick: object) -> argparse.Namespace:
    """
    C{parser}'s arguments, with a C{--quick} option that makes C{quick}'s
    values (by destination) the defaults: a few seconds of the same run,
    which checks that it works, not how fast. Options given still win.
    """
    shown = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in quick.items())
    parser.add_argument("--quick", action="store_true", help=f"a short run: {shown}")
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**quick)
    return parser.parse_args(argv)
