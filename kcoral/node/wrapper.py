"""
C{--worker-wrapper "CMD ..."}: a command line each worker's own is run
under, for a confinement KCoral does not build itself (bubblewrap, nsjail,
gVisor's C{runsc}). The supervisor runs C{CMD ... python -m kcoral server
...}, and the wrapper must pass on to the worker what the supervisor gives
it:

 - its environment (already the worker's allow-list, L{kcoral.node.environment});
 - its file descriptors 0 to 3: on 0 a pipe whose end asks the worker to
   drain and exit (L{kcoral.cli}: a SIGTERM would reach the wrapper, which
   bubblewrap does not pass on), its output on 1 and 2, and on 3
   (L{kcoral.common.announce.URL_FD}) the pipe on which it tells the
   supervisor where it listens. bubblewrap keeps the descriptors it
   inherits; nsjail closes them unless told (C{--pass_fd 3});
 - the network on which the supervisor reaches the worker (no network
   namespace of its own);
 - and the worker's end: the supervisor's SIGKILL for a worker that does
   not drain in time reaches the wrapper, which must take the worker with
   it, as it must when the supervisor dies (bubblewrap's
   C{--die-with-parent}).
"""

from __future__ import annotations

import shlex
import shutil


def wrapper_argv(command: str | None) -> tuple[str, ...]:
    """The command line of C{--worker-wrapper} C{command}, its executable
    found on C{PATH} (a ValueError when it names none); () without one."""
    if command is None:
        return ()
    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise ValueError(f"--worker-wrapper {command!r}: {e}") from None
    if not argv:
        raise ValueError("--worker-wrapper names no command")
    found = shutil.which(argv[0])
    if found is None:
        raise ValueError(f"--worker-wrapper: {argv[0]} is not an executable on PATH")
    return (found, *argv[1:])
