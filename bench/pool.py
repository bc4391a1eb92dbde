"""
The Router's cost as its pool grows: 10, 50 and 200 simulated nodes.

    .venv/bin/python -m bench.pool                 # about five minutes
    .venv/bin/python -m bench.pool --nodes 10,200 --runs 2000 --rounds 1

A real ``kcoral router`` child on a loopback port, and in this process (one
asyncio loop) that many light fake nodes: each a worker (an HTTP server on
an ephemeral loopback port, capacity 2, answering every run after a few
milliseconds with a valid result frame, reading and discarding its body)
and a supervisor's heartbeat (a ``NodeReport`` of ``kcoral/router/report.py``
PUT every 2 s on a keep-alive connection, the nodes' phases spread over the
interval, each with its worker's runs in flight).

For each pool size, with a fresh Router, in rounds (three by default: the
pool sizes one after another, then again), each figure the median of its
rounds, since a 2-core machine's pace drifts over minutes by more than the
differences looked for:

- reports: the Router's CPU over a window of heartbeats and no runs, as a
  share of one core (target for 200 nodes: under 10%);
- placements: a burst of queued runs (5,000 by default, each on its own
  connection, so that all wait in the Router's queue at once) and the
  Router's CPU per run, from the first run sent to the last answer, with
  the heartbeats going on (target: within +-25% from 10 to 200 nodes);
- memory (the largest pool only, or ``--rss-nodes``, in the first round): the Router's resident
  size idle, then its peak (``VmHWM``) while 256 MiB request bodies pass
  through it to the fake workers, one at a time and two at once (target:
  within 64 MiB of idle).

The exit status is 0 whatever the numbers; ``doc/benchmarks.rst`` ("Pool
scale") records them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from bench.support.answers import read_answer
from bench.support.child import command_line, write_results
from bench.support.procstat import cpu_seconds
from bench.support.quick import parse_quick
from bench.support.services import start_router
from kcoral._version import __version__
from kcoral.common.report import NodeReport, WorkerReport
from kcoral.protocol.wire import (
    PROGRAM_HEADER,
    REQUEST_CONTENT_TYPE,
    RESULT_CONTENT_TYPE,
    encode_request,
    encode_result,
)

NODES = (10, 50, 200)
CAPACITY = 2
REPORT_INTERVAL = 2.0
BIG_BODY = 256 << 20
TARGET_PLACEMENT_SPREAD = 0.25
TARGET_REPORT_CORE = 0.10
TARGET_RSS_MIB = 64
PROGRAM = "ab" * 32  # a digest: the Router never looks inside the program


# -- the fake nodes ---------------------------------------------------------------

class FakeWorker:
    """A worker's HTTP side: runs answered after C{delay} seconds, bodies
    read and dropped, readiness always."""

    def __init__(self, delay: float):
        self.delay = delay
        self.active = 0
        self.runs = 0
        self._connections: set[asyncio.Task] = set()
        parts, _ = encode_result([np.float32(2.0)])
        self._result = b"".join(bytes(memoryview(p).cast("B")) for p in parts)

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=1024)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        """Once its peers have gone: every connection has ended."""
        self._server.close()
        await asyncio.gather(*self._connections)

    async def _serve(self, reader, writer) -> None:
        self._connections.add(asyncio.current_task())
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                method, path, _ = head.split(b"\r\n", 1)[0].split(b" ", 2)
                headers = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
                headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
                await self._discard(reader, headers)
                if method == b"POST" and path == b"/v1/run":
                    self.active += 1
                    await asyncio.sleep(self.delay)
                    self.active -= 1
                    self.runs += 1
                    body, content_type = self._result, RESULT_CONTENT_TYPE.encode()
                else:
                    body, content_type = b'{"status": "ok"}', b"application/json"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (content_type, len(body), body))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _discard(reader, headers: dict) -> None:
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                await _skip(reader, size + 2)
                if size == 0:
                    return
        await _skip(reader, int(headers.get(b"content-length", b"0")))


async def _skip(reader, count: int) -> None:
    while count > 0:
        chunk = await reader.read(min(count, 1 << 20))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", count)
        count -= len(chunk)


class FakeNode:
    """One node: its worker and its supervisor's heartbeat to the Router."""

    def __init__(self, index: int, router_url: str, delay: float):
        self.node_id = f"fake-{index:04d}"
        self.worker = FakeWorker(delay)
        self._router = urlsplit(router_url)
        self.reports = 0

    def report(self) -> bytes:
        report = NodeReport(session=f"{self.node_id}-session", gpu_target="cpu",
                            runtime={"kcoral": __version__},
                            workers=(WorkerReport(name="worker0", url=self.url, healthy=True,
                                                  capacity=CAPACITY, active=self.worker.active),))
        body = json.dumps(report.to_json()).encode()
        return (f"PUT /v1/nodes/{self.node_id} HTTP/1.1\r\nHost: {self._router.netloc}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                ).encode() + body

    async def start(self) -> None:
        self.url = await self.worker.start()
        self._reader, self._writer = await asyncio.open_connection(self._router.hostname,
                                                                   self._router.port)
        await self.send_report()

    async def send_report(self) -> None:
        self._writer.write(self.report())
        code, body = await read_answer(self._reader)
        if code != 200:
            raise RuntimeError(f"the Router refused {self.node_id}'s report: {code} {body[:200]!r}")
        self.reports += 1

    async def heartbeat(self, phase: float) -> None:
        await asyncio.sleep(phase)
        while True:
            await self.send_report()
            await asyncio.sleep(REPORT_INTERVAL)


# -- runs -------------------------------------------------------------------------

def run_request(router_url: str, payload_bytes: int = 0) -> list:
    """The parts of a POST /v1/run: the program by digest, one scalar input,
    or one input of C{payload_bytes} sent inline."""
    array = np.zeros(payload_bytes // 4, np.float32) if payload_bytes else np.float32(1.0)
    parts, length = encode_request(PROGRAM, None, [(array, None, True)])
    head = (f"POST /v1/run HTTP/1.1\r\nHost: {urlsplit(router_url).netloc}\r\n"
            f"Content-Type: {REQUEST_CONTENT_TYPE}\r\n{PROGRAM_HEADER}: {PROGRAM}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()
    return [head, *parts]


async def one_run(router_url: str, parts: list, connecting: asyncio.Semaphore) -> None:
    url = urlsplit(router_url)
    async with connecting:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.writelines(parts)
        await writer.drain()
        code, body = await read_answer(reader)
        if code != 200:
            raise RuntimeError(f"a run was answered {code}: {body[:300]!r}")
    finally:
        writer.close()


def memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


async def wait_ready(router_url: str, count: int, timeout: float = 60.0) -> None:
    url = urlsplit(router_url)
    deadline = time.monotonic() + timeout
    while True:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        writer.write(f"GET /v1/nodes HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode())
        _, body = await read_answer(reader)
        writer.close()
        nodes = json.loads(body)["nodes"]
        if sum(1 for n in nodes if n.get("state") == "ready") >= count:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} nodes not ready within {timeout} s")
        await asyncio.sleep(0.2)


async def measure_pool(count: int, args, rss: bool) -> dict:
    router = start_router(None, "--max-queued-requests", str(args.runs + 1000),
                          "--max-request-bytes", str(BIG_BODY + (1 << 20)))
    beats: list[asyncio.Task] = []
    url = router.found["url"]
    nodes = [FakeNode(i, url, args.delay) for i in range(count)]
    try:
        await asyncio.gather(*(n.start() for n in nodes))
        beats = [asyncio.create_task(n.heartbeat(random.uniform(0, REPORT_INTERVAL)))
                 for n in nodes]
        await wait_ready(url, count)
        await asyncio.sleep(REPORT_INTERVAL)  # settled
        pid = router.pid
        result: dict = {"nodes": count}

        reports_before = sum(n.reports for n in nodes)
        started, cpu = time.perf_counter(), cpu_seconds(pid)
        await asyncio.sleep(args.report_seconds)
        elapsed = time.perf_counter() - started
        result["report_core"] = (cpu_seconds(pid) - cpu) / elapsed
        result["reports_per_second"] = (sum(n.reports for n in nodes) - reports_before) / elapsed

        parts = run_request(url)
        connecting = asyncio.Semaphore(256)
        runs_before = sum(n.worker.runs for n in nodes)
        started, cpu = time.perf_counter(), cpu_seconds(pid)
        await asyncio.gather(*(one_run(url, parts, connecting) for _ in range(args.runs)))
        elapsed = time.perf_counter() - started
        # The heartbeats' share of the same window is taken out: what is
        # left is the runs'.
        used = cpu_seconds(pid) - cpu - result["report_core"] * elapsed
        result["runs"] = sum(n.worker.runs for n in nodes) - runs_before
        result["placement_cpu_us"] = 1e6 * used / args.runs
        result["runs_per_second"] = args.runs / elapsed

        if rss:
            big = run_request(url, BIG_BODY)
            result["rss_idle_mib"] = memory_kib(pid, "VmRSS") / 1024
            hwm_before = memory_kib(pid, "VmHWM") / 1024
            for at_once in (1, 2):
                await asyncio.gather(*(one_run(url, big, connecting) for _ in range(at_once)))
                result[f"rss_peak_{at_once}_mib"] = memory_kib(pid, "VmHWM") / 1024
            result["rss_hwm_before_mib"] = hwm_before
        return result
    finally:
        for beat in beats:
            beat.cancel()
        router.stop()
        # The Router gone, the workers' connections end: none is left for
        # the loop to cancel.
        await asyncio.gather(*(n.worker.stop() for n in nodes))


def median_row(rows: list[dict]) -> dict:
    """One pool size's rounds in one row: each figure their median (the
    memory ones, measured once, as they are)."""
    row = rows[0] | {key: statistics.median(r[key] for r in rows)
                     for key in ("report_core", "reports_per_second", "runs_per_second",
                                 "placement_cpu_us")}
    row["placement_cpu_us_rounds"] = [r["placement_cpu_us"] for r in rows]
    return row


def report(results: dict) -> list:
    print()
    print(f"command: {results['command']}")
    print(f"machine: {results['machine']}; load average at start {results['load']}")
    print(f"{results['runs']} queued runs per pool (each on its own connection), fake workers of "
          f"capacity {CAPACITY} answering after {1000 * results['delay']:g} ms; reports every "
          f"{REPORT_INTERVAL:g} s, measured over {results['report_seconds']:g} s without runs")
    print()
    names = f"{'nodes':>5} {'reports/s':>9} {'report CPU':>10} {'runs/s':>7} {'CPU per run':>11}"
    print(names)
    print(f"{'':>5} {'':>9} {'% of core':>10} {'':>7} {'us':>11}")
    print("-" * len(names))
    for row in results["rows"]:
        rounds = ", ".join(f"{us:.0f}" for us in row["placement_cpu_us_rounds"])
        print(f"{row['nodes']:>5} {row['reports_per_second']:>9.1f} {100 * row['report_core']:>9.1f}% "
              f"{row['runs_per_second']:>7.0f} {row['placement_cpu_us']:>11.0f}   rounds: {rounds}")
    print()
    checks = []
    rows = results["rows"]
    base = rows[0]["placement_cpu_us"]
    spread = [row["placement_cpu_us"] / base - 1 for row in rows]
    checks.append(((f"CPU per placement within +-{100 * TARGET_PLACEMENT_SPREAD:g}% from "
                   f"{rows[0]['nodes']} to {rows[-1]['nodes']} nodes"),
                   all(abs(s) <= TARGET_PLACEMENT_SPREAD for s in spread),
                   ", ".join(f"{r['nodes']}: {100 * s:+.0f}%" for r, s in zip(rows, spread))))
    largest = rows[-1]
    checks.append(((f"{largest['nodes']} nodes' reports every {REPORT_INTERVAL:g} s under "
                   f"{100 * TARGET_REPORT_CORE:g}% of a core"),
                   largest["report_core"] < TARGET_REPORT_CORE,
                   f"{100 * largest['report_core']:.1f}%"))
    for row in rows:
        if "rss_idle_mib" in row:
            peak = max(row["rss_peak_1_mib"], row["rss_peak_2_mib"])
            print(f"RSS with {row['nodes']} nodes: idle {row['rss_idle_mib']:.0f} MiB (peak so far "
                  f"{row['rss_hwm_before_mib']:.0f}); peak with one 256 MiB body "
                  f"{row['rss_peak_1_mib']:.0f} MiB, with two at once {row['rss_peak_2_mib']:.0f} MiB")
            checks.append((f"RSS within {TARGET_RSS_MIB} MiB of idle while 256 MiB bodies pass",
                           peak - row["rss_idle_mib"] <= TARGET_RSS_MIB,
                           f"+{peak - row['rss_idle_mib']:.0f} MiB"))
    for what, ok, value in checks:
        print(f"  [{'met' if ok else 'MISSED'}] {what}: {value}")
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default=",".join(map(str, NODES)), help="comma list of pool sizes")
    parser.add_argument("--runs", type=int, default=5000, help="queued runs per pool size")
    parser.add_argument("--delay", type=float, default=0.005, help="seconds a fake run takes")
    parser.add_argument("--report-seconds", type=float, default=10.0,
                        help="window over which the heartbeats' cost is measured")
    parser.add_argument("--rss-nodes", type=int, help="the pool size whose RSS is measured "
                                                      "(default: the largest)")
    parser.add_argument("--rounds", type=int, default=3, help="times each pool size is measured")
    parser.add_argument("--json", help="also write the results to this file")
    args = parse_quick(parser, nodes="10", runs=200, report_seconds=2.0, rounds=1)
    counts = [int(n) for n in args.nodes.split(",")]
    rss_at = args.rss_nodes or max(counts)
    # A connection per queued run, and the fake workers' sockets.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < args.runs + 4 * max(counts) + 100:
        parser.error(f"{args.runs} runs at once need more open files than the limit, {hard}")
    results = {"command": command_line(),
               "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
               "load": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
               "runs": args.runs, "delay": args.delay, "report_seconds": args.report_seconds,
               "rows": []}
    measured: dict[int, list[dict]] = {count: [] for count in counts}
    for round_ in range(args.rounds):
        for count in counts:
            print(f"round {round_ + 1}: {count} nodes ...", flush=True)
            measured[count].append(
                asyncio.run(measure_pool(count, args, count == rss_at and not round_)))
    results["rows"] = [median_row(rows) for rows in measured.values()]
    report(results)
    write_results(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
