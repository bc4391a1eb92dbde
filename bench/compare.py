"""
The Router side by side with the proxies a user would put in front of a JAX
server instead: the same load sent straight to one KCoral worker, through a
Router, through HAProxy, and to the same program run by Ray Serve, through
Ray's Python proxy and through its HAProxy ingress.

    .venv/bin/python -m bench.compare              # about eight minutes
    .venv/bin/python -m bench.compare --quick      # two programs, 1 and 16 connections
    .venv/bin/python -m bench.compare --proxy-core 1 --programs 5ms

The KCoral side is ``bench.router``'s: a ``kcoral router`` and one node
(a supervisor and one CPU worker of capacity 2) on ephemeral loopback
ports, and with ``--bare`` the floors of ``bench.peers.bare_proxy`` (a proxy on
the Router's stack with nothing of the Router): ``floor`` sends the worker
every run at once (its own admission queues them), ``floor-capped`` at most
its capacity at a time, as the Router and HAProxy do. HAProxy is Debian's
``haproxy`` in front of that worker, configured as one would for it: one
thread, the worker's reported capacity as its ``maxconn`` (HAProxy queues
the rest, ``timeout queue``), ``option httpchk GET /readyz`` with ``rise 2
fall 3``, ``http-reuse always``, no logging.

Ray Serve (``ray[serve]`` from PyPI, installed on first use into
``.bench-venv/ray`` with the JAX of this interpreter) runs the same exported
programs with KCoral's own executor (``bench.peers.ray_serve``), one replica
with ``max_ongoing_requests`` = the same capacity, tuned as Ray's
performance guide says (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, a request-path
log buffer, access logs off, an ``async`` handler that runs the program on a
thread pool). Each Ray cluster (``ray start --head --node-ip-address
127.0.0.1``) runs in a network namespace of its own that holds only a
loopback interface (``unshare -n``, so this needs root): with its HAProxy
ingress, Ray binds its replicas' ports, HAProxy's stats and metrics on
every interface, whatever it is told, and in that namespace every interface
is loopback. The sockets each cluster listens on are listed (``ss``) and
printed; any outside 127.0.0.1 is named. The load generator runs in the
same namespace.

The load is ``wrk`` (Debian) with ``bench/support/run.lua``: closed-loop keep-alive
connections (1, 16, 64 and 256), each POSTing the same pre-encoded body,
the exact bytes ``Client.run`` sends for a repeated call (program and large
inputs by digest; the 16 MiB program's input inline every time, so that
each run moves 16 MiB through the proxy). Every path first answers the
same body with the same bytes, and every timed answer must be a 2xx. Each
cell is a warm-up window then a timed one; CPU time per run is read from
``/proc`` for each proxy (the Router, HAProxy, Ray's proxy actor or its
HAProxy, and the whole Ray cluster), the worker and ``wrk`` itself (to show
it is not the bottleneck). ``--proxy-core N`` pins every proxy to core N
and everything else to the other cores (the 5 ms target's condition).

Targets (all in one run): on the trivial program, the Router's throughput
>= 0.8x HAProxy's at 1, 16 and 64 connections, and its median within 0.3
ms of HAProxy's; on the 5 ms one, >= 0.97x HAProxy's from 16 connections
(pinned); against Ray with its HAProxy ingress, >= 1.5x on the trivial
program and >= 1.05x on the 5 ms one, and a lower p99 in every cell. The
exit status is 0 whatever the numbers; ``doc/benchmarks.rst`` ("Against
HAProxy and Ray Serve") records them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

from bench.support.child import KCoralChild, child_environment, command_line, start_jax, until, write_results
from bench.support.ports import free_port
from bench.support.procstat import cpu_seconds, machine_busy_seconds
from bench.support.programs import programs
from bench.support.services import CAPACITY, start_bare_proxy, start_node, start_router, wait_ready

ROOT = Path(__file__).resolve().parent.parent

CONNECTIONS = (1, 16, 64, 256)
QUICK_CONNECTIONS = (1, 16)
#: The 16 MiB program: 256 connections would hold 4 GiB of bodies in flight.
BIG_CONNECTIONS = (1, 16, 64)
BIG_SHAPE = (4096, 1024)  # float32: 16 MiB
RAY_VERSION = "2.60.0"
RAY_VENV = ROOT / ".bench-venv" / "ray"
LUA = ROOT / "bench" / "support" / "run.lua"
WRK_LINE = re.compile(r"kcoral-wrk (\{.*\})")

TARGET_TRIVIAL_HAPROXY = 0.8
TARGET_TRIVIAL_P50_MS = 0.3
TARGET_5MS_HAPROXY = 0.97
TARGET_TRIVIAL_RAY = 1.5
TARGET_5MS_RAY = 1.05


# -- bodies ---------------------------------------------------------------------

class Body:
    """One program's bodies on disk: the first call (everything inline) and
    the repeated call that the load sends."""

    def __init__(self, directory: Path, kind: str, label: str, program, inputs, inline: bool):
        import attrs

        from kcoral.client.exchange import RunCall

        call = RunCall.prepare(program, tuple(inputs), {})
        if inline:  # every input in the body of every run, as a new one would be
            call = attrs.evolve(call, digests=[None] * len(call.arrays))
        self.kind, self.label, self.digest = kind, label, program.digest
        self.first = directory / f"{kind}-first.bin"
        self.repeat = directory / f"{kind}-repeat.bin"
        for path, held in ((self.first, set()), (self.repeat, call.content_digests())):
            send = call.send(held, None)
            path.write_bytes(b"".join(bytes(memoryview(p).cast("B")) for p in send.parts))
        self.content_type = send.headers["Content-Type"]
        self.size = self.repeat.stat().st_size


def post(url: str, body: Path, digest: str, content_type: str) -> bytes:
    request = urllib.request.Request(url + "/v1/run", data=body.read_bytes(), method="POST",
                                     headers={"Content-Type": content_type,
                                              "X-KCoral-Program": digest})
    with urllib.request.urlopen(request, timeout=300) as answer:
        return answer.read()


# -- HAProxy ----------------------------------------------------------------------

def haproxy_config(port: int, workers: list[tuple[str, str, int]]) -> str:
    """HAProxy in front of KCoral workers (name, URL, capacity) as a user
    would put it: each worker's capacity as its maxconn, HAProxy queueing
    the rest, the worker's readiness as its health check."""
    servers = "\n".join(
        f"    server {name} {url.split('//', 1)[1]} maxconn {capacity} check inter 1s rise 2 fall 3"
        for name, url, capacity in workers)
    return f"""\
global
    nbthread 1
    maxconn 4096

defaults
    mode http
    option http-keep-alive
    http-reuse always
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    timeout queue 300s

frontend kcoral
    bind 127.0.0.1:{port}
    default_backend workers

backend workers
    balance leastconn
    option httpchk GET /readyz
{servers}
"""


def start_haproxy(directory: Path, worker_url: str, cores: set[int] | None) -> tuple[KCoralChild, str]:
    port = free_port()
    config = directory / "haproxy.cfg"
    config.write_text(haproxy_config(port, [("worker0", worker_url, CAPACITY)]))
    child = KCoralChild(["-db", "-f", str(config)], name="haproxy", cores=cores,
                        executable=shutil.which("haproxy") or "haproxy", program=())
    url = f"http://127.0.0.1:{port}"
    until(lambda: _answers(child, url + "/v1/run"), "HAProxy's port")
    return child, url


def _answers(child: KCoralChild, url: str) -> bool:
    if not child.running:
        child.fail(f"{child.name} exited")
    try:
        urllib.request.urlopen(url, timeout=2).read()
    except urllib.error.HTTPError:
        return True  # a 405 from the worker behind it
    except OSError:
        return False
    return True


# -- Ray Serve ----------------------------------------------------------------------

def ensure_ray_venv() -> Path:
    """The Ray venv's interpreter, the venv made and filled on first use: Ray
    and what KCoral's executor imports, with this interpreter's JAX."""
    python = RAY_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(RAY_VENV)], check=True)
    pins = [f"{name}=={metadata.version(name)}" for name in ("jax", "jaxlib", "numpy", "ml_dtypes")]
    wanted = [f"ray[serve]=={RAY_VERSION}", *pins, "attrs", "cachetools", "flatbuffers", "prometheus_client",
              "twisted"]
    check = subprocess.run([str(python), "-c", ("import ray, jax, twisted, cachetools, flatbuffers; "
                            "print(ray.__version__, jax.__version__)")],
                           capture_output=True, text=True)
    if check.stdout.split() != [RAY_VERSION, metadata.version("jax")]:
        print(f"installing {' '.join(wanted)} into {RAY_VENV} ...", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *wanted], check=True)
    return python


class RayCluster:
    """
    A one-node Ray cluster with Serve and the KCoral deployment, in a
    network namespace of its own (loopback only), with its proxy either
    Ray's Python one or its HAProxy ingress. C{nsenter} runs a command in
    that namespace.
    """

    PORT = 8000

    def __init__(self, python: Path, ingress: str, bodies: list[Body], directory: Path,
                 answers: dict[str, bytes]):
        self.ingress = ingress
        temp = Path(tempfile.mkdtemp(prefix="kcray-", dir="/tmp"))  # short: Ray's socket paths
        self._temp = temp
        env = {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
               "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
               "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
               "RAY_SERVE_ENABLE_HA_PROXY": "1" if ingress == "haproxy" else "0",
               # The throughput flags turn on direct ingress (no proxy at all);
               # the Python proxy is what this path measures.
               "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1" if ingress == "haproxy" else "0",
               "RAY_SERVE_HAPROXY_NBTHREAD": "1",
               "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
        self.env = env
        ray = python.with_name("ray")
        start = (f"ip link set lo up && exec {ray} start --head --block --node-ip-address 127.0.0.1 "
                 f"--port 6379 --num-cpus 2 --include-dashboard false --disable-usage-stats "
                 f"--object-store-memory 100000000 --temp-dir {temp}")
        self.child = KCoralChild(["-n", "--", "sh", "-c", start], name=f"ray-{ingress}",
                                 executable=shutil.which("unshare") or "unshare", program=(),
                                 env=env, ready={"up": r"(Ray runtime started)"}, timeout=300)
        self.namespace = f"/proc/{self.child.pid}/ns/net"
        self._identity = os.readlink(self.namespace)  # still known once the child has gone
        warm = []
        for body in bodies:
            answer = directory / f"ray-{ingress}-{body.kind}.answer"
            warm += ["--warm", str(body.first), str(answer)]
        deploy = subprocess.run(
            self.nsenter(str(python), "-m", "bench.peers.ray_serve", "--address",
                         "127.0.0.1:6379", "--port", str(self.PORT), "--capacity", str(CAPACITY),
                         *warm),
            env=child_environment(env), capture_output=True, text=True, timeout=600)
        if deploy.returncode != 0:
            logs = "".join(f"\n== {log.name}\n" + "\n".join(log.read_text().splitlines()[-30:])
                           for log in temp.glob("session_latest/logs/serve/controller_*.log"))
            self.stop()
            raise RuntimeError(f"the Ray Serve deployment failed:\n{deploy.stderr[-3000:]}{logs}")
        for body in bodies:
            got = (directory / f"ray-{ingress}-{body.kind}.answer").read_bytes()
            if got != answers[body.kind]:
                self.stop()
                raise RuntimeError(f"Ray answered {body.kind} with other bytes: {got[:200]!r}")
        self.url = f"http://127.0.0.1:{self.PORT}"

    def nsenter(self, *command: str) -> list[str]:
        return ["nsenter", f"--net={self.namespace}", *command]

    def listening(self) -> list[str]:
        """The sockets that listen in the cluster's namespace: their local
        addresses, with the process's name for those outside loopback."""
        out = subprocess.run(self.nsenter("ss", "-Htlnup"), capture_output=True, text=True).stdout
        found = set()
        for line in out.splitlines():
            fields = line.split()
            if len(fields) < 5:
                continue
            address = fields[4]
            user = re.search(r'users:\(\("([^"]+)"', line)
            if outside_loopback([address]) and user:
                address += f" ({user.group(1)})"
            found.add(address)
        return sorted(found)

    def processes(self) -> dict[int, str]:
        """The cluster's processes (the namespace's), by pid, with their names."""
        found = {}
        mine = self._identity
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(entry / "ns" / "net") != mine:
                    continue
                found[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")[0].decode()
            except OSError:
                continue
        return found

    def proxy_pids(self) -> list[int]:
        wanted = "haproxy" if self.ingress == "haproxy" else "ray::ProxyActor"
        return [pid for pid, name in self.processes().items() if wanted in name]

    def stop(self) -> None:
        """Stop the cluster, then end what it left in its namespace (Ray's
        HAProxy, started by an actor, outlives the actor's process): every
        process there is this cluster's."""
        self.child.stop()
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self._temp, ignore_errors=True)


def outside_loopback(addresses: list[str]) -> list[str]:
    loopback = ("127.", "[::1]", "[::ffff:127.")
    return [a for a in addresses if not a.startswith(loopback)]


# -- the load -----------------------------------------------------------------------

class CPU:
    """CPU seconds of named groups of processes over a measurement."""

    def __init__(self, groups: dict[str, list[int]]):
        self._groups = groups

    def _sample(self) -> dict[str, float]:
        seconds = {}
        for name, pids in self._groups.items():
            total = 0.0
            for pid in pids:
                try:
                    total += cpu_seconds(pid)
                except (FileNotFoundError, ProcessLookupError):
                    pass
            seconds[name] = total
        return seconds

    def __enter__(self):
        self._before, self._busy = self._sample(), machine_busy_seconds()
        return self

    def __exit__(self, *exc):
        after = self._sample()
        self.seconds = {n: after[n] - self._before[n] for n in after}
        self.busy = machine_busy_seconds() - self._busy


def wrk(url: str, body: Body, connections: int, seconds: int,
        prefix: list[str], cores: set[int] | None) -> list[str]:
    command = [*prefix, "wrk", "-t", str(min(connections, 2)), "-c", str(connections),
               "-d", f"{seconds}s", "--timeout", "60s", "-s", str(LUA), url, "--",
               str(body.repeat), body.content_type, body.digest]
    if cores is not None:
        command = ["taskset", "-c", ",".join(map(str, sorted(cores))), *command]
    return command


def measure(path: str, url: str, body: Body, connections: int, seconds: int, warmup: int,
            groups: dict[str, list[int]], prefix: list[str], cores: set[int] | None) -> dict:
    if warmup > 0:
        subprocess.run(wrk(url, body, connections, warmup, prefix, cores), check=True,
                       capture_output=True)
    # wrk's own CPU: what this process's children used once it is reaped.
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    process = subprocess.Popen(wrk(url, body, connections, seconds, prefix, cores),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with CPU(groups) as cpu:
        out, err = process.communicate()
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu.seconds["wrk"] = (reaped.ru_utime + reaped.ru_stime) - (children.ru_utime + children.ru_stime)
    match = WRK_LINE.search(out)
    if process.returncode != 0 or match is None:
        raise RuntimeError(f"wrk against {path} failed:\n{out}\n{err}")
    result = json.loads(match.group(1))
    # A proxy without a queue of its own (the floor) passes the worker's 503s
    # on once its queue is full: those answers are counted, never as runs.
    errors = sum(result[k] for k in ("connect", "read", "write", "status", "timeout"))
    runs = result["requests"] - result["status"]
    if runs <= 0:
        raise RuntimeError(f"{path}, {body.kind}, {connections} connections: no run answered "
                           f"({result})")
    return {"path": path, "runs": runs, "errors": errors,
            "runs_per_second": runs / (result["microseconds"] / 1e6),
            "p50_ms": result["p50_us"] / 1000, "p99_ms": result["p99_us"] / 1000,
            "cpu_ms_per_run": {n: 1000 * s / runs for n, s in cpu.seconds.items()},
            "machine_cores": cpu.busy / (result["microseconds"] / 1e6)}


# -- reporting --------------------------------------------------------------------

PROXY_OF = {"router": "router", "haproxy": "haproxy", "floor": "floor", "floor-capped": "floor-capped",
            "ray-python": "ray proxy", "ray-haproxy": "ray proxy"}


def report(results: dict) -> list[tuple[str, bool, str]]:
    print()
    print(f"command: {results['command']}")
    print(f"machine: {results['machine']}; load average at start {results['load']}; "
          f"jax {results['jax']}, ray {results.get('ray', '-')}, {results['haproxy']}")
    print(f"pinning: {results['pinning']}")
    print(f"{results['seconds']:g} s timed after {results['warmup']:g} s of warm-up per cell; "
          f"one KCoral worker (CPU), capacity {CAPACITY}; Ray: one replica, "
          f"max_ongoing_requests {CAPACITY}")
    for ingress, addresses in results.get("ray_listening", {}).items():
        outside = outside_loopback(addresses)
        print(f"Ray ({ingress}) listened on {', '.join(addresses)}"
              + (f"; outside 127.0.0.1: {', '.join(outside)} (the namespace has only loopback)"
                 if outside else ""))
    print()
    names = (f"{'program':<8} {'conns':>5} {'path':<12} {'runs/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
             f"{'proxy CPU':>9} {'all Ray':>8} {'worker':>7} {'wrk':>6} {'vs HAProxy':>10} "
             f"{'vs Ray HA':>9}")
    print(names)
    print(f"{'':<8} {'':>5} {'':<12} {'':>8} {'':>8} {'':>8} {'ms/run':>9} {'ms/run':>8} "
          f"{'ms/run':>7} {'ms/run':>6} {'x':>10} {'x':>9}")
    print("-" * len(names))
    for row in results["rows"]:
        cells = row["paths"]
        for path, cell in cells.items():
            cpu = cell["cpu_ms_per_run"]
            proxy = cpu.get(PROXY_OF.get(path, ""), float("nan"))
            ratios = []
            for other in ("haproxy", "ray-haproxy"):
                ratios.append(f"{cell['runs_per_second'] / cells[other]['runs_per_second']:.2f}"
                              if other in cells and other != path else "")
            if cell["errors"]:
                print(f"{'':<8} {'':>5} {path:<12} {cell['errors']} answers not 2xx or "
                      f"failed, not counted as runs:")
            print(f"{row['kind']:<8} {row['connections']:>5} {path:<12} "
                  f"{cell['runs_per_second']:>8.0f} {cell['p50_ms']:>8.3f} {cell['p99_ms']:>8.3f} "
                  f"{proxy:>9.3f} {cpu.get('ray', float('nan')):>8.3f} "
                  f"{cpu.get('worker', float('nan')):>7.3f} {cpu['wrk']:>6.3f} "
                  f"{ratios[0]:>10} {ratios[1]:>9}")
    print()
    checks = []

    def cells(kind, others, least=0, most=10**9):
        return [r for r in results["rows"] if r["kind"] == kind and least <= r["connections"] <= most
                and "router" in r["paths"] and all(o in r["paths"] for o in others)]

    def ratio(row, other):
        return row["paths"]["router"]["runs_per_second"] / row["paths"][other]["runs_per_second"]

    rows = cells("trivial", ["haproxy"], most=64)
    if rows:
        checks.append((f"trivial: Router >= {TARGET_TRIVIAL_HAPROXY}x HAProxy's throughput at 1-64",
                       all(ratio(r, "haproxy") >= TARGET_TRIVIAL_HAPROXY for r in rows),
                       ", ".join(f"{r['connections']}: {ratio(r, 'haproxy'):.2f}x" for r in rows)))
        added = [(r["connections"], r["paths"]["router"]["p50_ms"] - r["paths"]["haproxy"]["p50_ms"])
                 for r in rows]
        checks.append((f"trivial: Router's p50 within {TARGET_TRIVIAL_P50_MS} ms of HAProxy's",
                       all(a <= TARGET_TRIVIAL_P50_MS for _, a in added),
                       ", ".join(f"{c}: {a:+.3f} ms" for c, a in added)))
    rows = cells("5ms", ["haproxy"], least=16)
    if rows:
        checks.append(((f"5 ms: Router >= {TARGET_5MS_HAPROXY}x HAProxy's throughput from 16 "
                       f"({'pinned' if results['pinned'] else 'NOT pinned: run with --proxy-core'})"),
                       all(ratio(r, "haproxy") >= TARGET_5MS_HAPROXY for r in rows),
                       ", ".join(f"{r['connections']}: {ratio(r, 'haproxy'):.2f}x" for r in rows)))
    for kind, target in (("trivial", TARGET_TRIVIAL_RAY), ("5ms", TARGET_5MS_RAY)):
        rows = cells(kind, ["ray-haproxy"])
        if rows:
            checks.append((f"{kind}: Router >= {target}x Ray (HAProxy ingress)",
                           all(ratio(r, "ray-haproxy") >= target for r in rows),
                           ", ".join(f"{r['connections']}: {ratio(r, 'ray-haproxy'):.2f}x"
                                     for r in rows)))
    rows = [r for r in results["rows"] if "router" in r["paths"] and "ray-haproxy" in r["paths"]]
    if rows:
        checks.append(("every cell: Router's p99 below Ray's (HAProxy ingress)",
                       all(r["paths"]["router"]["p99_ms"] < r["paths"]["ray-haproxy"]["p99_ms"]
                           for r in rows),
                       ", ".join(f"{r['kind']}/{r['connections']}: "
                                 f"{r['paths']['router']['p99_ms']:.2f} vs "
                                 f"{r['paths']['ray-haproxy']['p99_ms']:.2f}" for r in rows)))
    for what, ok, value in checks:
        print(f"  [{'met' if ok else 'MISSED'}] {what}: {value}")
    return checks


# -- main ---------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="trivial and 5 ms programs, 1 and 16 connections, 2 s windows")
    # wrk takes whole seconds.
    parser.add_argument("--seconds", type=int, help="timed window per cell (default 3, quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed load before each window")
    parser.add_argument("--connections", help="comma list (default 1,16,64,256; quick 1,16)")
    parser.add_argument("--programs", help="comma list of trivial, 5ms, 16mib (default all; "
                                           "quick trivial,5ms)")
    parser.add_argument("--paths", default="direct,router,haproxy,ray-python,ray-haproxy",
                        help="comma list of direct, router, haproxy, floor, floor-capped, "
                             "ray-python, ray-haproxy")
    parser.add_argument("--bare", action="store_true",
                        help="also the floors: bench.peers.bare_proxy with the Router's client, "
                             "without a bound on what it sends the worker (floor) and with the "
                             "Router's (floor-capped)")
    parser.add_argument("--proxy-core", type=int, metavar="N",
                        help="pin every proxy to core N, everything else to the other cores")
    parser.add_argument("--profile-router", metavar="FILE",
                        help="run the Router under cProfile and write its statistics here "
                             "(python -m pstats FILE); its figures are then not comparable")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    seconds = args.seconds or (2 if args.quick else 3)
    connections = [int(c) for c in (args.connections.split(",") if args.connections else
                                    QUICK_CONNECTIONS if args.quick else CONNECTIONS)]
    kinds = (args.programs.split(",") if args.programs else
             ["trivial", "5ms"] if args.quick else ["trivial", "5ms", "16mib"])
    paths = args.paths.split(",") + ["floor", "floor-capped"] * args.bare
    for tool in ("wrk", "haproxy", "unshare", "nsenter", "ss"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not installed (apt-get install -y wrk haproxy util-linux iproute2)")

    proxy_cores = rest = None
    if args.proxy_core is not None:
        cores = os.sched_getaffinity(0)
        if args.proxy_core not in cores or len(cores) < 2:
            parser.error(f"--proxy-core {args.proxy_core}: this process may use {sorted(cores)}")
        proxy_cores, rest = {args.proxy_core}, cores - {args.proxy_core}
        os.sched_setaffinity(0, rest)  # before JAX and the children, which inherit it
    device = start_jax("none")
    import jax
    import numpy as np

    from kcoral import Program

    work = Path(tempfile.mkdtemp(prefix="kcoral-compare-"))
    try:
        bodies = []
        calibrated = programs(np.random.default_rng(0))[:2]
        for (name, function, inputs, _), kind in zip(calibrated, ("trivial", "5ms")):
            if kind in kinds:
                bodies.append(Body(work, kind, name, Program.from_function(function, *inputs),
                                   inputs, inline=False))
        if "16mib" in kinds:
            big = np.random.default_rng(1).standard_normal(BIG_SHAPE, dtype=np.float32)
            bodies.append(Body(work, "16mib", "sum of a 16 MiB input, sent every run",
                               Program.from_function(lambda x: jax.numpy.sum(x), big), (big,),
                               inline=True))
        haproxy_version = subprocess.run(["haproxy", "-v"], capture_output=True,
                                         text=True).stdout.split(" - ")[0]
        results = {"command": command_line(),
                   "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                   "load": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
                   "jax": jax.__version__, "device": str(device), "haproxy": haproxy_version,
                   "seconds": seconds, "warmup": args.warmup, "pinned": proxy_cores is not None,
                   "pinning": ("nothing pinned" if proxy_cores is None else
                               f"proxies on core {args.proxy_core}; worker, Ray's replica and wrk on "
                               f"{','.join(map(str, sorted(rest)))}"),
                   "rows": [{"kind": b.kind, "program": b.label, "connections": c, "paths": {}}
                            for b in bodies for c in connections
                            if b.kind != "16mib" or c in BIG_CONNECTIONS or args.connections]}

        services = []
        answers: dict[str, bytes] = {}
        try:
            print("starting a Router, one node and HAProxy ...", flush=True)
            if args.profile_router:
                # cProfile writes its file when the Router exits (stopped with SIGTERM).
                router = KCoralChild(["router", "--port", "0"],
                                     {"url": r"kcoral router listening on (http://\S+)"},
                                     cores=proxy_cores, program=("-m", "cProfile", "-o",
                                                                 args.profile_router, "-m", "kcoral"))
            else:
                router = start_router(proxy_cores)
            services.append(router)
            node = start_node(router.found["url"], "none")
            services.append(node)
            wait_ready(router.found["url"])
            worker_url = node.found["worker"]
            urls = {"direct": worker_url, "router": router.found["url"]}
            groups = {"worker": [node.worker_pid], "router": [router.pid]}
            if "haproxy" in paths:
                haproxy, urls["haproxy"] = start_haproxy(work, worker_url, proxy_cores)
                services.append(haproxy)
                groups["haproxy"] = [haproxy.pid]
            for path, capacity in (("floor", None), ("floor-capped", CAPACITY)):
                if path in paths:
                    floor = start_bare_proxy([worker_url], cores=proxy_cores, capacity=capacity)
                    services.append(floor)
                    urls[path] = floor.found["url"]
                    groups[path] = [floor.pid]
            for body in bodies:
                answers[body.kind] = post(worker_url, body.first, body.digest, body.content_type)
                for path, url in urls.items():
                    got = post(url, body.repeat, body.digest, body.content_type)
                    assert got == answers[body.kind], f"{path} answered {body.kind} with other bytes"
            kcoral_paths = [p for p in paths if p in urls]
            done: list[dict] = []
            for body in bodies:
                for row in [r for r in results["rows"] if r["kind"] == body.kind]:
                    print(f"  {body.kind}, {row['connections']} connection(s) ...", flush=True)
                    # Alternating the order, so that drift hits every path alike.
                    order = kcoral_paths if len(done) % 2 == 0 else kcoral_paths[::-1]
                    done.append(row)
                    for path in order:
                        row["paths"][path] = measure(path, urls[path], body, row["connections"],
                                                     seconds, args.warmup, groups, [], rest)
        finally:
            for service in reversed(services):
                service.stop()
            services.clear()

        ray_paths = [p for p in paths if p.startswith("ray-")]
        if ray_paths:
            python = ensure_ray_venv()
            results["ray"] = subprocess.run([str(python), "-c", "import ray; print(ray.__version__)"],
                                            capture_output=True, text=True).stdout.strip()
            results["ray_listening"] = {}
        for path in ray_paths:
            ingress = path.split("-", 1)[1]
            print(f"starting Ray Serve ({ingress} ingress) ...", flush=True)
            cluster = RayCluster(python, ingress, bodies, work, answers)
            try:
                results["ray_listening"][ingress] = cluster.listening()
                names = cluster.processes()
                proxies = cluster.proxy_pids()
                replica = [pid for pid, name in names.items() if "ServeReplica" in name]
                if proxy_cores is not None:
                    for pid in names:
                        where = proxy_cores if pid in proxies else rest
                        subprocess.run(["taskset", "-a", "-p", "-c", ",".join(map(str, sorted(where))),
                                        str(pid)], capture_output=True)
                groups = {"ray proxy": proxies, "worker": replica, "ray": list(names)}
                for body in bodies:
                    for row in [r for r in results["rows"] if r["kind"] == body.kind]:
                        print(f"  {body.kind}, {row['connections']} connection(s) ...", flush=True)
                        row["paths"][path] = measure(path, cluster.url, body, row["connections"],
                                                     seconds, args.warmup, groups,
                                                     cluster.nsenter(), rest)
            finally:
                cluster.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    report(results)
    write_results(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
