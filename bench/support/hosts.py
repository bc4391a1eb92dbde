"""
Test hosts on one machine: network namespaces, each with its own address,
joined by veth links to a bridge in a namespace of their own (the switch),
for the runs and tests that need faults between hosts (C{bench.netfaults},
C{tests/test_hosts.py}). Made with Debian's iproute2 and nftables, as root;
no traffic leaves the namespaces made here, and everything is removed on
L{Hosts.remove} (also when a step of L{Hosts.make} failed).

    with Hosts(["router", "node-a", "node-b"]) as hosts:
        hosts.command("node-a", ["python", "-m", "kcoral", ...])   # argv to run there
        hosts.cut("node-a")          # its link down: silent, for everyone
        hosts.block("node-a", "router")      # silent between those two only
        hosts.block("node-a", "router", both=False)   # node-a -> router dropped: half-open
        hosts.freeze("node-b")       # SIGSTOP every process of the host
        hosts.heal("node-a"); hosts.unblock("node-a", "router"); hosts.thaw("node-b")

The faults are silent: a link set down on the switch's side, or an nftables
rule that drops packets, never answers with a reset or an ICMP error, so
only timeouts (TCP keepalive, TCP's own retransmission limits, an
application's) tell a peer that the other side is gone. This kernel has no
C{tc netem}; delay and loss rates are not offered.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

#: The network the hosts' addresses are taken from: private to the
#: namespaces, so it may be the same in concurrent runs.
NETWORK = ipaddress.ip_network("10.77.0.0/24")
#: setns(2)'s flag for a network namespace.
CLONE_NEWNET = 0x40000000


class HostsUnavailable(Exception):
    """Network namespaces cannot be made here (not root, no iproute2)."""


def unavailable() -> str | None:
    """Why test hosts cannot be made on this machine, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install -y iproute2 nftables)"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)
    return done


class Hosts:
    """
    The hosts named C{names} (in order: 10.77.0.1, .2, ...), made by
    L{make} (or entering the context) and removed by L{remove} (or leaving
    it). Namespace and interface names start with C{prefix} (default: one
    of this process's own), so concurrent runs do not meet.
    """

    def __init__(self, names: Sequence[str], prefix: str | None = None):
        if len(names) >= NETWORK.num_addresses - 2:
            raise ValueError(f"at most {NETWORK.num_addresses - 3} hosts")
        self.names = list(names)
        self.prefix = prefix or f"kc{os.getpid() % 100000}"
        self.switch = f"{self.prefix}-sw"
        hosts = NETWORK.hosts()
        self.addresses = {name: str(next(hosts)) for name in self.names}
        self._made: list[str] = []
        #: The pairs L{block} cut, with its C{both}.
        self._blocked: dict[tuple[str, str], bool] = {}

    def __enter__(self) -> Hosts:
        self.make()
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # -- names ----------------------------------------------------------------

    def namespace(self, name: str) -> str:
        return f"{self.prefix}-{self.names.index(name)}"

    def _port(self, name: str) -> str:
        """The switch's end of C{name}'s link (interface names: 15 bytes at most)."""
        return f"{self.prefix}p{self.names.index(name)}"[:15]

    def address(self, name: str) -> str:
        return self.addresses[name]

    # -- making and removing -------------------------------------------------------

    def make(self) -> None:
        why = unavailable()
        if why:
            raise HostsUnavailable(why)
        try:
            self._namespace(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for name in self.names:
                ns, port = self.namespace(name), self._port(name)
                self._namespace(ns)
                _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth",
                     "peer", "name", port, "netns", self.switch)
                _run("ip", "-n", ns, "addr", "add", f"{self.address(name)}/{NETWORK.prefixlen}",
                     "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.switch, "link", "set", port, "up")
                # One table a host for the faults between two hosts.
                _run("ip", "netns", "exec", ns, "nft", "add", "table", "inet", "faults")
                for hook in ("input", "output"):
                    _run("ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "faults", hook,
                         f"{{ type filter hook {hook} priority 0; }}")
        except BaseException:
            self.remove()
            raise

    def _namespace(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._made.append(ns)

    def remove(self) -> None:
        """Kill what still runs in the hosts, then remove every namespace
        (a veth link goes with its namespace). Safe to call again."""
        for ns in reversed(self._made):
            for pid in self._pids(ns):
                _signal(pid, signal.SIGCONT)
                _signal(pid, signal.SIGKILL)
            _run("ip", "netns", "del", ns, check=False)
        self._made = []
        self._blocked.clear()

    # -- processes -------------------------------------------------------------------

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """C{argv} run on host C{name}."""
        return ["ip", "netns", "exec", self.namespace(name), *argv]

    def pids(self, name: str) -> list[int]:
        """The processes running on host C{name}."""
        return self._pids(self.namespace(name))

    def _pids(self, ns: str) -> list[int]:
        done = _run("ip", "netns", "pids", ns, check=False)
        return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []

    @contextmanager
    def entered(self, name: str) -> Iterator[None]:
        """
        The calling thread inside host C{name}'s network, then back: a
        socket made meanwhile belongs to that host for its whole life, and a
        thread started meanwhile stays there. Lets a run's own threads (its
        clients, its checks) sit on a host without a process of their own.
        """
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/thread-self/ns/net") as home, \
                open(f"/run/netns/{self.namespace(name)}") as there:
            if libc.setns(there.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {name}")
            try:
                yield
            finally:
                if libc.setns(home.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back")

    def freeze(self, name: str) -> list[int]:
        """SIGSTOP every process of host C{name} (its kernel still answers
        TCP: connections stay open, keepalives are acknowledged); returns them."""
        pids = self.pids(name)
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        return pids

    def thaw(self, name: str) -> None:
        for pid in self.pids(name):
            _signal(pid, signal.SIGCONT)

    # -- faults between hosts ----------------------------------------------------------

    def cut(self, name: str) -> None:
        """Host C{name}'s link goes down on the switch's side: nothing
        reaches it or leaves it, and it is told nothing."""
        _run("ip", "-n", self.switch, "link", "set", self._port(name), "down")

    def heal(self, name: str) -> None:
        _run("ip", "-n", self.switch, "link", "set", self._port(name), "up")

    def block(self, a: str, b: str, both: bool = True) -> None:
        """Host C{a} drops every packet it would send to C{b} (and, with
        C{both}, every one from C{b}), with no reset: alone, a half-open
        link (C{b}'s data arrive, C{a}'s acknowledgements never do)."""
        rules = [("output", "daddr", a, b)] + ([("input", "saddr", a, b)] if both else [])
        for hook, field, host, peer in rules:
            _run("ip", "netns", "exec", self.namespace(host), "nft", "add", "rule", "inet",
                 "faults", hook, "ip", field, self.address(peer), "drop")
        self._blocked[a, b] = both

    def unblock(self, a: str, b: str) -> None:
        """Removes every rule L{block} added on C{a} about C{b}."""
        ns = self.namespace(a)
        for hook in ("input", "output"):
            _run("ip", "netns", "exec", ns, "nft", "flush", "chain", "inet", "faults", hook)
        # Flushing took every peer's rules of this host: restore the others.
        others = {(x, y): both for (x, y), both in self._blocked.items() if x == a and y != b}
        self._blocked = {pair: both for pair, both in self._blocked.items() if pair[0] != a}
        for (x, y), both in others.items():
            self.block(x, y, both)

    def blocked(self) -> list[tuple[str, str]]:
        return sorted(self._blocked)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
