"""A ``kcoral`` child process for the benchmarks, shared by server.py,
node.py and router.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: JAX takes most of a GPU's memory when it starts, unless this says "false".
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"


def start_jax(gpus: str):
    """
    Start JAX in this process for a benchmark of a service run with
    C{--gpus gpus}, and return the device its in-process calls use. With
    'none', on the CPU, here and in the children (they inherit
    C{JAX_PLATFORMS}). Otherwise on the GPU (the one C{gpus} names, if one),
    without taking most of its memory up front as JAX does by default: the
    service under test, started afterwards, needs it.
    """
    if gpus == "none":
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax

        return jax.devices()[0]
    before = os.environ.get(PREALLOCATE)
    os.environ[PREALLOCATE] = "false"
    try:
        import jax

        device = jax.devices()[int(gpus) if gpus.isdigit() else 0]  # JAX reads it here, once
    finally:
        # The services allocate as they would anywhere.
        if before is None:
            del os.environ[PREALLOCATE]
        else:
            os.environ[PREALLOCATE] = before
    jax.config.update("jax_default_device", device)
    return device


class KCoralChild:
    """
    A ``kcoral`` child process on an ephemeral port, in its own session; its
    console output goes to a temporary file. C{ready} maps names to regular
    expressions that must all match the output; their first groups are kept
    in C{found}. C{cores} pins it (``taskset``); C{env} adds to the
    environment; C{cwd} is where it runs (another version's tree, say);
    C{program} is what Python runs (another script, say).
    """

    def __init__(self, args: list[str], ready: dict[str, str], *, cores: set[int] | None = None,
                 env: dict[str, str] | None = None, cwd: str | Path = ROOT,
                 timeout: float = 180.0, program: tuple[str, ...] = ("-m", "kcoral")):
        self._log = tempfile.NamedTemporaryFile(prefix="kcoral-bench-", suffix=".log", delete=False)
        self.command = [sys.executable, *program, *args]
        if cores is not None:
            self.command = ["taskset", "-c", ",".join(map(str, sorted(cores)))] + self.command
        self.process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), start_new_session=True)
        self.found = self._wait(ready, timeout)

    def output(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def _wait(self, ready: dict[str, str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.output()
            found = {name: re.search(pattern, text) for name, pattern in ready.items()}
            if all(found.values()):
                return {name: m.group(1) for name, m in found.items()}
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.fail(f"{' '.join(self.command)} did not start")

    def fail(self, why: str):
        """Stop, and raise C{why} with the end of the output (read first:
        stopping deletes it)."""
        output = self.output()
        self.stop()
        raise RuntimeError(f"{why}:\n{output[-3000:]}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)
