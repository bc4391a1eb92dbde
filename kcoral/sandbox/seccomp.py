"""
The seccomp filter of a process that runs programs: the system calls a
program has no use for, refused with EPERM (Python raises a clear
OSError; nothing is killed), in every thread at once (TSYNC).

Built with libseccomp (through C{pyseccomp}), which writes the BPF; what is
refused:

- starting another program (C{execve}, C{execveat}), unless the process
  serves a GPU (XLA runs C{ptxas} and C{nvlink});
- reading or changing another process (C{ptrace}, C{process_vm_readv},
  C{process_vm_writev}), the kernel's keyrings (C{keyctl}, C{add_key},
  C{request_key}), and what only an administrator does: mounts, namespaces
  (C{unshare}, C{setns}, and C{clone} with a namespace flag; C{clone3},
  whose flags a filter cannot read, says ENOSYS, and the C library falls
  back to C{clone}), C{bpf}, C{pivot_root}, C{kexec_*}, kernel modules,
  C{perf_event_open}, C{userfaultfd}, C{open_by_handle_at};
- C{io_uring}, whose operations (sockets among them) no filter sees;
- sockets but TCP and UNIX stream ones: datagram and raw sockets are not
  covered by Landlock's TCP rules, so UDP (DNS included) and raw IP are
  refused here.
"""

from __future__ import annotations

import errno
import socket

#: Refused with EPERM whatever their arguments.
REFUSED = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "fsopen", "fsmount", "fsconfig", "move_mount", "open_tree",
    "mount_setattr", "pivot_root", "unshare", "setns",
    "bpf", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "perf_event_open", "userfaultfd", "open_by_handle_at",
    "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)
#: Starting another program: refused but where the process serves a GPU.
EXECUTE = ("execve", "execveat")
#: The socket families, types and protocols a process may open.
FAMILIES = frozenset({socket.AF_UNIX, socket.AF_INET, socket.AF_INET6})
TYPES = frozenset({socket.SOCK_STREAM})
PROTOCOLS = frozenset({0, socket.IPPROTO_TCP})
#: The bits of socket()'s type that say it (the rest are SOCK_NONBLOCK and SOCK_CLOEXEC).
TYPE_MASK = 0xF
#: The flags of clone() that make a namespace.
NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
              0x40000000)  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET


def available() -> str | None:
    """None if a filter can be made here, or why not. Called before Landlock
    applies: C{pyseccomp}'s import finds libseccomp by running C{ldconfig}."""
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, RuntimeError) as e:  # not installed; libseccomp not found
        return f"seccomp: {e}"
    return None


def outside(allowed: frozenset[int], bits: int = 32) -> list[tuple[int, int]]:
    """
    The values of C{bits} bits not in C{allowed}, as (mask, value) pairs:
    a number C{n} is outside iff C{n & mask == value} for one of them. A
    filter compares a system call's 64-bit register, but the kernel reads an
    C{int} argument's low 32 bits only, whatever the high ones hold; so
    each argument is matched as its low bits, and the values refused are
    listed rather than the allowed ones (a rule can only add a refusal).
    The pairs are the subtrees of the values' binary tree that hold no
    allowed value: at most C{bits} per allowed value.
    """
    pairs = []

    def walk(prefix: int, depth: int, inside: frozenset[int]) -> None:
        if not inside:
            mask = ((1 << depth) - 1) << (bits - depth)
            pairs.append((mask, prefix << (bits - depth)))
        elif depth < bits:
            bit = bits - depth - 1
            for b in (0, 1):
                walk(prefix << 1 | b, depth + 1, frozenset(v for v in inside if v >> bit & 1 == b))

    walk(0, 0, frozenset(v for v in allowed if 0 <= v < 1 << bits))
    return pairs


def install(*, execute: bool) -> None:
    """Load the filter on every thread of this process (after
    no_new_privs). An OSError if the kernel refuses it."""
    import pyseccomp as sc

    refuse = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.CTL_TSYNC, 1)
    # A system call of another architecture (x86-64's 32-bit ones) is no
    # Python's: only code injected into the process makes one.
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    for name in REFUSED + (() if execute else EXECUTE):
        f.add_rule(refuse, name)
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in NAMESPACES:
        f.add_rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for arg, allowed, bits in ((0, FAMILIES, 32), (1, TYPES, 4), (2, PROTOCOLS, 32)):
        for mask, value in outside(allowed, bits):
            f.add_rule(refuse, "socket", sc.Arg(arg, sc.MASKED_EQ, mask, value))
    f.load()
