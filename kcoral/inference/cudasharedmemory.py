"""
CUDA shared memory, Triton's extension: a client on the same host allocates
memory on a GPU, exports it as a CUDA IPC handle (64 opaque bytes), and
registers the handle as a named region; inferences then name the region
instead of carrying an input's or an output's bytes.

Only a process on the GPU's host can open the handle: the front that the
client registers with, a standalone server or a node's gateway. It opens a
region as it is registered, through an L{IDeviceMemoryOpener} (the CUDA
one, L{CudaIpcOpener}, imports cuda-python when it first opens a region,
so nothing else needs it installed), and keeps it in the registry of its
system shared-memory regions, one namespace of names per client token as
in Triton; an inference names either kind the same way
(L{kcoral.inference.sharedmemory}), and the front copies a region's slice
to or from the inference's bytes on the host, as it reads and writes a
system region, whichever worker and device then run the model. A Router,
whose clients are on other hosts, refuses registration; so does a front
without a GPU, after the request itself is checked.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import weakref
from typing import Any

import attrs
import numpy as np
from twisted.internet.defer import Deferred, fail
from twisted.logger import Logger
from zope.interface import Interface, implementer

from kcoral.common.offreactor import off_reactor
from kcoral.errors import BadRequest
from kcoral.inference.sharedmemory import (
    IN_THREAD,
    MAX_NAME_CHARS,
    NOT_LOOPBACK,
    OFF,
    Caller,
    IRegion,
    SharedMemory,
)

__all__ = ["CUDA", "CUDA_OFF", "HANDLE_BYTES", "NOT_HERE", "NO_BINDINGS", "NO_GPU", "CudaIpcOpener",
           "CudaRegistration", "CudaSharedMemory", "IDeviceMemoryOpener", "IDeviceRegion",
           "refusal"]

log = Logger()

#: The size of a CUDA IPC memory handle (C{cudaIpcMemHandle_t}).
HANDLE_BYTES = 64
#: Why registration is refused where no worker holds a GPU.
NO_GPU = "CUDA shared memory is not served: no worker of this service holds a GPU"
#: Why a server on a GPU refuses it where it was not told to serve it.
CUDA_OFF = "CUDA shared memory is off: start the server with --allow-client-shm to serve it"
#: Why a front on a GPU host refuses it where it lacks cuda-python's bindings.
NO_BINDINGS = ("CUDA shared memory is not served: this service lacks cuda-python's bindings "
               "(install kcoral[cuda] beside it)")
#: Why a Router refuses it.
NOT_HERE = ("CUDA shared memory is served only on the region's host, by a standalone server or "
            "a node's gateway (--allow-client-shm): a Router's clients are on other hosts")


def refusal(on_gpu: bool, allowed: bool) -> str | None:
    """Why a front on a host with a GPU (C{on_gpu}) whose clients' shared
    memory is C{allowed} (--allow-client-shm) refuses CUDA regions; None:
    it serves them."""
    if not on_gpu:
        return NO_GPU
    return None if allowed else CUDA_OFF


#: The kind of a CUDA region (L{kcoral.inference.sharedmemory.IRegion}).
CUDA = "cuda"
#: The largest device number a request may name.
MAX_DEVICE_ID = 1023
#: The most bytes a region may hold where no bound is given: what gRPC's
#: field carries.
MAX_BYTE_SIZE = 2**64 - 1


@attrs.frozen
class CudaRegistration:
    """A region to register: C{byte_size} bytes of device C{device_id}'s
    memory, exported by its owner as the IPC handle C{handle}."""

    name: str
    handle: bytes
    device_id: int
    byte_size: int

    @classmethod
    def checked(cls, name: object, handle: object, device_id: object, byte_size: object, *,
                max_bytes: int) -> CudaRegistration:
        """The registration of these values, or L{BadRequest} saying what is wrong."""
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
            raise BadRequest(f"a region's name must be 1 to {MAX_NAME_CHARS} characters")
        if not isinstance(handle, bytes) or len(handle) != HANDLE_BYTES:
            raise BadRequest(f"failed to register CUDA shared memory region {name[:64]!r}: "
                             f"raw_handle must be a CUDA IPC handle of {HANDLE_BYTES} bytes")
        if type(device_id) is not int or not 0 <= device_id <= MAX_DEVICE_ID:
            raise BadRequest(f"failed to register CUDA shared memory region {name[:64]!r}: "
                             "device_id must be a device number")
        if type(byte_size) is not int or not 1 <= byte_size <= max_bytes:
            raise BadRequest(f"failed to register CUDA shared memory region {name[:64]!r}: "
                             f"byte_size must be a count of bytes from 1 to {max_bytes}")
        return cls(name, handle, device_id, byte_size)

    @classmethod
    def of_rest(cls, name: str, body: object, *, max_bytes: int) -> CudaRegistration:
        """The registration a REST body asks for: C{raw_handle} is
        C{{"b64": ...}}, the handle in base64."""
        if not isinstance(body, dict):
            raise BadRequest("a registration is a JSON object with raw_handle, device_id and byte_size")
        raw = body.get("raw_handle")
        encoded = raw.get("b64") if isinstance(raw, dict) else None
        handle: object = None
        if isinstance(encoded, str):
            try:
                handle = base64.b64decode(encoded.encode("ascii"), validate=True)
            except (UnicodeEncodeError, binascii.Error):
                handle = None
        return cls.checked(name, handle, body.get("device_id"), body.get("byte_size"),
                           max_bytes=max_bytes)

    def status(self) -> dict:
        """Its status, in Triton's form."""
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def within(self, offset: int, size: int) -> None:
        """L{BadRequest} unless C{size} bytes from C{offset} lie within the
        region: an opener checks every copy, so that none runs past the
        client's allocation (and faults the device's context)."""
        if not 0 <= offset <= offset + size <= self.byte_size:
            raise BadRequest(f"Invalid offset + byte size for shared memory region: "
                             f"{self.name[:64]!r}")


class IDeviceRegion(Interface):
    """A region of device memory opened from another process's handle; its
    copies wait on the device (call them in a thread)."""

    def read_into(offset: int, view: memoryview) -> None:
        """Copy C{len(view)} bytes from C{offset} into the host memory C{view}."""

    def write(offset: int, data: memoryview) -> None:
        """Copy the host memory C{data} to C{offset}."""

    def close() -> None:
        """Let the region go (its owner's memory stays allocated)."""


class IDeviceMemoryOpener(Interface):
    """Opens regions that clients register, in the process that holds their device."""

    def open(registration: CudaRegistration) -> IDeviceRegion:
        """The region C{registration} names, or L{BadRequest} saying why not."""


@implementer(IDeviceMemoryOpener)
class CudaIpcOpener:
    """
    Opens a CUDA IPC handle with C{cudaIpcOpenMemHandle}. Bytes move between
    the region and the host with C{cudaMemcpy}: the one copy across the bus
    that the front's inference bytes need either way, and no JAX, so that
    a gateway, which runs no model, opens a region as a server does.
    """

    def open(self, registration: CudaRegistration) -> IDeviceRegion:
        try:
            runtime = importlib.import_module("cuda.bindings.runtime")
            driver = importlib.import_module("cuda.bindings.driver")
        except ImportError:
            # The server's environment, not the request, is at fault; but
            # each registration would otherwise be an internal error and a
            # traceback in the log, saying nothing of the fix.
            raise BadRequest(NO_BINDINGS) from None
        _checked(runtime, runtime.cudaSetDevice(registration.device_id), registration)
        handle = runtime.cudaIpcMemHandle_t()
        handle.reserved = registration.handle
        pointer = int(_checked(runtime, runtime.cudaIpcOpenMemHandle(
            handle, runtime.cudaIpcMemLazyEnablePeerAccess), registration))
        # The client says how large its region is; what the handle exports
        # says how large it is: a copy past its end would fault the
        # worker's device context, and every model on it.
        error, base, size = driver.cuMemGetAddressRange(pointer)
        if error != driver.CUresult.CUDA_SUCCESS or int(base) + int(size) < pointer + registration.byte_size:
            runtime.cudaIpcCloseMemHandle(pointer)
            raise BadRequest(f"failed to register CUDA shared memory region {registration.name[:64]!r}: "
                             f"byte_size {registration.byte_size} runs past the memory its handle "
                             "exports")
        return _CudaRegion(runtime, pointer, registration)


@implementer(IDeviceRegion)
@attrs.define
class _CudaRegion:
    _runtime: Any
    _pointer: int
    _registration: CudaRegistration

    def read_into(self, offset: int, view: memoryview) -> None:
        self._registration.within(offset, len(view))
        host = np.frombuffer(view, np.uint8)
        self._copy(host.ctypes.data, self._pointer + offset, host.nbytes,
                   self._runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost)

    def write(self, offset: int, data: memoryview) -> None:
        self._registration.within(offset, len(data))
        host = np.frombuffer(data, np.uint8)
        self._copy(self._pointer + offset, host.ctypes.data, host.nbytes,
                   self._runtime.cudaMemcpyKind.cudaMemcpyHostToDevice)
        # A copy to the device from pageable memory may still run when
        # cudaMemcpy returns, and the client reads its region once answered;
        # one to the host (read_into) has ended when it returns.
        _checked(self._runtime, self._runtime.cudaDeviceSynchronize(), self._registration)

    def _copy(self, to: int, source: int, size: int, kind: Any) -> None:
        # The device is a thread's setting, and copies run in whichever
        # thread of the pool is free.
        _checked(self._runtime, self._runtime.cudaSetDevice(self._registration.device_id),
                 self._registration)
        _checked(self._runtime, self._runtime.cudaMemcpy(to, source, size, kind),
                 self._registration)

    def close(self) -> None:
        # In whichever thread lets go of the region last (its device set
        # first, else device 0 is used, in a context made for it), for no
        # request: a failure is logged.
        runtime, registration = self._runtime, self._registration
        error, *_ = runtime.cudaSetDevice(registration.device_id)
        if error == runtime.cudaError_t.cudaSuccess:
            error, *_ = runtime.cudaIpcCloseMemHandle(self._pointer)
        if error != runtime.cudaError_t.cudaSuccess:
            log.warn("CUDA shared memory region {name!r} on device {device} was not closed: "
                     "{error}", name=registration.name[:64], device=registration.device_id,
                     error=error.name)


def _checked(runtime: Any, result: tuple, registration: CudaRegistration) -> Any:
    """The value of a CUDA runtime call's C{(error, value...)}, or L{BadRequest}."""
    error, *values = result
    if error != runtime.cudaError_t.cudaSuccess:
        raise BadRequest(f"failed to open CUDA shared memory region {registration.name[:64]!r} on "
                         f"device {registration.device_id}: {error.name}")
    return values[0] if values else None


@implementer(IRegion)
@attrs.frozen(eq=False)
class _DeviceRegion:
    """A registered CUDA region, opened; let go once no one holds it (its
    registry, an inference in flight that names it)."""

    registration: CudaRegistration
    opened: IDeviceRegion
    kind = CUDA
    on_device = True

    def __attrs_post_init__(self) -> None:
        weakref.finalize(self, self.opened.close)

    @property
    def name(self) -> str:
        return self.registration.name

    @property
    def byte_size(self) -> int:
        return self.registration.byte_size

    def status(self) -> dict:
        return self.registration.status()

    def read_into(self, offset: int, view: memoryview) -> None:
        # The inference's binary tensor is on the host: the model's input
        # is placed on the device from it, as any other input.
        self.opened.read_into(offset, view)

    def write(self, offset: int, data: memoryview) -> None:
        self.opened.write(offset, data)


class CudaSharedMemory:
    """
    The CUDA shared-memory regions of one front, kept in C{shared}'s
    registry beside its system ones. C{refused}: why registration is
    refused (None: it is served, each region opened with C{opener}); a
    region is at most C{max_bytes}.
    """

    def __init__(self, shared: SharedMemory | None = None, *, refused: str | None = NOT_HERE,
                 opener: IDeviceMemoryOpener | None = None, max_bytes: int = MAX_BYTE_SIZE):
        self.refused = refused
        self._shared = shared or SharedMemory(refused=OFF, max_bytes=0)
        self._opener = opener or CudaIpcOpener()
        self._max_bytes = max_bytes

    def registration(self, name: str, body: object) -> CudaRegistration:
        """What a REST body asks to register as C{name}, checked."""
        return CudaRegistration.of_rest(name, body, max_bytes=self._max_bytes)

    def checked(self, name: object, handle: object, device_id: object, byte_size: object
                ) -> CudaRegistration:
        """What a gRPC request asks to register, checked."""
        return CudaRegistration.checked(name, handle, device_id, byte_size,
                                        max_bytes=self._max_bytes)

    def register(self, caller: Caller, registration: CudaRegistration) -> Deferred[None]:
        """Open and register a checked region for C{caller} (in a thread:
        opening waits on the device); L{BadRequest} says why not."""
        if self.refused is not None:
            return fail(BadRequest(self.refused))
        if not caller.local:
            return fail(BadRequest(NOT_LOOPBACK))
        try:
            self._shared.room(caller, registration.name)
        except BadRequest:
            return fail()
        # Added on the reactor once open; a region that lost a race for
        # its name is let go as it is dropped.
        return off_reactor(IN_THREAD, self._opener.open, registration).addCallback(
            lambda opened: self._shared.add(caller, _DeviceRegion(registration, opened)))

    def unregister(self, caller: Caller, name: str | None) -> None:
        """Unregister C{caller}'s region C{name} (None: all of them); one
        not registered is already gone, as Triton answers."""
        self._shared.remove(caller, name, CUDA)

    def status(self, caller: Caller, name: str | None) -> list[dict]:
        """The status of C{caller}'s region C{name} (None: all of them)."""
        return [r.status() for r in self._shared.regions(caller, CUDA) if name in (None, r.name)]
