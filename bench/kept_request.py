"""
What one kept-array request costs, apart from any model: a loop of a
trivial program with decoding's arguments, and the CPU each process spent
on it.

    .venv/bin/python -m bench.kept_request                 # a standalone server
    .venv/bin/python -m bench.kept_request --way router    # through a Router and one node

The program takes a tree of parameters (ten small arrays, as
``bench.decode``'s model has), a cache, a token and a position, and
returns the cache with one row changed and the next token. As the decoding
loop does, the parameters and the cache are put once, then each request is
``client.run(step, params, cache, token, pos, keep=(True, False),
free=cache)``: the new cache stays, the old one is freed, the token comes
back. After a warm-up, the timed requests' wall time (mean and median) and,
for this process and each service process (the server; or the Router, the
node's supervisor and its worker), the CPU time and the context switches
per request read from ``/proc`` before and after the loop: each voluntary
switch is a thread that blocked and was woken again, which on a busy
machine waits for a core. ``doc/benchmarks.rst`` ("Decoding:
the request's own cost") records runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.support.kept_loops import clients, descendants
from bench.support.procstat import cpu_seconds, wake_ups
from bench.support.quick import parse_quick

WARM_UP = 50


def step(params, cache, token, pos):
    """The cache with row C{pos} rewritten, and the token after C{token}."""
    import jax.numpy as jnp

    row = params["embed"][0] + params["layers"]["up"][0] + pos
    return cache.at[pos].set(row), (token + 1).astype(jnp.int32)


def small_params() -> dict:
    """A tree of the decoder's structure, its arrays tiny."""
    def ones(*shape):
        return np.ones(shape, np.float32)

    return {"embed": ones(4, 8), "position": ones(4, 8),
            "layers": {name: ones(2, 8) for name in ("norm1", "qkv", "out", "norm2", "up", "down")},
            "norm": ones(8)}


def command_of(pid: int) -> str:
    words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return " ".join(w.decode() for w in words[2:5])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--way", choices=("kept", "router"), default="kept",
                        help="a standalone server, or a Router in front of one node (default: kept)")
    parser.add_argument("--requests", type=int, default=2000, help="timed requests (default 2000)")
    args = parse_quick(parser, requests=50)

    from kcoral import Program

    params, cache = small_params(), np.zeros((4, 8), np.float32)
    program = Program.from_function(step, params, cache, np.int32(0), np.int32(0))
    with clients("none", args.way == "kept", args.way == "router") as (server, router):
        client = server or router
        kept_params, kept_cache = client.put(params), client.put(cache)
        token = np.int32(1)
        for i in range(WARM_UP + args.requests):
            if i == WARM_UP:
                pids = [os.getpid(), *descendants()]
                before = {pid: cpu_seconds(pid) for pid in pids}
                woken = {pid: wake_ups(pid) for pid in pids}
                started, times = time.perf_counter(), []
            began = time.perf_counter()
            kept_cache, token = client.run(program, kept_params, kept_cache, token, np.int32(i % 4),
                                           keep=(True, False), free=kept_cache)
            if i >= WARM_UP:
                times.append(time.perf_counter() - began)
        wall = time.perf_counter() - started
        after = {pid: cpu_seconds(pid) for pid in pids}
        switched = {pid: [b - a for a, b in zip(woken[pid], wake_ups(pid))] for pid in pids}
        names = {pid: "client (this process)" if pid == os.getpid() else command_of(pid)
                 for pid in pids}
    print(f"{args.way}: {args.requests} requests, wall {1000 * wall / args.requests:.3f} ms mean, "
          f"{1000 * float(np.median(times)):.3f} ms median; load average {os.getloadavg()[0]:.2f}")
    for pid in pids:
        voluntary, involuntary = (n / args.requests for n in switched[pid])
        print(f"  {names[pid]}: {1000 * (after[pid] - before[pid]) / args.requests:.3f} ms CPU, "
              f"{voluntary:.2f} wake-ups and {involuntary:.2f} preemptions a request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
