"""The programs the server, Router and proxy benchmarks run: a trivial one,
one of about 5 ms on this machine, and one with 64 MiB of weights."""

from __future__ import annotations

from bench.support.timing import percentile, timings

WEIGHTS_SHAPE = (4096, 4096)  # float32: 64 MiB


def programs(rng):
    """(name, function, inputs, fresh inputs for a repeated call) for each
    benchmarked program; the ~5 ms one is calibrated on this machine."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def trivial(x):
        return x + 1

    def work(n):
        def step(x, w):
            return jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ w), x)
        return step

    a = rng.standard_normal((128, 256), dtype=np.float32)
    w5 = rng.standard_normal((256, 256), dtype=np.float32) / 16
    # Calibrate the loop count so the in-process call takes about 5 ms:
    # estimate, then check the estimate once (a busy moment skews a probe).
    steps = 16
    for _ in range(2):
        probe = jax.jit(work(steps))
        per_step = percentile(timings(lambda: np.asarray(probe(a, w5)), 40, 5), 50) / steps
        steps = max(1, round(0.005 / per_step))

    def weighted(w, x):
        return jnp.tanh(x @ w)

    weights = rng.standard_normal(WEIGHTS_SHAPE, dtype=np.float32)
    x = rng.standard_normal((1, WEIGHTS_SHAPE[0]), dtype=np.float32)
    x2 = rng.standard_normal((1, WEIGHTS_SHAPE[0]), dtype=np.float32)
    return [
        ("trivial (x + 1, scalar)", trivial, (np.float32(1.0),), (np.float32(2.0),)),
        (f"~5 ms ({steps} x tanh(128x256 @ 256x256))", work(steps), (a, w5), (a * 0.5, w5)),
        ("64 MiB weights (tanh(x @ W), W 4096x4096 f32)", weighted, (weights, x), (weights, x2)),
    ]
