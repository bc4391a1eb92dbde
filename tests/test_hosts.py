"""
The test hosts of C{bench.support.hosts}: real network namespaces joined by a
bridge, real TCP across them, and the faults each silent (no reset, no
error): a link down, a blocked pair, a half-open pair, a frozen host; and
nothing left behind.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from bench.support import hosts

#: Run on a host: listen on its address, echo one line per connection.
ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000)); s.listen(); print("up", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(c.recv(100)); c.close()
"""

#: Run on a host: connect to the echo server, send a line, print the answer
#: or the error, within a timeout.
ASK = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
    c.sendall(b"ping"); print(c.recv(100).decode() or "closed")
except OSError as e:
    print(type(e).__name__)
"""


def ask(h: hosts.Hosts, host: str, peer: str, timeout: float = 10.0) -> str:
    """What C{host} gets back from C{peer}'s echo within C{timeout} seconds:
    the answer, or the error's name. A fault's silence is asked with a short
    timeout; an answer that must come gets a long one, which only a busy
    machine uses up."""
    done = subprocess.run(h.command(host, [sys.executable, "-c", ASK, h.address(peer), str(timeout)]),
                          capture_output=True, text=True, timeout=30)
    return done.stdout.strip()


@pytest.fixture
def three():
    with hosts.Hosts(["a", "b", "c"]) as h:
        server = subprocess.Popen(h.command("b", [sys.executable, "-c", ECHO, h.address("b")]),
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "up"
            yield h
        finally:
            server.kill()
            server.wait()


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_hosts_reach_each_other_and_not_this_machine(three):
    """Each host has its own address, reaches the others over the bridge, and not the outside's loopback."""
    assert ask(three, "a", "b") == "ping"
    assert ask(three, "c", "b") == "ping"
    assert len(set(three.addresses.values())) == 3
    with socket.socket() as outside:
        outside.bind(("127.0.0.1", 0))
        outside.listen()
        port = outside.getsockname()[1]
        connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), 1)"
        done = subprocess.run(three.command("a", [sys.executable, "-c", connect]),
                              capture_output=True, text=True)
        assert "ConnectionRefused" in done.stderr


def test_cut_is_silent_and_heals(three):
    """A cut host's connections time out (no refusal, no reset) and work again once healed."""
    three.cut("b")
    started = time.monotonic()
    assert ask(three, "a", "b", timeout=1.0) in ("TimeoutError", "timeout")
    assert time.monotonic() - started >= 0.9
    three.heal("b")
    assert ask(three, "a", "b") == "ping"


def test_block_is_between_two_hosts_only(three):
    """Blocking a and b silences them to each other while c still reaches b; unblocking restores them."""
    three.block("a", "b")
    three.block("a", "c")
    assert ask(three, "a", "b", timeout=1.0) in ("TimeoutError", "timeout")
    assert ask(three, "c", "b") == "ping"
    three.unblock("a", "b")
    assert ask(three, "a", "b") == "ping"
    assert three.blocked() == [("a", "c")]


def test_half_open_drops_one_direction(three):
    """A half-open block drops what b sends to a (a's connection goes unanswered), nothing else."""
    three.block("b", "a", both=False)
    assert ask(three, "a", "b", timeout=1.0) in ("TimeoutError", "timeout")
    # b's own packets to c are untouched.
    assert ask(three, "c", "b") == "ping"


def test_freeze_stops_every_process_of_the_host(three):
    """A frozen host accepts connections in its kernel but answers nothing until thawed."""
    frozen = three.freeze("b")
    assert frozen
    assert ask(three, "a", "b", timeout=1.0) in ("TimeoutError", "timeout")
    three.thaw("b")
    assert ask(three, "a", "b") == "ping"


def test_remove_leaves_nothing_even_after_a_failure():
    """Namespaces are removed when the block raises, with processes still running in them."""
    made = hosts.Hosts(["x", "y"], prefix="kcrm")
    with pytest.raises(RuntimeError), made:
        subprocess.Popen(made.command("x", ["sleep", "60"]))
        assert "kcrm-0" in namespaces()
        raise RuntimeError("a step failed")
    assert "kcrm" not in namespaces()


def source_address(peer: str) -> str:
    """The address this thread's network would send from to C{peer} (a
    connected UDP socket: nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 7000))
        return probe.getsockname()[0]


def test_a_thread_enters_a_host(three):
    """Sockets made inside entered() are the host's and keep working after; the thread comes back."""
    with three.entered("a"):
        assert source_address(three.address("b")) == three.address("a")
        conn = socket.create_connection((three.address("b"), 7000), timeout=5)
    with conn:
        conn.sendall(b"from a")
        assert conn.recv(100) == b"from a"
    assert source_address(three.address("b")) != three.address("a")
