"""
The gRPC fronts that ``bench.serving --grpc-fronts`` measures side by
side, each run as ``kcoral ARGS`` with its own gRPC front in place of
KCoral's, and the floors, which answer a fixed response.

    python -m bench.peers.grpc_fronts threaded kcoral-args...    # a KCoral front
    python -m bench.peers.grpc_fronts floor-aio PORT             # a floor (also floor-threaded, floor-h2)

Variants (KCoral's own front, ``kcoral.inference.h2front``, is the one a
plain ``kcoral`` serves; those here are built only to be measured beside it):

- ``threaded``: grpcio's threaded server (128 threads), every method
  (``GrpcMethods``) on raw bytes, each call asking the reactor with
  ``blockingCallFromThread``; none of the shipped front's bounds.

The floors serve ModelInfer with a fixed answer of the benchmark model's
shape, and the metadata and configuration perf_analyzer reads, with nothing
of KCoral's in the way: bare grpcio (``floor-aio``, ``floor-threaded``), and
KCoral's own HTTP/2 transport on the reactor (``floor-h2``).
"""

from __future__ import annotations

import asyncio
import sys
from concurrent import futures

VARIANTS = ("threaded",)
FLOORS = ("floor-aio", "floor-threaded", "floor-h2")


def threaded_front():
    """The shipped front's methods on grpcio's threaded server."""
    import grpc
    from twisted.internet import threads

    from kcoral.errors import KCoralError
    from kcoral.inference import grpcmethods, h2front

    class ThreadedFront(h2front.GrpcFront):
        def startService(self):
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=128),
                                 options=[("grpc.max_receive_message_length", self.max_message_bytes)])
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(grpcmethods.SERVICE, {
                name: grpc.unary_unary_rpc_method_handler(self._handler(method))
                for name, method in self.methods.items()}),))
            self.port = server.add_insecure_port(f"{self.host}:{self.port}")
            server.start()
            self._threaded = server
            self.running = 1
            h2front.log.info("serving the inference protocol over gRPC on {host}:{port}",
                             host=self.host, port=self.port)

        def stopService(self, grace=5.0):
            self.running = 0
            return threads.deferToThread(lambda: self._threaded.stop(grace).wait())

        def _handler(self, method):
            def handler(raw, context):
                metadata = {key.encode(): value.encode() for key, value in context.invocation_metadata()
                            if isinstance(value, str)}
                try:
                    return threads.blockingCallFromThread(self.reactor, method.answer, raw, "bench",
                                                          metadata)
                except KCoralError as e:
                    context.abort(grpcmethods.status_code_of(e), e.message)
            return handler

    return ThreadedFront


def floor(kind: str, port: int) -> None:
    """A bare grpcio server: fixed answers, nothing of KCoral's."""
    import grpc
    from tritonclient.grpc import model_config_pb2, service_pb2

    from bench.support import serving_model as model

    live = service_pb2.ServerLiveResponse(live=True).SerializeToString()
    ready = service_pb2.ServerReadyResponse(ready=True).SerializeToString()
    server_metadata = service_pb2.ServerMetadataResponse(name="floor", version="0").SerializeToString()
    tensor = service_pb2.ModelMetadataResponse.TensorMetadata
    metadata = service_pb2.ModelMetadataResponse(
        name=model.NAME, versions=["1"], platform="jax",
        inputs=[tensor(name=model.INPUT, datatype="FP32", shape=[-1, model.ROWS])],
        outputs=[tensor(name=model.OUTPUT, datatype="FP32", shape=[-1, model.ROWS])]).SerializeToString()
    config = service_pb2.ModelConfigResponse(config=model_config_pb2.ModelConfig(
        name=model.NAME, platform="jax", max_batch_size=model.MAX_BATCH_SIZE,
        input=[model_config_pb2.ModelInput(name=model.INPUT, data_type=model_config_pb2.TYPE_FP32,
                                           dims=[model.ROWS])],
        output=[model_config_pb2.ModelOutput(name=model.OUTPUT, data_type=model_config_pb2.TYPE_FP32,
                                             dims=[model.ROWS])])).SerializeToString()
    answer = service_pb2.ModelInferResponse(model_name=model.NAME, model_version="1")
    answer.outputs.add(name=model.OUTPUT, datatype="FP32", shape=[1, model.ROWS])
    answer.raw_output_contents.append(bytes(4 * model.ROWS))
    infer = answer.SerializeToString()
    fixed = {"ServerLive": live, "ServerReady": ready, "ServerMetadata": server_metadata,
             "ModelMetadata": metadata, "ModelConfig": config, "ModelInfer": infer}
    if kind == "floor-h2":
        floor_h2(fixed, port)
    elif kind == "floor-aio":
        def aio_handler(value):
            async def handler(raw, context):
                return value
            return handler

        async def serve():
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
                "inference.GRPCInferenceService",
                {n: grpc.unary_unary_rpc_method_handler(aio_handler(v)) for n, v in fixed.items()}),))
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            print("floor ready", flush=True)
            await server.wait_for_termination()

        asyncio.run(serve())
    else:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=128))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService",
            {n: grpc.unary_unary_rpc_method_handler(lambda raw, context, v=v: v)
             for n, v in fixed.items()}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("floor ready", flush=True)
        server.wait_for_termination()


def floor_h2(fixed: dict[str, bytes], port: int) -> None:
    """KCoral's own transport on the reactor, every method answering C{fixed}."""
    from twisted.internet import defer, reactor

    from kcoral.inference.grpcmethods import Method
    from kcoral.inference.h2front import GrpcFront

    served = GrpcFront(None, reactor=reactor, port=port)
    served.methods = {name: Method(lambda message, rid, metadata, value=value: defer.succeed(value),
                                   open=True) for name, value in fixed.items()}
    served.startService()
    print("floor ready", flush=True)
    reactor.run()


def main() -> int:
    variant, args = sys.argv[1], sys.argv[2:]
    if variant in FLOORS:
        floor(variant, int(args[0]))
        return 0
    if variant != "threaded":
        raise SystemExit(f"no variant {variant}: {', '.join(VARIANTS + FLOORS)}")
    from kcoral.inference import h2front

    h2front.GrpcFront = threaded_front()
    from kcoral.cli import main as kcoral

    return kcoral(args)


if __name__ == "__main__":
    sys.exit(main())
