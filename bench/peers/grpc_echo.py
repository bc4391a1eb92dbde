"""
The bare round trip of gRPC from Python on this host: a ``grpc.aio``
server of the inference protocol's ``ModelInfer`` that answers every call
at once with the same answer (a decoding step's: one INT32 token,
``NEXT`` ``[1, 1]``), reading nothing of the request. No model, no state,
no KCoral: what a call costs a client and a server of grpcio, side by side
with a server's step (``bench.sequence`` runs it beside KCoral).

    .venv/bin/python -m bench.peers.grpc_echo     # prints "echo serving on HOST:PORT"
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

SERVICE = "inference.GRPCInferenceService"
READY = r"echo serving on (\S+)"


def answer() -> bytes:
    """A decoding step's answer, serialized once."""
    output = service_pb2.ModelInferResponse.InferOutputTensor(name="NEXT", datatype="INT32",
                                                              shape=[1, 1])
    return service_pb2.ModelInferResponse(
        model_name="echo", model_version="1", outputs=[output],
        raw_output_contents=[np.zeros((1, 1), np.int32).tobytes()]).SerializeToString()


async def serve(port: int) -> None:
    answered = answer()

    async def infer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return answered

    # Identity (de)serializers: the handler sees bytes, as KCoral's front does.
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "ModelInfer": grpc.unary_unary_rpc_method_handler(infer)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"echo serving on 127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
