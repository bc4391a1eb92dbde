"""
The Ray Serve side of ``bench.compare``: a deployment that runs KCoral's
``/v1/run`` bodies with KCoral's own executor, deployed into a running Ray
cluster. Run with the Ray venv's interpreter (``.bench-venv/ray``), inside
the network namespace of that cluster:

    python -m bench.peers.ray_serve --address 127.0.0.1:6379 --port 8000 --capacity 2 \\
        --warm BODY ANSWER [--warm BODY ANSWER ...]

The deployment decodes each body with ``kcoral.protocol.wire`` and runs it
with ``kcoral.server.executor.Executor`` (the deserialization with
``jax.export``, the compile and device caches, the call) on a thread pool
of ``capacity`` threads, as a KCoral server does; ``max_ongoing_requests``
is the same capacity, so Ray holds back what the worker would queue. The
handler is ``async`` and never blocks its loop, so Ray's throughput flags
(``RAY_SERVE_THROUGHPUT_OPTIMIZED``, set by ``compare.py`` on the cluster)
are safe for it. Each ``--warm`` body (the program and its inputs inline) is
sent once through Ray's ingress after the deployment is up, and its answer
written to ANSWER, for ``compare.py`` to check against the KCoral worker's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ray import serve

ROUTE = "/v1/run"


@serve.deployment(name="kcoral", num_replicas=1)
class KCoralRun:
    def __init__(self, capacity: int):
        from prometheus_client import CollectorRegistry

        from kcoral.server.compile_cache import CompileCache
        from kcoral.server.device_cache import DeviceCache
        from kcoral.server.executor import Executor, ExecutorMetrics
        from kcoral.server.upload_cache import UploadCache

        # A KCoral server's default cache sizes (ServerConfig's, whose module
        # needs the HTTP stack that this venv does not hold).
        metrics = ExecutorMetrics(CollectorRegistry())
        self._executor = Executor(
            uploads=UploadCache(1 << 30, metrics.caches),
            compiled=CompileCache(64, metrics.caches),
            placed=DeviceCache(1 << 30, metrics.caches),
            metrics=metrics, gpus="none")
        self._executor.load()
        self._threads = ThreadPoolExecutor(capacity, thread_name_prefix="kcoral-run")

    async def __call__(self, request):
        from starlette.responses import JSONResponse, Response

        from kcoral.errors import KCoralError
        from kcoral.protocol.wire import RESULT_CONTENT_TYPE, WireError, decode_request

        body = await request.body()
        try:
            run = decode_request(body)
            result = await asyncio.get_running_loop().run_in_executor(
                self._threads, self._executor.execute, run, "ray")
        except WireError as e:
            return JSONResponse({"error": {"type": "bad_request", "message": str(e)}}, 400)
        except KCoralError as e:
            return JSONResponse({"error": {"type": e.type, "message": e.message}}, e.status)
        return Response(result, media_type=RESULT_CONTENT_TYPE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="the Ray cluster's GCS address")
    parser.add_argument("--port", type=int, default=8000, help="Serve's HTTP port")
    parser.add_argument("--capacity", type=int, required=True)
    parser.add_argument("--warm", nargs=2, action="append", default=[], metavar=("BODY", "ANSWER"))
    args = parser.parse_args()

    import ray

    ray.init(address=args.address, logging_level="WARNING")
    serve.start(http_options={"host": "127.0.0.1", "port": args.port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    app = KCoralRun.options(max_ongoing_requests=args.capacity,
                            ray_actor_options={"num_cpus": 1}).bind(args.capacity)
    serve.run(app, name="kcoral", route_prefix=ROUTE)
    for body, answer in args.warm:
        post = urllib.request.Request(f"http://127.0.0.1:{args.port}{ROUTE}",
                                      data=Path(body).read_bytes(), method="POST",
                                      headers={"Content-Type": "application/x-kcoral-run"})
        try:
            with urllib.request.urlopen(post, timeout=300) as reply:
                Path(answer).write_bytes(reply.read())
        except urllib.error.HTTPError as e:
            raise SystemExit(f"Ray Serve answered {body} with {e.code}: {e.read()[:500]!r}") from None
    print(f"ray serve ready on http://127.0.0.1:{args.port}{ROUTE}", flush=True)
    return 0


if __name__ == "__main__":
        sys.exit(main())
