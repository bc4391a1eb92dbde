"""
Landlock: the kernel's own confinement of a process's files, TCP ports,
signals and abstract UNIX sockets, which an unprivileged process applies
to itself.

Written here over its three system calls (ctypes), because no binding on
PyPI is kept up with the kernel's versions of it (its ABI: TCP ports came
at 4, device ioctls at 5, scopes at 6), and three calls are all it takes.
Every access right the running kernel knows is handled, so what no rule
grants is refused; a right the kernel does not know is neither handled
nor granted.
"""

from __future__ import annotations

import ctypes
import os
import stat
from collections.abc import Iterable

# The same numbers on x86-64 and ARM64 (the system calls came after their
# tables were unified).
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2

# File system rights, each with the ABI that brought it.
EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
IOCTL_DEV = 1 << 15  # ABI 5
# TCP rights (ABI 4) and scopes (ABI 6).
BIND_TCP = 1 << 0
CONNECT_TCP = 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1

#: What a rule on a file (not a folder) may grant: the rest are rights on a
#: folder's entries, which the kernel refuses on a file.
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
#: Read (and run) what is there.
READ = EXECUTE | READ_FILE | READ_DIR
#: Make, change and remove files and folders (no devices: MAKE_CHAR and
#: MAKE_BLOCK are never granted).
WRITE = WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO \
    | MAKE_SYM | REFER | TRUNCATE
#: The first ABI that has TCP rules, device ioctls, and scopes.
TCP_ABI, IOCTL_ABI, SCOPE_ABI = 4, 5, 6

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _RulesetAttr(ctypes.Structure):
    # A kernel of an older ABI takes the whole structure as long as the
    # fields it does not know are zero.
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # packed in the kernel's header
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPortAttr(ctypes.Structure):
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def abi() -> int:
    """The Landlock ABI of the running kernel: 0 when it has none (too old,
    or Landlock not among its security modules)."""
    version = _libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0),
                            ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(int(version), 0)


def handled_fs(version: int) -> int:
    """The file system rights a kernel of ABI C{version} knows."""
    rights = (1 << 13) - 1
    if version >= 2:
        rights |= REFER
    if version >= 3:
        rights |= TRUNCATE
    if version >= IOCTL_ABI:
        rights |= IOCTL_DEV
    return rights


def restrict(version: int, paths: Iterable[tuple[str, int]], *, bind: Iterable[int] = (),
             connect: Iterable[int] = ()) -> None:
    """
    Confine the calling thread, and every thread and process it starts
    after, to C{paths} (each a path and the rights granted beneath it; one
    that does not exist, or that this process cannot reach, is left out),
    TCP C{bind} and C{connect} ports (ABI 4), and its own signals and
    abstract UNIX sockets (ABI 6). Needs no_new_privs. An OSError if the
    kernel refuses.
    """
    fs = handled_fs(version)
    attr = _RulesetAttr(fs, BIND_TCP | CONNECT_TCP if version >= TCP_ABI else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if version >= SCOPE_ABI else 0)
    ruleset = _call(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                    ctypes.c_uint32(0))
    try:
        for path, rights in paths:
            _add_path(ruleset, path, rights & fs)
        if version >= TCP_ABI:
            ports: dict[int, int] = {}
            for port in bind:
                ports[port] = ports.get(port, 0) | BIND_TCP
            for port in connect:
                ports[port] = ports.get(port, 0) | CONNECT_TCP
            for port, rights in sorted(ports.items()):
                rule = _NetPortAttr(rights, port)
                _call(_ADD_RULE, ruleset, _RULE_NET_PORT, ctypes.byref(rule), ctypes.c_uint32(0))
        _call(_RESTRICT_SELF, ruleset, ctypes.c_uint32(0))
    finally:
        os.close(ruleset)


def _add_path(ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:  # missing, or out of this user's reach: nothing to grant
        return
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= FILE_RIGHTS
        rule = _PathBeneathAttr(rights, fd)
        _call(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0))
    finally:
        os.close(fd)


def _call(number: int, *args) -> int:
    result = _libc.syscall(number, *args)
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return int(result)
