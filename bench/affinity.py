"""
Benchmark of placement by cache residency: what a pool of workers is sent,
and how fast it answers, when runs are placed by where their program and
weights already are, against least-loaded placement and against HAProxy.

    .venv/bin/python -m bench.affinity --quick    # under a minute
    .venv/bin/python -m bench.affinity            # about a minute
    .venv/bin/python -m bench.affinity --warm-up 4 --runs 64   # warm: no first wave

Starts real processes on ephemeral loopback ports, afresh for each way of
routing (so every one starts cold): a ``kcoral router`` and two nodes of two
CPU workers each (``kcoral server --router URL --cpu-workers 2``, capacity 2
a worker). The ways: the Router with ``--routing affinity`` and with
``--routing least-loaded``, and HAProxy (Debian's ``haproxy``, one thread)
in front of the same four workers, with ``balance leastconn`` and with
``balance hdr(X-KCoral-Program)`` and ``hash-type consistent`` (the best a
generic proxy can do: it keeps a program on one worker, but knows nothing of
its weights), each server's ``maxconn`` its capacity, the rest queued.
The fifth way is the floor under the Router: ``bench.peers.bare_proxy``, the
Router's HTTP stack (Twisted's server and treq) with nothing else of it,
hashing the program header as HAProxy does; what it falls short of HAProxy
is the stack's cost, not KCoral's.

Two workloads, one after the other, each with 16 closed-loop clients (two
a program or weight set), each client on a keep-alive connection of its
own, sending its next run as soon as the last one was answered:

- 8 programs, each with its own 16 MiB of weights (``tanh(x @ W) * k``,
  ``W`` 2048x2048 float32, ``x`` 1x2048 sent inline);
- 1 program with 8 sets of 16 MiB weights (fine-tuned variants).

Clients send what ``kcoral.Client`` sends (the same request code: the
program and the weights by digest once the front answered 200, inline after
a 409), hashing each input once rather than on every call, so that the two
cores of a small machine go to the services. Measured: the bytes the
clients sent (the workers receive exactly these: every front forwards a
body unchanged, and a 409 goes back to the client, which sends again), the
weight bytes among them beyond each client's first upload of its weights
("re-sent"), the 409s and compiles the workers counted (their ``/metrics``),
runs per second over the workload's wall time, the p50 and p99 of a
run's latency, its resend after a 409 included, and the CPU time per run of
the front (the Router, HAProxy or the floor) and of the four workers
together: on a machine whose cores they share, the front's CPU is taken
from the workers'.

The exit status is 0 whatever the numbers; ``doc/benchmarks.rst``
("Affinity") records the results.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from bench.support.child import ChildFailed, KCoralChild, start_jax, until
from bench.support.ports import free_port
from bench.support.procstat import cpu_seconds
from bench.support.services import start_bare_proxy
from bench.support.timing import percentile

MIB = 1 << 20
WEIGHTS_SHAPE = (2048, 2048)  # float32: 16 MiB
CLIENTS = 16
SETS = 8
NODES = 2
WORKERS_PER_NODE = 2
CAPACITY = 2
WAYS = ("affinity", "least-loaded", "haproxy leastconn", "haproxy hdr consistent",
        "twisted hdr hash")
#: The ways the Router does it (its --routing), and the ways a generic proxy
#: does it, the better of which affinity's target is set against.
ROUTER_WAYS = ("affinity", "least-loaded")
HAPROXY_WAYS = ("haproxy leastconn", "haproxy hdr consistent")
TARGET_RESENT_RATIO = 10.0
TARGET_COMPILE_RATIO = 3.0
TARGET_THROUGHPUT_RATIO = 1.3


# -- the services ------------------------------------------------------------------------

def start_router(routing: str) -> KCoralChild:
    return KCoralChild(["router", "--port", "0", "--routing", routing,
                        "--status-check-interval-seconds", "0.5"],
                       {"url": r"kcoral router listening on (http://\S+)"}, name="router")


def start_node(router_url: str, index: int) -> tuple[KCoralChild, list[str], list[int]]:
    """A node of L{WORKERS_PER_NODE} CPU workers: it, their URLs and their pids."""
    names = [f"worker{i}" for i in range(WORKERS_PER_NODE)]
    ready = {name: rf"{name} is ready at (http://\S+)" for name in names}
    ready.update({f"{name} pid": rf"{name} started \(pid (\d+)\)" for name in names})
    node = KCoralChild(["server", "--router", router_url, "--node-id", f"node{index}",
                        "--port", "0", "--gpus", "none", "--cpu-workers", str(WORKERS_PER_NODE),
                        "--capacity", str(CAPACITY), "--health-interval-seconds", "0.5"],
                       ready, name=f"node{index}")
    return (node, [node.found[name] for name in names],
            [int(node.found[f"{name} pid"]) for name in names])


def haproxy_config(port: int, workers: list[str], balance: str) -> str:
    servers = "\n".join(
        f"    server w{i} {urlsplit(url).netloc} maxconn {CAPACITY}" for i, url in enumerate(workers))
    hashing = "    hash-type consistent\n" if balance.startswith("hdr") else ""
    return f"""global
    nbthread 1
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    timeout queue 300s
    http-reuse always
frontend runs
    bind 127.0.0.1:{port}
    default_backend workers
backend workers
    balance {balance}
{hashing}{servers}
"""


class HAProxy:
    """Debian's haproxy in front of C{workers}, in the foreground."""

    def __init__(self, workers: list[str], balance: str, directory: Path):
        self.port = free_port()
        config = directory / "haproxy.cfg"
        config.write_text(haproxy_config(self.port, workers, balance))
        self.process = subprocess.Popen(["haproxy", "-db", "-f", str(config)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{self.port}"
        until(lambda: self.process.poll() is not None or _answers(self.url + "/readyz"),
              "haproxy listening", timeout=30)
        if self.process.poll() is not None:
            raise ChildFailed(f"haproxy ended: {self.process.stderr.read().decode()}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(15)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status == 200
    except Exception:
        return False


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """The samples of C{url}'s C{/metrics}, by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def worker_counts(workers: list[str]) -> dict[str, float]:
    """Compiles and 409s, summed over C{workers}."""
    counts = {"compiles": 0.0, "conflicts": 0.0}
    for url in workers:
        samples = scrape(url)
        counts["compiles"] += samples.get(("kcoral_compile_seconds_count", ()), 0.0)
        counts["conflicts"] += samples.get(
            ("kcoral_http_requests_total", (("code", "409"), ("route", "/v1/run"))), 0.0)
    return counts


# -- the load ----------------------------------------------------------------------------

class Runner:
    """
    One closed-loop client: C{kcoral.Client}'s request code (L{exchange}) on
    a keep-alive connection of its own, its one call prepared (hashed) once.
    """

    def __init__(self, url: str, call):
        from kcoral.client.connection import Connection

        parts = urlsplit(url)
        self._host = parts.netloc
        self._conn = Connection(parts.hostname, parts.port, timeout=300)
        self._call = call
        self._held: set[str] = set()
        self.sent = 0
        self.weights_sent = 0
        self.resent = 0
        self.latencies: list[float] = []

    def run(self) -> None:
        from kcoral.client.exchange import Response, Send, exchange

        weights = self._call.digests[0]
        started = time.perf_counter()
        steps = exchange(self._call, self._held, busy_timeout=300)
        answer = None
        while True:
            try:
                step = steps.send(answer)
            except StopIteration:
                break
            if not isinstance(step, Send):
                time.sleep(step.seconds)
                answer = None
                continue
            if weights not in self._held:
                size = self._call.arrays[0].nbytes
                self.resent += size if self.weights_sent else 0
                self.weights_sent += size
            got = self._conn.request("POST", "/v1/run", self._host, step.headers, step.parts,
                                     step.length)
            self.sent += step.length
            if got.will_close:
                raise RuntimeError(f"the front closed the connection after {got.status}")
            answer = Response(got.status, got.body)
        self.latencies.append(time.perf_counter() - started)

    def close(self) -> None:
        self._conn.close()


def weights(rng):
    """A fresh set of 16 MiB weights."""
    import numpy as np

    return rng.standard_normal(WEIGHTS_SHAPE, dtype=np.float32) / 64


def eight_programs(rng):
    """L{SETS} programs (C{tanh(x @ W) * k}), each with its own weights, and
    the 8 KiB input they all take: (programs, weights, x)."""
    import jax.numpy as jnp
    import numpy as np

    from kcoral import Program

    x = rng.standard_normal((1, WEIGHTS_SHAPE[0]), dtype=np.float32)

    def scaled(k):
        return lambda w, v: jnp.tanh(v @ w) * k

    sets = [weights(rng) for _ in range(SETS)]
    return [Program.from_function(scaled(k + 1.0), sets[k], x) for k in range(SETS)], sets, x


def workloads(rng):
    """(name, [RunCall for each client]) of the two workloads."""
    import jax.numpy as jnp

    from kcoral import Program
    from kcoral.client.exchange import RunCall

    programs, sets, x = eight_programs(rng)
    many = [RunCall.prepare(programs[i % SETS], (sets[i % SETS], x), {}) for i in range(CLIENTS)]
    variant = Program.from_function(lambda w, v: jnp.tanh(v @ w), sets[0], x)
    tuned = [weights(rng) for _ in range(SETS)]
    one = [RunCall.prepare(variant, (tuned[i % SETS], x), {}) for i in range(CLIENTS)]
    return [("8 programs x 16 MiB", many), ("1 program x 8 weight sets", one)]


def all_at_once(loops: list[Callable[[], object]]) -> float:
    """The seconds C{loops} took, each in a thread of its own, all started
    at once; a RuntimeError naming the first that failed."""
    failures: list[BaseException] = []

    def run(loop: Callable[[], object]) -> None:
        try:
            loop()
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=run, args=(loop,), daemon=True) for loop in loops]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise RuntimeError(f"{len(failures)} client(s) failed: {failures[0]!r}")
    return time.perf_counter() - started


def drive(runners: list[Runner], runs: int) -> dict:
    """C{runs} more runs of each client's call, all clients at once; their
    figures."""
    sent, resent = sum(r.sent for r in runners), sum(r.resent for r in runners)
    for r in runners:
        r.latencies = []

    def loop(runner: Runner) -> None:
        for _ in range(runs):
            runner.run()

    elapsed = all_at_once([functools.partial(loop, r) for r in runners])
    latencies = [x for r in runners for x in r.latencies]
    return {"runs": len(latencies), "seconds": elapsed,
            "runs_per_second": len(latencies) / elapsed,
            "sent_mb": (sum(r.sent for r in runners) - sent) / 1e6,
            "resent_mb": (sum(r.resent for r in runners) - resent) / 1e6,
            "p50_ms": 1000 * percentile(latencies, 50), "p99_ms": 1000 * percentile(latencies, 99)}


# -- one way of routing ------------------------------------------------------------------

def used(front_pid: int, worker_pids: list[int]) -> tuple[float, float]:
    """CPU seconds so far of the front, and of the workers together."""
    return cpu_seconds(front_pid), sum(map(cpu_seconds, worker_pids))


def measure(way: str, loads, runs: int, directory: Path, warm_up: int = 0) -> list[dict]:
    """The rows of C{way}: each workload's figures over C{runs} runs a
    client, after C{warm_up} runs a client that are not counted (0: the
    first wave of uploads and compiles is measured too)."""
    routing = way if way in ROUTER_WAYS else "least-loaded"
    with started_pool(routing) as (router, workers, pids), \
            started_front(way, router, workers, directory) as (front, front_pid):
        rows = []
        for name, calls in loads:
            runners = [Runner(front, call) for call in calls]
            try:
                if warm_up:
                    drive(runners, warm_up)
                before = worker_counts(workers)
                cpu = used(front_pid, pids)
                row = drive(runners, runs)
            finally:
                for runner in runners:
                    runner.close()
            front_cpu, workers_cpu = (1000 * (now - then) / row["runs"]
                                      for now, then in zip(used(front_pid, pids), cpu))
            after = worker_counts(workers)
            row.update({key: after[key] - before[key] for key in after}, way=way, workload=name,
                       front_cpu_ms=front_cpu, workers_cpu_ms=workers_cpu)
            if way in ROUTER_WAYS:
                samples = scrape(router.found["url"])
                row["hits"] = samples.get(("kcoral_placements_total", (("cache", "hit"),)), 0.0)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        return rows


@contextmanager
def started_pool(routing: str) -> Iterator[tuple[KCoralChild, list[str], list[int]]]:
    """A Router with C{--routing routing} and L{NODES} nodes of
    L{WORKERS_PER_NODE} CPU workers, all ready: (the Router, the workers'
    URLs, their pids); all stopped on leaving."""
    router = start_router(routing)
    nodes = []
    try:
        workers, pids = [], []
        for i in range(NODES):
            node, urls, worker_pids = start_node(router.found["url"], i)
            nodes.append(node)
            workers += urls
            pids += worker_pids
        capacity = NODES * WORKERS_PER_NODE * CAPACITY
        until(lambda: _router_capacity(router.found["url"]) == capacity, "the pool ready",
              timeout=120)
        yield router, workers, pids
    finally:
        for node in nodes:
            node.stop()
        router.stop()


@contextmanager
def started_front(way: str, router: KCoralChild, workers: list[str],
                  directory: Path) -> Iterator[tuple[str, int]]:
    """The front of C{way} before C{workers}: (its URL, its pid). The
    Router's ways use C{router}; the others start HAProxy or the floor,
    stopped on leaving."""
    if way.startswith("haproxy"):
        proxy = HAProxy(workers, "leastconn" if "leastconn" in way else "hdr(X-KCoral-Program)",
                        directory)
        try:
            yield proxy.url, proxy.process.pid
        finally:
            proxy.stop()
    elif way == "twisted hdr hash":
        # The floor under the Router on this workload: the Router's HTTP
        # stack and nothing else of it, hashing the program header as
        # HAProxy does, at most each worker's capacity at a time.
        floor = start_bare_proxy(workers, capacity=CAPACITY)
        try:
            yield floor.found["url"], floor.process.pid
        finally:
            floor.stop()
    else:
        yield router.found["url"], router.process.pid


def _router_capacity(url: str) -> int:
    try:
        return _get_json(url + "/health")["capacity"]
    except Exception:
        return 0


# -- reporting ---------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
    head = ("way", "workload", "runs", "sent MB", "re-sent MB", "409s", "compiles", "runs/s",
            "p50 ms", "p99 ms", "front CPU ms/run", "workers CPU ms/run")
    lines = [head]
    for r in rows:
        lines.append((r["way"], r["workload"], str(r["runs"]), f"{r['sent_mb']:.0f}",
                      f"{r['resent_mb']:.0f}", f"{r['conflicts']:.0f}", f"{r['compiles']:.0f}",
                      f"{r['runs_per_second']:.1f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
                      f"{r['front_cpu_ms']:.2f}", f"{r['workers_cpu_ms']:.2f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    rule = "  ".join("=" * w for w in widths)
    body = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines]
    return "\n".join([rule, body[0], rule, *body[1:], rule])


def verdict(rows: list[dict]) -> list[str]:
    def total(way: str, key: str) -> float:
        return sum(r[key] for r in rows if r["way"] == way)

    def rate(way: str) -> float:
        return total(way, "runs") / total(way, "seconds")

    def p99(way: str) -> float:
        return max(r["p99_ms"] for r in rows if r["way"] == way)

    def ratio(key: str) -> str:
        more, fewer = total("least-loaded", key), total("affinity", key)
        return f"{more / fewer:.1f}x" if fewer else f"{more:.0f} / 0"

    haproxy = max(HAPROXY_WAYS, key=rate)
    speed = rate("affinity") / rate(haproxy)
    lines = [
        f"re-sent MB, least-loaded / affinity: {ratio('resent_mb')} (target >= {TARGET_RESENT_RATIO:g}x)",
        f"compiles, least-loaded / affinity: {ratio('compiles')} (target >= {TARGET_COMPILE_RATIO:g}x)",
        f"throughput, affinity / {haproxy}: {speed:.2f}x (target >= {TARGET_THROUGHPUT_RATIO:g}x)",
        (f"worst p99, affinity {p99('affinity'):.1f} ms, {haproxy} {p99(haproxy):.1f} ms "
         "(target: no worse)"),
    ]
    if "twisted hdr hash" in {r["way"] for r in rows}:
        floor = rate("twisted hdr hash")
        lines.append(f"the floor, twisted hdr hash / {haproxy}: {floor / rate(haproxy):.2f}x; "
                     f"affinity / the floor: {rate('affinity') / floor:.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs a client (6, not 20)")
    parser.add_argument("--runs", type=int, help="runs a client in each workload")
    parser.add_argument("--warm-up", type=int, default=0, metavar="N",
                        help="runs a client in each workload before the measured ones (default "
                             "0: from cold, the first uploads and compiles measured too)")
    parser.add_argument("--ways", default=",".join(WAYS), help="comma list of: " + ", ".join(WAYS))
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if shutil.which("haproxy") is None:
        sys.exit("haproxy is not installed (Debian: apt-get install -y haproxy)")
    runs = args.runs or (6 if args.quick else 20)
    ways = [w for w in args.ways.split(",") if w]
    start_jax("none")
    import numpy as np

    loads = workloads(np.random.default_rng(0))
    rows = []
    with tempfile.TemporaryDirectory(prefix="kcoral-affinity-") as directory:
        for way in ways:
            rows += measure(way, loads, runs, Path(directory), args.warm_up)
    load = os.getloadavg()
    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; load average after the run {load[0]:.1f}")
    warm = f" after {args.warm_up} uncounted" if args.warm_up else ", from cold"
    print(f"{CLIENTS} clients, {runs} runs each per workload{warm}; {NODES} nodes x "
          f"{WORKERS_PER_NODE} CPU workers, capacity {CAPACITY}\n")
    print(table(rows))
    if {*ROUTER_WAYS, *HAPROXY_WAYS} <= set(ways):
        print()
        print("\n".join(verdict(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
