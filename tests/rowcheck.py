"""
How far a batched model's row is from the same row computed alone, and the
bound the tests hold the default batching to.

Run as C{python -m tests.rowcheck REPOSITORY [--one-core]} (from the
project's root, with C{XLA_FLAGS} set to the configuration to check), it
loads the model C{mlp} of REPOSITORY twice, batched as by default and batch
invariant, sends every run of consecutive rows of one batch alone, and
prints as JSON the largest distance in ulps of the default, how many runs
differed in their bytes in each, and the CPU's XLA configuration. It
imports JAX only once the process is on one core, if it is to be.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

#: The most a batched row's outputs may differ from the same row's alone by
#: default, in ulps of the row's largest output magnitude: the model's own
#: float32 rounding (measured: 3 to 5 for the tests' 16 -> 32 -> 8 MLP on
#: every XLA CPU configuration tried; doc/models.rst).
ROUNDING_ULPS = 16
#: The rows of the batch that rowcheck splits.
BATCH = 8


def row_ulps(got: np.ndarray, alone: np.ndarray) -> float:
    """The largest distance between C{got} and C{alone} (rows of outputs,
    the batch first), in ulps of each row's largest magnitude in C{alone}."""
    rows = alone.reshape(len(alone), -1).astype(np.float64)
    scale = np.spacing(np.abs(alone.reshape(len(alone), -1)).max(axis=1, keepdims=True))
    return float((np.abs(got.reshape(len(got), -1) - rows) / scale).max())


def assert_within_rounding(got: np.ndarray, alone: np.ndarray) -> None:
    """C{got} equals C{alone} within L{ROUNDING_ULPS}."""
    assert got.shape == alone.shape and got.dtype == alone.dtype, (got, alone)
    distance = row_ulps(got, alone)
    assert distance <= ROUNDING_ULPS, (distance, got, alone)


def runs(batch: int):
    """Every run of consecutive rows of a batch of C{batch}: (start, count)."""
    return [(start, count) for start in range(batch) for count in range(1, batch - start + 1)]


def check(repository: str) -> dict:
    import jax

    from kcoral.server.models import ModelRepository

    x = np.random.default_rng(3).standard_normal((BATCH, 16)).astype(np.float32)
    found: dict = {"xla_flags": os.environ.get("XLA_FLAGS", ""),
                   "cores": len(os.sched_getaffinity(0))}
    for invariant in (False, True):
        models = ModelRepository(repository, batch_invariant=invariant)
        models.load(jax.local_devices()[0])
        model = models.get("mlp")
        whole = model.infer({"input": x})["output"]
        parts = [(model.infer({"input": x[start:start + count]})["output"],
                  whole[start:start + count]) for start, count in runs(BATCH)]
        found["invariant_differing" if invariant else "differing"] = sum(
            part.tobytes() != batched.tobytes() for part, batched in parts)
        if not invariant:
            found["ulps"] = max(row_ulps(batched, part) for part, batched in parts)
    return found


def main(argv: list[str]) -> None:
    if "--one-core" in argv:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    print(json.dumps(check(argv[0])))


if __name__ == "__main__":
    main(sys.argv[1:])
