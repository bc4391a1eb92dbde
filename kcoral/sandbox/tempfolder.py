"""
The private temporary folder of a confined process: the one folder of
C{TMPDIR} it may write, made before it is confined and removed when it
ends, however it ends.

The process itself could not remove it: Landlock lets it remove what is
beneath the folder, not the folder, whose parent is the system's temporary
folder. Nor would an C{atexit} handler run when it is killed, crashes, or
leaves at once after a run past C{--max-run-seconds}. So a small remover
starts beside it, before it is confined: a Python without the process's
environment, files or session (a Ctrl+C in a terminal does not end it
first), reading a pipe only the process holds open, and removing the
folder when the pipe ends.

The remover is forked, not spawned: a fork runs the fork handlers of the
libraries the process loaded, and OpenBLAS's (numpy's) ends the threads it
started as it was loaded, to start them again at its next call -- then
inside the sandbox, which does not confine a thread that already runs.
"""

from __future__ import annotations

import os
import sys
import tempfile

#: The remover: wait for the end of its standard input, then remove the folder.
REMOVER = ("import os, shutil, sys\n"
           "while os.read(0, 512): pass\n"
           "shutil.rmtree(sys.argv[1], ignore_errors=True)\n")


def private_temporary_folder() -> str:
    """Make the folder, point C{TMPDIR} and L{tempfile} at it, start its remover."""
    folder = tempfile.mkdtemp(prefix="kcoral-")
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    # The write end is never closed: the kernel closes it as this process
    # ends, which is the remover's signal.
    read, _ = os.pipe()
    if os.fork() == 0:
        try:
            os.setsid()
            os.dup2(read, 0)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 1)
            os.dup2(null, 2)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            os.execve(sys.executable, [sys.executable, "-I", "-S", "-c", REMOVER, folder], {})
        finally:
            os._exit(127)
    os.close(read)
    return folder
