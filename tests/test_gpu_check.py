"""
The GPU check (bench/gpu_check.sh) rehearsed on this machine's CPU, so that
its one run on a lent GPU machine is known to work before it is made: the
wheels made for this Python by bench.gpu_carry (from the package index,
as C{make gpu-carry} makes them for the GPU machine's), the script's install
of them with no index, and each of its steps, shortened, passing; the steps
of features this tree may not hold yet pass or are skipped. Every process
the run starts is gone when it ends, whatever became of it.
"""

from __future__ import annotations

import os
import platform
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

pytest.importorskip("jax")

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("install", "devices", "node", "conformance", "two-devices")
HOOKS = ("serving", "training")


def marked(mark: str) -> list[int]:
    """The processes whose environment carries the check's mark."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            variables = environ.read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if f"KCORAL_GPU_CHECK_RUN={mark}".encode() in variables:
            found.append(int(environ.parent.name))
    return found


@pytest.fixture
def wheels(tmp_path):
    """The carried wheels, made for this Python."""
    folder = tmp_path / "wheels"
    prepared = subprocess.run(
        [sys.executable, "-m", "bench.gpu_carry", "prepare", "--dir", str(folder),
         "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}",
         "--arch", platform.machine(), "--glibc", platform.libc_ver()[1]],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    # Made for this Python, they are checked here too: every requirement found.
    assert re.search(r"requirements followed, \d+ modules imported, 0 problem", prepared.stdout)
    return folder


@pytest.mark.slow
def test_the_gpu_check_rehearsed_on_the_cpu(wheels, tmp_path):
    """The GPU check, on the CPU with this Python: exit 0, every step ok, the summary last."""
    results = tmp_path / "out"
    mark = f"test-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHON": sys.executable, "KCORAL_GPU_CHECK_PLATFORM": "cpu",
           "KCORAL_GPU_CHECK_SHORT": "1", "KCORAL_GPU_WHEELS": str(wheels), "OUT": str(results),
           "KCORAL_GPU_CHECK_RUN": mark}
    # The script chooses the platform and devices itself, not the test process's settings.
    for name in ("JAX_PLATFORMS", "XLA_FLAGS", "PYTHONPATH"):
        env.pop(name, None)
    check = subprocess.Popen(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = check.communicate(timeout=240)[0]
    finally:
        if check.poll() is None:
            os.killpg(check.pid, signal.SIGKILL)
            check.wait()
        left = marked(mark)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert check.returncode == 0, output
    assert not left, f"the check left {left} running"

    summary = (results / "summary.txt").read_text()
    assert output.rstrip().endswith(summary.rstrip()), output
    for name in STEPS:
        assert re.search(rf"^{name} +ok ", summary, re.MULTILINE), summary
    for name in HOOKS:
        assert re.search(rf"^{name} +(ok|skipped) ", summary, re.MULTILINE), summary
    assert "0 failed step(s)" in summary
    assert "422 not_enough_devices" in (results / "two-devices.log").read_text()
    # What comes back from the GPU machine: at most 8 files.
    assert sorted(p.name for p in results.iterdir()) == sorted(
        [f"{name}.log" for name in STEPS + HOOKS] + ["summary.txt"])
