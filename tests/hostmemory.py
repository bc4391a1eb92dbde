"""
Device memory over host memory, for tests without a GPU: an
L{IDeviceMemoryOpener} whose handles name files of one folder, which a
client process fills and reads as the region's memory (as a CUDA client
does its device allocation), mapped shared so that each process sees the
other's writes.

A handle is a file's name, NUL-padded to the 64 bytes of a CUDA IPC
handle (L{handle_of}). C{python -m tests.hostmemory FOLDER OPTIONS...}
runs C{kcoral server OPTIONS...} with this opener over C{FOLDER}: a
standalone server's, or a node's gateway's.
"""

from __future__ import annotations

import os
import sys

import attrs
import numpy as np
from zope.interface import implementer

from kcoral.errors import BadRequest
from kcoral.inference.cudasharedmemory import (
    HANDLE_BYTES,
    CudaRegistration,
    IDeviceMemoryOpener,
    IDeviceRegion,
)


def handle_of(name: str) -> bytes:
    """The handle of the file C{name} (at most 64 bytes of it)."""
    return name.encode().ljust(HANDLE_BYTES, b"\0")


@implementer(IDeviceMemoryOpener)
@attrs.define
class HostMemoryOpener:
    """Opens the files of C{folder} as device regions; C{closed} lists the
    names of the regions it let go, in order."""

    folder: str
    closed: list[str] = attrs.field(factory=list)

    def open(self, registration: CudaRegistration) -> IDeviceRegion:
        name = registration.handle.rstrip(b"\0").decode(errors="replace")
        path = os.path.join(self.folder, name)
        if "/" in name or not name or not os.path.isfile(path):
            raise BadRequest(f"failed to open CUDA shared memory region {registration.name!r}: "
                             "no memory of that handle")
        # As the CUDA opener asks the driver how much the handle exports.
        if os.path.getsize(path) < registration.byte_size:
            raise BadRequest(f"failed to register CUDA shared memory region "
                             f"{registration.name!r}: byte_size {registration.byte_size} runs "
                             "past the memory its handle exports")
        return HostRegion(np.memmap(path, np.uint8, "r+"), registration, self.closed)


@implementer(IDeviceRegion)
@attrs.define
class HostRegion:
    """A file's bytes, mapped, as a region of the CPU device's memory."""

    memory: np.memmap | None
    registration: CudaRegistration
    closed: list[str]

    def read_into(self, offset: int, view: memoryview) -> None:
        self.registration.within(offset, len(view))
        assert self.memory is not None, "read after close"
        np.frombuffer(view, np.uint8)[:] = self.memory[offset:offset + len(view)]

    def write(self, offset: int, data: memoryview) -> None:
        self.registration.within(offset, len(data))
        assert self.memory is not None, "written after close"
        self.memory[offset:offset + len(data)] = np.frombuffer(data, np.uint8)

    def close(self) -> None:
        self.memory = None
        self.closed.append(self.registration.name)


def main(folder: str, args: list[str]) -> int:
    """Run C{kcoral server ARGS} with regions opened over C{folder}: by the
    server, or by the node's gateway where ARGS make a node."""
    from kcoral.cli import run_service
    from kcoral.node.supervisor import make_supervisor_service
    from kcoral.server.service import ServerService
    from kcoral.taps.node import NodeOptions

    class Tap:
        @staticmethod
        def makeService(options: NodeOptions, reactor):
            if options.supervised:
                return make_supervisor_service(options, reactor, HostMemoryOpener(folder))
            return ServerService(options.server_config(), reactor,
                                 device_memory=HostMemoryOpener(folder))

    options = NodeOptions()
    options.parseOptions(args)
    return run_service(Tap, options)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
