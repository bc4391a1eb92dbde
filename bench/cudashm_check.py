"""
CUDA shared memory on a GPU, as Triton's clients share it: this process
allocates device memory, fills it and exports it as a CUDA IPC handle (as
``tritonclient.utils.cuda_shared_memory`` does: ``cudaMalloc``,
``cudaIpcGetMemHandle``, the handle's 64 bytes in base64); a second process
registers the handle from the JSON body Triton's HTTP client sends, opens it
with KCoral's opener (kcoral.inference.cudasharedmemory.CudaIpcOpener),
reads it into host memory, checks it, and writes its bytes plus one back;
it also checks that a size past the exported memory, and a read past the
region, are refused.
This process then checks what it finds in its memory.

Then an inference end to end: a standalone server on the same GPU
(``--allow-client-shm``, confined as by default) serving Triton's
``simple`` (INT32 ``[1, 16]`` inputs to their sum and difference); this
process registers an input and an output region with Triton's HTTP and gRPC
clients, infers through them with each, and checks the outputs it finds in
its device memory; a slice past a region is refused. On a host of two GPUs
or more, the same through the gateway of a node of a worker on each.

    python3 -m bench.cudashm_check --gpus 0

The last line says what was found; the exit status is 0 only if every
check passed. An IPC handle cannot be opened by the process that made it,
hence two processes.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import time

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
          "opened in another process, read and written back, bit for bit")
    return served(runtime, device)


class DeviceBuffer:
    """C{size} bytes of this process's memory on the GPU, and their IPC handle."""

    def __init__(self, runtime, size: int):
        self.runtime, self.size = runtime, size
        self.pointer = _call(runtime, runtime.cudaMalloc(size))
        self.handle = base64.b64encode(bytes(_call(runtime, runtime.cudaIpcGetMemHandle(
            self.pointer)).reserved))

    def put(self, data: bytes) -> None:
        host = np.frombuffer(data, np.uint8)
        _call(self.runtime, self.runtime.cudaMemcpy(
            self.pointer, host.ctypes.data, host.nbytes,
            self.runtime.cudaMemcpyKind.cudaMemcpyHostToDevice))

    def get(self) -> np.ndarray:
        out = np.empty(self.size, np.uint8)
        _call(self.runtime, self.runtime.cudaMemcpy(
            out.ctypes.data, self.pointer, self.size,
            self.runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return out

    def free(self) -> None:
        _call(self.runtime, self.runtime.cudaFree(self.pointer))


def served(runtime, device: int) -> int:
    """Infer Triton's C{simple} through two regions of this process's device
    memory, over REST and gRPC, on a server on the same GPU and, on a host
    of two GPUs or more, on the gateway of a node of a worker on each."""
    # The bundle is exported on the CPU (for both platforms): this process
    # leaves the GPU's memory to the server.
    os.environ["JAX_PLATFORMS"] = "cpu"
    import kcoral

    repository = tempfile.mkdtemp(prefix="kcoral-cudashm-")
    x = np.zeros((1, 16), np.int32)
    kcoral.export_bundle(lambda a, b: (a + b, a - b), None, x, x, dir=f"{repository}/simple",
                         name="simple", input_names=["INPUT0", "INPUT1"],
                         output_names=["OUTPUT0", "OUTPUT1"])
    common = ["server", "--port", "0", "--grpc-port", "0", "--allow-client-shm",
              "--model-repository", repository]
    fronts = [("a confined server", [*common, "--gpus", str(device)],
               {"url": r"kcoral server listening on http://(\S+)", "grpc": r"over gRPC on (\S+)",
                "ready": r"kcoral server (ready) on"})]
    if _call(runtime, runtime.cudaGetDeviceCount()) > 1:
        fronts.append(("a node's gateway", [*common, "--gpus", "all"],
                       {"url": r"kcoral gateway listening on http://(\S+)",
                        "grpc": r"over gRPC on (\S+)", "ready": r"worker1 is (ready) at"}))
    else:
        print("one GPU: a node's gateway (two GPU workers or more) not checked")
    from bench.support.child import KCoralChild

    for what, args, ready in fronts:
        front = KCoralChild(args, ready, name="front", env={"JAX_PLATFORMS": None})
        try:
            through_regions(runtime, device, front.found["url"], front.found["grpc"])
        finally:
            front.stop()
        print(f"CUDA shared memory on GPU {device}: opened by the opener, and an inference "
              f"through it on {what} over REST and gRPC, outputs as JAX computes them")
    return 0


def through_regions(runtime, device: int, url: str, grpc: str) -> None:
    """Infer C{simple} through an input and an output region with Triton's
    HTTP client at C{url} and its gRPC client at C{grpc}."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 7, np.int32)
    inputs, outputs = DeviceBuffer(runtime, 128), DeviceBuffer(runtime, 128)
    try:
        inputs.put(a.tobytes() + b.tobytes())
        for module, address in ((httpclient, url), (grpcclient, grpc)):
            outputs.put(bytes(128))
            client = module.InferenceServerClient(address)
            try:
                deadline = time.monotonic() + 60
                while not client.is_server_ready():  # a gateway: until its workers are
                    assert time.monotonic() < deadline, "the front never said it was ready"
                    time.sleep(0.5)
                client.register_cuda_shared_memory("in", inputs.handle, device, 128)
                client.register_cuda_shared_memory("out", outputs.handle, device, 128)
                tensors = [module.InferInput("INPUT0", [1, 16], "INT32"),
                           module.InferInput("INPUT1", [1, 16], "INT32")]
                tensors[0].set_shared_memory("in", 64)
                tensors[1].set_shared_memory("in", 64, offset=64)
                wanted = [module.InferRequestedOutput("OUTPUT0"),
                          module.InferRequestedOutput("OUTPUT1")]
                wanted[0].set_shared_memory("out", 64)
                wanted[1].set_shared_memory("out", 64, offset=64)
                client.infer("simple", tensors, outputs=wanted)
                found = outputs.get().view(np.int32).reshape(2, 16)
                assert np.array_equal(found[0], (a + b)[0]), f"OUTPUT0 is {found[0]}"
                assert np.array_equal(found[1], (a - b)[0]), f"OUTPUT1 is {found[1]}"
                tensors[1].set_shared_memory("in", 64, offset=100)
                try:
                    client.infer("simple", tensors, outputs=wanted)
                except InferenceServerException as e:
                    assert "Invalid offset + byte size" in str(e), e
                else:
                    raise AssertionError("a slice past the region was read")
                client.unregister_cuda_shared_memory()
                print(f"{module.__name__}: inputs read from and outputs written to CUDA regions")
            finally:
                client.close()
    finally:
        inputs.free()
        outputs.free()


def opener(body: str) -> int:
    """Open the region a registration body names, as a front on its host would."""
    import attrs

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
            region.read_into(SIZE - 8, memoryview(bytearray(16)))
        except BadRequest as e:
            print(f"a read past the region refused: {e}")
        else:
            raise AssertionError("a read past the region was made")
        read = np.empty(SIZE, np.uint8)
        region.read_into(0, memoryview(read))
        expected = (np.arange(SIZE) % 251).astype(np.uint8)
        assert np.array_equal(read, expected), "the region's bytes are not the owner's"
        region.write(0, memoryview(read + 1))
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
