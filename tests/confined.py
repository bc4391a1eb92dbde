"""
A process confined as a server of the given settings confines itself (with
L{kcoral.sandbox.confinement.confine}, which the server calls as it
starts), then tries what a program that took the process over would, and
what a server does; it prints one JSON object: the sandbox, its temporary
folder, and for each try "ok" or the name of the error; given SOCKETS, it
tries those alone.

    python -m tests.confined SETTINGS [SOCKETS]

Run with C{-m}, as a node runs its workers, from a working folder that
holds a file named C{secret} (the folder its node was started in: the
operator's).

SETTINGS: a JSON object of L{kcoral.common.serverconfig.ServerConfig}
fields, plus "parent_port" (a TCP port it may not connect to), "tokens"
(the client tokens file; "sibling" is a file beside it; none with SOCKETS), and "threads" (1
starts a thread before it confines itself). SOCKETS: a JSON list of
(family, type, protocol) for socket(), as 64-bit registers.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import socket
import sys
import tempfile
import threading

from kcoral.common.serverconfig import ServerConfig
from kcoral.sandbox.confinement import confine

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
PTRACE_ATTACH = 16


def attempt(f) -> str:
    try:
        f()
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e.errno))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def read(path: str) -> None:
    with open(path, "rb") as f:
        f.read(1)


def write(path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"x")


def bind(port: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def connect(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


def sock(family: int, kind: int, protocol: int = 0) -> None:
    fd = libc.syscall(41, ctypes.c_long(family), ctypes.c_long(kind), ctypes.c_long(protocol))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "socket")
    os.close(fd)


def run(argv: list[str]) -> None:
    pid = os.posix_spawn(argv[0], argv, {})
    os.waitpid(pid, 0)


def ptrace(pid: int) -> None:
    if libc.ptrace(PTRACE_ATTACH, pid, None, None) != 0:
        raise OSError(ctypes.get_errno(), "ptrace")


def jitted() -> None:
    import jax
    import jax.numpy as jnp

    assert int(jax.jit(lambda x: x * 2)(jnp.arange(3)).sum()) == 6


def main() -> None:
    settings = json.loads(sys.argv[1])
    parent_port, tokens = settings.pop("parent_port", 0), settings.pop("tokens", None)
    if settings.pop("threads", 0):
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    config = ServerConfig(**settings, client_tokens_file=tokens)
    sandbox = confine(config)
    if len(sys.argv) > 2:
        print(json.dumps({"sandbox": sandbox.to_json(), "sockets": [
            attempt(functools.partial(sock, *triple)) for triple in json.loads(sys.argv[2])]}))
    else:
        print(json.dumps({"sandbox": sandbox.to_json(), "tmpdir": tempfile.gettempdir(),
                          "tries": tries(config, tokens, parent_port)}))


def tries(config: ServerConfig, tokens: str, parent_port: int) -> dict[str, str]:
    """What a program that took a server over would try, and what a server does."""
    parent, me = os.getppid(), os.getpid()
    return {
        "read /etc/shadow": attempt(lambda: read("/etc/shadow")),
        "read its own status": attempt(lambda: read(f"/proc/{me}/status")),
        "read /proc/1/environ": attempt(lambda: read("/proc/1/environ")),
        "read its parent's environ": attempt(lambda: read(f"/proc/{parent}/environ")),
        "read /proc/cpuinfo": attempt(lambda: read("/proc/cpuinfo")),
        "read /proc/meminfo": attempt(lambda: read("/proc/meminfo")),
        "make /dev/shm/x": attempt(lambda: write(f"/dev/shm/kcoral-confined-{me}")),
        "write /tmp": attempt(lambda: write(f"/tmp/kcoral-confined-{me}")),
        "bind its gRPC port": attempt(lambda: bind(config.grpc_port or 0)),
        "bind a port not its own": attempt(lambda: bind(0)),
        "connect to a port not allowed": attempt(lambda: connect(parent_port)),
        "connect to its collector": attempt(
            lambda: connect(int(os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rsplit(":", 1)[1]))),
        "open a UDP socket": attempt(lambda: sock(socket.AF_INET, socket.SOCK_DGRAM)),
        "open a raw socket": attempt(lambda: sock(socket.AF_INET, socket.SOCK_RAW, 1)),
        "open a packet socket": attempt(lambda: sock(socket.AF_PACKET, socket.SOCK_RAW)),
        "start /bin/true": attempt(lambda: run(["/bin/true"])),
        "ptrace its parent": attempt(lambda: ptrace(parent)),
        "signal its parent": attempt(lambda: os.kill(parent, 0)),
        "write its cache folder": attempt(lambda: write(os.path.join(config.cache_dir, "x"))),
        "write its temporary folder": attempt(lambda: tempfile.mkstemp()),
        "read the model repository": attempt(
            lambda: read(os.path.join(config.model_repository, "bundle"))),
        "read its tokens file": attempt(lambda: read(tokens)),
        "read a file beside its tokens file": attempt(
            lambda: read(os.path.join(os.path.dirname(tokens), "sibling"))),
        "read a file of its working folder": attempt(lambda: read("secret")),
        "run a jitted function": attempt(jitted),
    }


if __name__ == "__main__":
    main()
