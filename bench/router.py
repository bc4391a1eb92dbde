"""
Benchmark of the Router: the same load sent straight to one server worker
and through a Router, side by side.

    .venv/bin/python -m bench.router            # about four minutes
    .venv/bin/python -m bench.router --router-core 1
    .venv/bin/python -m bench.router --bare     # and the floor under it

Starts real processes on ephemeral loopback ports: a ``kcoral router`` and
one node (``kcoral server --router URL --node-id bench --gpus none``, or
one GPU with ``--gpus N``: a supervisor and one server worker, capacity 2).
The load goes either straight
to that worker ("direct") or to the Router, which forwards each run to the
same worker ("router"), so the two paths differ only by the Router's hop.

The load: closed-loop keep-alive HTTP/1.1 connections (1, 4, 16 and 64 at
once), each sending the next run as soon as the previous answer arrived,
for a fixed window per cell. Programs: a trivial one (``x + 1`` on a scalar)
and a ~5 ms one (calibrated in-process on this machine), both exported and
warmed with the real ``Client`` first (upload and compile); the timed
requests are the exact bytes ``Client.run`` sends for a repeated call
(program and large inputs by digest), sent by a lean asyncio load generator
so that the client spends as little of the machine's CPU as it can. Every
answer must be a 200 with the expected outputs. The paths' windows
alternate, in rounds, so that drift hits them all alike.

For each program and concurrency: medians and p99s of the run latency,
runs per second, the Router's throughput over the direct one and the median
latency it adds, and the CPU time each process spent per run, with the CPU
that processes outside the benchmark took meanwhile (on a shared machine, a
measure of how far to trust the rest). By default nothing is pinned: on a
small machine the Router then competes with the worker for the same cores.
``--router-core N`` gives the Router a core of its own, as it would have on
its own host. ``--bare`` also sends the load through the two proxies of
``bench.peers.bare_proxy``, which forward runs with the Router's stack
(Twisted's HTTP server and treq) and nothing of the Router: "floor" with
the Router's own outgoing client, "plain" with treq as documented.
``--gpus 0`` runs the node's worker on a GPU (a GPU node's program leaves
the host's cores to the Router). ``--profile-router FILE`` samples the
Router with py-spy (not a dependency of KCoral) while it holds the GIL, i.e.
where its Python spends CPU, for the whole run.

Targets: the Router adds under 1 ms to the trivial program's
median latency (one client), and keeps at least 97% of the direct
throughput for the 5 ms program while the node is kept busy (as many
clients as its capacity, or more). With fewer, throughput is one over the
latency: a hop within the 1 ms the first target allows would cost a 5 ms
program up to a sixth of it, so the two targets only agree under load; the
report still gives the one-client ratio. The exit status is 0 whatever the
numbers; ``doc/benchmarks.rst`` ("Router") records the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from bench.support.answers import BadAnswer, read_answer
from bench.support.child import KCoralChild, command_line, start_jax, start_py_spy, stop_py_spy, write_results
from bench.support.procstat import cpu_seconds, machine_busy_seconds
from bench.support.programs import programs
from bench.support.quick import parse_quick
from bench.support.services import CAPACITY, start_bare_proxy, start_node, start_router, wait_ready
from bench.support.timing import ms, percentile

TARGET_ADDED_MS = 1.0
TARGET_THROUGHPUT_RATIO = 0.97
CONCURRENCY = (1, 4, 16, 64)


# -- the services ----------------------------------------------------------------


class BaselineRouter(KCoralChild):
    """
    A second Router, run from another version's C{kcoral} package (a
    directory holding it, e.g. C{git archive REV kcoral | tar -x -C DIR}),
    in front of the same worker: this process registers the worker with it
    and reports for it, as a supervisor would, every half second.
    """

    def __init__(self, tree: str, worker_url: str, cores: set[int] | None = None):
        self.tree = str(Path(tree).resolve())
        self._worker_url = worker_url
        self._stop = threading.Event()
        super().__init__(["router", "--port", "0"],
                         {"url": r"kcoral router listening on (http://\S+)"},
                         cores=cores, env={"PYTHONPATH": self.tree}, cwd=self.tree)
        self._reporter = threading.Thread(target=self._report, daemon=True)
        self._reporter.start()

    def _report(self):
        import urllib.request

        report = json.dumps({
            "session": "bench-baseline", "gpu_target": "cpu", "runtime": {}, "draining": False,
            "workers": [{"name": "worker0", "url": self._worker_url, "healthy": True,
                         "capacity": CAPACITY, "active": 0}]}).encode()
        while not self._stop.is_set():
            put = urllib.request.Request(self.found["url"] + "/v1/nodes/bench-baseline",
                                         data=report, method="PUT",
                                         headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(put, timeout=5).read()
            except OSError:
                pass
            self._stop.wait(0.5)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        super().stop(timeout)


# -- the load --------------------------------------------------------------------

def request_bytes(url: str, program, inputs) -> bytes:
    """The bytes of C{Client.run(program, *inputs)} once the server holds the
    program and the large inputs: what a repeated call sends."""
    from kcoral.client.exchange import RunCall

    call = RunCall.prepare(program, tuple(inputs), {})
    send = call.send(call.content_digests(), None)
    parts = urlsplit(url)
    head = ["POST /v1/run HTTP/1.1", f"Host: {parts.netloc}",
            f"Content-Length: {send.length}"]
    head += [f"{name}: {value}" for name, value in send.headers.items()]
    body = b"".join(bytes(memoryview(p).cast("B")) for p in send.parts)
    assert len(body) == send.length
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


async def _connection(host: str, port: int, payload: bytes, expected: bytes, start: float,
                      until: float, latencies: list) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    clock = time.perf_counter
    try:
        while True:
            started = clock()
            writer.write(payload)
            code, body = await read_answer(reader)
            finished = clock()
            if code != 200 or body != expected:
                raise BadAnswer(f"answer {code}: {body[:300]!r}")
            if finished > until:
                return
            if finished >= start:
                latencies.append(finished - started)
    finally:
        writer.close()


def load(url: str, payload: bytes, expected: bytes, clients: int, seconds: float,
         warmup: float) -> list[float]:
    """Latencies of the runs that C{clients} closed-loop connections
    completed within a window of C{seconds}, which starts after C{warmup}
    seconds of the same load."""
    parts = urlsplit(url)

    async def main():
        start = time.perf_counter() + warmup
        latencies: list[float] = []
        await asyncio.gather(*(
            _connection(parts.hostname, parts.port, payload, expected, start, start + seconds,
                        latencies) for _ in range(clients)))
        return latencies

    return asyncio.run(main())


class CPU:
    """CPU seconds of some processes, and of everything else on the machine,
    over a measurement."""

    def __init__(self, pids: dict[str, int]):
        self._pids = pids

    def _sample(self):
        return {name: cpu_seconds(pid) for name, pid in self._pids.items()}, machine_busy_seconds()

    def __enter__(self):
        self._start = self._sample()
        return self

    def __exit__(self, *exc):
        (before, busy0), (after, busy1) = self._start, self._sample()
        self.seconds = {name: after[name] - before[name] for name in before}
        self.others = max(0.0, (busy1 - busy0) - sum(self.seconds.values()))


def measure(path: str, url: str, payload: bytes, expected: bytes, clients: int, seconds: float,
            warmup: float, pids: dict[str, int]) -> dict:
    with CPU(pids) as cpu:
        latencies = load(url, payload, expected, clients, seconds, warmup)
    # The CPU window includes the warmup and the runs still in flight at the
    # end: per run, it is spread over all the runs done in it.
    total = len(latencies) * (seconds + warmup) / seconds
    return {"path": path, "latencies": latencies, "runs": len(latencies), "seconds": seconds,
            "cpu_ms_per_run": {name: 1000 * s / total for name, s in cpu.seconds.items()},
            "others_ms_per_run": 1000 * cpu.others / total}


def summarize(rows: list[dict]) -> dict:
    latencies = [v for r in rows for v in r["latencies"]]
    seconds = sum(r["seconds"] for r in rows)
    names = rows[0]["cpu_ms_per_run"].keys()
    return {"runs": len(latencies), "runs_per_second": len(latencies) / seconds,
            "median": percentile(latencies, 50), "p99": percentile(latencies, 99),
            "cpu_ms_per_run": {n: sum(r["cpu_ms_per_run"][n] * r["runs"] for r in rows) / len(latencies)
                               for n in names},
            "others_ms_per_run": sum(r["others_ms_per_run"] * r["runs"] for r in rows) / len(latencies)}


# -- reporting -------------------------------------------------------------------

def _heading(names: str, units: str) -> None:
    """A table's two heading lines and a rule as long as the first."""
    print(names)
    print(units)
    print("-" * len(names))


def report(results: dict) -> None:
    print()
    print(f"command: {results['command']}")
    print(f"machine: {results['machine']}; jax {results['jax']}")
    paths = ["direct", "router", *results["others"]]
    print(f"{results['seconds']:g} s per window, {results['rounds']} rounds per cell, "
          f"{', '.join(paths)} alternating; node: one worker ({results['device']}), "
          f"capacity {CAPACITY}")
    print(f"pinning: {results['pinning']}")
    print()
    _heading(f"{'program':<24} {'conc':>4} {'direct ms':>17} {'router ms':>17} {'added':>7} "
             f"{'direct':>7} {'router':>7} {'ratio':>6} {'router CPU':>10}",
             f"{'':<24} {'':>4} {'median / p99':>17} {'median / p99':>17} {'ms':>7} "
             f"{'runs/s':>7} {'runs/s':>7} {'':>6} {'ms/run':>10}")
    for row in results["rows"]:
        d, r = row["direct"], row["router"]
        print(f"{row['program']:<24} {row['clients']:>4} "
              f"{ms(d['median']) + ' / ' + ms(d['p99']):>17} "
              f"{ms(r['median']) + ' / ' + ms(r['p99']):>17} "
              f"{ms(row['added_median']):>7} {d['runs_per_second']:>7.0f} "
              f"{r['runs_per_second']:>7.0f} {100 * row['ratio']:>5.1f}% "
              f"{r['cpu_ms_per_run']['router']:>10.3f}")
    print()
    print("CPU ms per run (direct -> router): worker, client (this process), router, "
          "other processes on the machine (not this benchmark's)")
    for row in results["rows"]:
        d, r = row["direct"]["cpu_ms_per_run"], row["router"]["cpu_ms_per_run"]
        print(f"  {row['program']:<24} {row['clients']:>3}: worker {d['worker']:.3f} -> "
              f"{r['worker']:.3f}, client {d['client']:.3f} -> {r['client']:.3f}, router "
              f"{r['router']:.3f}, others {row['direct']['others_ms_per_run']:.3f} -> "
              f"{row['router']['others_ms_per_run']:.3f}")
    print()
    for name, what in results["others"].items():
        print(f"{what} against this Router, same worker, same rounds:")
        _heading(f"{'program':<24} {'conc':>4} {'median ms':>17} {'runs/s':>15} "
                 f"{'CPU ms/run':>19}",
                 f"{'':<24} {'':>4} {name + ' -> Router':>17} {name + ' -> Router':>15} "
                 f"{name + ' -> Router':>19}")
        for row in results["rows"]:
            b, r = row[name], row["router"]
            print(f"{row['program']:<24} {row['clients']:>4} "
                  f"{ms(b['median']) + ' -> ' + ms(r['median']):>17} "
                  f"{b['runs_per_second']:>6.0f} -> {r['runs_per_second']:<5.0f} "
                  f"{b['cpu_ms_per_run'][name]:>8.3f} -> {r['cpu_ms_per_run']['router']:<6.3f}")
        print()
    checks = []
    trivial = [r for r in results["rows"] if r["kind"] == "trivial" and r["clients"] == 1]
    if trivial:
        added = trivial[0]["added_median"]
        checks.append((f"trivial program, 1 client: the Router adds < {TARGET_ADDED_MS:g} ms (median)",
                       added * 1000 < TARGET_ADDED_MS, f"{ms(added)} ms"))
    heavy = [r for r in results["rows"] if r["kind"] == "5ms"]
    busy = [r for r in heavy if r["clients"] >= CAPACITY]
    if busy:
        worst = min(busy, key=lambda r: r["ratio"])
        checks.append(((f"5 ms program, node kept busy (clients >= its capacity, {CAPACITY}): "
                        f"Router throughput >= {100 * TARGET_THROUGHPUT_RATIO:g}% of direct "
                        f"(worst concurrency: {worst['clients']})"),
                       worst["ratio"] >= TARGET_THROUGHPUT_RATIO,
                       ", ".join(f"{r['clients']}: {100 * r['ratio']:.1f}%" for r in busy)))
    for what, ok, value in checks:
        print(f"  [{'met' if ok else 'MISSED'}] {what}: {value}")
    for row in heavy:
        if row["clients"] < CAPACITY:
            print(f"  [latency-bound] 5 ms program, {row['clients']} client(s): "
                  f"{100 * row['ratio']:.1f}% of direct, one over the latency "
                  f"({ms(row['added_median'])} ms added to {ms(row['direct']['median'])} ms)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each timed window")
    parser.add_argument("--warmup", type=float, default=0.5,
                        help="untimed load before each window")
    parser.add_argument("--rounds", type=int, default=2,
                        help="windows of each path per cell (alternating their order)")
    parser.add_argument("--clients", default=",".join(map(str, CONCURRENCY)),
                        help="comma list of concurrencies")
    parser.add_argument("--programs", default="trivial,5ms", help="trivial, 5ms or both")
    parser.add_argument("--profile-router", metavar="FILE",
                        help="sample the Router with py-spy (not a dependency: pip install "
                             "py-spy) during the whole load and write its collapsed stacks here")
    parser.add_argument("--router-core", type=int, metavar="N",
                        help="pin the Router (and --baseline, --bare) to core N and everything "
                             "else (this process, the node, its worker) to the other cores: the "
                             "Router's hop without its competition for the worker's CPU "
                             "(default: nothing pinned)")
    parser.add_argument("--baseline", metavar="DIR",
                        help="also measure a Router run from another version's kcoral package "
                             "in DIR (e.g. git archive REV kcoral | tar -x -C DIR), in front "
                             "of the same worker, in the same rounds")
    parser.add_argument("--bare", action="store_true",
                        help="also measure the two proxies of bench.peers.bare_proxy (Twisted's "
                             "HTTP server and treq, nothing of the Router) in front of the same "
                             "worker, in the same rounds")
    parser.add_argument("--gpus", default="none",
                        help="the node's --gpus: none (the CPU, the default) or one GPU's index; "
                             "the programs are calibrated on the same device in-process")
    parser.add_argument("--json", help="also write the results to this file")
    args = parse_quick(parser, seconds=1.0, warmup=0.2, rounds=1, clients="1,16",
                       programs="trivial")
    if args.gpus != "none" and not args.gpus.isdigit():
        parser.error(f"--gpus {args.gpus}: 'none' or one GPU's index (the node has one worker)")

    router_cores = None
    if args.router_core is not None:
        cores = os.sched_getaffinity(0)
        if args.router_core not in cores or len(cores) < 2:
            parser.error(f"--router-core {args.router_core}: this process may use cores "
                         f"{sorted(cores)}, and the others need one left")
        router_cores = {args.router_core}
        # Before JAX starts, so that its thread pools (and the node's, which
        # inherits this affinity) are sized for the cores left.
        os.sched_setaffinity(0, cores - router_cores)
    device = start_jax(args.gpus)
    import jax
    import numpy as np

    from kcoral import Client, Program
    from kcoral.protocol.wire import decode_result

    wanted = args.programs.split(",")
    concurrency = [int(c) for c in args.clients.split(",")]
    results = {"command": command_line(),
               "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
               "jax": jax.__version__, "device": str(device),
               "seconds": args.seconds, "rounds": args.rounds,
               "pinning": ("nothing pinned: client, Router, supervisor and worker share all cores"
                           if router_cores is None else
                           f"Router (and the proxies measured beside it) on core "
                           f"{args.router_core}; client, supervisor and worker "
                           f"on cores {','.join(map(str, sorted(os.sched_getaffinity(0))))}"),
               "others": {}, "rows": []}
    chosen = []
    for (name, function, inputs, _), kind in zip(programs(np.random.default_rng(0))[:2],
                                                 ("trivial", "5ms")):
        if kind in wanted:
            chosen.append((kind, name.split(" (")[0], Program.from_function(function, *inputs),
                           inputs))

    services, profiler = [], None
    try:
        print("starting a Router and one node ...", flush=True)
        router = start_router(router_cores)
        services.append(router)
        node = start_node(router.found["url"], args.gpus)
        services.append(node)
        router_url, worker_url = router.found["url"], node.found["worker"]
        wait_ready(router_url)
        pids = {"worker": node.worker_pid, "router": router.process.pid, "client": os.getpid(),
                "supervisor": node.process.pid}
        if args.profile_router:
            profiler = start_py_spy(router.process.pid, args.profile_router, "--gil")
        paths = {"direct": worker_url, "router": router_url}
        if args.baseline:
            baseline = BaselineRouter(args.baseline, worker_url, router_cores)
            services.append(baseline)
            wait_ready(baseline.found["url"])
            paths["baseline"] = baseline.found["url"]
            pids["baseline"] = baseline.process.pid
            results["others"]["baseline"] = f"the baseline Router (kcoral from {args.baseline})"
        if args.bare:
            for name, plain, what in (("floor", False, "with the Router's outgoing client"),
                                      ("plain", True, "with treq as documented")):
                bare = start_bare_proxy([worker_url], plain, router_cores)
                services.append(bare)
                paths[name] = bare.found["url"]
                pids[name] = bare.process.pid
                results["others"][name] = f"a bare proxy {what} (bench.peers.bare_proxy)"

        for kind, label, program, inputs in chosen:
            # Upload and compile with the real Client, and check its outputs
            # against the answer the load generator will expect.
            with Client(worker_url) as client:
                outputs = [np.asarray(a) for a in jax.tree.leaves(client.run(program, *inputs))]
            with Client(router_url) as client:
                client.run(program, *inputs)
            payloads = {p: request_bytes(u, program, inputs) for p, u in paths.items()}
            expected = _expected_answer(worker_url, payloads["direct"])
            for got, want in zip(decode_result(expected), outputs):
                np.testing.assert_array_equal(got, want)
            for clients in concurrency:
                print(f"  {label}, {clients} client(s) ...", flush=True)
                windows = {path: [] for path in paths}
                for i in range(args.rounds):
                    order = list(paths) if i % 2 == 0 else list(reversed(paths))
                    for path in order:
                        windows[path].append(measure(path, paths[path], payloads[path], expected,
                                                     clients, args.seconds, args.warmup, pids))
                row = {"kind": kind, "program": label, "clients": clients,
                       **{path: summarize(w) for path, w in windows.items()}}
                row["added_median"] = row["router"]["median"] - row["direct"]["median"]
                row["added_p99"] = row["router"]["p99"] - row["direct"]["p99"]
                row["ratio"] = row["router"]["runs_per_second"] / row["direct"]["runs_per_second"]
                results["rows"].append(row)
    finally:
        stop_py_spy(profiler)
        for service in reversed(services):
            service.stop()

    report(results)
    write_results(results, args.json)
    return 0


def _expected_answer(url: str, payload: bytes) -> bytes:
    parts = urlsplit(url)

    async def once():
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(payload)
        code, body = await read_answer(reader)
        writer.close()
        if code != 200:
            raise BadAnswer(f"answer {code}: {body[:300]!r}")
        return body

    return asyncio.run(once())


if __name__ == "__main__":
    sys.exit(main())
