"""
Which devices a node serves, found without initialising CUDA in the
supervisor (which never imports JAX): C{nvidia-smi} when present.
"""

from __future__ import annotations

import shutil
import subprocess

import attrs


@attrs.frozen
class WorkerSpec:
    """One server process to run: its name, index (port offset) and device."""

    name: str
    index: int
    gpu: str | None  # None: a CPU worker

    @property
    def env(self) -> dict[str, str]:
        # Each GPU worker sees only its own device; CPU workers see none.
        return {"CUDA_VISIBLE_DEVICES": self.gpu if self.gpu is not None else ""}

    @property
    def gpus_argument(self) -> str:
        return "0" if self.gpu is not None else "none"


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


def plan_workers(gpus: str, cpu_workers: int, detected: list[str]) -> tuple[list[WorkerSpec], str]:
    """The workers to run and a one-line account of the choice."""
    if gpus != "none" and detected:
        chosen = detected if gpus == "all" else [g.strip() for g in gpus.split(",") if g.strip()]
        if not chosen:
            raise ValueError(f"--gpus {gpus!r} names no GPU")
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"--gpus names a GPU twice: {gpus}")
        unknown = [g for g in chosen if g not in detected]
        if unknown:
            raise ValueError(f"--gpus names GPU {unknown[0]}, but this host has {', '.join(detected)}")
        return ([WorkerSpec(f"worker{i}", i, g) for i, g in enumerate(chosen)],
                f"{len(chosen)} GPU worker(s) on GPU {', '.join(chosen)}")
    why = "--gpus none" if gpus == "none" else "no GPU found"
    return ([WorkerSpec(f"worker{i}", i, None) for i in range(cpu_workers)],
            f"{why}: {cpu_workers} CPU worker(s)")
