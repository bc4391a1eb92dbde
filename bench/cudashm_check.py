"""
CUDA shared memory on a GPU, as Triton's clients share it: this process
allocates device memory, fills it and exports it as a CUDA IPC handle (as
``tritonclient.utils.cuda_shared_memory`` does: ``cudaMalloc``,
``cudaIpcGetMemHandle``, the handle's 64 bytes in base64); a second process
registers the handle from the JSON body Triton's HTTP client sends, opens it
with KCoral's opener (kcoral.inference.cudasharedmemory.CudaIpcOpener),
reads it into a JAX array, checks it, and writes its bytes plus one back;
it also checks that a size past the exported memory, and a read past the
region, are refused.
This process then checks what it finds in its memory.

    python3 -m bench.cudashm_check --gpus 0

The last line says what was found; the exit status is 0 only if both
processes saw the right bytes. An IPC handle cannot be opened by the
process that made it, hence two.
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys

import numpy as np

SIZE = 1 << 20


def _call(runtime, result):
    error, *values = result
    assert error == runtime.cudaError_t.cudaSuccess, error
    return values[0] if values else None


def owner(device: int) -> int:
    """Allocate, fill and export a region; let another process open it; check it."""
    from cuda.bindings import runtime

    _call(runtime, runtime.cudaSetDevice(device))
    pointer = _call(runtime, runtime.cudaMalloc(SIZE))
    data = (np.arange(SIZE) % 251).astype(np.uint8)
    _call(runtime, runtime.cudaMemcpy(pointer, data.ctypes.data, SIZE,
                                      runtime.cudaMemcpyKind.cudaMemcpyHostToDevice))
    handle = _call(runtime, runtime.cudaIpcGetMemHandle(pointer))
    body = json.dumps({"raw_handle": {"b64": base64.b64encode(bytes(handle.reserved)).decode()},
                       "device_id": device, "byte_size": SIZE})
    try:
        opened = subprocess.run([sys.executable, "-m", "bench.cudashm_check", "--open", body], timeout=120)
        if opened.returncode != 0:
            print(f"the opening process failed (exit {opened.returncode})")
            return 1
        back = np.empty(SIZE, np.uint8)
        _call(runtime, runtime.cudaMemcpy(back.ctypes.data, pointer, SIZE,
                                          runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost))
    finally:
        _call(runtime, runtime.cudaFree(pointer))
    if not np.array_equal(back, data + 1):
        print("the region does not hold what the other process wrote")
        return 1
    print(f"CUDA shared memory on GPU {device}: {SIZE} bytes registered from Triton's JSON, "
          "opened in another process, read into JAX and written back, bit for bit")
    return 0


def opener(body: str) -> int:
    """Open the region a registration body names, as a worker on its device would."""
    import attrs
    import jax

    from kcoral.errors import BadRequest
    from kcoral.inference.cudasharedmemory import CudaIpcOpener, CudaRegistration

    registration = CudaRegistration.of_rest("check", json.loads(body), max_bytes=SIZE)
    try:
        CudaIpcOpener().open(attrs.evolve(registration, byte_size=SIZE * 64))
    except BadRequest as e:
        print(f"a size past the exported memory refused: {e}")
    else:
        raise AssertionError("a region larger than the memory its handle exports was opened")
    region = CudaIpcOpener().open(registration)
    try:
        try:
            region.read(SIZE - 8, 16)
        except BadRequest as e:
            print(f"a read past the region refused: {e}")
        else:
            raise AssertionError("a read past the region was made")
        read = region.read(0, SIZE)
        print(f"read {read.nbytes} bytes into a JAX array on {read.devices()}")
        expected = jax.device_put((np.arange(SIZE) % 251).astype(np.uint8), read.devices().pop())
        assert bool((read == expected).all()), "the region's bytes are not the owner's"
        region.write(0, read + 1)
    finally:
        region.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="0", help="the device to check (none: nothing to check)")
    parser.add_argument("--open", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.open is not None:
        return opener(args.open)
    if args.gpus == "none":
        print("no GPU: CUDA shared memory not checked")
        return 0
    return owner(int(args.gpus))


if __name__ == "__main__":
    sys.exit(main())
