"""
The services of the Router benchmarks, as child processes: a Router, a node
of one worker registered with it, and the bare proxy that stands where the
Router would (L{bench.peers.bare_proxy}).
"""

from __future__ import annotations

import json
import time

from bench.support.child import KCoralChild

#: Programs the node's one worker runs at once (the server's default).
CAPACITY = 2


def start_router(cores: set[int] | None = None, *options: str) -> KCoralChild:
    return KCoralChild(["router", "--port", "0", *options],
                       {"url": r"kcoral router listening on (http://\S+)"}, cores=cores)


def start_node(router_url: str, gpus: str, *options: str) -> KCoralChild:
    node = KCoralChild(["server", "--router", router_url, "--node-id", "bench", "--port", "0",
                    "--gpus", gpus, "--capacity", str(CAPACITY),
                    "--health-interval-seconds", "0.5", *options],
                   {"worker": r"worker0 is ready at (http://\S+)",
                    "pid": r"worker0 started \(pid (\d+)\)",
                    "ready": r"(the Router reports node bench ready)"})
    node.worker_pid = int(node.found["pid"])
    return node


def start_bare_proxy(worker_urls: list[str], plain: bool = False, cores: set[int] | None = None,
                     capacity: int | None = None) -> KCoralChild:
    """L{bench.peers.bare_proxy} in front of C{worker_urls} (hashing runs over
    them when there are several), sending each at most C{capacity} runs at
    a time when given."""
    options = ["--plain"] * plain + (["--capacity", str(capacity)] if capacity else [])
    return KCoralChild([",".join(worker_urls), *options],
                       {"url": r"bare proxy listening on (http://\S+)"}, name="bare proxy",
                       cores=cores, program=("-m", "bench.peers.bare_proxy"))


def wait_ready(router_url: str, timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(router_url + "/health", timeout=5) as answer:
                if json.loads(answer.read())["status"] == "ok":
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the Router never reported a ready node")
