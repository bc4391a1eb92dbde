"""
What a process that runs programs may touch, made from its settings: the
files and folders it reads, those it writes, and the TCP ports it binds
and connects to. Anything else Landlock refuses.

The read-only part is what a CPU worker was seen to open once it serves
(C{strace -f -e trace=file}): Python and its import path, the system's
libraries, a few files of C{/etc}, C{/sys} and C{/dev}, and its own
C{/proc/<pid>} -- never C{/proc} as a whole, where another process's
environment (its supervisor's holds the node's tokens) and command line
are. Then what its settings name: the model repository, TLS files and
the client tokens file; and read-write only its cache folders and a
private temporary folder.

A GPU worker's further rules (C{/dev/nvidia*}, the driver's libraries,
C{ptxas}, C{/dev/shm} for NCCL) are written from what CUDA and XLA are
documented to open, and were not tried on a machine with a GPU: they are
kept to those.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from urllib.parse import urlsplit

import attrs

from kcoral.common.serverconfig import ServerConfig
from kcoral.sandbox import landlock

#: What every process that runs programs reads: the C library's and the
#: system's shared libraries, time zones, what XLA reads of the CPUs (its
#: kernels' cpuinfo parses /proc/cpuinfo: without it some fail to run), and
#: random bytes.
SYSTEM = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/share/zoneinfo", "/etc/ld.so.cache",
          "/etc/localtime", "/sys/devices/system/cpu", "/proc/cpuinfo", "/dev/urandom")
#: Written in place, never made or removed.
DEVICES = ("/dev/null",)
#: How a name is found, for a process that connects out (an OpenTelemetry
#: collector): C{/etc/hosts} and the resolver's settings. A DNS query is a
#: datagram, which the seccomp filter refuses (doc/security.rst).
NAMES = ("/etc/hosts", "/etc/resolv.conf", "/etc/nsswitch.conf", "/etc/host.conf", "/etc/gai.conf",
         "/etc/ssl/certs")
#: A GPU's: NVIDIA's driver state, and the PCI topology CUDA and NCCL read.
GPU_READ = ("/proc/driver/nvidia", "/sys/bus/pci", "/sys/devices", "/usr/local/cuda")
#: What XLA runs to compile for a GPU (found on PATH; the pip wheels' copies are on sys.path).
GPU_PROGRAMS = ("ptxas", "nvlink")
#: OpenTelemetry's OTLP/HTTP exporter's collector when its variables name none.
OTLP_DEFAULT = "http://localhost:4318"


@attrs.frozen
class Policy:
    """What a confined process may touch (paths that do not exist are left out)."""

    #: Read (and run) beneath.
    read_only: tuple[str, ...] = ()
    #: Read, write, make and remove beneath.
    read_write: tuple[str, ...] = ()
    #: Files read and written in place, device ioctls included: devices,
    #: and the process's own threads' names.
    written: tuple[str, ...] = ()
    #: TCP ports it may still bind (its HTTP port is bound before it is
    #: confined; its gRPC front binds after).
    bind: tuple[int, ...] = ()
    #: TCP ports it may connect to.
    connect: tuple[int, ...] = ()
    #: Whether it may start programs (XLA's ptxas, on a GPU).
    execute: bool = False

    def with_read_write(self, path: str) -> Policy:
        return attrs.evolve(self, read_write=(*self.read_write, path))

    def landlock_paths(self) -> list[tuple[str, int]]:
        """Each path with its Landlock rights."""
        return [*((p, landlock.READ) for p in self.read_only),
                *((p, landlock.READ | landlock.WRITE) for p in self.read_write),
                *((p, landlock.READ_FILE | landlock.WRITE_FILE | landlock.IOCTL_DEV)
                  for p in self.written)]


def serves_gpu(config: ServerConfig, environ: Mapping[str, str]) -> bool:
    """Whether the process will serve NVIDIA GPUs: its C{--gpus} names
    some, JAX is not held to the CPU, and the host has NVIDIA's devices."""
    platforms = [p for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    return config.gpus != "none" and platforms != ["cpu"] and os.path.exists("/dev/nvidiactl")


def policy_for(config: ServerConfig, *, environ: Mapping[str, str] = os.environ,
               pid: int | None = None) -> Policy:
    """The policy of the process that serves with C{config}, whose pid is
    C{pid} (this one's by default)."""
    pid = os.getpid() if pid is None else pid
    gpu = serves_gpu(config, environ)
    read_only = [*python_paths(), *SYSTEM, f"/proc/{pid}"]
    read_write = [p for p in (config.cache_dir, config.compilation_cache_dir) if p]
    # Threads name each other through /proc/<pid>/task/<tid>/comm.
    written = [*DEVICES, f"/proc/{pid}/task"]
    read_only += [p for p in (config.model_repository, config.tls_cert, config.tls_key,
                              config.tls_client_ca, config.client_tokens_file) if p]
    connect = []
    if config.tracing == "otlp":
        read_only += NAMES
        connect.append(otlp_port(environ))
    if gpu:
        read_only += [*GPU_READ, *driver_folders(),
                      *(p for p in environ.get("LD_LIBRARY_PATH", "").split(":") if p)]
        read_only += [path for path in map(shutil.which, GPU_PROGRAMS) if path]
        written += glob.glob("/dev/nvidia*")
        read_write.append("/dev/shm")  # NCCL's buffers between devices
    elif config.allow_client_shm:
        # A standalone server opens its clients' shared-memory regions
        # itself; a node's workers are never given the option (their
        # gateway opens the regions).
        read_write.append("/dev/shm")
    return Policy(read_only=tuple(_absolute(read_only)), read_write=tuple(_absolute(read_write)),
                  written=tuple(written),
                  bind=() if config.grpc_port is None else (config.grpc_port,),
                  connect=tuple(connect), execute=gpu)


def python_paths() -> list[str]:
    """Python's installation (the prefixes, where a conda environment's
    own libraries also are) and every folder and archive it imports from,
    but the working folder, unless KCoral itself is imported from there."""
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    # C{python -m}, which starts every worker of a node, puts the working
    # folder on the import path: wherever the node was started (a home
    # folder, with its keys and the node's token file), never a folder of
    # Python's.
    here = os.getcwd()
    imported = [os.path.abspath(p or here) for p in sys.path]
    return list(dict.fromkeys([*prefixes, *(p for p in imported if p != here), _kcoral_root()]))


def _kcoral_root() -> str:
    """The folder KCoral is imported from (a source checkout's, where it is not installed)."""
    import kcoral

    return os.path.dirname(os.path.dirname(os.path.abspath(kcoral.__file__)))


def otlp_port(environ: Mapping[str, str]) -> int:
    """The TCP port of the collector OpenTelemetry's OTLP/HTTP exporter sends traces to."""
    url = urlsplit(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                   or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or OTLP_DEFAULT)
    return url.port or (443 if url.scheme == "https" else 80)


def driver_folders() -> list[str]:
    """The folders of NVIDIA's driver libraries as the dynamic linker knows
    them (C{ldconfig -p}): a container's runtime mounts them where it will."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        listing = subprocess.run([ldconfig, "-p"], capture_output=True, text=True,
                                 timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    folders = {os.path.dirname(line.rpartition(" => ")[2]) for line in listing.splitlines()
               if ("libcuda" in line or "libnvidia" in line) and " => " in line}
    return sorted(folders)


def _absolute(paths: list[str]) -> list[str]:
    return list(dict.fromkeys(os.path.abspath(os.path.expanduser(p)) for p in paths))
