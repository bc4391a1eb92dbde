"""
Benchmark of a multi-worker node: throughput with one and two CPU workers,
and the latency the embedded gateway adds.

    .venv/bin/python -m bench.node              # about a minute and a half

Starts real processes on ephemeral loopback ports: a ``kcoral server
--cpu-workers 2`` node (a supervisor, two server children and the embedded
gateway on the public port) and, for the one-worker baseline, a standalone
``kcoral server``.

Per-process scaling, honestly: every server has ``--capacity 1`` (one run at
a time per process), and the compute-bound program is a serial chain (a
``fori_loop`` of ``sin`` over 16 floats, calibrated to about 50 ms
in-process) that XLA cannot spread over threads, so one run keeps exactly
one core busy. (A matmul loop is not used: XLA's CPU runtime runs a dot on
several threads whatever ``--xla_cpu_multi_thread_eigen=false`` says, and a
single worker would then use both cores of a 2-core machine by itself.) The
table gives each setup's worker CPU seconds per second, which shows how many
cores it really used, and the CPU that *other* processes used meanwhile
(from ``/proc/stat``), which says how far to trust a row on a shared machine;
``--wait-for-idle SECONDS`` waits for the others to go quiet before each
measurement, and measures again when they did not stay quiet.

Measured in one run:

 - throughput: closed-loop client threads for a fixed window: one worker
   with two clients (the standalone server; the second client waits for the
   slot), then the node with one, two and four clients; the scaling ratio is
   two workers with two clients over one worker with two clients;
 - gateway latency: a trivial program (``x + 1`` on a scalar), run
   sequentially by one client through the gateway and straight at worker0,
   in alternating blocks: medians, p99s and the difference.

The exit status is 0 whatever the numbers; ``doc/benchmarks.rst`` ("Nodes")
records the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time

from bench.support.child import KCoralChild, command_line, write_results
from bench.support.procstat import OutsideLoad, cpu_seconds
from bench.support.quick import parse_quick
from bench.support.timing import percentile

TARGET_RUN_SECONDS = 0.05


class Service(KCoralChild):
    """A ``kcoral server`` (one worker) or node (``--cpu-workers 2``) child."""

    def __init__(self, *args: str):
        node = "--cpu-workers" in args
        names = ("worker0", "worker1") if node else ()
        ready = {"url": r"kcoral gateway listening on (http://\S+)" if node
                 else r"kcoral server listening on (http://\S+)"}
        ready.update({name: rf"{name} is ready at (http://\S+)" for name in names})
        ready.update({f"{name} pid": rf"{name} started \(pid (\d+)\)" for name in names})
        if not node:
            ready["ready"] = r"(kcoral server ready)"
        super().__init__(["server", "--port", "0", "--gpus", "none", *args], ready)
        self.url = self.found["url"]
        if not node:
            self.worker_urls, self.pids = {"worker0": self.url}, {"worker0": self.process.pid}
            return
        self.worker_urls = {name: self.found[name] for name in names}
        self.pids = {name: int(self.found[f"{name} pid"]) for name in names}
        deadline = time.monotonic() + 60
        while _healthy_workers(self.url) < len(names):
            if time.monotonic() > deadline:
                self.fail("the gateway never counted both workers")
            time.sleep(0.05)

    def cpu_seconds(self) -> float:
        """CPU time of the worker processes so far."""
        return sum(cpu_seconds(pid) for pid in self.pids.values())


def wait_for_idle(services, timeout: float, limit: float = 0.2) -> None:
    """On a shared machine: wait (up to C{timeout} seconds) until processes
    other than ours use under C{limit} cores over two seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with OutsideLoad(_pids(services)) as outside:
            time.sleep(2.0)
        if outside.cores < limit:
            return


def quietly(measure, services, timeout: float, limit: float = 0.2) -> dict:
    """C{measure()}, after waiting for idle cores, and again while other
    processes used C{limit} cores or more during it (for up to C{timeout}
    seconds in all): the last result."""
    deadline = time.monotonic() + timeout
    while True:
        wait_for_idle(services, deadline - time.monotonic(), limit)
        row = measure()
        if row["outside_cores"] < limit or time.monotonic() >= deadline:
            return row


def _healthy_workers(url: str) -> int:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as answer:
            body = json.loads(answer.read())
    except Exception:
        return 0
    return sum(1 for w in body.get("workers", []) if w["healthy"])


def _pids(services) -> list[int]:
    """The processes of C{services}: each one's own and its workers'."""
    return [pid for s in services for pid in (s.process.pid, *s.pids.values())]


# -- programs ------------------------------------------------------------------

def _median_seconds(call, count: int = 10) -> float:
    call()
    times = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return percentile(times, 50)


def compute_program():
    """(Program, inputs, description, in-process seconds): a serial chain of
    about TARGET_RUN_SECONDS here, which XLA cannot spread over threads."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kcoral import Program

    x = np.ones(16, np.float32)

    def work(n):
        def spin(x):
            return jax.lax.fori_loop(0, n, lambda i, v: jnp.sin(v) * 0.5 + v * 0.5, x)
        return spin

    probe_steps = 200_000
    probe = jax.jit(work(probe_steps))
    per_step = _median_seconds(lambda: probe(x).block_until_ready(), 5) / probe_steps
    steps = max(1, round(TARGET_RUN_SECONDS / per_step))
    jitted = jax.jit(work(steps))
    in_process = _median_seconds(lambda: jitted(x).block_until_ready())
    return (Program.from_function(work(steps), x), (x,),
            f"{steps:,} serial steps of sin on 16 floats", in_process)


# -- measurements --------------------------------------------------------------

def throughput(service: Service, program, inputs, clients: int, seconds: float,
               services) -> dict:
    """Closed-loop client threads for C{seconds}; runs per second, run
    latency, and the workers' CPU seconds per wall-clock second."""
    from kcoral import Client

    ready = threading.Barrier(clients + 1)
    go = threading.Barrier(clients + 1)
    window = {}
    results = [None] * clients

    def client_thread(i):
        with Client(service.url) as client:
            for _ in range(2):  # warm: every worker compiles, the client learns what it holds
                client.run(program, *inputs)
            ready.wait()
            go.wait()
            latencies = []
            while True:
                started = time.perf_counter()
                client.run(program, *inputs)
                finished = time.perf_counter()
                if finished > window["until"]:
                    break
                latencies.append(finished - started)
            results[i] = latencies

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    ready.wait(timeout=300)
    with OutsideLoad(_pids(services)) as outside:
        cpu_before = service.cpu_seconds()
        start = time.perf_counter()
        window["until"] = start + seconds
        go.wait(timeout=60)
        for t in threads:
            t.join()
        cpu = service.cpu_seconds() - cpu_before
    latencies = [v for r in results for v in r]
    return {"clients": clients, "runs": len(latencies), "runs_per_second": len(latencies) / seconds,
            "median_ms": 1000 * percentile(latencies, 50),
            "worker_cpu_per_second": cpu / seconds, "outside_cores": outside.cores}


def gateway_latency(node: Service, count: int, services, block: int = 50) -> dict:
    """Sequential trivial runs through the gateway and straight at worker0,
    in alternating blocks (so that drift hits both alike)."""
    import numpy as np

    from kcoral import Client, Program

    trivial = Program.from_function(lambda x: x + 1, np.float32(1))
    x = np.float32(1)
    times = {"direct": [], "gateway": []}
    with Client(node.worker_urls["worker0"]) as direct, Client(node.url) as gateway:
        clients = {"direct": direct, "gateway": gateway}
        for client in clients.values():
            for _ in range(block):
                client.run(trivial, x)
        with OutsideLoad(_pids(services)) as outside:
            while len(times["gateway"]) < count:
                for name, client in clients.items():
                    for _ in range(block):
                        started = time.perf_counter()
                        client.run(trivial, x)
                        times[name].append(time.perf_counter() - started)
    row = {name: {"median_ms": 1000 * percentile(v, 50), "p99_ms": 1000 * percentile(v, 99),
                  "count": len(v)} for name, v in times.items()}
    row["added_median_ms"] = row["gateway"]["median_ms"] - row["direct"]["median_ms"]
    row["added_p99_ms"] = row["gateway"]["p99_ms"] - row["direct"]["p99_ms"]
    row["outside_cores"] = outside.cores
    return row


# -- reporting -----------------------------------------------------------------

def report(results: dict) -> None:
    print()
    print(f"command: {results['command']}")
    flags = f"; XLA_FLAGS={results['xla_flags']!r}" if results["xla_flags"] else ""
    print(f"machine: {results['machine']}; jax {results['jax']}{flags}")
    print()
    print(f"compute-bound program: {results['program']} "
          f"({results['in_process_ms']:.1f} ms in-process), --capacity 1 per worker, "
          f"{results['seconds']:g} s windows")
    head = (f"{'setup':<32} {'clients':>7} {'runs/s':>8} {'run ms':>8} {'worker CPU':>11} "
            f"{'others':>7}")
    print(head)
    print(f"{'':<32} {'':>7} {'':>8} {'median':>8} {'s per s':>11} {'cores':>7}")
    print("-" * len(head))
    for row in results["throughput"]:
        print(f"{row['setup']:<32} {row['clients']:>7} {row['runs_per_second']:>8.2f} "
              f"{row['median_ms']:>8.1f} {row['worker_cpu_per_second']:>11.2f} "
              f"{row['outside_cores']:>7.2f}")
    print()
    print(f"scaling, 2 workers / 1 worker (two clients each): {results['scaling']:.2f}x")
    print()
    lat = results["latency"]
    head = f"{'trivial program (x + 1), sequential':<44} {'median ms':>10} {'p99 ms':>10}"
    print(head)
    print("-" * len(head))
    for label, key in (("worker0 directly", "direct"), ("through the gateway", "gateway")):
        print(f"{label:<44} {lat[key]['median_ms']:>10.3f} {lat[key]['p99_ms']:>10.3f}")
    print(f"{'added by the gateway':<44} {lat['added_median_ms']:>10.3f} {lat['added_p99_ms']:>10.3f}")
    print(f"({lat['gateway']['count']} runs each; other processes used "
          f"{lat['outside_cores']:.2f} cores meanwhile)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each throughput window")
    parser.add_argument("--count", type=int, default=1000, help="timed trivial runs per path")
    parser.add_argument("--wait-for-idle", type=float, default=0.0, metavar="SECONDS",
                        help="on a shared machine, wait up to this long before each measurement "
                             "for other processes to leave the cores alone (default: 0)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parse_quick(parser, seconds=1.0, count=50)

    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    results = {"command": command_line(),
               "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
               "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "seconds": args.seconds, "throughput": []}
    def calibrate():
        with OutsideLoad([]) as outside:
            found = compute_program()
        return {"program": found, "outside_cores": outside.cores}

    # Calibrated on quiet cores too.
    program, inputs, description, in_process = quietly(calibrate, [], args.wait_for_idle)["program"]
    results["program"] = description
    results["in_process_ms"] = 1000 * in_process

    services = []
    try:
        print("starting a two-worker node and a one-worker server ...", flush=True)
        node = Service("--cpu-workers", "2", "--capacity", "1", "--health-interval-seconds", "0.5")
        services.append(node)
        single = Service("--capacity", "1")
        services.append(single)

        print("measuring the gateway's latency ...", flush=True)
        results["latency"] = quietly(lambda: gateway_latency(node, args.count, services),
                                     services, args.wait_for_idle)

        for setup, service, clients in [
                ("1 worker (standalone server)", single, 2),
                ("2 workers behind the gateway", node, 1),
                ("2 workers behind the gateway", node, 2),
                ("2 workers behind the gateway", node, 4)]:
            print(f"throughput: {setup}, {clients} client(s) ...", flush=True)
            row = quietly(lambda: throughput(service, program, inputs, clients, args.seconds,
                                             services), services, args.wait_for_idle)
            row["setup"] = setup
            results["throughput"].append(row)
    finally:
        for service in services:
            service.stop()

    one, two = results["throughput"][0], results["throughput"][2]
    results["scaling"] = two["runs_per_second"] / one["runs_per_second"]
    report(results)
    write_results(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
