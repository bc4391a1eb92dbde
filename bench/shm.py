"""
A 64 MiB input through system shared memory against the same input sent as
a binary tensor, side by side, over REST and gRPC, to one standalone server
on this host (started here, with ``--allow-client-shm``).

    python -m bench.shm [--requests N] [--megabytes M]

The model sums its input (one FP32 row of M MiB): the answer is a few
bytes, so what is measured is the input's way in. Each row is the median
of N inferences after one warm-up, with tritonclient's own clients and
shared-memory utilities.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from bench.support.quick import parse_quick

ROOT = Path(__file__).resolve().parent.parent


READY = re.compile(r"kcoral server ready")
LISTENING = re.compile(r"listening on http://(?P<host>[\d.]+):(?P<port>\d+)")
GRPC = re.compile(r"over gRPC on [\d.]+:(?P<port>\d+)")


def export(root: str, values: int) -> None:
    import jax.numpy as jnp

    import kcoral

    kcoral.export_bundle(lambda x: jnp.sum(x, axis=1, keepdims=True), None,
                         np.zeros((1, values), np.float32), dir=f"{root}/sum", name="sum",
                         input_names=["INPUT"], output_names=["OUTPUT"])


def start(root: str) -> tuple[subprocess.Popen, str, str]:
    """The server, its REST and its gRPC address."""
    server = subprocess.Popen(
        [sys.executable, "-m", "kcoral", "server", "--port", "0", "--grpc-port", "0", "--gpus",
         "none", "--model-repository", root, "--allow-client-shm"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    rest = grpc = None
    assert server.stdout is not None
    for line in server.stdout:
        if (found := LISTENING.search(line)) is not None:
            rest = f"{found['host']}:{found['port']}"
        if (found := GRPC.search(line)) is not None:
            grpc = f"127.0.0.1:{found['port']}"
        if READY.search(line):
            break
    assert rest and grpc, "the server did not start"
    # What it logs from now on is read, so that it never waits on a full pipe.
    threading.Thread(target=server.stdout.read, daemon=True).start()
    return server, rest, grpc


def timed(infer, count: int) -> float:
    infer()
    seconds = []
    for _ in range(count):
        began = time.perf_counter()
        infer()
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def measure(module, address: str, x: np.ndarray, count: int) -> tuple[float, float]:
    """Median seconds of one inference: the input as a binary tensor, then
    through a region."""
    import tritonclient.utils.shared_memory as shm

    client = module.InferenceServerClient(address)
    key = f"/kc-bench-{uuid.uuid4().hex[:8]}"
    region = shm.create_shared_memory_region("bench", key, x.nbytes)
    try:
        shm.set_shared_memory_region(region, [x])
        client.register_system_shared_memory("bench", key, x.nbytes)
        expected = x.sum(dtype=np.float64)

        def binary():
            tensor = module.InferInput("INPUT", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            answer = client.infer("sum", [tensor]).as_numpy("OUTPUT")
            assert abs(answer[0, 0] - expected) <= 1e-3 * abs(expected) + 1

        def through_region():
            tensor = module.InferInput("INPUT", list(x.shape), "FP32")
            tensor.set_shared_memory("bench", x.nbytes)
            answer = client.infer("sum", [tensor]).as_numpy("OUTPUT")
            assert abs(answer[0, 0] - expected) <= 1e-3 * abs(expected) + 1

        return timed(binary, count), timed(through_region, count)
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(region)
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--megabytes", type=int, default=64)
    options = parse_quick(parser, requests=2, megabytes=4)
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    values = options.megabytes * (1 << 20) // 4
    x = np.random.default_rng(0).standard_normal((1, values), dtype=np.float32)
    with tempfile.TemporaryDirectory() as root:
        export(root, values)
        server, rest, grpc = start(root)
        try:
            print(f"{options.megabytes} MiB FP32 input, median of {options.requests} inferences")
            print(f"{'front':<8}{'binary tensor':>16}{'shared memory':>16}")
            for name, module, address in (("REST", httpclient, rest), ("gRPC", grpcclient, grpc)):
                binary, region = measure(module, address, x, options.requests)
                print(f"{name:<8}{binary * 1e3:>13.1f} ms{region * 1e3:>13.1f} ms")
        finally:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    main()
