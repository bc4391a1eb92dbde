"""
Chaos run: two Routers, three CPU nodes that each report to both, and a load
generator whose clients know both Routers, while a fault injector on a
seeded schedule kills workers (SIGKILL), freezes them (SIGSTOP, later
SIGCONT), stops whole nodes with SIGTERM and starts them again, kills
supervisors (SIGKILL: their worker must drain and go by itself) and starts
them again, restarts a Router (SIGTERM, then a new Router on the same port),
kills a Router (SIGKILL, then a new one on the same port), and cuts a node
off from one Router (the forwarder on the path of its reports to that Router,
C{bench.peers.forwarder}, stopped with SIGSTOP, later SIGCONT). About a third of
the faults strike while the previous one is still in progress. A share of
the requests allow re-dispatch (C{Client(..., redispatch=True)}).

    .venv/bin/python -m bench.chaos                        # 5,000 requests, 60 faults
    .venv/bin/python -m bench.chaos --quick                # what `make test` runs
    .venv/bin/python -m bench.chaos --requests 3000 --faults 40 --seed 7

What it checks:

 - every request ends with exactly one answer: 200 with the correct outputs,
   502, or 503 (the client's C{ServerBusy}, after its own retries within
   C{busy_timeout}); a client timeout (queue timeout + run time + the longest
   fault) counts as *hung*, a connection closed without an answer as
   *dropped* (unless a Router was SIGKILLed while it was in flight: then it
   is a 502 of the client's own, the run's fate unknown); both are *lost*,
   and so is any other exception;
 - no 200 carries wrong data: every request has its own random inputs and
   outputs checked exactly (integers) or to float tolerance;
 - no request that allowed re-dispatch ends in a 502;
 - a 502 is *explained* only when the Router's log names the node that failed
   the request and a worker of that node died (killed by a signal) while the
   request was in flight, or when a Router was SIGKILLed while it was;
 - afterwards the pool is back to full capacity by itself, on both Routers,
   and each Router's memory (RSS) and open file descriptors are back near
   their level after warm-up.

It prints one table and exits 0 when lost, wrong and unexplained 502s are 0
and the pool and the Router recovered; 1 otherwise. C{tests/test_chaos.py}
runs C{run(Settings.quick())} from this module; C{doc/reliability.rst} keeps
the figures of the last full run.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

# The load generator only exports programs and checks results.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from bench.support.child import ChildFailed, KCoralChild

KILL, FREEZE, NODE_STOP, ROUTER_RESTART, SUPERVISOR_KILL, ROUTER_KILL, CUT = (
    "kill", "freeze", "node_stop", "router_restart", "supervisor_kill", "router_kill", "cut")
KINDS = (KILL, FREEZE, NODE_STOP, ROUTER_RESTART, SUPERVISOR_KILL, ROUTER_KILL, CUT)
#: Faults that stop a Router: one at a time, and none late in the run.
ROUTER_FAULTS = (ROUTER_RESTART, ROUTER_KILL)
#: How often each kind is drawn once every kind has had its turn.
WEIGHTS = {KILL: 0.25, FREEZE: 0.2, NODE_STOP: 0.1, ROUTER_RESTART: 0.1, SUPERVISOR_KILL: 0.1,
           ROUTER_KILL: 0.1, CUT: 0.15}
ROUTERS = ("router-a", "router-b")

LISTENING = re.compile(r"kcoral (?:router|server) listening on (https?://\S+)")
WORKER_STARTED = re.compile(r"worker0 started \(pid (\d+)\)")
WORKER_READY = re.compile(r"worker0 is ready at (\S+)")
WORKER_EXITED = re.compile(r"worker0 exited with (signal|status) (\d+)")
REGISTERED = re.compile(r"registered with the Router as ")
ROUTER_FAILED = re.compile(r"(\S+) failed on ([^/\s]+)/(\S+):")
FORWARDING = re.compile(r"forwarding 127\.0\.0\.1:(\d+) to ")
REDISPATCHED = re.compile(r"(\S+) re-dispatched \(")


@dataclasses.dataclass
class Settings:
    requests: int = 5000
    faults: int = 60
    seed: int = 1
    nodes: int = 3
    #: Routers, each of them reported to by every node (at most two).
    routers: int = 2
    #: Runs at once on each worker (the server's default).
    capacity: int = 2
    clients: int = 8
    #: The client's busy_timeout: how long it retries 503s and refused
    #: connections (a Router restart) before it gives up with ServerBusy.
    busy_timeout: float = 5.0
    #: The Router's --queue-wait-timeout-seconds.
    queue_timeout: float = 10.0
    #: Running times of the long programs (the short ones take milliseconds).
    long_seconds: tuple = (0.2, 0.5, 1.0)
    #: Steady load between one fault's recovery and the next fault.
    fault_gap: tuple = (1.0, 3.0)
    #: SIGSTOP to SIGCONT, alternately long (the supervisor, after 3 failed
    #: probes of up to 1 s and 1 s of termination grace, kills the worker)
    #: and short (the worker resumes before the supervisor acts).
    freeze_long: tuple = (6.0, 8.0)
    freeze_short: tuple = (0.5, 2.0)
    #: Chance that the next fault strikes before this one has recovered.
    overlap: float = 0.3
    #: How long a node is cut off from a Router: past the Router's
    #: --max-status-age-seconds and its unhealthy threshold, so it notices.
    cut_seconds: tuple = (3.0, 5.0)
    #: Share of the requests that allow re-dispatch.
    redispatch_share: float = 0.3
    #: A stopped node is started again after this long.
    node_down_seconds: tuple = (0.5, 2.0)
    #: A fault not recovered from in this long fails the run.
    recovery_timeout: float = 90.0
    #: Router RSS growth (MiB) and fd growth accepted after the run.
    rss_slack_mib: float = 30.0
    fd_slack: int = 10
    log_dir: str | None = None
    echo: bool = False

    @classmethod
    def quick(cls, **changes) -> Settings:
        """The `make test` run: every fault kind, about two minutes."""
        base = {"requests": 150, "faults": len(KINDS), "long_seconds": (0.2, 0.5),
                "fault_gap": (0.5, 1.5), "node_down_seconds": (0.3, 1.0)}
        base.update(changes)
        return cls(**base)

    @property
    def full_capacity(self) -> int:
        return self.nodes * self.capacity

    @property
    def client_timeout(self) -> float:
        """The longest a request may take before it counts as hung: the
        client's retries, the queue wait, the longest run (slowed down by a
        busy 2-core machine), a frozen worker and a draining Router."""
        return self.busy_timeout + self.queue_timeout + 4 * max(self.long_seconds) \
            + self.freeze_long[1] + 15.0

    def router_args(self, port: int) -> list[str]:
        return ["router", "--port", str(port),
                "--status-check-interval-seconds", "0.2", "--max-status-age-seconds", "2",
                "--unhealthy-threshold", "2", "--recovery-threshold", "1",
                "--queue-wait-timeout-seconds", str(self.queue_timeout),
                "--node-retention-seconds", "30"]

    def node_args(self, router_urls: list[str], node_id: str) -> list[str]:
        return ["server", "--router", ",".join(router_urls), "--node-id", node_id, "--port", "0",
                "--gpus", "none", "--capacity", str(self.capacity),
                "--health-interval-seconds", "0.5", "--health-timeout-seconds", "1",
                "--failure-threshold", "3", "--startup-grace-seconds", "8",
                "--termination-grace-seconds", "1", "--stable-reset-seconds", "10",
                "--restart-min-delay-seconds", "0.2", "--restart-max-delay-seconds", "2",
                "--restart-jitter", "0.1"]


# -- child processes -------------------------------------------------------------------

def free_port() -> int:
    """A free port below the ephemeral range, so that no outgoing
    connection takes it while the Router restarts."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def signal_pid(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def process_resources(pid: int) -> tuple[float, int] | None:
    """(RSS in MiB, open file descriptors) of C{pid}."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss / 1024.0, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


# -- the deployment ---------------------------------------------------------------------

class Deployment:
    """The Routers, the nodes and the forwarders between them, started and
    restarted by the injector."""

    def __init__(self, settings: Settings, log_dir: Path | None):
        self.settings = settings
        self.log_dir = log_dir
        self.names = ROUTERS[:settings.routers]
        self.ports = {name: free_port() for name in self.names}
        self.urls = [f"http://127.0.0.1:{self.ports[name]}" for name in self.names]
        #: The live (or last) Router of each name.
        self.router: dict[str, KCoralChild] = {}
        #: Every Router ever started, in order.
        self.routers: list[KCoralChild] = []
        self.node_children: dict[str, list[KCoralChild]] = {}
        self.node_ids = [f"node-{chr(ord('a') + i)}" for i in range(settings.nodes)]
        #: The forwarder on the path of each node's reports to each Router.
        self.forwarders: dict[tuple[str, str], KCoralChild] = {}
        self._starts = 0

    def _child(self, name: str, args: list[str], **kwargs) -> KCoralChild:
        self._starts += 1
        name = f"{self._starts:02d}-{name}"
        # Servers run with --gpus none; this process's JAX_PLATFORMS is its own.
        return KCoralChild(args, name=name, env={"JAX_PLATFORMS": None}, echo=self.settings.echo,
                           log=self.log_dir / f"{name}.log" if self.log_dir else None, **kwargs)

    def start_router(self, name: str) -> KCoralChild:
        child = self._child(name, self.settings.router_args(self.ports[name]))
        self.routers.append(child)
        child.wait_for(LISTENING, 60)
        self.router[name] = child
        return child

    def start(self) -> list[tuple[float, KCoralChild]]:
        """Start the Routers, the forwarders and the nodes, and wait for full
        capacity; returns when each Router started, and the Router."""
        started = [(time.monotonic(), self.start_router(name)) for name in self.names]
        self._start_forwarders()
        children = [self.start_node(node_id, wait=False) for node_id in self.node_ids]
        for node_id, child in zip(self.node_ids, children, strict=True):
            self.wait_node(node_id, child)
        if self.wait_full(60) is None:
            raise RuntimeError(f"the pool did not reach full capacity: {self.health()}")
        return started

    def _start_forwarders(self) -> None:
        for node_id in self.node_ids:
            for name in self.names:
                child = self._child(f"forward-{node_id}-{name}",
                                    ["0", str(self.ports[name])],
                                    program=("-m", "bench.peers.forwarder"))
                child.wait_for(FORWARDING, 30)
                self.forwarders[node_id, name] = child

    def node_urls(self, node_id: str) -> list[str]:
        """The Routers as the node reaches them: through its forwarders."""
        return [f"http://127.0.0.1:{self.forwarders[node_id, name].find(FORWARDING)[0][1].group(1)}"
                for name in self.names]

    def start_node(self, node_id: str, wait: bool = True) -> KCoralChild:
        child = self._child(node_id, self.settings.node_args(self.node_urls(node_id), node_id))
        self.node_children.setdefault(node_id, []).append(child)
        if wait:
            self.wait_node(node_id, child)
        return child

    def wait_node(self, node_id: str, child: KCoralChild) -> None:
        """Wait for the node's worker, and for each Router to have taken its report."""
        child.wait_for(WORKER_READY, 120)
        for url in self.node_urls(node_id):
            child.wait_for(re.compile(REGISTERED.pattern + rf".* at {re.escape(url)}"), 60)

    def node(self, node_id: str) -> KCoralChild:
        return self.node_children[node_id][-1]

    def worker_pid(self, node_id: str) -> int | None:
        started = self.node(node_id).find(WORKER_STARTED)
        return int(started[-1][1].group(1)) if started else None

    def get(self, name: str, path: str, timeout: float = 2.0) -> dict | None:
        """Router C{name}'s JSON answer to C{GET path}, or None when it does not answer."""
        conn = http.client.HTTPConnection("127.0.0.1", self.ports[name], timeout=timeout)
        try:
            conn.request("GET", path)
            return json.loads(conn.getresponse().read())
        except (OSError, ValueError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def health(self, timeout: float = 2.0) -> dict:
        """Each Router's C{/health} (None where it does not answer)."""
        return {name: self.get(name, "/health", timeout) for name in self.names}

    def pool_nodes(self, name: str = ROUTERS[0]) -> dict:
        """Router C{name}'s C{/v1/nodes}, by node id."""
        answer = self.get(name, "/v1/nodes") or {}
        return {node["node_id"]: node for node in answer.get("nodes", [])}

    def is_full(self) -> bool:
        """Whether every Router has every node ready, at full capacity."""
        return all(bool(h) and h.get("capacity") == self.settings.full_capacity
                   and h.get("nodes", {}).get("ready") == self.settings.nodes
                   for h in self.health().values())

    def wait_full(self, timeout: float) -> float | None:
        """The time the pool was first seen at full capacity, or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_full():
                return time.monotonic()
            time.sleep(0.1)
        return None

    def children(self) -> list[KCoralChild]:
        return self.routers + [c for cs in self.node_children.values() for c in cs]

    def stop_all(self, grace: float = 30.0) -> dict[str, int | None]:
        """SIGTERM every live supervisor, then the Routers, then the
        forwarders; SIGKILL what is left after C{grace}. Returns exit
        statuses by child name."""
        codes = {}
        live = [c for c in self.children() if c.running]
        nodes = [c for c in live if c not in self.routers]
        routers = [c for c in live if c in self.routers]
        forwarders = list(self.forwarders.values())
        for child in forwarders:
            # A forwarder a cut left stopped would never see its SIGTERM.
            child.signal(signal.SIGCONT)
        for group in (nodes, routers, forwarders):
            for child in group:
                child.signal(signal.SIGTERM)
            for child in group:
                codes[child.name] = child.wait(grace)
        for child in self.children() + forwarders:
            if child.running:
                child.signal(signal.SIGKILL)
                child.wait(10)
        # A worker whose supervisor was killed would outlive it.
        for cs in self.node_children.values():
            for child in cs:
                for _, match in child.find(WORKER_STARTED):
                    pid = int(match.group(1))
                    if pid_alive(pid):
                        signal_pid(pid, signal.SIGCONT)
                        signal_pid(pid, signal.SIGKILL)
        return codes


# -- programs and their expected outputs -------------------------------------------------

BLOB_ELEMENTS = 32 * 1024  # int32: 128 KiB, sent by digest once a worker holds it


class Workload:
    """Three programs with outputs checked against numpy (or a local JAX
    reference for the floating-point loop): short (microseconds), big (a
    128 KiB input that goes through the upload cache, so restarts and other
    nodes exercise the 409 resend) and long (a while loop of calibrated
    length)."""

    def __init__(self, long_seconds: tuple, mix: tuple = (0.65, 0.15, 0.2)):
        import jax
        import jax.numpy as jnp
        from jax import lax

        from kcoral import Program

        def short(a, b):
            return {"y": a @ b, "s": jnp.sum(a, dtype=jnp.int32)}

        def big(blob, v):
            return jnp.sum(blob, dtype=jnp.int32) + v, v * 2

        def long(n, x, v0):
            def body(carry):
                i, v = carry
                return i + 1, jnp.sin(v) * 0.5 + v * 0.5

            i, v = lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), v0))
            return {"x": x * 3 + 1, "v": v, "i": i}

        #: Shares of short, big and long requests.
        self.mix = mix
        self.a_shape, self.v_shape, self.x_shape = (16, 16), (4,), (8,)
        i32 = np.int32
        self.short = Program.from_function(short, np.zeros(self.a_shape, i32), np.zeros(16, i32))
        self.blob = np.random.default_rng(12345).integers(0, 100, BLOB_ELEMENTS, dtype=np.int32)
        self.blob_sum = np.int32(self.blob.sum())
        self.big = Program.from_function(big, self.blob, np.zeros(self.v_shape, i32))
        self.v0 = np.full(16, 0.75, np.float32)
        self.long = Program.from_function(long, np.int32(1), np.zeros(self.x_shape, i32), self.v0)
        # Calibrate the loop here, and compute its floating-point result once
        # per length with the same XLA the servers use.
        local = jax.jit(long)
        local(np.int32(10), np.zeros(self.x_shape, i32), self.v0)["v"].block_until_ready()
        probe = 1_000_000
        started = time.perf_counter()
        local(np.int32(probe), np.zeros(self.x_shape, i32), self.v0)["v"].block_until_ready()
        per_iteration = max((time.perf_counter() - started) / probe, 1e-9)
        self.long_n = [int(s / per_iteration) for s in long_seconds]
        self.long_v = {n: np.asarray(local(np.int32(n), np.zeros(self.x_shape, i32), self.v0)["v"])
                       for n in self.long_n}

    def request(self, rng: np.random.Generator):
        """(kind, program, args, check) for one request; check(outputs)
        returns None when they are right, else what is wrong."""
        draw = rng.random() * sum(self.mix)
        if draw < self.mix[0]:
            a = rng.integers(-50, 50, self.a_shape, dtype=np.int32)
            b = rng.integers(-50, 50, 16, dtype=np.int32)
            want = {"y": a @ b, "s": np.int32(a.sum())}
            return "short", self.short, (a, b), lambda out: mismatch(out, want)
        if draw < self.mix[0] + self.mix[1]:
            v = rng.integers(-1000, 1000, self.v_shape, dtype=np.int32)
            want = (self.blob_sum + v, v * 2)
            return "big", self.big, (self.blob, v), lambda out: mismatch(out, want)
        n = self.long_n[int(rng.integers(len(self.long_n)))]
        x = rng.integers(-1000, 1000, self.x_shape, dtype=np.int32)
        want = {"x": x * 3 + 1, "v": self.long_v[n], "i": np.int32(n)}
        return "long", self.long, (np.int32(n), x, self.v0), lambda out: mismatch(out, want)


def mismatch(got, want, path="outputs") -> str | None:
    """Where C{got}, an answer's outputs, is not C{want} (the first place, named
    by its C{path}), or None: integers exactly, floats to a tolerance."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{path}: {type(got).__name__} with keys {sorted(got) if isinstance(got, dict) else '-'}"
        for key in want:
            problem = mismatch(got[key], want[key], f"{path}[{key!r}]")
            if problem:
                return problem
        return None
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"{path}: {type(got).__name__} instead of {len(want)} items"
        for i, (g, w) in enumerate(zip(got, want)):
            problem = mismatch(g, w, f"{path}[{i}]")
            if problem:
                return problem
        return None
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{path}: {got.dtype}{got.shape} instead of {want.dtype}{want.shape}"
    same = np.array_equal(got, want) if want.dtype.kind in "iub" else \
        np.allclose(got, want, rtol=1e-5, atol=1e-6)
    return None if same else f"{path}: wrong values"


# -- the load generator -----------------------------------------------------------------

@dataclasses.dataclass
class Record:
    index: int
    request_id: str
    kind: str
    start: float
    end: float = 0.0
    #: ok, wrong, 502, 503, dropped, hung or error.
    outcome: str = ""
    #: 503 reason, error type, what was wrong.
    detail: str = ""
    #: Whether the request allowed re-dispatch.
    redispatch: bool = False


class Pacer:
    """Spreads the requests over the injector's run: each request is due
    after an interval of (time the injector still needs) / (requests left);
    once the injector is done, the rest go as fast as the clients can."""

    def __init__(self, total: int, injector: Injector | None = None):
        self.total = total
        self.injector = injector
        self._next = 0
        self._due = time.monotonic()
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            if self._next >= self.total:
                return None
            index = self._next
            self._next += 1
            now = time.monotonic()
            if self.injector is None or self.injector.finished:
                due = now
            else:
                left = max(self.injector.expected_end() - now, 0.5)
                self._due = max(self._due, now - 1.0) + left / (self.total - index)
                due = self._due
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return index


class Load:
    def __init__(self, deployment: Deployment, workload: Workload, settings: Settings,
                 pacer: Pacer):
        self.deployment = deployment
        self.workload = workload
        self.settings = settings
        self.pacer = pacer
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), name=f"client-{i}",
                                         daemon=True) for i in range(settings.clients)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def client_options(self) -> dict:
        """What each Client is made with besides its URLs and timeouts."""
        return {}

    def join(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self.threads:
            thread.join(None if deadline is None else max(deadline - time.monotonic(), 0))
        return not any(t.is_alive() for t in self.threads)

    def _client(self, index: int) -> None:
        from kcoral import Client

        # Every client knows both Routers; half of them start with each.
        urls = self.deployment.urls[index % 2:] + self.deployment.urls[:index % 2]
        clients = [Client(urls, busy_timeout=self.settings.busy_timeout,
                          timeout=self.settings.client_timeout, redispatch=redispatch,
                          **self.client_options())
                   for redispatch in (False, True)]
        try:
            while (i := self.pacer.take()) is not None:
                record = self._one(clients, i)
                with self._lock:
                    self.records.append(record)
        finally:
            for client in clients:
                client.close()

    def _one(self, clients: list, index: int) -> Record:
        from kcoral import KCoralError, NodeFailure, ServerBusy

        rng = np.random.default_rng([self.settings.seed, index])
        kind, program, args, check = self.workload.request(rng)
        redispatch = bool(rng.random() < self.settings.redispatch_share)
        client = clients[redispatch]
        record = Record(index, f"chaos-{self.settings.seed}-{index}", kind, time.monotonic(),
                        redispatch=redispatch)
        try:
            outputs = client.run(program, *args, request_id=record.request_id)
        except NodeFailure as e:
            # A 502 answer carries the service's request id; the client's own
            # NodeFailure (the connection closed with no answer) does not.
            record.outcome = "502" if e.request_id else "dropped"
            record.detail = e.message
        except ServerBusy as e:
            record.outcome, record.detail = "503", e.reason or "busy"
        except TimeoutError as e:
            record.outcome, record.detail = "hung", str(e)
        except KCoralError as e:
            record.outcome, record.detail = "error", f"{e.status} {e.type}: {e.message}"
        except Exception as e:
            record.outcome, record.detail = "error", f"{e.__class__.__name__}: {e}"
        else:
            problem = check(outputs)
            record.outcome, record.detail = ("wrong", problem) if problem else ("ok", "")
        record.end = time.monotonic()
        return record


# -- the fault injector ------------------------------------------------------------------

@dataclasses.dataclass
class Fault:
    index: int
    kind: str
    target: str
    start: float = 0.0
    #: When the target was back (full capacity again).
    back: float | None = None
    #: When its target alone was back, whatever other faults in progress
    #: did (C{bench.netfaults}'s faults between hosts).
    target_back: float | None = None
    #: Worker pid for kill/freeze; exit status for node_stop/router_restart.
    pid: int | None = None
    exit_code: int | None = None
    #: For freeze: whether the supervisor killed the frozen worker; for
    #: cut: whether the Router it was cut off from stopped sending it work.
    killed: bool = False
    #: For cut: the Router the node was cut off from.
    router: str = ""
    #: Drain time of a SIGTERMed node or Router; freeze length.
    seconds: float = 0.0
    problem: str = ""
    #: Whether another fault was in progress at some point of this one.
    overlapped: bool = False
    rng: random.Random = dataclasses.field(default=None, repr=False)

    @property
    def recovery(self) -> float | None:
        return None if self.back is None else self.back - self.start


def fault_plan(count: int, rng: random.Random, every: tuple = KINDS,
               weights: dict | None = None) -> list[str]:
    """Every kind of C{every} once (in a seeded order) when there are at least as many
    faults as kinds, the rest drawn by C{weights} (default L{WEIGHTS}); no Router restart
    or kill in the last third, so the Routers measured at the end have lived through
    other faults."""
    weights = WEIGHTS if weights is None else weights
    kinds = list(every) if count >= len(every) else []
    rng.shuffle(kinds)
    kinds += rng.choices(list(weights), weights=list(weights.values()), k=count - len(kinds))
    kinds = kinds[:count]
    last_third = count - count // 3
    for i in range(last_third, count):
        if kinds[i] in ROUTER_FAULTS:
            swaps = [j for j in range(last_third) if kinds[j] not in ROUTER_FAULTS]
            if swaps:
                j = rng.choice(swaps)
                kinds[i], kinds[j] = kinds[j], kinds[i]
    return kinds


class Injector:
    def __init__(self, deployment: Deployment, settings: Settings):
        self.deployment = deployment
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.plan = fault_plan(settings.faults, self.rng)
        self.faults: list[Fault] = []
        self.finished = False
        self.failed: str | None = None
        self.started = time.monotonic()
        #: Seconds a fault takes, lead-in and gap included, until measured.
        self._guess = 8.0
        self.router_starts: list[tuple[float, KCoralChild]] = []
        self.thread = threading.Thread(target=self._run, name="injector", daemon=True)

    def expected_end(self) -> float:
        now = time.monotonic()
        done = len([f for f in self.faults if f.back is not None])
        per_fault = (now - self.started) / done if done else self._guess
        return now + (len(self.plan) - done) * per_fault + 3.0

    def _run(self) -> None:
        settings, rng = self.settings, self.rng
        running: dict[str, threading.Thread] = {}
        try:
            time.sleep(rng.uniform(*settings.fault_gap) + 1.0)
            freezes = 0
            for index, kind in enumerate(self.plan):
                target = self._target(kind, running)
                fault = Fault(index, kind, target)
                fault.rng = random.Random(rng.random())
                if kind == FREEZE:
                    # Alternately a freeze the supervisor must end (longer
                    # than its probes' patience) and one that ends before it
                    # notices.
                    freezes += 1
                    fault.seconds = rng.uniform(*(settings.freeze_long if freezes % 2
                                                  else settings.freeze_short))
                overlap = index + 1 < len(self.plan) and rng.random() < settings.overlap
                fault.overlapped = overlap or any(t.is_alive() for t in running.values())
                self.faults.append(fault)
                thread = threading.Thread(target=self._inject, args=(fault,),
                                          name=f"fault-{index}", daemon=True)
                running[target] = thread
                thread.start()
                if overlap:
                    # The next fault strikes while this one is in progress.
                    time.sleep(rng.uniform(0.2, 1.5))
                    continue
                for thread in running.values():
                    thread.join()
                if self.failed:
                    return
                time.sleep(rng.uniform(*settings.fault_gap))
            for thread in running.values():
                thread.join()
        except Exception as e:
            self.failed = f"the injector failed: {e.__class__.__name__}: {e}"
        finally:
            self.finished = True

    def _target(self, kind: str, running: dict) -> str:
        """A target no fault in progress holds (waiting for one if need be)."""
        while True:
            busy = {target for target, thread in running.items() if thread.is_alive()}
            if kind in ROUTER_FAULTS:
                # One Router at a time: the other serves meanwhile.
                names = self.deployment.names
                free = [] if busy & set(names) else list(names)
            else:
                free = [n for n in self.deployment.node_ids if n not in busy]
            if free:
                return self.rng.choice(free)
            for thread in list(running.values()):
                thread.join()

    def _inject(self, fault: Fault) -> None:
        try:
            getattr(self, f"_{fault.kind}")(fault)
        except Exception as e:
            fault.problem = f"{e.__class__.__name__}: {e}"
        if fault.back is None and not self.failed:
            self.failed = (f"fault {fault.index} ({fault.kind} {fault.target}) did not recover: "
                           f"{fault.problem}")

    def _wait_back(self, fault: Fault, child: KCoralChild, since: int) -> None:
        """Back: the node logged a new ready worker (when its worker was
        replaced) and the pool has its full capacity again."""
        timeout = self.settings.recovery_timeout
        exits = child.find_indexed(WORKER_EXITED, since)
        if exits:
            try:
                child.wait_for(WORKER_READY, timeout, exits[-1][0] + 1)
            except ChildFailed as e:
                fault.problem = str(e)
                return
        self._await_full_capacity(fault)

    def _signal_worker(self, fault: Fault, sig: int) -> tuple[KCoralChild, int]:
        """Send C{sig} to the target's worker: its node and the mark of its
        output before."""
        d = self.deployment
        child = d.node(fault.target)
        since = child.mark()
        fault.pid = d.worker_pid(fault.target)
        fault.start = time.monotonic()
        signal_pid(fault.pid, sig)
        return child, since

    def _kill(self, fault: Fault) -> None:
        child, since = self._signal_worker(fault, signal.SIGKILL)
        try:
            child.wait_for(WORKER_EXITED, 30, since)
        except ChildFailed as e:
            fault.problem = str(e)
            return
        self._wait_back(fault, child, since)

    def _freeze(self, fault: Fault) -> None:
        child, since = self._signal_worker(fault, signal.SIGSTOP)
        time.sleep(fault.seconds)
        signal_pid(fault.pid, signal.SIGCONT)
        # The supervisor may be about to kill it (SIGTERM pending, SIGKILL
        # after the grace): give that a moment to show.
        try:
            child.wait_for(WORKER_EXITED, 1.5, since)
            fault.killed = True
        except ChildFailed:
            fault.killed = False
        self._wait_back(fault, child, since)

    def _node_stop(self, fault: Fault) -> None:
        d = self.deployment
        child = d.node(fault.target)
        fault.start = time.monotonic()
        child.signal(signal.SIGTERM)
        fault.exit_code = child.wait(60)
        fault.seconds = time.monotonic() - fault.start
        if fault.exit_code is None:
            fault.problem = "the node did not exit within 60 s of SIGTERM"
            return
        self._start_node_again(fault)

    def _supervisor_kill(self, fault: Fault) -> None:
        """SIGKILL the supervisor: its worker must drain and exit by itself
        (an orphan would keep its port and device), and a new supervisor
        takes the node id over once the old one's reports are stale."""
        d = self.deployment
        child = d.node(fault.target)
        fault.pid = d.worker_pid(fault.target)
        fault.start = time.monotonic()
        child.signal(signal.SIGKILL)
        child.wait(30)
        deadline = time.monotonic() + 60
        while pid_alive(fault.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        fault.seconds = time.monotonic() - fault.start
        if pid_alive(fault.pid):
            fault.problem = f"worker {fault.pid} outlived its supervisor by 60 s"
            return
        self._start_node_again(fault)

    def _router_restart(self, fault: Fault) -> None:
        d = self.deployment
        fault.start = time.monotonic()
        d.router[fault.target].signal(signal.SIGTERM)
        fault.exit_code = d.router[fault.target].wait(60)
        fault.seconds = time.monotonic() - fault.start
        if fault.exit_code is None:
            fault.problem = "the Router did not exit within 60 s of SIGTERM"
            return
        self._start_router_again(fault)

    def _router_kill(self, fault: Fault) -> None:
        """SIGKILL a Router: its clients go on with the other one; after a
        pause, a new one on the same port, which the nodes find by themselves."""
        d = self.deployment
        fault.start = time.monotonic()
        d.router[fault.target].signal(signal.SIGKILL)
        fault.exit_code = d.router[fault.target].wait(30)
        time.sleep(fault.rng.uniform(*self.settings.node_down_seconds))
        self._start_router_again(fault)

    def _start_router_again(self, fault: Fault) -> None:
        try:
            child = self.deployment.start_router(fault.target)
        except ChildFailed as e:
            fault.problem = str(e)
            return
        self.router_starts.append((time.monotonic(), child))
        self._await_full_capacity(fault)

    def _cut(self, fault: Fault) -> None:
        """Cut the node off from one Router: the forwarder its reports to
        that Router pass through stops passing bytes (SIGSTOP), for longer
        than that Router takes to stop sending it work; then SIGCONT."""
        d = self.deployment
        router = fault.rng.choice(d.names)
        forwarder = d.forwarders[fault.target, router]
        watched = d.router[router]
        since = watched.mark()
        fault.start = time.monotonic()
        fault.seconds = fault.rng.uniform(*self.settings.cut_seconds)
        forwarder.signal(signal.SIGSTOP)
        time.sleep(fault.seconds)
        forwarder.signal(signal.SIGCONT)
        # Whether the Router noticed (the node left ready there); the other
        # Router sent it work all along.
        fault.router = router
        fault.killed = bool(watched.find(rf"node {fault.target}: ready -> ", since))
        self._await_full_capacity(fault)

    def _start_node_again(self, fault: Fault) -> None:
        """After a pause, a new node with the stopped one's id; then full capacity."""
        time.sleep(fault.rng.uniform(*self.settings.node_down_seconds))
        try:
            self.deployment.start_node(fault.target)
        except ChildFailed as e:
            fault.problem = str(e)
            return
        self._await_full_capacity(fault)

    def _await_full_capacity(self, fault: Fault) -> None:
        d, timeout = self.deployment, self.settings.recovery_timeout
        fault.back = d.wait_full(timeout)
        if fault.back is None:
            fault.problem = f"capacity not back within {timeout} s: {d.health()}"


class ResourceMonitor:
    """Samples the current Routers' RSS and open fds twice a second."""

    def __init__(self, deployment: Deployment):
        self.deployment = deployment
        self.samples: list[tuple[float, int, float, int]] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="resources", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for router in list(self.deployment.router.values()):
                if router.running:
                    sample = process_resources(router.pid)
                    if sample:
                        self.samples.append((time.monotonic(), router.pid, *sample))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()

    def baseline(self, pid: int, after: float) -> tuple[float, int] | None:
        """The first sample of Router C{pid} taken after C{after}."""
        for t, p, rss, fds in self.samples:
            if p == pid and t >= after:
                return rss, fds
        return None


# -- the run ------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    settings: Settings
    records: list[Record]
    faults: list[Fault]
    deaths: list[tuple[float, str, str]]
    failed_on: dict[str, str]
    elapsed: float = 0.0
    t0: float = 0.0
    final_recovery: float | None = None
    resources: dict = dataclasses.field(default_factory=dict)
    exit_codes: dict = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)
    #: Runs a Router sent again after the loss of their node.
    redispatched: int = 0
    #: (start, end, node) of each fault that cut a node off, or froze it,
    #: without killing anything: a 502 in flight meanwhile is explained too.
    outages: list[tuple[float, float, str]] = dataclasses.field(default_factory=list)

    def by_outcome(self, outcome: str) -> list[Record]:
        return [r for r in self.records if r.outcome == outcome]

    def unexplained_502(self) -> list[Record]:
        """502s with no death of a worker of the node that failed them (or
        of a Router), nor an outage of that node, while they were in flight
        (1 s of slack for log lines to arrive)."""
        bad = []
        for r in self.by_outcome("502"):
            node = self.failed_on.get(r.request_id)
            if not any((node is None or n == node) and r.start - 1.0 <= t <= r.end + 1.0
                       for t, n, _ in self.deaths) and \
                    not any((node is None or n == node) and start <= r.end + 1.0
                            and r.start - 1.0 <= end for start, end, n in self.outages):
                bad.append(r)
        return bad

    @property
    def lost(self) -> list[Record]:
        """Requests without one valid answer; every index once."""
        seen = {r.index for r in self.records}
        missing = [Record(i, "", "", 0.0, outcome="missing")
                   for i in range(self.settings.requests) if i not in seen]
        return missing + [r for r in self.records if r.outcome in ("hung", "dropped", "error")]

    @property
    def wrong(self) -> list[Record]:
        return self.by_outcome("wrong")

    @property
    def redispatch_502(self) -> list[Record]:
        """502s of requests that allowed re-dispatch: there should be none."""
        return [r for r in self.by_outcome("502") if r.redispatch]

    def failures(self) -> list[str]:
        """The name of each check the run failed, none when it passed."""
        checks = {"lost": self.lost, "wrong": self.wrong, "unexplained 502": self.unexplained_502(),
                  "re-dispatched 502": self.redispatch_502, "problems": self.problems}
        return [name for name, failed in checks.items() if failed]

    @property
    def ok(self) -> bool:
        return not self.failures()


def run(settings: Settings, deployment_class: Callable[..., Deployment] = Deployment,
        injector_class: Callable[..., Injector] = Injector,
        load_class: Callable[..., Load] = Load, workload: Workload | None = None) -> Result:
    """The run of C{settings}; C{bench.netfaults} gives its own
    deployment, injector, load and workload (default: this module's)."""
    log_dir = Path(settings.log_dir) if settings.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    workload = workload or Workload(settings.long_seconds)
    d = deployment_class(settings, log_dir)
    problems: list[str] = []
    monitor = ResourceMonitor(d)
    injector = None
    load = None
    final_recovery = None
    resources: dict = {}
    exit_codes: dict = {}
    try:
        first = d.start()
        monitor.thread.start()
        injector = injector_class(d, settings)
        injector.router_starts.extend(first)
        load = load_class(d, workload, settings, Pacer(settings.requests, injector))
        injector.thread.start()
        load.start()
        injector.thread.join()
        if injector.failed:
            problems.append(injector.failed)
        if not load.join(settings.client_timeout * (settings.requests / settings.clients + 2)):
            problems.append("the load generator did not finish")
        load_end = max((r.end for r in load.records), default=time.monotonic())
        full = d.wait_full(settings.recovery_timeout)
        if full is None:
            problems.append(f"the pool did not recover full capacity: {d.health()}")
        else:
            final_recovery = max(full - load_end, 0.0)
        # Let closed client connections and idle pooled ones settle.
        time.sleep(2.0)
        for name, router in d.router.items():
            start_time, _ = next((t, c) for t, c in reversed(injector.router_starts)
                                 if c is router)
            base = monitor.baseline(router.pid, start_time + 5.0)
            end = process_resources(router.pid)
            if not (base and end):
                problems.append(f"no {name} resource baseline (the last one ran under 5 s)")
                continue
            resources[name] = {
                "rss_base": base[0], "rss_end": end[0], "fds_base": base[1], "fds_end": end[1],
                "rss_peak": max(s[2] for s in monitor.samples if s[1] == router.pid),
                "fds_peak": max(s[3] for s in monitor.samples if s[1] == router.pid)}
            if end[0] - base[0] > settings.rss_slack_mib:
                problems.append(f"{name} RSS grew from {base[0]:.1f} to {end[0]:.1f} MiB")
            if end[1] - base[1] > settings.fd_slack:
                problems.append(f"{name} fds grew from {base[1]} to {end[1]}")
    finally:
        monitor._stop.set()
        if load is not None:
            load.join(5)
        exit_codes = d.stop_all()
    deaths = []
    for node_id, children in d.node_children.items():
        for child in children:
            for t, match in child.find(WORKER_EXITED):
                if match.group(1) == "signal" or match.group(2) != "0":
                    deaths.append((t, node_id, match.group(0)))
    records = load.records if load else []
    for fault in injector.faults if injector else []:
        if fault.kind == ROUTER_KILL:
            deaths.append((fault.start, fault.target, "SIGKILL"))
            # A run in flight there lost its connection with no answer: a
            # 502 of the client's own (it may have run), not a lost run.
            for r in records:
                if r.outcome == "dropped" and r.start - 1.0 <= fault.start <= r.end + 1.0:
                    r.outcome, r.detail = "502", f"{fault.target} killed: {r.detail}"
    failed_on = {}
    for router in d.routers:
        for _, match in router.find(ROUTER_FAILED):
            failed_on[match.group(1)] = match.group(2)
    redispatched = sum(len(router.find(REDISPATCHED)) for router in d.routers)
    result = Result(settings, sorted(records, key=lambda r: r.index),
                    injector.faults if injector else [], sorted(deaths), failed_on,
                    elapsed=time.monotonic() - began, t0=began, final_recovery=final_recovery,
                    resources=resources, exit_codes=exit_codes, problems=problems,
                    redispatched=redispatched)
    for fault in result.faults:
        if fault.kind in (NODE_STOP, ROUTER_RESTART) and fault.exit_code not in (0, None):
            problems.append(f"fault {fault.index}: {fault.kind} {fault.target} exited "
                            f"{fault.exit_code} after SIGTERM")
    for name, code in exit_codes.items():
        if code != 0:
            problems.append(f"{name} exited {code} at the end of the run")
    return result


# -- the table ----------------------------------------------------------------------------

def seconds_summary(values: list[float]) -> str:
    """A table cell: the median and the longest of C{values}, in seconds."""
    if not values:
        return "-"
    return f"median {statistics.median(values):.1f} s, max {max(values):.1f} s"


def table(result: Result) -> str:
    s = result.settings
    rows: list[tuple[str, str]] = []
    records = result.records
    rows.append(("requests", (f"{len(records)} of {s.requests} "
                              f"({sum(r.kind == 'short' for r in records)} short, "
                              f"{sum(r.kind == 'big' for r in records)} big, "
                              f"{sum(r.kind == 'long' for r in records)} long), {s.clients} clients")))
    rows.append(("200 correct", str(len(result.by_outcome("ok")))))
    asked = [r for r in records if r.redispatch]
    rows.append(("re-dispatch allowed", (f"{len(asked)} requests, "
                                        f"{sum(r.outcome == 'ok' for r in asked)} correct 200s, "
                                        f"{len(result.redispatch_502)} 502s; "
                                        f"{result.redispatched} runs sent again by a Router")))
    rows.append(("502", f"{len(result.by_outcome('502'))} (unexplained: {len(result.unexplained_502())})"))
    busy = result.by_outcome("503")
    reasons: dict[str, int] = {}
    for r in busy:
        reasons[r.detail] = reasons.get(r.detail, 0) + 1
    rows.append(("503", f"{len(busy)}" + (" (" + ", ".join(
        f"{k} {v}" for k, v in sorted(reasons.items())) + ")" if reasons else "")))
    lost = result.lost
    rows.append(("lost", f"{len(lost)}" + (" (" + ", ".join(
        f"{o} {sum(r.outcome == o for r in lost)}" for o in sorted({r.outcome for r in lost}))
        + ")" if lost else "")))
    rows.append(("wrong", str(len(result.wrong))))
    faults = result.faults
    for kind in KINDS:
        of_kind = [f for f in faults if f.kind == kind]
        extra = ""
        if kind == FREEZE and of_kind:
            extra = f", {sum(f.killed for f in of_kind)} ended by the supervisor"
        if kind in (NODE_STOP, ROUTER_RESTART) and of_kind:
            extra = f", drain {seconds_summary([f.seconds for f in of_kind])}"
        if kind == CUT and of_kind:
            extra = (f", {seconds_summary([f.seconds for f in of_kind])} each, "
                     f"{sum(f.killed for f in of_kind)} noticed by that Router")
        if kind == SUPERVISOR_KILL and of_kind:
            extra = f", orphaned worker drained and gone {seconds_summary([f.seconds for f in of_kind])}"
        rows.append((f"faults: {kind}", f"{len(of_kind)}{extra}"))
        rows.append((f"  recovery after {kind}", seconds_summary([f.recovery for f in of_kind
                                                           if f.recovery is not None])))
    rows.append(("faults injected",
                 f"{len(faults)} of {s.faults}, {sum(f.overlapped for f in faults)} overlapping another"))
    rows.append(("worker deaths", str(len(result.deaths))))
    rows.append(("pool at full capacity after the run",
                 "no" if result.final_recovery is None
                 else f"yes, {result.final_recovery:.1f} s after the last answer"))
    for name, res in result.resources.items():
        rows.append((f"{name} RSS", (f"{res['rss_base']:.1f} MiB after warm-up, peak "
                                     f"{res['rss_peak']:.1f}, end {res['rss_end']:.1f}")))
        rows.append((f"{name} open fds", (f"{res['fds_base']} after warm-up, peak "
                                          f"{res['fds_peak']}, end {res['fds_end']}")))
    done = [r for r in records if r.outcome == "ok"]
    if done:
        latency = sorted(r.end - r.start for r in done)
        rows.append(("200 latency", f"median {statistics.median(latency):.2f} s, max {latency[-1]:.2f} s"))
    rows.append(("elapsed", f"{result.elapsed:.0f} s (seed {s.seed})"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for problem in result.problems:
        lines.append(f"PROBLEM: {problem}")
    for r in (lost + result.wrong + result.unexplained_502() + result.redispatch_502)[:20]:
        lines.append(f"  {r.outcome} #{r.index} {r.kind} {r.request_id} "
                     f"[{r.start - result.t0:.1f} s, {r.end - result.t0:.1f} s] {r.detail}")
    lines.append("verdict: " + ("OK" if result.ok else "FAILED"))
    return "\n".join(lines)


def arguments(description: str) -> argparse.ArgumentParser:
    """The options of a run of faults beside its sizes: its seed, the quick
    run, where the children's logs go and whether their output is shown."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault schedule and inputs")
    parser.add_argument("--quick", action="store_true", help="the short run the test suite makes")
    parser.add_argument("--log-dir", help="keep every child's log here")
    parser.add_argument("--echo", action="store_true", help="print the children's output")
    return parser


def report(args: argparse.Namespace, settings_type: type[Settings], sizes: dict,
           run: Callable, table: Callable, prefix: str) -> int:
    """Run C{settings_type} with the C{sizes} given (those not None) and
    C{args}, print its C{table}, keep its logs when it failed, and return
    the exit status: 0 when every check passed."""
    changes = {k: v for k, v in sizes.items() if v is not None}
    changes.update(seed=args.seed, echo=args.echo)
    if args.log_dir:
        changes["log_dir"] = args.log_dir
    settings = settings_type.quick(**changes) if args.quick else settings_type(**changes)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        if not settings.log_dir:
            settings.log_dir = tmp
        outcome = run(settings)
        print(table(outcome))
        if not outcome.ok and settings.log_dir == tmp:
            keep = Path(tempfile.mkdtemp(prefix=prefix + "logs-"))
            for path in Path(tmp).iterdir():
                (keep / path.name).write_bytes(path.read_bytes())
            print(f"logs kept in {keep}")
    return 0 if outcome.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, help="requests to send (default 5000, quick 150)")
    parser.add_argument("--faults", type=int, help="faults to inject (default 60, quick 7)")
    parser.add_argument("--clients", type=int, help="client threads (default 8)")
    args = parser.parse_args(argv)
    return report(args, Settings, {"requests": args.requests, "faults": args.faults,
                                   "clients": args.clients}, run, table, "kcoral-chaos-")

if __name__ == "__main__":
    sys.exit(main())
