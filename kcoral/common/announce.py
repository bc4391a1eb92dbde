"""
How a supervised server tells its supervisor where it listens: on a pipe of
its own, the file descriptor named by C{URL_FD_ENV}, one line holding its URL.
Its log says the same for people; the pipe is for the program, so no log
format is ever parsed.
"""

from __future__ import annotations

import os

#: The environment variable that names the child's end of the pipe.
URL_FD_ENV = "KCORAL_URL_FD"
#: The descriptor the supervisor gives the pipe in its children.
URL_FD = 3


def announce(url: str) -> None:
    """Write C{url} on the supervisor's pipe, when there is one, and close it."""
    fd = os.environ.pop(URL_FD_ENV, None)
    if fd is None:
        return
    try:
        os.write(int(fd), url.encode("utf-8") + b"\n")
    finally:
        os.close(int(fd))
