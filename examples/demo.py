"""
`make demo`: start a Router and one CPU node, run a program through the
Router, print the answer and the Router's /health, then stop both cleanly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import jax.numpy as jnp
import numpy as np

from kcoral import Client, Program

LISTENING = re.compile(r"kcoral router listening on (\S+)")


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kcoral", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def relay(process: subprocess.Popen, prefix: str, found: dict | None = None,
          ready: threading.Event | None = None) -> None:
    for line in process.stdout:
        print(f"{prefix} {line}", end="")
        if found is not None and "url" not in found and (m := LISTENING.search(line)):
            found["url"] = m.group(1)
            ready.set()


def wait_for(url: str, seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                return json.load(answer)
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not become healthy within {seconds:.0f}s")


def model(w, b, x):
    return {"logits": jnp.tanh(x @ w + b), "norm": jnp.linalg.norm(x, axis=-1)}


def main() -> int:
    router = start("router", "--port", "0")
    found: dict = {}
    listening = threading.Event()
    threading.Thread(target=relay, args=(router, "[router]", found, listening), daemon=True).start()
    node = None
    try:
        if not listening.wait(30):
            raise SystemExit("the Router did not start")
        url = found["url"]
        node = start("server", "--router", url, "--node-id", "demo-cpu", "--port", "0")
        threading.Thread(target=relay, args=(node, "[node]  "), daemon=True).start()
        wait_for(url, 90)

        rng = np.random.default_rng(0)
        w = rng.standard_normal((4, 3), dtype=np.float32)
        b = np.zeros(3, np.float32)
        x = rng.standard_normal((2, 4), dtype=np.float32)
        program = Program.from_function(model, w, b, x)
        with Client(url, busy_timeout=90) as client:
            outputs = client.run(program, w, b, x)
            health = client.health()
        expected = model(w, b, x)
        print("\n== outputs through the Router ==")
        for name, value in outputs.items():
            print(f"{name} = {np.array2string(value, precision=4)}")
            assert np.allclose(value, expected[name], atol=1e-5), name
        print("\n== Router /health ==")
        print(json.dumps(health, indent=2, sort_keys=True))
        return 0
    finally:
        for process in (node, router):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    code = process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    code = process.wait()
                print(f"== {process.args[3]} exited with status {code} ==")


if __name__ == "__main__":
    sys.exit(main())
