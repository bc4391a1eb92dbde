"""
Faults between hosts: the chaos run (C{bench.chaos}) with every process on
a host of its own. Two Routers, three CPU nodes (each reporting to both) and
the clients (who know both Routers) sit on six test hosts
(C{bench.support.hosts}: network namespaces with their own addresses, joined by
a bridge), speaking TLS between hosts with a node token and a client token,
as the deployment guide recommends beyond one machine. On a seeded
schedule, overlapping a third of the time, the injector

 - cuts a node off from one Router (both directions dropped: its reports
   there stop, and so does what that Router sent it), ``cut_one``;
 - cuts a node off from everyone (its link down), ``isolate``;
 - cuts a Router off from its clients (it still reaches its nodes),
   ``cut_clients``;
 - makes a node's link to one Router half-open: every packet one way is
   dropped, with no reset, ``half_open``;
 - freezes a node's host (SIGSTOP on every process there: its kernel still
   answers TCP), ``freeze_host``;
 - and strikes as the chaos run does: a worker killed or frozen, a node
   stopped and started again, a supervisor killed, a Router restarted or
   killed.

    .venv/bin/python -m bench.netfaults                      # 3,000 requests, 40 faults
    .venv/bin/python -m bench.netfaults --quick              # what `make test` runs
    .venv/bin/python -m bench.netfaults --requests 3000 --faults 40 --seed 7

It checks what the chaos run checks (one correct answer, or an explained 502
or 503, per request; no wrong bytes; no 502 for a request that allowed
re-dispatch; the pool back to full capacity by itself on both Routers; the
Routers' memory and descriptors back near their level) and:

 - no request takes longer than L{NetSettings.hang_bound}, the bound
   ``doc/operations.rst`` states as a formula of the options (queue wait,
   running time, and the longest a silent peer goes unnoticed: the
   keepalive's bound, or C{--silent-node-seconds} for a frozen host);
 - after each network fault heals, both Routers have the node it struck
   ready at its full capacity again (a Router cut off: answering again)
   within L{NetSettings.recovery_bound} (the node's next report after its
   retry backoff, and the Routers' recovery checks), whatever other faults
   in progress do;
 - one long run, sent first on a node and Router that no fault touches
   while it runs, is answered 200 however long its program runs with
   nothing crossing its connections (L{NetSettings.long_hold}).

A 502 is explained by a worker's death or a Router's as in the chaos run, or
by a network fault of the node that failed it while it was in flight; a run
in flight when its Router was cut off from its clients, or killed, is the
client's own 502 (its connection went silent, or closed, without an answer).
Needs root (network namespaces); exits 0 when every check holds, 1
otherwise. C{tests/test_netfaults.py} runs the quick one.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import random
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import chaos
from bench.chaos import KILL, NODE_STOP, ROUTER_FAULTS, SUPERVISOR_KILL, Fault, Result
from bench.support.child import KCoralChild
from bench.support.hosts import Hosts
from tests.tlsutil import TestCA

CUT_ONE, ISOLATE, CUT_CLIENTS, HALF_OPEN, FREEZE_HOST = (
    "cut_one", "isolate", "cut_clients", "half_open", "freeze_host")
NETWORK_KINDS = (CUT_ONE, ISOLATE, CUT_CLIENTS, HALF_OPEN, FREEZE_HOST)
#: The chaos run's faults, but its cut (a forwarder stopped on loopback):
#: the network faults cut for real.
PROCESS_KINDS = tuple(k for k in chaos.KINDS if k != chaos.CUT)
KINDS = NETWORK_KINDS + PROCESS_KINDS
WEIGHTS = {CUT_ONE: 0.12, ISOLATE: 0.1, CUT_CLIENTS: 0.08, HALF_OPEN: 0.1, FREEZE_HOST: 0.1,
           KILL: 0.14, chaos.FREEZE: 0.1, NODE_STOP: 0.06, SUPERVISOR_KILL: 0.06,
           chaos.ROUTER_RESTART: 0.07, chaos.ROUTER_KILL: 0.07}
#: Faults that hold a Router: one at a time, so that clients always have one.
HOLDS_A_ROUTER = (*ROUTER_FAULTS, CUT_CLIENTS)
CLIENTS = "clients"
NODE_TOKEN = "netfaults-node-token"
CLIENT_TOKEN = "netfaults-client-token"
PORT, NODE_PORT = 9000, 8000


@dataclasses.dataclass
class NetSettings(chaos.Settings):
    requests: int = 3000
    faults: int = 40
    #: How long a network fault lasts: past the Routers' notice (status age
    #: and thresholds), and some past the keepalive's bound.
    cut_seconds: tuple = (3.0, 8.0)
    #: A frozen host, alternately past --silent-node-seconds and within it.
    freeze_host_long: tuple = (7.0, 9.0)
    freeze_host_short: tuple = (1.0, 3.0)
    #: The Routers' --keepalive-* and --silent-node-seconds.
    keepalive: tuple = (2, 1, 3)
    silent_node_seconds: float = 6.0
    #: Health interval and timeout of the nodes (their reports' period, and
    #: each report's timeout), the Routers' status checks and thresholds.
    health_interval: float = 0.5
    status_interval: float = 0.2
    recovery_threshold: int = 1
    #: The long run: its program's running time, sent first.
    long_hold: float = 300.0
    #: Slack for a busy two-core machine, on each stated bound.
    slack: float = 5.0

    @classmethod
    def quick(cls, **changes) -> NetSettings:
        """The `make test` run: every fault kind once, a one-minute long run."""
        base = {"requests": 150, "faults": len(KINDS), "long_seconds": (0.2, 0.5),
                "fault_gap": (0.5, 1.5), "node_down_seconds": (0.3, 1.0), "long_hold": 60.0}
        base.update(changes)
        return cls(**base)

    @property
    def keepalive_bound(self) -> float:
        idle, interval, count = self.keepalive
        return idle + interval * count

    @property
    def silent_bound(self) -> float:
        """The longest a run in flight waits on a node it can no longer
        hear from: the keepalive's bound for a silent link, and for a frozen
        host --silent-node-seconds past its last report plus a status check."""
        return max(self.keepalive_bound, self.silent_node_seconds + self.status_interval)

    @property
    def hang_bound(self) -> float:
        """The longest a request may take: the client's retries of 503s
        (busy_timeout, each try up to its connect timeout), the queue wait,
        its run (four times the longest, on two busy cores), a silent peer
        noticed, and what the chaos run allows for a frozen worker."""
        return (self.busy_timeout + 5.0 + self.queue_timeout + 4 * max(self.long_seconds)
                + max(self.silent_bound, self.freeze_long[1] + 3.0) + self.slack)

    @property
    def client_timeout(self) -> float:
        # Past the bound, so that a request that breaks it is measured, not cut.
        return 2 * self.hang_bound

    @property
    def recovery_bound(self) -> float:
        """From a healed fault to full capacity on both Routers: the report in
        flight times out (one health interval), the reporter's retry backoff
        (at most four intervals, plus a fifth of one of jitter), then
        --recovery-threshold good checks (one status interval each, and one
        to see it)."""
        return (self.health_interval * (1 + 4 + 0.2)
                + (self.recovery_threshold + 1) * self.status_interval + self.slack)

    def net_router_args(self, address: str, pki: dict[str, str]) -> list[str]:
        idle, interval, count = self.keepalive
        return ["router", "--host", address, "--port", str(PORT),
                "--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"],
                "--node-token", NODE_TOKEN, "--client-token", CLIENT_TOKEN,
                "--status-check-interval-seconds", str(self.status_interval),
                "--max-status-age-seconds", "2", "--unhealthy-threshold", "2",
                "--recovery-threshold", str(self.recovery_threshold),
                "--queue-wait-timeout-seconds", str(self.queue_timeout),
                "--node-retention-seconds", "30",
                "--keepalive-idle-seconds", str(idle), "--keepalive-interval-seconds",
                str(interval), "--keepalive-count", str(count),
                "--silent-node-seconds", str(self.silent_node_seconds)]

    def net_node_args(self, router_urls: list[str], node_id: str, address: str,
                      pki: dict[str, str]) -> list[str]:
        args = super().node_args(router_urls, node_id)
        args[args.index("--port") + 1] = str(NODE_PORT)
        args[args.index("--health-interval-seconds") + 1] = str(self.health_interval)
        return [*args, "--host", address, "--tls-cert", pki["cert"], "--tls-key", pki["key"],
                "--tls-ca", pki["ca"], "--node-token", NODE_TOKEN]


class NetDeployment(chaos.Deployment):
    """The chaos run's deployment, each Router and node on a host of its
    own, the clients on another; TLS, node and client tokens between them."""

    def __init__(self, settings: NetSettings, log_dir: Path | None, workload: LongWorkload,
                 long_run: LongRun):
        super().__init__(settings, log_dir)
        self.settings: NetSettings = settings
        self.workload = workload
        self.long_run = long_run
        #: The Router and node the long run holds, which no fault touches.
        self.protected: set[str] = set()
        self._long_thread: threading.Thread | None = None
        self.hosts = Hosts([*self.names, *self.node_ids, CLIENTS])
        self._pki_dir = tempfile.TemporaryDirectory(prefix="kcoral-netfaults-pki-")
        ca = TestCA(Path(self._pki_dir.name))
        self.ca = ca.path
        self.pki = {}
        for name in [*self.names, *self.node_ids]:
            issued = ca.issue(name, dns=(), ips=(self.hosts.address(name),))
            self.pki[name] = {"cert": issued.cert, "key": issued.key, "ca": ca.path}
        self.ports = dict.fromkeys(self.names, PORT)
        self.urls = [f"https://{self.hosts.address(name)}:{PORT}" for name in self.names]
        self.hosts.make()

    def _child(self, name: str, args: list[str], **kwargs) -> KCoralChild:
        self._starts += 1
        label = f"{self._starts:02d}-{name}"
        # Each child runs on the host of its name.
        argv = self.hosts.command(name, [sys.executable, "-m", "kcoral"])
        return KCoralChild(args, name=label, env={"JAX_PLATFORMS": None}, echo=self.settings.echo,
                           log=self.log_dir / f"{label}.log" if self.log_dir else None,
                           executable=argv[0], program=tuple(argv[1:]), **kwargs)

    def start_router(self, name: str) -> KCoralChild:
        args = self.settings.net_router_args(self.hosts.address(name), self.pki[name])
        child = self._child(name, args)
        self.routers.append(child)
        child.wait_for(chaos.LISTENING, 60)
        self.router[name] = child
        return child

    def start(self) -> list[tuple[float, KCoralChild]]:
        """Start everything, then the long run, on a pool with nothing else
        in flight (so that the node that shows a run in flight holds it)."""
        started = super().start()
        found = threading.Event()
        self._long_thread = threading.Thread(target=hold_long_run, args=(self, found),
                                             name="long-run", daemon=True)
        with self.hosts.entered(CLIENTS):  # the thread, and its client, on the clients' host
            self._long_thread.start()
        if not found.wait(60):
            raise RuntimeError("the long run reached no node within 60 s")
        return started

    def _start_forwarders(self) -> None:
        """No forwarders: the hosts' links are cut instead."""

    def node_urls(self, node_id: str) -> list[str]:
        return list(self.urls)

    def start_node(self, node_id: str, wait: bool = True) -> KCoralChild:
        args = self.settings.net_node_args(self.urls, node_id, self.hosts.address(node_id),
                                           self.pki[node_id])
        child = self._child(node_id, args)
        self.node_children.setdefault(node_id, []).append(child)
        if wait:
            self.wait_node(node_id, child)
        return child

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca)

    def get(self, name: str, path: str, timeout: float = 2.0) -> dict | None:
        """Router C{name}'s JSON answer, asked from its own host (a cut
        between it and the clients does not hide it from the run's checks)."""
        conn = http.client.HTTPSConnection(self.hosts.address(name), PORT, timeout=timeout,
                                           context=self.client_context())
        try:
            with self.hosts.entered(name):
                conn.connect()
            conn.request("GET", path, headers={"Authorization": f"Bearer {CLIENT_TOKEN}"})
            return json.loads(conn.getresponse().read())
        except (OSError, ValueError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def stop_all(self, grace: float = 30.0) -> dict[str, int | None]:
        """Wait for the long run, heal and thaw every host, stop every
        process, then remove the hosts."""
        try:
            if self._long_thread is not None:
                self._long_thread.join(self.settings.long_hold * 4 + 60)
            for name in self.hosts.names:
                self.hosts.thaw(name)
                self.hosts.heal(name)
            for a, b in self.hosts.blocked():
                self.hosts.unblock(a, b)
            return super().stop_all(grace)
        finally:
            self.hosts.remove()
            self._pki_dir.cleanup()


class NetLoad(chaos.Load):
    """The chaos run's clients, on the clients' host, with TLS and the token."""

    def client_options(self) -> dict:
        return {"ssl_context": self.deployment.client_context(), "token": CLIENT_TOKEN}

    def start(self) -> None:
        with self.deployment.hosts.entered(CLIENTS):
            super().start()


class NetInjector(chaos.Injector):
    """The chaos run's injector, with the faults between hosts; targets
    that the long run holds (L{protected}) are spared while it runs."""

    def __init__(self, deployment: NetDeployment, settings: NetSettings):
        super().__init__(deployment, settings)
        self.deployment: NetDeployment = deployment
        self.settings: NetSettings = settings
        self.rng = random.Random(settings.seed)
        self.plan = chaos.fault_plan(settings.faults, self.rng, KINDS, WEIGHTS)
        self._freezes = 0

    def _target(self, kind: str, running: dict) -> str:
        protected = self.deployment.protected
        while True:
            busy = {target for target, thread in running.items() if thread.is_alive()}
            if kind in HOLDS_A_ROUTER:
                names = self.deployment.names
                free = [] if busy & set(names) else [n for n in names if n not in protected]
            else:
                free = [n for n in self.deployment.node_ids if n not in busy | protected]
            if free:
                return self.rng.choice(free)
            alive = [t for t in running.values() if t.is_alive()]
            if alive:
                for thread in alive:
                    thread.join()
            else:
                time.sleep(0.5)  # only the long run holds them: it ends by itself

    def _router_for(self, fault: Fault) -> str:
        names = [n for n in self.deployment.names if n not in self.deployment.protected]
        return fault.rng.choice(names or list(self.deployment.names))

    def _outage(self, fault: Fault, seconds: float, start, end) -> None:
        """Start the fault, hold it C{seconds}, end it; then wait for its
        target back, and for the pool at full capacity."""
        fault.start = time.monotonic()
        fault.seconds = seconds
        start()
        try:
            time.sleep(seconds)
        finally:
            end()
        fault.target_back = self._await_target(fault)
        self._await_full_capacity(fault)

    def _await_target(self, fault: Fault) -> float | None:
        """When the fault's node was ready at its full capacity on both
        Routers again (a Router: when it answered its clients' host again),
        whatever other faults in progress do; None if not within the
        recovery timeout."""
        d = self.deployment
        deadline = time.monotonic() + self.settings.recovery_timeout
        while time.monotonic() < deadline:
            if fault.target in d.names:
                if d.health().get(fault.target):
                    return time.monotonic()
            elif all(n.get("state") == "ready" and n.get("capacity") == self.settings.capacity
                     for n in (d.pool_nodes(name).get(fault.target, {}) for name in d.names)):
                return time.monotonic()
            time.sleep(0.1)
        return None

    def _cut_one(self, fault: Fault) -> None:
        hosts, router = self.deployment.hosts, self._router_for(fault)
        fault.router = router
        self._outage(fault, fault.rng.uniform(*self.settings.cut_seconds),
                     lambda: hosts.block(fault.target, router),
                     lambda: hosts.unblock(fault.target, router))

    def _isolate(self, fault: Fault) -> None:
        hosts = self.deployment.hosts
        self._outage(fault, fault.rng.uniform(*self.settings.cut_seconds),
                     lambda: hosts.cut(fault.target), lambda: hosts.heal(fault.target))

    def _cut_clients(self, fault: Fault) -> None:
        hosts = self.deployment.hosts
        self._outage(fault, fault.rng.uniform(*self.settings.cut_seconds),
                     lambda: hosts.block(fault.target, CLIENTS),
                     lambda: hosts.unblock(fault.target, CLIENTS))

    def _half_open(self, fault: Fault) -> None:
        """Every packet one way between the node and a Router dropped (which
        way: seeded), with no reset."""
        hosts, router = self.deployment.hosts, self._router_for(fault)
        fault.router = router
        sender, receiver = fault.rng.choice([(fault.target, router), (router, fault.target)])
        self._outage(fault, fault.rng.uniform(*self.settings.cut_seconds),
                     lambda: hosts.block(sender, receiver, both=False),
                     lambda: hosts.unblock(sender, receiver))

    def _freeze_host(self, fault: Fault) -> None:
        """SIGSTOP on every process of the node's host, alternately past the
        Routers' --silent-node-seconds and within it; then SIGCONT."""
        hosts, s = self.deployment.hosts, self.settings
        self._freezes += 1
        seconds = fault.rng.uniform(*(s.freeze_host_long if self._freezes % 2 else
                                      s.freeze_host_short))
        self._outage(fault, seconds, lambda: hosts.freeze(fault.target),
                     lambda: hosts.thaw(fault.target))


@dataclasses.dataclass
class LongRun:
    """The long run: its outcome, and where it ran."""

    seconds: float
    outcome: str = ""
    took: float = 0.0
    node: str = ""


def hold_long_run(deployment: NetDeployment, found: threading.Event) -> None:
    """Send the long run through the first Router; the node that then shows
    a run in flight holds it: that node and Router are spared by the
    injector until it is answered."""
    from kcoral import Client

    run, router = deployment.long_run, deployment.names[0]
    client = Client(deployment.urls[0], token=CLIENT_TOKEN,
                    ssl_context=deployment.client_context(), timeout=run.seconds * 4 + 60)
    deployment.protected.add(router)
    done = threading.Event()

    def find_node() -> None:
        while not done.is_set():
            busy = [n for n, node in deployment.pool_nodes(router).items() if node.get("active")]
            if busy:
                run.node = busy[0]
                deployment.protected.add(busy[0])
                break
            time.sleep(0.1)
        found.set()

    threading.Thread(target=find_node, name="long-run-node", daemon=True).start()
    started = time.monotonic()
    try:
        program, args, check = deployment.workload.long_run()
        problem = check(client.run(program, *args, request_id="netfaults-long"))
        run.outcome = "200" if problem is None else f"wrong: {problem}"
    except Exception as e:
        run.outcome = f"{e.__class__.__name__}: {e}"
    finally:
        run.took = time.monotonic() - started
        done.set()
        client.close()
        deployment.protected.clear()


class LongWorkload(chaos.Workload):
    """The chaos run's programs, and the long run: an outer loop of
    L{INNER} steps of the long program's body each, run C{hold} seconds
    (one loop of int32 steps would overflow past a few minutes); its
    counter and integer output are checked exactly."""

    #: Steps of the long program's body in each outer step.
    INNER = 1000

    def __init__(self, long_seconds: tuple, hold: float):
        import jax.numpy as jnp
        import numpy as np
        from jax import lax

        from kcoral import Program

        super().__init__(long_seconds)
        self.hold_n = max(int(self.long_n[-1] * hold / long_seconds[-1]) // self.INNER, 1)
        inner = self.INNER

        def hold_loop(n, x, v0):
            def outer(carry):
                k, v = carry
                v = lax.fori_loop(0, inner, lambda _, w: jnp.sin(w) * 0.5 + w * 0.5, v)
                return k + 1, v

            k, v = lax.while_loop(lambda c: c[0] < n, outer, (jnp.int32(0), v0))
            return {"x": x * 3 + 1, "v": v, "k": k}

        self.hold = Program.from_function(hold_loop, np.int32(1), np.zeros(self.x_shape, np.int32),
                                          self.v0)

    def long_run(self):
        import numpy as np

        x = np.arange(8, dtype=np.int32)

        def check(out) -> str | None:
            if not isinstance(out, dict) or set(out) != {"x", "v", "k"}:
                return f"outputs {out!r:.80}"
            return chaos.mismatch({"x": out["x"], "k": out["k"]},
                               {"x": x * 3 + 1, "k": np.int32(self.hold_n)})

        return self.hold, (np.int32(self.hold_n), x, self.v0), check


@dataclasses.dataclass
class NetResult:
    result: Result
    long_run: LongRun
    #: Requests that took longer than the hang bound.
    over_bound: list
    #: (fault, seconds from its heal to its target back, or None: never)
    #: past the recovery bound.
    slow_recoveries: list

    @property
    def ok(self) -> bool:
        return self.result.ok and self.long_run.outcome == "200" and not self.over_bound \
            and not self.slow_recoveries


def run(settings: NetSettings) -> NetResult:
    workload = LongWorkload(settings.long_seconds, settings.long_hold)
    long_run = LongRun(settings.long_hold)
    result = chaos.run(settings, lambda s, log_dir: NetDeployment(s, log_dir, workload, long_run),
                       NetInjector, NetLoad, workload)
    explain(result)
    over = [r for r in result.records if r.end and r.end - r.start > settings.hang_bound]
    slow = []
    for fault in result.faults:
        if fault.kind in NETWORK_KINDS:
            after_heal = None if fault.target_back is None else \
                fault.target_back - (fault.start + fault.seconds)
            if after_heal is None or after_heal > settings.recovery_bound:
                slow.append((fault, after_heal))
    return NetResult(result, long_run, over, slow)


def explain(result: Result) -> None:
    """Network faults explain the 502s of the nodes they cut off or froze
    (Result.outages); a request whose connection to a Router went silent
    or closed with no answer while that Router was cut off from its clients
    (or killed) is the client's own 502."""
    for fault in result.faults:
        end = fault.start + fault.seconds + result.settings.silent_bound
        if fault.kind in (CUT_ONE, ISOLATE, HALF_OPEN, FREEZE_HOST):
            result.outages.append((fault.start, end, fault.target))
        if fault.kind == CUT_CLIENTS:
            for r in result.records:
                if r.outcome == "dropped" and r.start - 1.0 <= end and fault.start <= r.end + 1.0:
                    r.outcome, r.detail = "502", f"{fault.kind} {fault.target}: {r.detail}"


def table(net: NetResult) -> str:
    result, s = net.result, net.result.settings
    lines = chaos.table(result).splitlines()[:-1]  # its verdict is not the whole one
    rows = []
    for kind in NETWORK_KINDS:
        faults = [f for f in result.faults if f.kind == kind and f.target_back is not None]
        heals = [f.target_back - (f.start + f.seconds) for f in faults]
        rows.append((f"{kind} target back after heal", chaos.seconds_summary(heals)))
    latency = sorted(r.end - r.start for r in result.records if r.end)
    rows.append(("longest request", f"{latency[-1]:.1f} s (bound {s.hang_bound:.1f} s)"
                 if latency else "-"))
    rows.append(("recovery bound after a heal", f"{s.recovery_bound:.1f} s"))
    rows.append(("long run", (f"{net.long_run.outcome or 'unanswered'} after "
                 f"{net.long_run.took:.0f} s on {net.long_run.node or '?'} "
                 f"(program of {s.long_hold:.0f} s)")))
    rows.append(("over the hang bound", str(len(net.over_bound))))
    rows.append(("slow recoveries", str(len(net.slow_recoveries))))
    width = max(len(k) for k, _ in rows)
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    for r in net.over_bound[:10]:
        during = [f"{f.kind} {f.target}" for f in result.faults
                  if f.start <= r.end and r.start <= (f.back or f.start + f.seconds)]
        lines.append(f"  over #{r.index} {r.kind} {r.outcome} {r.end - r.start:.1f} s "
                     f"[{r.start - result.t0:.1f} s, {r.end - result.t0:.1f} s] {r.detail} "
                     f"during: {', '.join(during) or 'no fault'}")
    if net.over_bound or net.slow_recoveries:
        for f in result.faults:
            lines.append(f"  fault {f.index} {f.kind} {f.target} {f.router}: "
                         f"{f.start - result.t0:.1f} s for {f.seconds:.1f} s, back at "
                         f"{(f.back or 0) - result.t0:.1f} s")
    for fault, seconds in net.slow_recoveries[:10]:
        lines.append(f"  slow recovery: fault {fault.index} {fault.kind} {fault.target} "
                     + ("never back" if seconds is None else f"{seconds:.1f} s after the heal"))
    lines.append("verdict: " + ("OK" if net.ok else "FAILED"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = chaos.arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, help="requests to send (default 3000, quick 150)")
    parser.add_argument("--faults", type=int, help=f"faults to inject (default 40, quick {len(KINDS)})")
    parser.add_argument("--long-hold", type=float, help="seconds of the long run (default 300, quick 60)")
    args = parser.parse_args(argv)
    return chaos.report(args, NetSettings, {"requests": args.requests, "faults": args.faults,
                                            "long_hold": args.long_hold}, run, table,
                        "kcoral-netfaults-")

if __name__ == "__main__":
    sys.exit(main())
