"""
The peers of C{bench.serving}, each serving L{serving_model.mlp} on
loopback from a venv of its own (they pin other versions of grpcio,
protobuf and numpy than KCoral's):

    python -m bench.peers.serving_peers triton PARAMS HTTP GRPC METRICS --max-batch-delay US
    python -m bench.peers.serving_peers kserve PARAMS HTTP GRPC

Each logs ``peer ready`` once it answers, and stops on SIGTERM or SIGINT.
Like a KCoral bundle, the function is compiled for the batch sizes 1, 2,
4 ... 64 before the peer is ready, and a batch runs padded to the next of
them: no request pays a compile, and every front runs the same programs.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import threading
from pathlib import Path

import numpy as np

from bench.support import serving_model as model

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def compiled(params_path: str):
    """The model as a function of a batch of rows, compiled for every batch size."""
    import jax

    params = jax.device_put(model.load_params(params_path))
    program = jax.jit(model.mlp)

    def run(x: np.ndarray) -> np.ndarray:
        rows = len(x)
        size = next(s for s in BATCH_SIZES if s >= rows)
        if size > rows:
            x = np.concatenate([x, np.zeros((size - rows, *x.shape[1:]), x.dtype)])
        return np.asarray(program(params, x))[:rows]

    for size in BATCH_SIZES:
        run(np.zeros((size, model.ROWS), np.float32))
    return run


def until_stopped() -> None:
    """Block until SIGTERM or SIGINT (which a background job starts ignoring)."""
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    while not stopped.wait(1.0):
        pass


def triton(args) -> None:
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    run = compiled(args.params)

    @batch
    def infer(**inputs):
        return {model.OUTPUT: run(inputs[model.INPUT])}

    config = TritonConfig(http_address="127.0.0.1", http_port=args.http, grpc_address="127.0.0.1",
                          grpc_port=args.grpc, metrics_address="127.0.0.1", metrics_port=args.metrics)
    # By default statistics sit behind a token, and perf_analyzer, which
    # reads them every window, then fails.
    security = TritonSecurityConfig(restricted_endpoints=["shared-memory", "trace", "logging"])
    with tempfile.TemporaryDirectory(prefix="kcoral-pytriton-") as workspace:
        server = Triton(config=config, workspace=Path(workspace) / "triton", security_config=security)
        try:
            server.bind(model_name=model.NAME, infer_func=infer,
                        inputs=[Tensor(name=model.INPUT, dtype=np.float32, shape=(model.ROWS,))],
                        outputs=[Tensor(name=model.OUTPUT, dtype=np.float32, shape=(model.ROWS,))],
                        config=ModelConfig(max_batch_size=model.MAX_BATCH_SIZE, batcher=DynamicBatcher(
                            max_queue_delay_microseconds=args.max_batch_delay)))
            server.run()
            print("peer ready", flush=True)
            until_stopped()
        finally:
            server.stop()


def kserve(args) -> None:
    import kserve
    from kserve import InferOutput, InferResponse

    run = compiled(args.params)

    class MLP(kserve.Model):
        def __init__(self):
            super().__init__(model.NAME)
            self.ready = True

        def predict(self, payload, headers=None, response_headers=None):
            y = run(payload.inputs[0].as_numpy())
            output = InferOutput(name=model.OUTPUT, shape=list(y.shape), datatype="FP32")
            output.set_data_from_numpy(y, binary_data=payload.use_binary_outputs)
            # The request's outputs say, one by one, which come back as binary.
            return InferResponse(response_id=payload.id, model_name=model.NAME, infer_outputs=[output],
                                 use_binary_outputs=payload.use_binary_outputs,
                                 requested_outputs=payload.request_outputs)

    print("peer ready", flush=True)  # printed early; serving.py polls the model's readiness
    kserve.ModelServer(http_port=args.http, grpc_port=args.grpc).start([MLP()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("peer", choices=["triton", "kserve"])
    parser.add_argument("params", help="the model's params (.npz)")
    parser.add_argument("http", type=int)
    parser.add_argument("grpc", type=int)
    parser.add_argument("metrics", type=int, nargs="?")
    parser.add_argument("--max-batch-delay", type=int, default=0, help="microseconds (Triton)")
    args = parser.parse_args()
    {"triton": triton, "kserve": kserve}[args.peer](args)


if __name__ == "__main__":
    main()
