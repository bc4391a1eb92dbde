"""
The model of C{bench.serving}, imported by every front it serves from
(KCoral's bundle, PyTriton, KServe) and by its in-process floor, so that
each runs the same function on the same params.
"""

from __future__ import annotations

import numpy as np

NAME = "mlp"
ROWS = 256  # floats in, and out, per row
HIDDEN = 1024
MAX_BATCH_SIZE = 64
INPUT, OUTPUT = "input", "output"


def make_params(seed: int = 0) -> dict[str, np.ndarray]:
    """Weights scaled so that tanh is not saturated: the outputs are not constant."""
    rng = np.random.default_rng(seed)
    return {"w1": (rng.standard_normal((ROWS, HIDDEN)) / np.sqrt(ROWS)).astype(np.float32),
            "b1": np.zeros(HIDDEN, np.float32),
            "w2": (rng.standard_normal((HIDDEN, ROWS)) / np.sqrt(HIDDEN)).astype(np.float32),
            "b2": np.zeros(ROWS, np.float32)}


def save_params(path, params: dict[str, np.ndarray]) -> None:
    np.savez(path, **params)


def load_params(path) -> dict[str, np.ndarray]:
    with np.load(path) as saved:
        return {name: saved[name] for name in saved.files}


def mlp(params, x):
    import jax.numpy as jnp

    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
