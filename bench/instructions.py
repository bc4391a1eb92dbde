"""
The instructions one trivial run takes through a Router's site, in process,
counted by valgrind's callgrind, which a shared machine's noise does not
move (CPU time here swings by a tenth from run to run of the same code):

    .venv/bin/python -m bench.instructions [--runs 5] [--baseline DIR ...]

The rig is L{bench.routing}'s: a real C{KCoralSite} over a
C{StringTransport}, one keep-alive connection, the Router's forward
answered at once. Each count is two processes under callgrind, one
answering C{--requests} runs and one C{--requests} plus C{--more}, the
difference over C{--more}: what starting Python, importing and the first
runs (warming up) cost drops out. A count still moves from process to
process, by a few percent: where the interpreter places objects orders the
sets of those hashed by identity (automat's states among them, so the
transitions it scans to find one), and the string hash seed orders the rest.
So each of C{--runs} counts takes a seed of its own (1, 2, ...), the trees
alternate, and the median and range are given; the processes run as many
at once as there are cores (a count does not depend on the load). Each
C{--baseline} counts another version's C{kcoral} package too (a directory
holding it, as C{bench.router}'s option takes).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.support.child import ROOT, child_environment
from bench.support.quick import parse_quick


def serve(requests: int) -> None:
    """Answer C{requests} trivial runs through a Router's site."""
    import kcoral
    from bench.routing import connection, router, run_request

    print(f"kcoral from {Path(kcoral.__file__).parent.parent}", file=sys.stderr)

    protocol, transport = connection(router, klein=False)
    request = run_request()
    for _ in range(requests):
        transport.clear()
        protocol.dataReceived(request)
    if not transport.value().startswith(b"HTTP/1.1 200 "):
        raise SystemExit(f"the Router's site did not answer 200: {transport.value()[:200]!r}")


def count(requests: int, seed: int, tree: str | None) -> int:
    """Instructions callgrind counts for L{serve}C{(requests)} in a fresh process."""
    # "python -m" puts its working directory first on the path: a baseline
    # runs in its own, so that its kcoral is the one imported, not this tree's.
    cwd = ROOT if tree is None else Path(tree).resolve()
    env = child_environment({"PYTHONHASHSEED": str(seed),
                             "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(cwd), str(ROOT)]))})
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         sys.executable, "-m", "bench.instructions", "--serve", str(requests)],
        env=env, cwd=cwd, capture_output=True, text=True, check=True)
    if f"kcoral from {cwd}\n" not in done.stderr:
        raise SystemExit(f"the count ran another kcoral than {cwd}:\n{done.stderr[-2000:]}")
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise SystemExit(f"callgrind counted nothing:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", type=int, metavar="N", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--more", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5, help="counts of each tree, each its own hash seed")
    parser.add_argument("--baseline", metavar="DIR", action="append", default=[],
                        help="also count another version's kcoral package in DIR "
                             "(git archive REV kcoral | tar -x -C DIR); may be given again")
    args = parse_quick(parser, requests=50, more=200, runs=1)
    if args.serve is not None:
        serve(args.serve)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench.instructions needs valgrind (apt-get install valgrind)")
    trees = {"this tree": None} | {f"baseline ({tree})": tree for tree in args.baseline}
    print(f"instructions a trivial run through a Router's site (callgrind; "
          f"{args.requests} and {args.requests + args.more} runs, the difference over {args.more})")
    runs = [(seed, name) for seed in range(1, args.runs + 1) for name in trees]
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        started = {(seed, name, n): pool.submit(count, n, seed, trees[name])
                   for seed, name in runs for n in (args.requests, args.requests + args.more)}
        counts: dict[str, list[float]] = {name: [] for name in trees}
        for seed, name in runs:
            fewer, more = (started[seed, name, n].result()
                           for n in (args.requests, args.requests + args.more))
            counts[name].append((more - fewer) / args.more)
            print(f"  hash seed {seed:3}  {name:40} {counts[name][-1]:12,.0f}", flush=True)
    for name, figures in counts.items():
        print(f"{name:40} median {statistics.median(figures):9,.0f}  "
              f"range {min(figures):9,.0f} to {max(figures):9,.0f}")


if __name__ == "__main__":
    main()
