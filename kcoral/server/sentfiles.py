"""
A model's files sent with its load: written to a private folder of their own
(in the server's cache folder, else its temporary folder: the only places a
confined server writes), read from there as a model folder of the repository
is, and removed once the load is over, whatever its outcome: a loaded model
keeps nothing open in its folder.

The paths were checked by the front that took them
(L{kcoral.inference.front.unsafe_path}): relative, no C{..}, no empty
component. The folder is new and only this writes in it, so no link can
stand on a path; files are still created exclusively and without following
links, and two paths that collide (C{a} and C{a/b}) fail the load.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

#: The start of each load's folder name.
PREFIX = "kcoral-load-"


class SentFilesError(Exception):
    """The files could not be written; the message says which and why."""


@contextmanager
def sent_folder(files: Mapping[str, bytes], parent: str | None) -> Iterator[str]:
    """A new folder in C{parent} (None: the temporary folder) that holds
    C{files}, by relative path, for the block; removed after it. It writes
    to disk: call it off the reactor."""
    try:
        root = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    except OSError as e:
        raise SentFilesError(f"cannot make a folder for the files: {e.strerror}") from None
    try:
        for path, data in files.items():
            _write(root, path, data)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _write(root: str, path: str, data: bytes) -> None:
    folder, _, _ = path.rpartition("/")
    try:
        if folder:
            os.makedirs(os.path.join(root, folder), mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(root, path),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
    except OSError as e:
        raise SentFilesError(f"{path[:300]!r}: {e.strerror}") from None
