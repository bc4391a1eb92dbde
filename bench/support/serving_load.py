"""
A closed-loop load of C{bench.serving} for a front perf_analyzer cannot
drive (KServe's, which serves no model configuration) or where there is no
perf_analyzer (a GPU machine): C{--threads} threads, each with its own
C{tritonclient} client, send one row at a time from C{--start} (a
C{time.time()} shared by every process of the load) on; the requests that
end within C{--seconds} after C{--warmup} count. The last line is ``load
{json}``: the count, the latencies of those requests, and any errors.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np

from bench.support import serving_model as model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="host:port")
    parser.add_argument("protocol", choices=["http", "grpc"])
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--start", type=float, required=True)
    parser.add_argument("--warmup", type=float, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args()
    if args.protocol == "http":
        import tritonclient.http as client_module
    else:
        import tritonclient.grpc as client_module

    row = np.random.default_rng(1).standard_normal((1, model.ROWS)).astype(np.float32)
    begin = args.start + args.warmup
    end = begin + args.seconds
    latencies: list[float] = []
    errors: list[str] = []

    def send() -> None:
        client = client_module.InferenceServerClient(args.target)
        tensor = client_module.InferInput(model.INPUT, list(row.shape), "FP32")
        tensor.set_data_from_numpy(row)
        output = client_module.InferRequestedOutput(model.OUTPUT)
        mine = []
        time.sleep(max(0.0, args.start - time.time()))
        while (sent := time.time()) < end:
            try:
                client.infer(model.NAME, [tensor], outputs=[output])
            except Exception as e:  # counted, and the load goes on as perf_analyzer's does
                errors.append(str(e)[:200])
                continue
            done = time.time()
            if begin <= done <= end:
                mine.append(done - sent)
        latencies.extend(mine)  # list.extend holds the GIL: no lock needed
        client.close()

    threads = [threading.Thread(target=send, daemon=True) for _ in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print("load " + json.dumps({"latencies": latencies, "errors": errors[:5], "error_count": len(errors)}),
          flush=True)


if __name__ == "__main__":
    main()
