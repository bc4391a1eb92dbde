"""
Device memory over host memory, for tests without a GPU: an
L{IDeviceMemoryOpener} whose handles name files of one folder, which a
client process fills and reads as the region's memory (as a CUDA client
does its device allocation), mapped shared so that each process sees the
other's writes. Reads and writes go through JAX arrays on the CPU device,
as the CUDA opener's go through arrays on the GPU.

A handle is a file's name, NUL-padded to the 64 bytes of a CUDA IPC
handle (L{handle_of}). C{python -m tests.hostmemory FOLDER OPTIONS...}
runs C{kcoral server OPTIONS...} with this opener over C{FOLDER}.
"""

from __future__ import annotations

import os
import sys
from typing import Any

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

    @property
    def device(self) -> Any:
        import jax

        return jax.devices("cpu")[0]

    def read(self, offset: int, size: int) -> Any:
        import jax

        self.registration.within(offset, size)
        assert self.memory is not None, "read after close"
        return jax.device_put(np.array(self.memory[offset:offset + size]), self.device)

    def write(self, offset: int, data: Any) -> None:
        self.registration.within(offset, data.nbytes)
        assert self.memory is not None, "written after close"
        self.memory[offset:offset + data.nbytes] = np.asarray(data)

    def close(self) -> None:
        self.memory = None
        self.closed.append(self.registration.name)


def main(folder: str, args: list[str]) -> int:
    """Run C{kcoral server ARGS} with regions opened over C{folder}."""
    from kcoral.cli import run_service
    from kcoral.server.service import ServerService
    from kcoral.taps.node import NodeOptions

    class Tap:
        @staticmethod
        def makeService(options: NodeOptions, reactor) -> ServerService:
            return ServerService(options.server_config(), reactor,
                                 device_memory=HostMemoryOpener(folder))

    options = NodeOptions()
    options.parseOptions(args)
    return run_service(Tap, options)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
