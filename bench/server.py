"""
Benchmark of one standalone KCoral server against calling JAX in-process.

    .venv/bin/python -m bench.server            # or: make bench
    .venv/bin/python -m bench.server --baseline DIR   # A/B against another version

Starts real ``kcoral server`` child processes on ephemeral loopback ports and
measures, in one run:

 - latency: the in-process call (``jax.jit(f)`` on numpy inputs, outputs
   turned into numpy arrays) against ``Client.run`` of the same function
   exported as a Program, for a trivial program (``x + 1`` on a scalar), a
   ~5 ms program and a program with 64 MiB of weights: medians, p99s, the
   time the round trip adds, and ratios;
 - bytes: ``Client.bytes_sent`` for the first call of each program against a
   fresh server and for a repeated call (new activations, same weights);
 - throughput: trivial runs per second against a second server pinned to one
   core (``taskset -c 0``), driven by client processes on the other cores.

Targets: the trivial round trip adds under 1 ms (median); a repeated
call with cached 64 MiB weights sends under 1% of the first call's bytes; one
core sustains 1,000 trivial runs/s. The exit status is 0 whatever the numbers;
C{doc/benchmarks.rst} records the results.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path

from bench.support.child import KCoralChild, command_line, start_jax, write_results
from bench.support.procstat import cpu_seconds
from bench.support.programs import programs
from bench.support.quick import parse_quick
from bench.support.timing import ms, percentile, timings

TARGET_ADDED_MS = 1.0
TARGET_BYTES_PERCENT = 1.0
TARGET_RUNS_PER_SECOND = 1000.0


# -- the server child process --------------------------------------------------

class ServerProcess(KCoralChild):
    """A ``kcoral server`` child on an ephemeral port, optionally pinned to
    some cores."""

    def __init__(self, gpus: str, cores: set[int] | None = None, tree: str | None = None):
        # With C{tree}, the kcoral package of another version (a directory
        # holding it, e.g. from C{git archive REV kcoral}) runs the server.
        where = {"env": {"PYTHONPATH": tree}, "cwd": tree} if tree else {}
        super().__init__(["server", "--port", "0", "--gpus", gpus],
                         {"url": r"kcoral server listening on (http://\S+)",
                          "ready": r"(kcoral server ready)"},
                         cores=cores, timeout=120.0, **where)  # JAX_PLATFORMS: see start_jax
        self.url = self.found["url"]

    def cpu_seconds(self) -> float:
        """CPU time of the server process (all its threads)."""
        return cpu_seconds(self.process.pid)


# -- measurements --------------------------------------------------------------

def interleaved(calls, count: int, warmup: int, rounds: int = 10) -> list[list[float]]:
    """
    Timings of each of C{calls}, taken in alternating rounds so that a
    change in the machine's load during the run affects them all alike.
    """
    per_round = max(1, count // rounds)
    times = [timings(call, 0, warmup) for call in calls]
    for _ in range(rounds):
        for call, kept in zip(calls, times):
            kept += timings(call, per_round, 0)
    return times


def _throughput_worker(url, serialized, warmup, ready, go, until_box, results):
    import numpy as np

    from kcoral import Client, Program

    program = Program.from_bytes(serialized)
    x = np.float32(1.0)
    with Client(url) as client:
        for _ in range(warmup):
            client.run(program, x)
        ready.wait()
        go.wait()
        until = until_box.value
        count = 0
        finished = time.time()
        while finished < until:
            client.run(program, x)
            count += 1
            finished = time.time()
    results.put((count, finished))


def throughput(server: ServerProcess, program, seconds: float, clients: int,
               client_cores: set[int]) -> dict:
    ctx = multiprocessing.get_context("spawn")  # never fork a process running JAX
    ready, go = ctx.Barrier(clients + 1), ctx.Barrier(clients + 1)
    until_box = ctx.Value("d", 0.0)
    results = ctx.Queue()
    workers = [ctx.Process(target=_throughput_worker,
                           args=(server.url, program.serialized, 50, ready, go, until_box, results))
               for _ in range(clients)]
    for p in workers:
        p.start()
        if client_cores:
            os.sched_setaffinity(p.pid, client_cores)
    # Everyone warms up, then all start together for a fixed window.
    ready.wait(timeout=300)
    start = time.time()
    until_box.value = start + seconds
    cpu_before = server.cpu_seconds()
    go.wait(timeout=60)
    done = [results.get(timeout=seconds + 60) for _ in workers]
    cpu = server.cpu_seconds() - cpu_before
    for p in workers:
        p.join(30)
    runs = sum(count for count, _ in done)
    elapsed = max(end for _, end in done) - start
    return {"runs": runs, "seconds": elapsed, "runs_per_second": runs / elapsed,
            "server_cpu_ms_per_run": 1000 * cpu / runs if runs else float("nan"),
            "clients": clients}


def _median_run(runs: list[dict]) -> dict:
    """The throughput run of median rate among C{runs}."""
    return sorted(runs, key=lambda r: r["runs_per_second"])[len(runs) // 2]


# -- reporting -----------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="none",
                        help="the server's --gpus and, unless 'none', JAX's default device "
                             "in-process (default: none, the CPU)")
    parser.add_argument("--count", type=int, default=1000, help="timed calls of the trivial program")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of the throughput window")
    parser.add_argument("--clients", type=int, default=4, help="client processes for the throughput test")
    parser.add_argument("--server-core", type=int, default=0, help="the one core of the throughput server")
    parser.add_argument("--baseline", metavar="DIR",
                        help="also time a server run from another version's kcoral package in "
                             "DIR (e.g. git archive REV kcoral | tar -x -C DIR), in the same "
                             "rounds, and its throughput beside this version's")
    parser.add_argument("--json", help="also write the results to this file")
    args = parse_quick(parser, count=50, seconds=1.0, clients=2)

    device = start_jax(args.gpus)
    import jax
    import numpy as np

    from kcoral import Client, Program

    rng = np.random.default_rng(0)
    results = {"command": command_line(),
               "machine": f"{_cpu_model()}, {os.cpu_count()} CPUs ({platform.machine()})",
               "jax": jax.__version__, "device": str(device), "latency": [],
               "load_before": os.getloadavg()[0]}
    servers = []
    try:
        print(f"device: {device}; starting a server ...", flush=True)
        server = ServerProcess(args.gpus)
        servers.append(server)
        tree = str(Path(args.baseline).resolve()) if args.baseline else None
        baseline = None
        if tree:
            baseline = ServerProcess(args.gpus, tree=tree)
            servers.append(baseline)
        for name, function, inputs, again in programs(rng):
            jitted = jax.jit(function)
            program = Program.from_function(function, *inputs)
            big = any(np.asarray(a).nbytes > 1 << 20 for a in inputs)
            count = max(20, args.count // (50 if big else 1) // (10 if "5 ms" in name else 1))
            warmup = max(3, count // 20)
            with Client(server.url) as client, Client((baseline or server).url) as before:
                client.run(program, *inputs)
                first = client.bytes_sent
                client.run(program, *again)
                repeated = client.bytes_sent - first
                calls = [lambda: jax.tree.map(np.asarray, jitted(*inputs)),
                         lambda: client.run(program, *inputs)]
                if baseline is not None:
                    calls.append(lambda: before.run(program, *inputs))
                local, remote, *old = interleaved(calls, count, warmup)
            row = {"program": name, "count": count,
                   "local_median": percentile(local, 50), "local_p99": percentile(local, 99),
                   "remote_median": percentile(remote, 50), "remote_p99": percentile(remote, 99),
                   "first_bytes": first, "repeated_bytes": repeated}
            if old:
                row["baseline_median"] = percentile(old[0], 50)
                row["baseline_p99"] = percentile(old[0], 99)
            row["added_median"] = row["remote_median"] - row["local_median"]
            row["ratio"] = row["remote_median"] / row["local_median"]
            results["latency"].append(row)
            print(f"  measured {name}", flush=True)

        cores = sorted(os.sched_getaffinity(0))
        server_core = args.server_core if args.server_core in cores else cores[0]
        client_cores = set(cores) - {server_core} or set(cores)
        print(f"starting a server pinned to core {server_core} (clients on cores "
              f"{','.join(map(str, sorted(client_cores)))}) ...", flush=True)
        pinned = ServerProcess(args.gpus, cores={server_core})
        servers.append(pinned)
        trivial = Program.from_function(lambda x: x + 1, np.float32(1.0))
        if baseline is None:
            results["throughput"] = throughput(pinned, trivial, args.seconds, args.clients,
                                               client_cores)
        else:
            # One pinned server at a time, alternating, so that neither
            # takes the other's core and drift hits both alike.
            pinned_before = ServerProcess(args.gpus, cores={server_core}, tree=tree)
            servers.append(pinned_before)
            rounds = {"this": [], "baseline": []}
            for _ in range(3):
                for key, which in (("this", pinned), ("baseline", pinned_before)):
                    rounds[key].append(throughput(which, trivial, args.seconds, args.clients,
                                                  client_cores))
            results["throughput"] = _median_run(rounds["this"])
            results["baseline_throughput"] = _median_run(rounds["baseline"])
        results["throughput"]["server_command"] = " ".join(
            [Path(c).name if c == sys.executable else c for c in pinned.command])
    finally:
        for server in servers:
            server.stop()

    results["load_after"] = os.getloadavg()[0]
    report(results)
    write_results(results, args.json)
    return 0


def report(results: dict) -> None:
    print()
    print(f"command: {results['command']}")
    print(f"machine: {results['machine']}; jax {results['jax']} on {results['device']}; "
          f"load average {results['load_before']:.2f} before, {results['load_after']:.2f} after")
    print()
    head = (f"{'program':<48} {'in-process ms':>15} {'Client.run ms':>15} "
            f"{'added ms':>9} {'ratio':>7}")
    print(head)
    print(f"{'':<48} {'median / p99':>15} {'median / p99':>15} {'median':>9} {'median':>7}")
    print("-" * len(head))
    for row in results["latency"]:
        print(f"{row['program']:<48} "
              f"{ms(row['local_median']) + ' / ' + ms(row['local_p99']):>15} "
              f"{ms(row['remote_median']) + ' / ' + ms(row['remote_p99']):>15} "
              f"{ms(row['added_median']):>9} {row['ratio']:>6.2f}x")
    print()
    print(f"{'program':<48} {'first call B':>14} {'repeated B':>12} {'repeated/first':>15}")
    for row in results["latency"]:
        print(f"{row['program']:<48} {row['first_bytes']:>14,} {row['repeated_bytes']:>12,} "
              f"{100 * row['repeated_bytes'] / row['first_bytes']:>14.3f}%")
    if "baseline_median" in results["latency"][0]:
        print()
        print(f"{'program':<48} {'baseline ms':>15} {'this ms':>15} {'change':>8}")
        print(f"{'':<48} {'median / p99':>15} {'median / p99':>15} {'median':>8}")
        for row in results["latency"]:
            change = 100 * (row["remote_median"] / row["baseline_median"] - 1)
            print(f"{row['program']:<48} "
                  f"{ms(row['baseline_median']) + ' / ' + ms(row['baseline_p99']):>15} "
                  f"{ms(row['remote_median']) + ' / ' + ms(row['remote_p99']):>15} "
                  f"{change:>+7.1f}%")
    t = results["throughput"]
    if "baseline_throughput" in results:
        b = results["baseline_throughput"]
        print()
        print(f"throughput, median of 3 alternating windows: this {t['runs_per_second']:,.0f} runs/s "
              f"({t['server_cpu_ms_per_run']:.3f} ms CPU per run), baseline "
              f"{b['runs_per_second']:,.0f} runs/s ({b['server_cpu_ms_per_run']:.3f} ms CPU per run)")
    print()
    print(f"throughput, trivial program, server on one core, {t['clients']} client processes: "
          f"{t['runs_per_second']:,.0f} runs/s ({t['runs']} runs in {t['seconds']:.1f} s; "
          f"server CPU {t['server_cpu_ms_per_run']:.3f} ms per run)")
    print()
    trivial, weights = results["latency"][0], results["latency"][2]
    checks = [
        (f"trivial round trip adds < {TARGET_ADDED_MS:g} ms (median)",
         trivial["added_median"] * 1000 < TARGET_ADDED_MS, f"{ms(trivial['added_median'])} ms"),
        (f"repeated call with cached weights sends < {TARGET_BYTES_PERCENT:g}% of the first",
         100 * weights["repeated_bytes"] / weights["first_bytes"] < TARGET_BYTES_PERCENT,
         f"{100 * weights['repeated_bytes'] / weights['first_bytes']:.3f}%"),
        (f"one core sustains >= {TARGET_RUNS_PER_SECOND:,.0f} trivial runs/s",
         t["runs_per_second"] >= TARGET_RUNS_PER_SECOND, f"{t['runs_per_second']:,.0f} runs/s"),
    ]
    for what, ok, value in checks:
        print(f"  [{'met' if ok else 'MISSED'}] {what}: {value}")


if __name__ == "__main__":
    sys.exit(main())
