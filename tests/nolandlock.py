"""
Run a command on this kernel as if it had no Landlock: a seccomp filter
answers ENOSYS to C{landlock_create_ruleset}, as a kernel without it does,
then the command replaces this process (the filter stays with it).

    python tests/nolandlock.py COMMAND [ARG...]
"""

from __future__ import annotations

import errno
import os
import sys

import pyseccomp as sc

LANDLOCK_CREATE_RULESET = 444

if __name__ == "__main__":
    hidden = sc.SyscallFilter(sc.ALLOW)
    hidden.add_rule(sc.ERRNO(errno.ENOSYS), LANDLOCK_CREATE_RULESET)
    hidden.load()
    os.execv(sys.argv[1], sys.argv[1:])
