"""
What C{bench.training} and C{bench.decode} share: the services a loop
on kept arrays runs against (a standalone server, a Router with one node),
the bytes the client's connection moves as the kernel counts them, the
ways of a loop taking turns, and the report's machine line and tables.
"""

from __future__ import annotations

import os
import platform
import socket
import struct
import time
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from urllib.parse import urlsplit

from bench.support.child import SERVER_READY, KCoralChild
from bench.support.procstat import OutsideLoad
from bench.support.services import start_node, start_router, wait_ready

#: tcpi_bytes_acked and tcpi_bytes_received in Linux's struct tcp_info.
_TCP_INFO_BYTES = struct.Struct("=QQ")
_TCP_INFO_OFFSET = 120
_TCP_INFO_LENGTH = 232


# -- the services ------------------------------------------------------------------

@contextmanager
def standalone_server(gpus: str, *options: str):
    """The URL of a C{kcoral server --port 0} on C{gpus}, with C{options},
    stopped on the way out."""
    server = KCoralChild(["server", "--port", "0", "--gpus", gpus, *options],
                         {"url": r"kcoral server listening on (http://\S+)", "ready": SERVER_READY},
                         name="server", timeout=120.0)
    try:
        yield server.found["url"]
    finally:
        server.stop()


@contextmanager
def routed_node(gpus: str, *options: str):
    """The URL of a C{kcoral router} once its one node (one worker on
    C{gpus}) is ready, both with C{options}; both stopped on the way out,
    the node first."""
    router = start_router(None, *options)
    try:
        node = start_node(router.found["url"], gpus, *options)
        try:
            wait_ready(router.found["url"])
            yield router.found["url"]
        finally:
            node.stop()
    finally:
        router.stop()


@contextmanager
def clients(gpus: str, server: bool, router: bool, *options: str):
    """
    A C{Client} of a standalone server and one of a Router in front of a
    node, for the ways that use them (None for one not asked for), each
    service started with C{options} (options both commands take): both
    services run at once, so that the ways can take turns. Every child is
    stopped on the way out, whatever happened.
    """
    from kcoral import Client

    with ExitStack() as stack:
        found = []
        for wanted, service in ((server, standalone_server), (router, routed_node)):
            if wanted:
                url = stack.enter_context(service(gpus, *options))
                found.append(stack.enter_context(Client(url, timeout=600)))
            else:
                found.append(None)
        yield tuple(found)


# -- traffic ----------------------------------------------------------------------

def connections_to(port: int) -> dict[int, tuple[int, int]]:
    """
    For each TCP connection of this process to C{port} (by its local port):
    the bytes it sent that the peer acknowledged and the bytes it received,
    HTTP heads included, as the kernel counts them (C{TCP_INFO}). The
    client keeps its socket to itself; the kernel's count costs the loop
    nothing, where a counting proxy would take a share of the cores.
    """
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed since it was listed
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                peer = sock.getpeername()
            except OSError:  # not connected
                continue
            if peer[1] == port:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LENGTH)
                found[sock.getsockname()[1]] = _TCP_INFO_BYTES.unpack_from(info, _TCP_INFO_OFFSET)
    return found


class Traffic:
    """
    The bytes C{client}'s connection moved while blocks under it
    ran, added up: C{sent} and C{received} on the wire (heads included), and
    C{bodies} of requests as C{client.bytes_sent} counts them. A connection
    opened or closed within a block would hide bytes: that fails the
    measurement.
    """

    def __init__(self, client):
        self._client = client
        self._port = urlsplit(client.url).port
        self.sent = self.received = self.bodies = 0

    def __enter__(self) -> Traffic:
        self._start = connections_to(self._port)
        self._bodies = self._client.bytes_sent
        return self

    def __exit__(self, *exc) -> None:
        end, start = connections_to(self._port), self._start
        if exc[0] is None and end.keys() != start.keys():
            raise RuntimeError(f"the client's connections changed during the loop "
                               f"({sorted(start)} to {sorted(end)}): bytes uncounted")
        self.sent += sum(end[c][0] - start[c][0] for c in end if c in start)
        self.received += sum(end[c][1] - start[c][1] for c in end if c in start)
        self.bodies += self._client.bytes_sent - self._bodies


# -- reporting --------------------------------------------------------------------

def descendants() -> list[int]:
    """This process's children, theirs, and so on (a node's workers are its
    supervisor's children)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone since it was listed
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [os.getpid()]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def machine() -> dict:
    """The machine, and how busy it was as the run began."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": f"{model}, {os.cpu_count()} CPUs ({platform.machine()})",
            "python": platform.python_version(), "load_before": os.getloadavg()}


def way_row(name: str, way: dict, count: int, rate: str, base: dict | None,
            digits: tuple[int, int]) -> list[str]:
    """One way's row of the table: its rate and milliseconds per item (with
    C{digits} decimals each), against the floor's, its bytes per item, and
    whether it matched the floor."""
    return [name, f"{way[rate]:.{digits[0]}f}", f"{1000 / way[rate]:.{digits[1]}f}",
            f"{way[rate] / base[rate]:.2f}x" if base else "",
            *([f"{way[k] / count:,.0f}" for k in ("bodies", "sent", "received")] if "sent" in way
              else ["", "", ""]),
            {True: "yes", False: "NO"}.get(way.get("equal"), "")]


def print_context(results: dict) -> None:
    """The command, the machine and how busy it was, above a table."""
    print()
    print(f"command: {results['command']}")
    print(f"machine: {results['cpu']}; jax {results['jax']} on {results['device']}; load average "
          f"{results['load_before'][0]:.2f} before, {results['load_after'][0]:.2f} after")
    print(f"other processes took {results['outside_cores']:.2f} cores' worth meanwhile")


def table(head: list[str], rows: list[list[str]]) -> str:
    """C{rows} under C{head}, columns right-aligned but the first, as
    reStructuredText's simple tables rule them (to paste into the docs)."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    rule = "  ".join("=" * w for w in widths)

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([rule, line(head), rule, *map(line, rows), rule])


# -- the loop ---------------------------------------------------------------------

class Way:
    """
    One way of running a loop, ready (warmed) once made: L{step} takes the
    loop's next item and returns what the loop records of it. C{traffic},
    where set, counts the bytes of its timed steps; C{seconds} adds up their
    time, and C{times} holds each one's.
    """

    name = "way"
    traffic: Traffic | None = None

    def __init__(self):
        self.seconds = 0.0
        self.times: list[float] = []
        self.records: list = []

    def step(self, item):
        raise NotImplementedError


def take_turns(ways: list[Way], items: list, turn: int) -> float:
    """
    Each of C{ways} through all of C{items}, C{turn} items at a time each in
    rotation, so that a change in the machine's load (it is shared) hits
    them all alike. Returns the cores' worth of CPU that processes outside
    this one and its children took meanwhile: how far to trust the times.
    """
    with OutsideLoad(descendants()) as outside:
        _rotate(ways, items, turn)
    return outside.cores


def _rotate(ways: list[Way], items: list, turn: int) -> None:
    for start in range(0, len(items), turn):
        for way in ways:
            with way.traffic or nullcontext():
                started = time.perf_counter()
                for item in items[start:start + turn]:
                    began = time.perf_counter()
                    way.records.append(way.step(item))
                    way.times.append(time.perf_counter() - began)
                way.seconds += time.perf_counter() - started
