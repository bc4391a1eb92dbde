"""
CUDA shared memory, Triton's extension: a client on the same host allocates
memory on a GPU, exports it as a CUDA IPC handle (64 opaque bytes), and
registers the handle as a named region; inferences then name the region
instead of carrying an input's or an output's bytes.

Only a process that holds that GPU can open the handle, and no front holds
one: a front keeps the registry (by client token, as for system shared
memory) and a worker on the region's device opens it, through an
L{IDeviceMemoryOpener}. The CUDA one, L{CudaIpcOpener}, imports cuda-python
when it first opens a region, so nothing else needs it installed. Where no
worker holds a GPU, the registry is empty and registration is refused with
the reason, after the request itself is checked.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib
from typing import Any

import attrs
from zope.interface import Interface, implementer

from kcoral.errors import BadRequest
from kcoral.inference.sharedmemory import MAX_NAME_CHARS, MAX_REGIONS, Caller

__all__ = ["HANDLE_BYTES", "NO_GPU", "CudaIpcOpener", "CudaRegistration", "CudaSharedMemory",
           "IDeviceMemoryOpener", "IDeviceRegion"]

#: The size of a CUDA IPC memory handle (C{cudaIpcMemHandle_t}).
HANDLE_BYTES = 64
#: Why registration is refused where no worker holds a GPU.
NO_GPU = "CUDA shared memory is not served: no worker of this service holds a GPU"
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


class IDeviceRegion(Interface):
    """A region of device memory opened from another process's handle."""

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
        runtime = importlib.import_module("cuda.bindings.runtime")
        driver = importlib.import_module("cuda.bindings.driver")
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

    def read(self, offset: int, size: int) -> Any:
        import jax
        import jax.numpy as jnp

        self._within(offset, size)
        device = jax.devices("gpu")[self._registration.device_id]
        # A fresh array of the size, which nothing else holds: the copy
        # overwrites it in place before it is handed out.
        out = jnp.zeros((size,), jnp.uint8, device=device).block_until_ready()
        self._copy(out.unsafe_buffer_pointer(), self._pointer + offset, size)
        return out

    def write(self, offset: int, data: Any) -> None:
        self._within(offset, data.nbytes)
        data.block_until_ready()
        self._copy(self._pointer + offset, data.unsafe_buffer_pointer(), data.nbytes)

    def _within(self, offset: int, size: int) -> None:
        if not 0 <= offset <= offset + size <= self._registration.byte_size:
            raise BadRequest(f"Invalid offset + byte size for shared memory region: "
                             f"{self._registration.name[:64]!r}")

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


class CudaSharedMemory:
    """
    The CUDA shared-memory regions of one front, by client token (with
    C{namespaced} False, where the service has no tokens, one namespace).
    C{refused}: why registration is refused (None: it is served); a region
    is at most C{max_bytes}.
    """

    def __init__(self, *, refused: str | None = NO_GPU, max_bytes: int = MAX_BYTE_SIZE,
                 namespaced: bool = False):
        self.refused = refused
        self._max_bytes = max_bytes
        self._namespaced = namespaced
        self._regions: dict[bytes, dict[str, CudaRegistration]] = {}

    def _space(self, caller: Caller) -> bytes:
        # A digest: the token itself is never kept.
        if not self._namespaced or caller.token is None:
            return b""
        return hashlib.sha256(caller.token).digest()

    def registration(self, name: str, body: object) -> CudaRegistration:
        """What a REST body asks to register as C{name}, checked."""
        return CudaRegistration.of_rest(name, body, max_bytes=self._max_bytes)

    def checked(self, name: object, handle: object, device_id: object, byte_size: object
                ) -> CudaRegistration:
        """What a gRPC request asks to register, checked."""
        return CudaRegistration.checked(name, handle, device_id, byte_size,
                                        max_bytes=self._max_bytes)

    def register(self, caller: Caller, registration: CudaRegistration) -> None:
        """Register a checked region for C{caller}; L{BadRequest} says why not."""
        if self.refused is not None:
            raise BadRequest(self.refused)
        regions = self._regions.setdefault(self._space(caller), {})
        if registration.name in regions:
            raise BadRequest(f"shared memory region {registration.name[:64]!r} already in manager")
        if len(regions) >= MAX_REGIONS:
            raise BadRequest(f"failed to register CUDA shared memory region "
                             f"{registration.name[:64]!r}: {MAX_REGIONS} regions are already "
                             "registered")
        regions[registration.name] = registration

    def unregister(self, caller: Caller, name: str | None) -> None:
        """Unregister C{caller}'s region C{name} (None: all of them); one
        not registered is already gone, as Triton answers."""
        regions = self._regions.get(self._space(caller), {})
        if name is None:
            regions.clear()
        else:
            regions.pop(name, None)

    def status(self, caller: Caller, name: str | None) -> list[dict]:
        """The status of C{caller}'s region C{name} (None: all of them)."""
        regions = self._regions.get(self._space(caller), {})
        return [r.status() for n, r in regions.items() if name is None or n == name]
