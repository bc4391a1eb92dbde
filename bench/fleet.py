"""
Benchmark of a fleet of fresh clients: what eight new ``kcoral.Client``
instances, each knowing nothing of what the workers hold, send when they
share eight programs of 16 MiB weights through one front over four workers.

    .venv/bin/python -m bench.fleet --quick    # about a minute
    .venv/bin/python -m bench.fleet            # about two minutes

The pool is ``bench.affinity``'s (a ``kcoral router`` and two nodes of
two CPU workers, capacity 2 a worker), started afresh and cold for each way,
and so are its programs (``tanh(x @ W) * k``, ``W`` 2048x2048 float32, ``x``
8 KiB). Each client is a thread with a ``kcoral.Client`` of its own, created
for the run, that calls every program in turn, starting with a program of
its own (client ``c`` calls program ``(c + k) % 8`` on its ``k``-th call),
for a number of rounds: each weight set is used by all eight clients.

Four ways: the Router with ``--routing affinity`` and with ``--routing
least-loaded``, and HAProxy in front of the same workers with ``balance
hdr(X-KCoral-Program)`` and ``hash-type consistent`` (each program kept on
one worker) and with ``balance leastconn``; HAProxy can only pass a
worker's 409 back to the client, where the Router places the run again on a
member that holds what the first lacked. Measured: the
bytes the clients sent (``Client.bytes_sent``, every request body, resends
after a 409 included) over the bytes of the eight weight sets, the 409s and
compiles the workers counted, runs per second over the wall time, and the
p50 and p99 of a call's latency (its 409 and resend included).

The exit status is 0 whatever the numbers; ``doc/benchmarks.rst``
("A fleet of fresh clients") records the results.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from bench.affinity import (
    CAPACITY,
    NODES,
    ROUTER_WAYS,
    SETS,
    WORKERS_PER_NODE,
    all_at_once,
    eight_programs,
    started_front,
    started_pool,
    worker_counts,
)
from bench.support.child import start_jax
from bench.support.timing import percentile

CLIENTS = 8
WAYS = ("affinity", "least-loaded", "haproxy hdr consistent", "haproxy leastconn")
#: The most the clients may send, in weight sets' bytes.
TARGET_SENT_RATIO = 1.5


def drive(front: str, programs, sets, x, rounds: int) -> dict:
    """C{rounds} of calls of every program by each of L{CLIENTS} fresh
    clients of C{front}, all at once; their figures."""
    from kcoral import Client

    clients = [Client(front, busy_timeout=300) for _ in range(CLIENTS)]
    latencies: list[list[float]] = [[] for _ in clients]

    def loop(c: int) -> None:
        for k in range(rounds * SETS):
            p = (c + k) % SETS
            began = time.perf_counter()
            clients[c].run(programs[p], sets[p], x)
            latencies[c].append(time.perf_counter() - began)

    try:
        elapsed = all_at_once([functools.partial(loop, c) for c in range(CLIENTS)])
    finally:
        for client in clients:
            client.close()
    every = [s for each in latencies for s in each]
    sent = sum(client.bytes_sent for client in clients)
    weights = sum(w.nbytes for w in sets)
    return {"runs": len(every), "seconds": elapsed, "runs_per_second": len(every) / elapsed,
            "sent_mb": sent / 1e6, "weights_mb": weights / 1e6, "sent_ratio": sent / weights,
            "p50_ms": 1000 * percentile(every, 50), "p99_ms": 1000 * percentile(every, 99)}


def measure(way: str, programs, sets, x, rounds: int, directory: Path) -> dict:
    """The figures of C{way}, on a pool started cold for it."""
    routing = way if way in ROUTER_WAYS else "least-loaded"
    with started_pool(routing) as (router, workers, _), \
            started_front(way, router, workers, directory) as (front, _):
        row = drive(front, programs, sets, x, rounds)
        row.update(worker_counts(workers), way=way)
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def table(rows: list[dict]) -> str:
    head = ("way", "runs", "sent MB", "sent / weights", "409s", "compiles", "runs/s", "p50 ms",
            "p99 ms")
    lines = [head]
    for r in rows:
        lines.append((r["way"], str(r["runs"]), f"{r['sent_mb']:.0f}", f"{r['sent_ratio']:.2f}x",
                      f"{r['conflicts']:.0f}", f"{r['compiles']:.0f}",
                      f"{r['runs_per_second']:.1f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    rule = "  ".join("=" * w for w in widths)
    body = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines]
    return "\n".join([rule, body[0], rule, *body[1:], rule])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, not 4")
    parser.add_argument("--rounds", type=int, help="calls of every program by each client")
    parser.add_argument("--ways", default=",".join(WAYS), help="comma list of: " + ", ".join(WAYS))
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 4)
    start_jax("none")
    import numpy as np

    programs, sets, x = eight_programs(np.random.default_rng(0))
    with tempfile.TemporaryDirectory(prefix="kcoral-fleet-") as directory:
        rows = [measure(way, programs, sets, x, rounds, Path(directory))
                for way in args.ways.split(",") if way]
    load = os.getloadavg()
    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; load average after the run {load[0]:.1f}")
    print(f"{CLIENTS} fresh clients, {rounds} rounds of {SETS} programs each ({SETS} x 16 MiB "
          f"weights, {rows[0]['weights_mb']:.0f} MB); {NODES} nodes x {WORKERS_PER_NODE} CPU "
          f"workers, capacity {CAPACITY}\n")
    print(table(rows))
    print(f"\ntarget: sent / weights <= {TARGET_SENT_RATIO:g}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
