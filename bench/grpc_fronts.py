"""
The gRPC fronts that ``bench/serving.py --grpc-fronts`` measures side by
side, each run as ``kcoral ARGS`` with its own gRPC front in place of
KCoral's, and the floor: a bare grpcio server answering a fixed response.

    python bench/grpc_fronts.py VARIANT kcoral-args...     # a KCoral front
    python bench/grpc_fronts.py floor-aio PORT             # the floor (also floor-threaded)

Variants (the first is KCoral's own; the others are built here only):

- ``thread-loop``: ``GrpcFront`` as shipped, grpc.aio on an event loop in a
  thread of its own beside the reactor, every method on raw bytes.
- ``reactor-loop``: the same handlers on the asyncio reactor's own loop
  (the process runs Twisted's asyncio reactor): no hand-off between threads.
- ``reactor-h2``: gRPC's HTTP/2 served by the reactor itself with ``h2``
  (``kcoral.inference.h2front``): no thread, loop or hand-off of its own.
- ``threaded``: grpcio's threaded server (128 threads), every method on raw
  bytes (identity serializers) with the same parsing, each call asking the
  reactor with ``blockingCallFromThread``.

The floor serves ModelInfer with a fixed answer of the benchmark model's
shape, and the metadata and configuration perf_analyzer reads, with nothing
of KCoral's in the way.
"""

from __future__ import annotations

import asyncio
import sys
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

VARIANTS = ("thread-loop", "reactor-loop", "threaded", "reactor-h2")
FLOORS = ("floor-aio", "floor-threaded")


def reactor_loop_front():
    """GrpcFront on the asyncio reactor's loop."""
    from twisted.internet import defer

    from kcoral.inference import grpcfront

    class ReactorLoopFront(grpcfront.GrpcFront):
        def startService(self):
            self._loop = asyncio.get_event_loop()
            started = asyncio.ensure_future(self._start())

            def listening(future):
                self._server, self.port = future.result()
                grpcfront.log.info("serving the inference protocol over gRPC on {host}:{port}",
                                   host=self.host, port=self.port)

            started.add_done_callback(listening)
            self._sweep.start(grpcfront.SWEEP_SECONDS, now=False)
            self.running = 1

        def stopService(self, grace=5.0):
            self.running = 0
            if self._sweep.running:
                self._sweep.stop()
            return defer.Deferred.fromFuture(asyncio.ensure_future(self._server.stop(grace)))

        def _sweep_unread(self):
            self._expire(self._clock.seconds())

        async def on_reactor(self, ask):
            return await defer.maybeDeferred(ask).asFuture(self._loop)

    return ReactorLoopFront


def threaded_front():
    """GrpcFront's methods on grpcio's threaded server, on raw bytes."""
    import grpc
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2, service_pb2
    from twisted.internet import threads

    from kcoral.errors import KCoralError
    from kcoral.inference import grpcfront
    from kcoral.inference.front import InferCall
    from kcoral.protocol.inference import grpc_of_rest_answer, rest_of_grpc_infer

    class ThreadedFront(grpcfront.GrpcFront):
        def startService(self):
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=128),
                                 options=[("grpc.max_receive_message_length", self._max_message_bytes)])
            methods = {name: grpc.unary_unary_rpc_method_handler(self._method(name))
                       for name in ("ServerLive", "ServerReady", "ServerMetadata", "ModelMetadata",
                                    "ModelConfig", "ModelInfer")}
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(grpcfront.SERVICE,
                                                                                  methods),))
            self.port = server.add_insecure_port(f"{self.host}:{self.port}")
            server.start()
            self._threaded = server
            self.running = 1
            grpcfront.log.info("serving the inference protocol over gRPC on {host}:{port}",
                               host=self.host, port=self.port)

        def stopService(self, grace=5.0):
            self.running = 0
            return threads.deferToThread(lambda: self._threaded.stop(grace).wait())

        def _method(self, name):
            front = self.front

            def ask(raw):
                if name == "ServerLive":
                    return lambda: True, lambda _: service_pb2.ServerLiveResponse(live=True)
                if name == "ServerReady":
                    return front.ready, lambda ready: service_pb2.ServerReadyResponse(ready=ready)
                if name == "ServerMetadata":
                    return front.metadata, lambda v: service_pb2.ServerMetadataResponse(
                        name=v["name"], version=v["version"], extensions=v["extensions"])
                if name == "ModelMetadata":
                    r = service_pb2.ModelMetadataRequest.FromString(raw)
                    return (lambda: front.model_metadata(r.name, r.version or None),
                            grpcfront._metadata_response)
                if name == "ModelConfig":
                    r = service_pb2.ModelConfigRequest.FromString(raw)
                    return (lambda: front.model_config(r.name, r.version or None),
                            lambda v: service_pb2.ModelConfigResponse(config=json_format.ParseDict(
                                v, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)))
                rest = rest_of_grpc_infer(service_pb2.ModelInferRequest.FromString(raw))
                return (lambda: front.infer(rest.model, rest.version,
                                            InferCall(rest.body, rest.header_length, "bench")),
                        lambda a: grpc_of_rest_answer(a.body, a.header_length))

            def handler(raw, context):
                try:
                    asked, respond = ask(raw)
                    value = threads.blockingCallFromThread(self._reactor, asked)
                    return respond(value).SerializeToString()
                except KCoralError as e:
                    context.abort(grpcfront.status_code_of(e), e.message)

            return handler

    return ThreadedFront


def floor(kind: str, port: int) -> None:
    """A bare grpcio server: fixed answers, nothing of KCoral's."""
    import grpc
    from tritonclient.grpc import model_config_pb2, service_pb2

    import serving_model as model

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
    if kind == "floor-aio":
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


def main() -> int:
    variant, args = sys.argv[1], sys.argv[2:]
    if variant in FLOORS:
        floor(variant, int(args[0]))
        return 0
    if variant == "reactor-loop":
        from twisted.internet import asyncioreactor

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        asyncioreactor.install(loop)
    from kcoral.inference import grpcfront

    if variant == "reactor-loop":
        grpcfront.GrpcFront = reactor_loop_front()
    elif variant == "threaded":
        grpcfront.GrpcFront = threaded_front()
    elif variant == "reactor-h2":
        from kcoral.inference import h2front

        grpcfront.GrpcFront = h2front.GrpcFront
    elif variant != "thread-loop":
        raise SystemExit(f"no variant {variant}: {', '.join(VARIANTS + FLOORS)}")
    from kcoral.cli import main as kcoral

    return kcoral(args)


if __name__ == "__main__":
    sys.exit(main())
