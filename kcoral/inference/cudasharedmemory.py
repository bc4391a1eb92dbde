"""
CUDA shared memory, Triton's extension: a client on the same host allocates
memory on a GPU, exports it as a CUDA IPC handle (64 opaque bytes), and
registers the handle as a named region; inferences then name the region
instead of carrying an input's or an output's bytes.

Only a process that holds that GPU can open the handle: a standalone server
on the GPU, whose front and runs are one process. It opens a region as it
is registered, through an L{IDeviceMemoryOpener} (the CUDA one,
L{CudaIpcOpener}, imports cuda-python when it first opens a region, so
nothing else needs it installed), and keeps it in the registry of its
system shared-memory regions, one namespace of names per client token as
in Triton; an inference names either kind the same way
(L{kcoral.inference.sharedmemory}). A node's gateway and a Router hold no
GPU, and refuse registration naming where to register instead; so does a
server without a GPU, after the request itself is checked.
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
from zope.interface import Attribute, Interface, implementer

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
           "CudaRegistration", "CudaSharedMemory", "IDeviceMemoryOpener", "IDeviceRegion"]

#: The size of a CUDA IPC memory handle (C{cudaIpcMemHandle_t}).
HANDLE_BYTES = 64
#: Why registration is refused where no worker holds a GPU.
NO_GPU = "CUDA shared memory is not served: no worker of this service holds a GPU"
#: Why a server on a GPU refuses it where it was not told to serve it.
CUDA_OFF = "CUDA shared memory is off: start the server with --allow-client-shm to serve it"
#: Why a server on a GPU refuses it where it lacks cuda-python's bindings.
NO_BINDINGS = ("CUDA shared memory is not served: this server lacks cuda-python's bindings "
               "(install kcoral[cuda] beside it)")
#: Why a node's gateway and a Router refuse it.
NOT_HERE = ("CUDA shared memory is served only by a standalone server on the region's GPU "
            "(kcoral server --allow-client-shm): a node's gateway and a Router hold no GPU, "
            "and do not pass a region on to the worker that holds its device")
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
    """A region of device memory opened from another process's handle."""

    device = Attribute("The JAX device it is on.")

    def read(offset: int, size: int) -> Any:
        """C{size} bytes from C{offset}, as a one-dimensional uint8 JAX array
        on the region's device."""

    def write(offset: int, data: Any) -> None:
        """The bytes of the JAX array C{data}, on the region's device, at C{offset}."""

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
    the region and JAX arrays on the same device with device-to-device
    copies: nothing goes through the host.
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

    @property
    def device(self) -> Any:
        import jax

        return jax.devices("gpu")[self._registration.device_id]

    def read(self, offset: int, size: int) -> Any:
        import jax.numpy as jnp

        self._registration.within(offset, size)
        # A fresh array of the size, which nothing else holds: the copy
        # overwrites it in place before it is handed out.
        out = jnp.zeros((size,), jnp.uint8, device=self.device).block_until_ready()
        self._copy(out.unsafe_buffer_pointer(), self._pointer + offset, size)
        return out

    def write(self, offset: int, data: Any) -> None:
        self._registration.within(offset, data.nbytes)
        data.block_until_ready()
        self._copy(self._pointer + offset, data.unsafe_buffer_pointer(), data.nbytes)

    def _copy(self, to: int, source: int, size: int) -> None:
        _checked(self._runtime, self._runtime.cudaMemcpy(
            to, source, size, self._runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice),
            self._registration)
        # A copy between device buffers may still run when cudaMemcpy
        # returns, and JAX's streams do not wait for the default one.
        _checked(self._runtime, self._runtime.cudaDeviceSynchronize(), self._registration)

    def close(self) -> None:
        self._runtime.cudaIpcCloseMemHandle(self._pointer)


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
        np.frombuffer(view, np.uint8)[:] = np.asarray(self.opened.read(offset, len(view)))

    def write(self, offset: int, data: memoryview) -> None:
        import jax

        self.opened.write(offset, jax.device_put(np.frombuffer(data, np.uint8), self.opened.device))


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
