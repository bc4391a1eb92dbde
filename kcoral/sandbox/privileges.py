"""
What a process that runs programs gives up of its privileges: it can never
gain one again (no_new_privs), leaves no core dump (which would hold the
inputs of every run) and cannot be read by a debugger of its user (not
dumpable), and holds no capability, whatever user it runs as (workers run
as root on many machines).

Through C{prctl} and C{capset} with ctypes: the standard library has
neither, and the bindings on PyPI that do need a C compiler and libcap's
headers for these few calls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource

_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def no_new_privs() -> None:
    """Neither this process nor what it starts can gain a privilege
    (set-user-ID files, file capabilities); Landlock and seccomp need it."""
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)


def no_core_dumps() -> None:
    """No core file, and not dumpable: no core either way, and a process of
    the same user may not attach to it or read its memory."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _prctl(_PR_SET_DUMPABLE, 0)


def drop_capabilities() -> None:
    """
    Empty the bounding set (when this process may: it needs CAP_SETPCAP,
    which a process of another user than root lacks, and then it has no
    capability to drop), the ambient set, then the effective, permitted
    and inheritable sets.
    """
    for capability in range(64):
        if _libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            # EINVAL past the kernel's last capability; EPERM without CAP_SETPCAP.
            if ctypes.get_errno() not in (errno.EINVAL, errno.EPERM):
                _raise()
            break
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    data = (_CapData * 2)()
    if _libc.capset(ctypes.byref(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)), data) != 0:
        _raise()


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        _raise()


def _raise() -> None:
    code = ctypes.get_errno()
    raise OSError(code, os.strerror(code))
