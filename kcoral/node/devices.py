"""
Which devices a node serves, found without initialising CUDA in the
supervisor (which never imports JAX): C{nvidia-smi} when present. Each worker
owns C{--devices-per-worker} of them: that many GPUs, or on the CPU that
many host devices.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import attrs

from kcoral.common.hostdevices import host_device_flags


@attrs.frozen
class WorkerSpec:
    """One server process to run: its name, index (port offset) and devices."""

    name: str
    index: int
    #: Its GPUs as the host numbers them, a C{CUDA_VISIBLE_DEVICES} list
    #: ("2,3"); None: a CPU worker.
    gpus: str | None
    #: How many devices it owns: its GPUs, or host devices on the CPU.
    devices: int = 1

    @property
    def env(self) -> dict[str, str]:
        # Each GPU worker sees only its own devices; CPU workers see none,
        # and split the host into theirs before JAX starts.
        if self.gpus is not None:
            return {"CUDA_VISIBLE_DEVICES": self.gpus}
        env = {"CUDA_VISIBLE_DEVICES": ""}
        if self.devices > 1:
            env["XLA_FLAGS"] = host_device_flags(os.environ.get("XLA_FLAGS", ""), self.devices)
        return env

    @property
    def gpus_argument(self) -> str:
        """Its C{--gpus}: the GPUs it sees, which it numbers from 0."""
        if self.gpus is None:
            return "none"
        return ",".join(str(i) for i in range(self.devices))


#: The environment that sizes a node (its C{--gpus} and C{--cpu-workers}):
#: never its workers', whose devices their command lines name.
NODE_DEVICES_ENV = {"gpus": "KCORAL_GPUS", "cpu-workers": "KCORAL_CPU_WORKERS"}


def gpus_from_count(text: str) -> str:
    """
    The C{--gpus} of C{KCORAL_GPUS}, which takes the value other node
    supervisors give it: a count (C{0}: a CPU node; C{N}: the first N GPUs),
    C{all}, or a comma list that names the GPUs.
    """
    text = text.strip()
    if text.isdigit():
        count = int(text)
        return "none" if count == 0 else ",".join(str(i) for i in range(count))
    names = [g.strip() for g in text.split(",")]
    if text in ("all", "none") or (len(names) > 1 and all(g.isdigit() for g in names)):
        return text
    raise ValueError(f"must be a count of GPUs, 'all' or a comma list of GPUs, got {text!r}")


def detect_gpus() -> list[str]:
    """Indices of the GPUs on this host, as C{nvidia-smi} lists them."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip().isdigit()]


def plan_workers(gpus: str, cpu_workers: int, detected: list[str],
                 devices_per_worker: int = 1) -> tuple[list[WorkerSpec], str]:
    """
    The workers to run and a one-line account of the choice: the GPUs named
    by C{gpus}, C{devices_per_worker} to a worker in the order named, or
    C{cpu_workers} CPU workers of that many host devices each. A ValueError
    when C{gpus} names what the host lacks, or a count of GPUs that
    C{devices_per_worker} does not divide.
    """
    n = devices_per_worker
    if gpus != "none" and detected:
        chosen = detected if gpus == "all" else [g.strip() for g in gpus.split(",") if g.strip()]
        if not chosen:
            raise ValueError(f"--gpus {gpus!r} names no GPU")
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"--gpus names a GPU twice: {gpus}")
        unknown = [g for g in chosen if g not in detected]
        if unknown:
            raise ValueError(f"--gpus names GPU {unknown[0]}, but this host has {', '.join(detected)}")
        if len(chosen) % n:
            raise ValueError(f"--devices-per-worker {n} does not divide the {len(chosen)} GPU(s) "
                             f"of --gpus {gpus} ({', '.join(chosen)})")
        groups = [",".join(chosen[i:i + n]) for i in range(0, len(chosen), n)]
        return ([WorkerSpec(f"worker{i}", i, group, n) for i, group in enumerate(groups)],
                f"{len(groups)} GPU worker(s) on GPU {(', ' if n == 1 else '; ').join(groups)}")
    why = "--gpus none" if gpus == "none" else "no GPU found"
    each = f" of {n} host devices each" if n > 1 else ""
    return ([WorkerSpec(f"worker{i}", i, None, n) for i in range(cpu_workers)],
            f"{why}: {cpu_workers} CPU worker(s){each}")
