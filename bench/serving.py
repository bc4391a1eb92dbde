"""
Named models served side by side: the same MLP (256 -> 1024 -> 256,
float32, 2 MiB of params, one row of 256 floats per request,
``max_batch_size`` 64) and the same load, over REST and gRPC, against a
KCoral node's gateway (two CPU workers), the same node behind a Router,
Triton (through PyTriton, its dynamic batcher on), KServe's model server,
and the floor: the same JAX function called in this process.

    .venv/bin/python -m bench.serving                  # about ten minutes
    .venv/bin/python -m bench.serving --quick          # concurrency 1 and 16, short windows
    .venv/bin/python -m bench.serving --fronts kcoral,floor --load loop --gpus 0
    .venv/bin/python -m bench.serving --quick --fronts kcoral,floor --load loop --batch-invariant
    .venv/bin/python -m bench.serving --fronts gateway,triton --protocols grpc \
        --grpc-fronts threaded,floor-aio,floor-threaded   # gRPC fronts side by side
    .venv/bin/python -m bench.serving --quick --fronts gateway,triton --protocols grpc \
        --front-processes 2       # the gateway with 2 processes on its gRPC port, beside 1

Every front serves the programs of the same bundle's batch sizes (1, 2, 4
... 64): KCoral compiles the bundle's, the peers (``bench.peers.serving_peers``)
compile ``jax.jit`` of the same function for the same sizes and pad a batch
to the next, before they say they are ready. The peers run from venvs of
their own under ``.bench-venv/``, made on first use: ``triton``
(``nvidia-pytriton`` 0.7.0, Triton 2.51 inside) and ``kserve`` (``kserve``
0.21.0), each with a CPU JAX. PyTriton's Python backend is started with
this interpreter's ``libpython`` first on ``LD_LIBRARY_PATH``: the stub
otherwise loads the system's, of another patch release, and fails.

The load is Triton's perf_analyzer (2.51.0, the last wheel whose binary
runs on glibc 2.36; fetched into ``.bench-venv/perf_analyzer`` with the
CUDA runtime it links, and Debian's ``libb64-0d``, installed with apt-get
when missing and run as root), one run per front, protocol and
concurrency (every front started first, and each concurrency measured on
all of them in turn, so that the machine's drift over the run falls on
all alike): ``--concurrency-range C:C``, windows of ``--seconds``, stable
within 50 %. KServe serves no model configuration, which perf_analyzer
reads first: it gets ``bench.support.serving_load`` instead, the same closed
loop from ``tritonclient`` threads (in two processes from 2 concurrent
requests on, or in a quarter of the cores' count where that is more),
and so does the gateway once more, so that the KServe ratio compares two
fronts under one load generator. ``--load loop`` uses it for every front
(a machine with no package index, such as the GPU check's).

CPU per inference is the CPU time of each front's whole process tree (the
node's supervisor, gateway and workers; the Router and its node;
PyTriton, tritonserver and its Python stub; KServe) over a cell, from
``/proc``, divided by the inferences in it; ``others`` is the cores the
rest of the machine used meanwhile. The gateway's mean executed
batch comes from its ``kcoral_inference_batch_size`` histogram, read
before and after each cell.

``--batch-invariant`` starts a second node, the same but for
``--batch-invariant`` on its command line, and measures its gateway
(``gateway-invariant``) beside the first in every round: the cost of a
row's bytes not depending on its batch, in inferences/s and p99.

``--swap`` measures instead a new version of the model taking over under
load: the gateway's node in poll mode (``--repository-poll-seconds 0.5``)
serves version 1 (``models/mlp/1``); a closed loop of ``--concurrency``
(default 64) tritonclient connections runs a window before, then a window
during which version 2 (other weights) is moved into ``models/mlp/2``, is
loaded and compiled by both workers beside version 1, and takes the
traffic. Targets: no failed request, and p99 during the swap <= 2x p99
before it.

Targets: the gateway >= 1.2x Triton's throughput from concurrency 16 on
with the same or a lower p99, >= 0.9x at concurrency 1; >= 3x KServe's
from 16 on; the Router >= 0.9x the gateway; a mean batch at concurrency
64 of at least 0.8x ``max_batch_size``. The exit status is 0 whatever the
numbers; ``doc/benchmarks.rst`` ("Serving models") records them.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np

from bench.support import serving_model as model
from bench.support.child import ChildFailed, KCoralChild, command_line, start_jax, until, write_results
from bench.support.ports import free_port
from bench.support.procstat import cpu_seconds, machine_busy_seconds

ROOT = Path(__file__).resolve().parent.parent

CONCURRENCY = (1, 4, 16, 64)
QUICK_CONCURRENCY = (1, 16)
PROTOCOLS = ("http", "grpc")
FRONTS = ("gateway", "router", "triton", "kserve", "floor")
#: Fronts measured only when named: a standalone server (one CPU worker, no gateway).
OTHER_FRONTS = ("server",)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
VENVS = ROOT / ".bench-venv"
# Run with "-m" from the repository root (a child's working directory).
PEERS = "bench.peers.serving_peers"
LOADER = "bench.support.serving_load"
GRPC_FRONTS = "bench.peers.grpc_fronts"

PYTRITON = "0.7.0"
KSERVE = "0.21.0"
TRITON_JAX = "0.7.1"  # the newest JAX for PyTriton's numpy 1.26; KServe's venv takes KCoral's
PERF_ANALYZER = "2.51.0"
CUDA_RUNTIME = "12.9.79"

TARGET_TRITON = 1.2
TARGET_TRITON_C1 = 0.9
TARGET_KSERVE = 3.0
TARGET_ROUTER = 0.9
TARGET_BATCH = 0.8


# -- the peers' venvs and perf_analyzer ---------------------------------------

def ensure_venv(name: str, packages: list[str]) -> Path:
    """The interpreter of C{.bench-venv/NAME}, made and filled unless it
    holds every one of C{packages}, each pinned C{name==version}."""
    python = VENVS / name / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(python.parent.parent)], check=True)
    pins = [re.sub(r"\[.*\]", "", package).split("==") for package in packages]
    check = subprocess.run([str(python), "-c", ("import sys; from importlib.metadata import version; "
                            "print(' '.join(version(name) for name in sys.argv[1:]))"),
                            *(name for name, _ in pins)], capture_output=True, text=True)
    if check.stdout.split() != [wanted for _, wanted in pins]:
        print(f"installing {' '.join(packages)} into {python.parent.parent} ...", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True)
    return python


def ensure_perf_analyzer() -> tuple[Path, dict[str, str]]:
    """perf_analyzer and the environment it runs in, fetched on first use."""
    home = VENVS / "perf_analyzer"
    binary = home / "bin" / "perf_analyzer"
    cudart = home / "cudart" / "nvidia" / "cuda_runtime" / "lib"
    if not binary.exists():
        print(f"fetching perf_analyzer from the tritonclient {PERF_ANALYZER} wheel ...", flush=True)
        wheels = home / "wheel"
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--platform", "manylinux1_x86_64", "-d", str(wheels),
                        f"tritonclient=={PERF_ANALYZER}"], check=True)
        with zipfile.ZipFile(next(wheels.glob("tritonclient-*.whl"))) as wheel:
            data = wheel.read(f"tritonclient-{PERF_ANALYZER}.data/data/bin/perf_analyzer")
        binary.parent.mkdir(parents=True, exist_ok=True)
        binary.write_bytes(data)
        binary.chmod(0o755)
    if not cudart.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(home / "cudart"),
                        f"nvidia-cuda-runtime-cu12=={CUDA_RUNTIME}"], check=True)
    if "libb64.so.0d" not in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout:
        if os.geteuid() != 0:
            raise SystemExit("perf_analyzer needs libb64.so.0d: apt-get install libb64-0d (as root)")
        print("installing libb64-0d ...", flush=True)
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "libb64-0d"], check=True)
    env = {**os.environ, "LD_LIBRARY_PATH": str(cudart)}
    subprocess.run([str(binary), "--version"], env=env, check=True, capture_output=True)
    return binary, env


# -- process trees ------------------------------------------------------------

def tree_cpu(roots: list[int]) -> float:
    """CPU seconds used so far by the processes C{roots} and all their
    descendants (a front's workers, tritonserver and its stub)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    total, todo = 0.0, list(roots)
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            total += cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


# -- the fronts ---------------------------------------------------------------

class Front:
    """A running front: where it answers each protocol, its processes, and
    where its KCoral metrics are (None for a peer)."""

    def __init__(self, name: str, children: list[KCoralChild], http: str, grpc: str,
                 metrics: str | None = None):
        self.name, self.children, self.metrics = name, children, metrics
        self.targets = {"http": http, "grpc": grpc}

    @property
    def roots(self) -> list[int]:
        return [child.pid for child in self.children]

    def wait_ready(self, timeout: float = 240.0) -> None:
        url = f"http://{self.targets['http']}/v2/models/{model.NAME}/ready"

        def ready() -> bool:
            for child in self.children:
                if not child.running:
                    child.fail(f"{self.name} exited")
            try:
                with urllib.request.urlopen(url, timeout=5) as answer:
                    return answer.status == 200
            except OSError:
                return False

        until(ready, f"{self.name}: model {model.NAME} ready", timeout, interval=0.2)

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()


def node_options(repository: Path, gpus: str, delay: list[str]) -> list[str]:
    devices = ["--gpus", "none", "--cpu-workers", "2"] if gpus == "none" else ["--gpus", gpus]
    return [*devices, "--model-repository", str(repository), *delay]


def workers_ready(gpus: str) -> dict[str, str]:
    """The node's log lines that say each of its workers has compiled the model."""
    return {f"worker{i}": rf"(worker{i} is ready)" for i in range(2 if gpus == "none" else 1)}


def start_gateway(started: list[Front], repository: Path, gpus: str, delay: list[str],
                  name: str = "gateway", grpc_front: str | None = None,
                  front_processes: int | None = None) -> Front:
    """The node's gateway in front of its two CPU workers; on one GPU a node
    is one server, with no gateway: that server. C{delay}: its further
    options; C{grpc_front}: one of C{bench.peers.grpc_fronts}'s variants in
    place of its gRPC front; C{front_processes}: how many processes serve its
    gRPC port (its C{--front-processes}; on one GPU, more than one puts a
    gateway before the server)."""
    options = node_options(repository, gpus, delay)
    fronts = {}
    if front_processes is not None:
        options += ["--front-processes", str(front_processes)]
        fronts = {f"front{i}": rf"(front{i} is ready)" for i in range(1, front_processes)}
    if gpus == "none" or front_processes and front_processes > 1:
        ready = {"url": r"kcoral gateway listening on http://(\S+)", **workers_ready(gpus), **fronts}
    else:
        ready = {"url": r"kcoral server listening on http://(\S+)"}
    return start_kcoral(started, name, options, ready, grpc_front)


def start_server(started: list[Front], repository: Path, delay: list[str],
                 grpc_front: str | None = None) -> Front:
    """A standalone server (one CPU worker, no gateway), with C{grpc_front}
    as L{start_gateway} takes it."""
    return start_kcoral(started, "server", ["--gpus", "none", "--model-repository", str(repository),
                                            *delay],
                        {"url": r"kcoral server listening on http://(\S+)"}, grpc_front)


def start_kcoral(started: list[Front], name: str, options: list[str], ready: dict[str, str],
                 grpc_front: str | None) -> Front:
    """C{kcoral server OPTIONS} with gRPC, once C{ready}'s lines are logged and its model is
    ready; C{grpc_front} names a variant of its gRPC front (and the front's name)."""
    grpc = free_port()
    if grpc_front is not None:
        name = f"{name}[{grpc_front}]"
    program = ("-m", "kcoral") if grpc_front is None else ("-m", GRPC_FRONTS, grpc_front)
    child = KCoralChild(["server", "--port", "0", "--grpc-port", str(grpc), *options], ready,
                        name=name, timeout=300, program=program)
    front = Front(name, [child], child.found["url"], f"127.0.0.1:{grpc}",
                  f"http://{child.found['url']}/metrics")
    started.append(front)
    front.wait_ready()
    return front


def start_grpc_floor(started: list[Front], kind: str) -> Front:
    """A bare grpcio server answering a fixed response (gRPC only)."""
    grpc = free_port()
    floor = KCoralChild([kind, str(grpc)], {"ready": r"(floor ready)"}, name=f"grpc-{kind}",
                        program=("-m", GRPC_FRONTS))
    front = Front(f"grpc-{kind}", [floor], "", f"127.0.0.1:{grpc}")
    started.append(front)
    return front


def start_router(started: list[Front], repository: Path, gpus: str, delay: list[str]) -> Front:
    grpc = free_port()
    router = KCoralChild(["router", "--port", "0", "--grpc-port", str(grpc)],
                         {"url": r"kcoral router listening on http://(\S+)"}, name="router")
    front = Front("router", [router], router.found["url"], f"127.0.0.1:{grpc}",
                  f"http://{router.found['url']}/metrics")
    started.append(front)
    front.children.append(KCoralChild(
        ["server", "--router", f"http://{router.found['url']}", "--node-id", "n", "--port", "0",
         *node_options(repository, gpus, delay)], workers_ready(gpus), name="router-node", timeout=300))
    front.wait_ready()
    return front


def start_peer(started: list[Front], which: str, python: Path, params: Path, delay: int) -> Front:
    http, grpc = free_port(), free_port()
    ports = [str(http), str(grpc)]
    env = {"JAX_PLATFORMS": "cpu"}
    if which == "triton":
        ports.append(str(free_port()))  # its metrics, which nothing here reads
        env["LD_LIBRARY_PATH"] = sysconfig.get_config_var("LIBDIR")
    peer = KCoralChild([which, str(params), *ports, "--max-batch-delay", str(delay)],
                       {"ready": r"(peer ready)"}, name=which, executable=str(python),
                       program=("-m", PEERS), env=env, timeout=300)
    front = Front(which, [peer], f"127.0.0.1:{http}", f"127.0.0.1:{grpc}")
    started.append(front)
    front.wait_ready()
    return front


def check_answer(front: Front, protocol: str, params: dict[str, np.ndarray]) -> None:
    """The front answers a row as the function does here, requested as the
    load requests it, before it is measured."""
    if protocol == "http":
        import tritonclient.http as client_module
    else:
        import tritonclient.grpc as client_module
    x = np.random.default_rng(2).standard_normal((1, model.ROWS)).astype(np.float32)
    client = client_module.InferenceServerClient(front.targets[protocol])
    try:
        tensor = client_module.InferInput(model.INPUT, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        got = client.infer(model.NAME, [tensor], outputs=[client_module.InferRequestedOutput(model.OUTPUT)]
                           ).as_numpy(model.OUTPUT)
    finally:
        client.close()
    want = np.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise AssertionError(f"{front.name} over {protocol}: not the model's answer")


def machine_split(roots: list[int]) -> tuple[float, float, float]:
    """The time, the machine's busy CPU seconds, and those of this benchmark
    (this process, its ended children such as the load, and the front's tree)."""
    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    ours = sum(usage.ru_utime + usage.ru_stime for usage in usages)
    return time.perf_counter(), machine_busy_seconds(), ours + tree_cpu(roots)


def batch_totals(front: Front) -> tuple[float, float] | None:
    """The sum and count of C{kcoral_inference_batch_size} over the front's
    workers, or None where its /metrics has none."""
    if front.metrics is None:
        return None
    with urllib.request.urlopen(front.metrics, timeout=10) as answer:
        text = answer.read().decode()
    found = {"sum": 0.0, "count": 0.0}
    labels = rf'\{{[^}}]*model="{model.NAME}"[^}}]*\}}'
    pattern = re.compile(rf"^kcoral_inference_batch_size_(sum|count){labels} (\S+)$", re.MULTILINE)
    matches = pattern.findall(text)
    for kind, value in matches:
        found[kind] += float(value)
    return (found["sum"], found["count"]) if matches else None


# -- the loads ----------------------------------------------------------------

def cell(front: Front, protocol: str, concurrency: int, load, **options) -> dict:
    """One measurement: C{load} runs against the front, reading its process
    tree's CPU time (C{load}'s fourth argument) around its window; the
    executed batches are read around the whole load."""
    before_batches = batch_totals(front)
    before = machine_split(front.roots)
    result = load(front.targets[protocol], protocol, concurrency, lambda: tree_cpu(front.roots), **options)
    after = machine_split(front.roots)
    after_batches = batch_totals(front)
    # What the rest of the machine used meanwhile, in cores: on a shared
    # machine, how far to trust the cell.
    elapsed, busy, ours = (a - b for a, b in zip(after, before, strict=True))
    result["outside_cores"] = max(0.0, busy - ours) / elapsed
    result.update(front=front.name, protocol=protocol, concurrency=concurrency)
    inferences, cpu = result.pop("inferences"), result.pop("cpu")
    result["cpu_ms_per_inference"] = 1000 * cpu / inferences if inferences else None
    if before_batches and after_batches and after_batches[1] > before_batches[1]:
        result["mean_batch"] = (after_batches[0] - before_batches[0]) / (after_batches[1] - before_batches[1])
    return result


#: perf_analyzer's abort on statistics read mid-call, and how often a run is tried.
STATISTICS_ABORT = "Server side statistics compute counts must be the same"
STATISTICS_ATTEMPTS = 3


def perf_analyzer_load(target: str, protocol: str, concurrency: int, cpu, *, perf_analyzer, seconds: float,
                       trials: int, directory: Path) -> dict:
    binary, env = perf_analyzer
    # perf_analyzer aborts a run whose server statistics, read while calls
    # are in flight, count a stage of a call that its next stage does not
    # count yet (KCoral counts each stage as it ends): such a run is
    # measured again, at most twice.
    for attempt in range(STATISTICS_ATTEMPTS):
        out = directory / f"pa-{protocol}-{concurrency}-{time.monotonic_ns()}.csv"
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_before = cpu()
        started = time.perf_counter()
        run = subprocess.run([str(binary), "-m", model.NAME, "-u", target, "-i", protocol,
                              "--concurrency-range", f"{concurrency}:{concurrency}",
                              "-p", str(int(seconds * 1000)), "-s", "50", "-r", str(trials), "-f", str(out)],
                             env=env, capture_output=True, text=True, timeout=60 + 2 * trials * seconds)
        elapsed = time.perf_counter() - started
        if STATISTICS_ABORT not in run.stderr:
            break
        print(f"  (perf_analyzer's statistics check failed, attempt {attempt + 1})", flush=True)
    used_cpu = cpu() - cpu_before
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0 or not out.exists():
        raise RuntimeError(f"perf_analyzer failed ({run.returncode}):\n"
                           f"{run.stdout[-2000:]}{run.stderr[-2000:]}")
    with open(out) as f:
        row = next(csv.DictReader(f))
    rate = float(row["Inferences/Second"])
    # perf_analyzer keeps the load on from its first window to its last: the
    # tree's CPU over the run is spent on about rate x elapsed inferences.
    return {"load": "perf_analyzer", "throughput": rate, "p50_ms": float(row["p50 latency"]) / 1000,
            "p99_ms": float(row["p99 latency"]) / 1000, "inferences": rate * elapsed, "cpu": used_cpu,
            "load_cpu_cores": (used.ru_utime + used.ru_stime - children.ru_utime - children.ru_stime)
            / elapsed,
            "seconds": elapsed}


def loop_load(target: str, protocol: str, concurrency: int, cpu, *, seconds: float, warmup: float) -> dict:
    # Enough processes that the client's own GIL is not the bound on a host
    # of many cores (a quarter of them), two on a small one.
    processes = min(concurrency, max(2, (os.cpu_count() or 2) // 4))
    start = time.time() + 2.0  # every loader imported and connected by then
    loaders = [KCoralChild([target, protocol, "--threads", str(threads), "--start", str(start),
                            "--warmup", str(warmup), "--seconds", str(seconds)],
                           name="load", program=("-m", LOADER))
               for threads in (concurrency // processes + (i < concurrency % processes)
                               for i in range(processes))]
    latencies: list[float] = []
    errors = 0
    try:
        time.sleep(max(0.0, start + warmup - time.time()))
        cpu_before = cpu()
        time.sleep(max(0.0, start + warmup + seconds - time.time()))
        used_cpu = cpu() - cpu_before
        for loader in loaders:
            line = loader.wait_for(r"^load (\{.*\})$", 60 + warmup + seconds)[1].group(1)
            found = json.loads(line)
            latencies += found["latencies"]
            errors += found["error_count"]
            if found["errors"]:
                print(f"  {errors} errors, e.g. {found['errors'][0]}", flush=True)
    finally:
        for loader in loaders:
            loader.stop()
    if errors:
        raise RuntimeError(f"{errors} of the requests to {target} over {protocol} failed")
    return {"load": "loop", "throughput": len(latencies) / seconds,
            "p50_ms": 1000 * float(np.percentile(latencies, 50)) if latencies else None,
            "p99_ms": 1000 * float(np.percentile(latencies, 99)) if latencies else None,
            "inferences": len(latencies), "cpu": used_cpu, "errors": errors}


def floor(gpus: str, params: dict[str, np.ndarray], seconds: float) -> list[dict]:
    """The function itself, jax.jit in this process, at batch 1 and 64."""
    start_jax(gpus)
    import jax

    program = jax.jit(model.mlp)
    on_device = jax.device_put(params)
    results = []
    for rows in (1, model.MAX_BATCH_SIZE):
        x = jax.device_put(np.random.default_rng(3).standard_normal((rows, model.ROWS)).astype(np.float32))
        program(on_device, x).block_until_ready()
        times = []
        cpu = time.process_time()
        deadline = time.perf_counter() + seconds
        while (started := time.perf_counter()) < deadline:
            program(on_device, x).block_until_ready()
            times.append(time.perf_counter() - started)
        cpu = time.process_time() - cpu
        results.append({"front": "floor", "protocol": "-", "concurrency": f"b{rows}", "load": "in process",
                        "throughput": rows * len(times) / sum(times),
                        "p50_ms": 1000 * float(np.percentile(times, 50)),
                        "p99_ms": 1000 * float(np.percentile(times, 99)),
                        "cpu_ms_per_inference": 1000 * cpu / (rows * len(times))})
    return results


# -- the report ---------------------------------------------------------------

def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(cells: list[dict]) -> dict:
    print(f"\n{'front':<16} {'proto':<5} {'load':<13} {'c':>4} {'infer/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'CPU ms/inf':>10} {'batch':>6} {'others':>6}")
    # Measured round the fronts, shown front by front.
    fronts = list(dict.fromkeys(c["front"] for c in cells))
    for c in sorted(cells, key=lambda c: (fronts.index(c["front"]), c["protocol"] != "http")):
        print(f"{c['front']:<16} {c['protocol']:<5} {c['load']:<13} {c['concurrency']:>4} "
              f"{fmt(c['throughput'], ',.0f'):>9} {fmt(c['p50_ms'], '.2f'):>8} {fmt(c['p99_ms'], '.2f'):>8} "
              f"{fmt(c.get('cpu_ms_per_inference'), '.3f'):>10} {fmt(c.get('mean_batch'), '.1f'):>6} "
              f"{fmt(c.get('outside_cores'), '.2f'):>6}")
    by = {(c["front"], c["protocol"], c["concurrency"]): c for c in cells}
    ratios = []

    def compare(top: str, bottom: str, title: str, target) -> None:
        lines = []
        for (front, protocol, concurrency), mine in by.items():
            theirs = by.get((bottom, protocol, concurrency))
            if front != top or theirs is None or not theirs["throughput"]:
                continue
            ratio = mine["throughput"] / theirs["throughput"]
            wanted = target(concurrency)
            ratios.append({"ratio": f"{top}/{bottom}", "protocol": protocol, "concurrency": concurrency,
                           "throughput": ratio, "p99_ms": [mine["p99_ms"], theirs["p99_ms"]],
                           "target": wanted})
            lines.append(f"  {protocol:<4} c={concurrency:<3} {ratio:5.2f}x  "
                         f"p99 {fmt(mine['p99_ms'], '.2f')} vs {fmt(theirs['p99_ms'], '.2f')} ms"
                         + (f"  (target >= {wanted}x)" if wanted else ""))
        if lines:
            print(f"\n{title}")
            print("\n".join(lines))

    for front in dict.fromkeys(c["front"] for c in cells):
        if front in ("gateway", "server") or front.startswith(("gateway[", "gateway-f", "server[",
                                                                   "grpc-floor")):
            compare(front, "triton", f"KCoral {front} / Triton (perf_analyzer):",
                    lambda c: TARGET_TRITON_C1 if c == 1 else TARGET_TRITON if c >= 16 else None)
    kserve_base = "gateway-loop" if any(c["front"] == "gateway-loop" for c in cells) else "gateway"
    compare(kserve_base, "kserve", "KCoral gateway / KServe (the same tritonclient loop):",
            lambda c: TARGET_KSERVE if c >= 16 else None)
    compare("router", "gateway", "Router / gateway:", lambda c: TARGET_ROUTER)
    compare("gateway-invariant", "gateway", "Batch-invariant gateway / gateway:", lambda c: None)
    for front in dict.fromkeys(c["front"] for c in cells):
        if front.startswith("gateway-f"):
            compare(front, "gateway", f"{front} / gateway:", lambda c: None)
    for c in cells:
        if c["front"] == "gateway" and c["concurrency"] == 64 and c.get("mean_batch") is not None:
            print(f"\nmean executed batch at c=64 ({c['protocol']}): {c['mean_batch']:.1f} rows "
                  f"(target >= {TARGET_BATCH * model.MAX_BATCH_SIZE:.1f})")
    return {"ratios": ratios}


def export_bundle(params_path: Path, folder: Path) -> None:
    """The model's bundle of the params at C{params_path}, written to C{folder}
    (exported in a child: this process's JAX is the floor's, on the device
    under test)."""
    code = ("import numpy as np, kcoral; "
            "from bench.support import serving_model as m; "
            f"kcoral.export_bundle(m.mlp, m.load_params({str(params_path)!r}), "
            f"np.zeros((1, m.ROWS), np.float32), dir={str(folder)!r}, "
            f"name=m.NAME, batch_sizes={list(BATCH_SIZES)})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                   env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})


def served_versions(front: Front) -> list[str]:
    """The versions of the model the front's repository index says are ready."""
    request = urllib.request.Request(f"http://{front.targets['http']}/v2/repository/index",
                                     data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return [m["version"] for m in json.load(answer)
                if m["name"] == model.NAME and m["state"] == "READY"]


def swap(directory: Path, gpus: str, delay: list[str], protocol: str, concurrency: int,
         seconds: float, started: list[Front]) -> dict:
    """A window of load before, and one during a swap to version 2 (see the module's text)."""
    model.save_params(directory / "v2.npz", model.make_params(seed=1))
    export_bundle(directory / "params.npz", directory / "models" / model.NAME / "1")
    export_bundle(directory / "v2.npz", directory / "staged")
    polled = [*delay, "--model-control-mode", "poll", "--repository-poll-seconds", "0.5"]
    front = start_gateway(started, directory / "models", gpus, polled)
    loop = {"seconds": seconds, "warmup": 1.0}
    before = cell(front, protocol, concurrency, loop_load, **loop)
    print(f"  before: {before['throughput']:,.0f}/s p99 {fmt(before['p99_ms'], '.2f')} ms", flush=True)
    # Moved in as the measured window opens (after 2 s of connecting and
    # 1 s of warm-up), and the window lasts three times as long: the load,
    # the compile and the move of the traffic fall inside it (the result
    # says whether they did).
    moved_at: list[float] = []
    served_at: list[float] = []

    def move() -> None:
        os.rename(directory / "staged", directory / "models" / model.NAME / "2")
        moved_at.append(time.monotonic())
        until(lambda: served_versions(front) == ["2"], "version 2 served alone", 300, interval=0.1)
        served_at.append(time.monotonic())

    mover = threading.Thread(target=move, daemon=True)
    timer = threading.Timer(3.0, mover.start)
    timer.start()
    window_end = time.monotonic() + 3.0 + 3 * seconds
    try:
        during = cell(front, protocol, concurrency, loop_load, **{**loop, "seconds": 3 * seconds})
    finally:
        timer.cancel()
    mover.join(300)
    swap_seconds = served_at[0] - moved_at[0] if served_at and moved_at else None
    print(f"  during: {during['throughput']:,.0f}/s p99 {fmt(during['p99_ms'], '.2f')} ms, "
          f"errors {during['errors']}, version 2 served alone {fmt(swap_seconds, '.1f')} s "
          "after it was moved in", flush=True)
    return {"protocol": protocol, "concurrency": concurrency, "before": before, "during": during,
            "swap_seconds": swap_seconds,
            "swap_within_window": bool(served_at) and served_at[0] <= window_end,
            "p99_ratio": during["p99_ms"] / before["p99_ms"] if before["p99_ms"] else None,
            "failed_requests": during["errors"] + before["errors"]}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "jax": metadata.version("jax"),
            "pytriton": PYTRITON, "kserve": KSERVE, "perf_analyzer": PERF_ANALYZER}


def kcoral_batch_delay(delay: int) -> list[str]:
    """C{--max-batch-delay-microseconds DELAY} where this tree's server takes it."""
    help_text = subprocess.run([sys.executable, "-m", "kcoral", "server", "--help"],
                               capture_output=True, text=True, cwd=ROOT).stdout
    flag = "--max-batch-delay-microseconds"
    return [flag, str(delay)] if flag in help_text else []


def stop_on_signals() -> None:
    """A SIGTERM ends this process as a Ctrl+C does: through the finally that
    stops every child. A background job starts with SIGINT ignored."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)


def stop_all(started: list[Front], directory: Path) -> None:
    """Stop every front started, the last first, and remove the run's folder."""
    for front in reversed(started):
        front.stop()
    shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", help="comma-separated (default 1,4,16,64; --quick 1,16)")
    parser.add_argument("--fronts", default=",".join(FRONTS),
                        help=f"comma-separated, of {', '.join(FRONTS + OTHER_FRONTS)}; kcoral is "
                             "gateway,router")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--grpc-fronts", default="",
                        help="comma-separated gRPC fronts of bench.peers.grpc_fronts to measure too, each "
                             "in a gateway of its own, and a standalone server with --fronts server "
                             "(threaded), and the floors (floor-aio, floor-h2, "
                             "floor-threaded)")
    parser.add_argument("--front-processes", default="",
                        help="comma-separated counts: the gateway once more with each as its "
                             "--front-processes (gateway-fN), beside the plain one")
    parser.add_argument("--load", choices=["perf_analyzer", "loop"], default="perf_analyzer",
                        help="the load for every front but KServe's (which always gets the loop)")
    parser.add_argument("--seconds", type=float, help="one measurement window (default 2; --quick 1)")
    parser.add_argument("--max-batch-delay", type=int, default=500,
                        help="microseconds a batch waits for more requests (Triton; KCoral where it has one)")
    parser.add_argument("--gpus", default="none", help="KCoral's device and the floor's: none or an index")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also measure the gateway of a node started with --batch-invariant")
    parser.add_argument("--swap", action="store_true",
                        help="measure a swap to a new model version under load (the gateway only)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.swap:
        return main_swap(args)
    fronts = [name for item in args.fronts.split(",")
              for name in (("gateway", "router") if item == "kcoral" else (item,))]
    unknown = set(fronts) - set(FRONTS) - set(OTHER_FRONTS)
    if unknown:
        parser.error(f"unknown fronts: {', '.join(sorted(unknown))}")
    if args.batch_invariant and "gateway" not in fronts:
        parser.error("--batch-invariant measures beside the gateway: --fronts gateway or kcoral")
    if args.gpus != "none" and {"triton", "kserve"} & set(fronts):
        parser.error("the peers run on the CPU only: --fronts kcoral,floor with --gpus")
    concurrency = [int(c) for c in (args.concurrency or ",".join(
        map(str, QUICK_CONCURRENCY if args.quick else CONCURRENCY))).split(",")]
    protocols = args.protocols.split(",")
    front_counts = [int(n) for n in filter(None, args.front_processes.split(","))]
    seconds = args.seconds or (1.0 if args.quick else 2.0)
    began = time.monotonic()
    stop_on_signals()

    pythons = {}
    if "triton" in fronts:
        pythons["triton"] = ensure_venv("triton", [f"nvidia-pytriton=={PYTRITON}",
                                                   "tritonclient[http,grpc]==2.60.0", f"jax=={TRITON_JAX}"])
    if "kserve" in fronts:
        pythons["kserve"] = ensure_venv("kserve", [f"kserve=={KSERVE}", f"jax=={metadata.version('jax')}"])
    measured = [f for f in fronts if f in ("gateway", "router", "triton", "server")]
    perf_analyzer = ensure_perf_analyzer() if args.load == "perf_analyzer" and measured else None

    results = {"command": command_line(), "machine": machine(), "seconds": seconds,
               "max_batch_delay_us": args.max_batch_delay, "cells": []}
    started: list[Front] = []
    directory = Path(tempfile.mkdtemp(prefix="kcoral-serving-"))
    try:
        params = model.make_params()
        model.save_params(directory / "params.npz", params)
        delay = kcoral_batch_delay(args.max_batch_delay)
        results["kcoral_batch_delay_flag"] = bool(delay)
        if {"gateway", "router", "server"} & set(fronts):
            export_bundle(directory / "params.npz", directory / "models" / model.NAME)
        pa = {"perf_analyzer": perf_analyzer, "seconds": seconds, "trials": 5 if args.quick else 10,
              "directory": directory}
        loop = {"seconds": 2 * seconds, "warmup": seconds}
        kcoral_load = (perf_analyzer_load, pa) if args.load == "perf_analyzer" else (loop_load, loop)
        plans = {"gateway": kcoral_load, "router": kcoral_load, "triton": kcoral_load, "server": kcoral_load,
                 "kserve": (loop_load, loop)}
        # Every front is started first and the cells go round them, one
        # concurrency at a time: this shared machine's speed drifts over a
        # run, and fronts measured in turn would each get a part of it.
        runs = []
        for name in fronts:
            if name == "floor":
                continue
            print(f"== starting {name}", flush=True)
            if name in ("gateway", "router"):
                start = start_gateway if name == "gateway" else start_router
                front = start(started, directory / "models", args.gpus, delay)
            elif name == "server":
                front = start_server(started, directory / "models", delay)
            else:
                front = start_peer(started, name, pythons[name], directory / "params.npz",
                                   args.max_batch_delay)
            runs.append((front, *plans[name]))
            if name == "gateway":
                for count in front_counts:
                    print(f"== starting gateway-f{count} (--front-processes {count})", flush=True)
                    runs.append((start_gateway(started, directory / "models", args.gpus, delay,
                                               f"gateway-f{count}", front_processes=count),
                                 *kcoral_load))
            if name == "gateway" and args.batch_invariant:
                print("== starting gateway-invariant", flush=True)
                runs.append((start_gateway(started, directory / "models", args.gpus,
                                           [*delay, "--batch-invariant"], "gateway-invariant"),
                             *kcoral_load))
            if name in ("gateway", "server"):
                for variant in filter(None, args.grpc_fronts.split(",")):
                    print(f"== starting gRPC front {variant} ({name})", flush=True)
                    if variant.startswith("floor"):
                        if name == "gateway":
                            runs.append((start_grpc_floor(started, variant), *kcoral_load))
                    elif name == "gateway":
                        runs.append((start_gateway(started, directory / "models", args.gpus, delay,
                                                   grpc_front=variant), *kcoral_load))
                    else:
                        runs.append((start_server(started, directory / "models", delay, variant),
                                     *kcoral_load))
            if name == "gateway" and "kserve" in fronts and args.load == "perf_analyzer":
                same = Front("gateway-loop", front.children, front.targets["http"], front.targets["grpc"],
                             front.metrics)
                runs.append((same, loop_load, loop))
        for protocol in protocols:
            for front in started:
                if not front.name.startswith("grpc-floor"):
                    check_answer(front, protocol, params)
            for c in concurrency:
                for measured_front, load, options in runs:
                    # The gRPC fronts' variants and floors are measured over gRPC only.
                    if (measured_front.name.startswith(("grpc-floor", "gateway[", "server["))
                            and protocol != "grpc"):
                        continue
                    result = cell(measured_front, protocol, c, load, **options)
                    print(f"  {measured_front.name} {protocol} c={c}: {result['throughput']:,.0f}/s "
                          f"p99 {fmt(result['p99_ms'], '.2f')} ms", flush=True)
                    results["cells"].append(result)
        if "floor" in fronts:
            results["cells"] += floor(args.gpus, params, 2 * seconds)
    except ChildFailed as e:
        print(f"a front did not start: {e}", file=sys.stderr)
        return 1
    finally:
        stop_all(started, directory)
    results.update(report(results["cells"]))
    results["wall_seconds"] = time.monotonic() - began
    write_results(results, args.json)
    # The last line says what was measured (the GPU check keeps it).
    top = [c for c in results["cells"] if c["front"] in ("gateway", "gateway-invariant")
           and c["concurrency"] == max(concurrency)]
    found = [f"{c['front']} {c['protocol']} c={c['concurrency']} {c['throughput']:,.0f}/s"
             for c in top]
    found += [f"floor {c['concurrency']} {c['throughput']:,.0f}/s"
              for c in results["cells"] if c["front"] == "floor"]
    print(f"\nserving: {len(results['cells'])} cells in {results['wall_seconds']:.0f} s; {'; '.join(found)}")
    return 0


def main_swap(args) -> int:
    """C{--swap}: one gateway, one protocol (the first of C{--protocols}),
    one concurrency (default 64), windows of C{--seconds} (default 5)."""
    stop_on_signals()
    concurrency = int((args.concurrency or "64").split(",")[0])
    protocol = args.protocols.split(",")[0]
    started: list[Front] = []
    directory = Path(tempfile.mkdtemp(prefix="kcoral-swap-"))
    try:
        model.save_params(directory / "params.npz", model.make_params())
        result = swap(directory, args.gpus, kcoral_batch_delay(args.max_batch_delay), protocol,
                      concurrency, args.seconds or 5.0, started)
    except ChildFailed as e:
        print(f"the gateway did not start: {e}", file=sys.stderr)
        return 1
    finally:
        stop_all(started, directory)
    results = {"command": command_line(), "machine": machine(), "swap": result}
    write_results(results, args.json)
    print(f"\nswap: {result['failed_requests']} failed requests, p99 during / before "
          f"{fmt(result['p99_ratio'], '.2f')}x, version 2 alone after "
          f"{fmt(result['swap_seconds'], '.1f')} s (within the window: {result['swap_within_window']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
