"""
Large bodies through the Router, side by side with HAProxy in front of the
same worker: what each proxy costs per MiB it moves, and what the Router
holds in memory while it moves them.

    .venv/bin/python -m bench.large            # about five minutes
    .venv/bin/python -m bench.large --quick    # shorter windows, about three
    .venv/bin/python -m bench.large --bare     # and the floor under the Router

The services are ``bench.compare``'s (a ``kcoral router``, one node of
one CPU worker of capacity 2, Debian's ``haproxy`` with that capacity as its
``maxconn``; with ``--bare`` also ``bench.peers.bare_proxy --capacity 2``: the
Router's stack, Twisted's server and treq, with nothing of the Router), all
with ``--max-request-bytes`` raised to fit a 256 MiB input and its framing.
The load is ``wrk`` with ``bench/support/run.lua`` (closed-loop keep-alive
connections, 1 and 16), three programs:

- ``16mib`` and ``256mib``: the sum of a 16 MiB or 256 MiB float32 input
  sent inline with every run, so that every run moves that many bytes
  through the proxy (and a few bytes back);
- ``5ms``: ``bench.compare``'s 5 ms program, its inputs by digest, whose
  answer is 131 KB: what a proxy costs per answer of that size.

Each cell is a warm-up then a timed window, the paths' order alternating
from row to row. Reported per cell: runs/s and the ratio to HAProxy's, the
proxy's CPU per run and per MiB of request body (from ``/proc``), and the
Router's resident memory before the cell and its peak through the cell
(``VmHWM``, reset before each cell through ``/proc/PID/clear_refs``).

Targets (one run): on 16 MiB and 256 MiB inputs, at 1 and 16 connections,
the Router's runs/s >= 1.0x HAProxy's and its CPU per MiB <= 1.5x
HAProxy's; its resident memory within 64 MiB of where it started while 256
MiB bodies pass. The exit status is 0 whatever the numbers;
``doc/benchmarks.rst`` ("Large bodies through the Router") records them.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.compare import Body, measure, post, start_haproxy
from bench.support.child import command_line, start_jax, start_py_spy, stop_py_spy, write_results
from bench.support.procstat import cpu_seconds
from bench.support.programs import programs
from bench.support.services import CAPACITY, start_bare_proxy, start_node, start_router, wait_ready

MIB = 1 << 20
SHAPES = {"16mib": (4096, 1024), "256mib": (16384, 4096)}  # float32
#: The services' bound on a body: the largest input and its framing.
MAX_REQUEST_BYTES = 288 * MIB
CONNECTIONS = (1, 16)
TARGET_RUNS = 1.0
TARGET_CPU_PER_MIB = 1.5
TARGET_RSS_MIB = 64


def memory_mib(pid: int) -> dict[str, float]:
    """C{pid}'s resident memory now and at its peak, in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":" in line)
    return {name: int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM")}


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def settle(pid: int, timeout: float = 60.0) -> None:
    """Wait until the worker C{pid} is idle: runs a window left in flight
    (its client gone, the proxy still sending) must not load the next."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(0.5)
        if cpu_seconds(pid) - before < 0.05:
            return


def report(results: dict) -> list[tuple[str, bool, str]]:
    print()
    print(f"command: {results['command']}")
    print(f"machine: {results['machine']}; load average at start {results['load']}; "
          f"jax {results['jax']}, {results['haproxy']}")
    print("windows: " + ", ".join(f"{kind} {w[1]} s (1 connection), {w[2]} s (more) after "
                                  f"{w[0]} s of warm-up" for kind, w in results["windows"].items()))
    print()
    names = (f"{'program':<7} {'conns':>5} {'path':<12} {'runs/s':>7} {'x HA':>5} {'p50 ms':>8} "
             f"{'CPU ms/run':>10} {'CPU ms/MiB':>10} {'x HA':>5} {'worker':>7} {'RSS MiB':>13}")
    print(names)
    print("-" * len(names))
    for row in results["rows"]:
        cells = row["paths"]
        for path, cell in cells.items():
            base = cells.get("haproxy")
            runs = cell["runs_per_second"] / base["runs_per_second"] if base and path != "haproxy" else None
            per_mib = cell["proxy_ms_per_mib"] / base["proxy_ms_per_mib"] if base and path != "haproxy" \
                else None
            rss = f"{cell['rss_before_mib']:.0f} -> {cell['rss_peak_mib']:.0f}" if "rss_peak_mib" in cell \
                else ""
            print(f"{row['kind']:<7} {row['connections']:>5} {path:<12} {cell['runs_per_second']:>7.1f} "
                  f"{'' if runs is None else f'{runs:.2f}':>5} {cell['p50_ms']:>8.1f} "
                  f"{cell['proxy_ms_per_run']:>10.3f} {cell['proxy_ms_per_mib']:>10.3f} "
                  f"{'' if per_mib is None else f'{per_mib:.2f}':>5} "
                  f"{cell['cpu_ms_per_run'].get('worker', float('nan')):>7.2f} {rss:>13}")
    print()
    checks = []
    rows = [r for r in results["rows"] if r["kind"] in SHAPES and {"router", "haproxy"} <= set(r["paths"])]

    def ratio(row, key):
        return row["paths"]["router"][key] / row["paths"]["haproxy"][key]

    if rows:
        checks.append((f"large inputs: Router >= {TARGET_RUNS}x HAProxy's runs/s",
                       all(ratio(r, "runs_per_second") >= TARGET_RUNS for r in rows),
                       ", ".join(f"{r['kind']}/{r['connections']}: {ratio(r, 'runs_per_second'):.2f}x"
                                 for r in rows)))
        checks.append((f"large inputs: Router's CPU per MiB <= {TARGET_CPU_PER_MIB}x HAProxy's",
                       all(ratio(r, "proxy_ms_per_mib") <= TARGET_CPU_PER_MIB for r in rows),
                       ", ".join(f"{r['kind']}/{r['connections']}: {ratio(r, 'proxy_ms_per_mib'):.2f}x"
                                 for r in rows)))
    big = [r["paths"]["router"] for r in results["rows"] if r["kind"] == "256mib" and "router" in r["paths"]]
    if big:
        start = min(c["rss_before_mib"] for c in big)
        growth = max(c["rss_peak_mib"] for c in big) - start
        checks.append((f"256 MiB inputs: Router's RSS within {TARGET_RSS_MIB} MiB of its start",
                       growth <= TARGET_RSS_MIB, f"{start:.0f} MiB, peak +{growth:.0f} MiB"))
    for what, ok, value in checks:
        print(f"  [{'met' if ok else 'MISSED'}] {what}: {value}")
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows")
    parser.add_argument("--programs", default="16mib,256mib,5ms",
                        help="comma list of 16mib, 256mib, 5ms (default all)")
    parser.add_argument("--connections", default=",".join(map(str, CONNECTIONS)))
    parser.add_argument("--bare", action="store_true",
                        help="also the floor: bench.peers.bare_proxy with the Router's bound")
    parser.add_argument("--profile-router", metavar="FILE",
                        help="sample the Router's threads with py-spy (not a dependency: pip "
                             "install py-spy) through the whole load; collapsed stacks to FILE")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    for tool in ("wrk", "haproxy"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not installed (apt-get install -y wrk haproxy)")
    kinds = args.programs.split(",")
    connections = [int(c) for c in args.connections.split(",")]
    # (warm-up, timed at 1 connection, timed at more) seconds: a 256 MiB run
    # takes a good part of a second, and 16 of them queue behind each other.
    windows = ({"16mib": (1, 2, 3), "256mib": (0, 6, 15), "5ms": (1, 2, 2)} if args.quick else
               {"16mib": (1, 4, 5), "256mib": (0, 10, 25), "5ms": (1, 4, 4)})
    paths = ["router", "haproxy"] + ["floor-capped"] * args.bare

    start_jax("none")
    import jax
    import numpy as np

    from kcoral import Program

    work = Path(tempfile.mkdtemp(prefix="kcoral-large-"))
    services, profiler = [], None
    try:
        bodies = []
        for kind in kinds:
            if kind == "5ms":
                name, function, inputs, _ = programs(np.random.default_rng(0))[1]
                bodies.append(Body(work, kind, name, Program.from_function(function, *inputs),
                                   inputs, inline=False))
            else:
                big = np.random.default_rng(1).standard_normal(SHAPES[kind], dtype=np.float32)
                bodies.append(Body(work, kind, f"sum of a {kind[:-3]} MiB input, sent every run",
                                   Program.from_function(lambda x: jax.numpy.sum(x), big), (big,),
                                   inline=True))
                del big
        haproxy_version = subprocess.run(["haproxy", "-v"], capture_output=True,
                                         text=True).stdout.split(" - ")[0]
        results = {"command": command_line(),
                   "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                   "load": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
                   "jax": jax.__version__, "haproxy": haproxy_version,
                   "windows": {b.kind: windows[b.kind] for b in bodies},
                   "rows": [{"kind": b.kind, "body_mib": b.size / MIB, "connections": c, "paths": {}}
                            for b in bodies for c in connections]}
        bound = ("--max-request-bytes", str(MAX_REQUEST_BYTES))
        print("starting a Router, one node and HAProxy ...", flush=True)
        router = start_router(None, *bound)
        services.append(router)
        node = start_node(router.found["url"], "none", *bound)
        services.append(node)
        wait_ready(router.found["url"])
        worker_url = node.found["worker"]
        urls = {"router": router.found["url"]}
        groups = {"worker": [node.worker_pid], "router": [router.pid]}
        if args.profile_router:
            profiler = start_py_spy(router.pid, args.profile_router, "--threads")
        haproxy, urls["haproxy"] = start_haproxy(work, worker_url, None)
        services.append(haproxy)
        groups["haproxy"] = [haproxy.pid]
        if args.bare:
            floor = start_bare_proxy([worker_url], capacity=CAPACITY)
            services.append(floor)
            urls["floor-capped"] = floor.found["url"]
            groups["floor-capped"] = [floor.pid]
        for body in bodies:
            answer = post(worker_url, body.first, body.digest, body.content_type)
            for path, url in urls.items():
                got = post(url, body.repeat, body.digest, body.content_type)
                assert got == answer, f"{path} answered {body.kind} with other bytes"
        for index, row in enumerate(results["rows"]):
            body = next(b for b in bodies if b.kind == row["kind"])
            warmup, one, more = windows[body.kind]
            seconds = one if row["connections"] == 1 else more
            print(f"  {body.kind}, {row['connections']} connection(s) ...", flush=True)
            for path in paths if index % 2 == 0 else paths[::-1]:
                if path == "router":
                    before = memory_mib(router.pid)["VmRSS"]
                    reset_peak(router.pid)
                settle(node.worker_pid)
                try:
                    cell = measure(path, urls[path], body, row["connections"], seconds, warmup,
                                   groups, [], None)
                except RuntimeError as e:  # no run answered within the window
                    print(f"    {path}: {e}", flush=True)
                    continue
                cell["proxy_ms_per_run"] = cell["cpu_ms_per_run"][path]
                cell["proxy_ms_per_mib"] = cell["proxy_ms_per_run"] / row["body_mib"]
                if path == "router":
                    cell["rss_before_mib"] = before
                    cell["rss_peak_mib"] = memory_mib(router.pid)["VmHWM"]
                row["paths"][path] = cell
    finally:
        stop_py_spy(profiler)
        for service in reversed(services):
            service.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(results)
    write_results(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
