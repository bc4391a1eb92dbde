"""
Programs and inputs the tests send to real servers, built with real
C{jax.export}.
"""

from __future__ import annotations

import time

import numpy as np


def references(run) -> list[str | None]:
    """The digests a decoded run sent without their content."""
    return [blob.digest for blob in (run.program, *(spec.blob for spec in run.inputs))
            if blob.data is None]


def affine_program():
    """A dict of outputs, a tuple nested inside: C{w @ x + b}."""
    import jax.numpy as jnp

    from kcoral import Program

    def affine(w, x, b):
        y = w @ x + b
        return {"y": y, "stats": (jnp.sum(y), jnp.max(y))}

    w = np.random.default_rng(1).standard_normal((256, 128)).astype(np.float32)  # 128 KiB
    x = np.linspace(-1, 1, 128, dtype=np.float32)
    b = np.float32(0.5)

    def expected(w, x, b):
        y = w @ x + b
        return {"y": y, "stats": (y.sum(), y.max())}

    return Program.from_function(affine, w, x, b), (w, x, b), expected


def integer_program():
    """Integer and boolean inputs, a tuple of outputs of other dtypes."""
    import jax.numpy as jnp

    from kcoral import Program

    def count(a, mask):
        kept = jnp.where(mask, a, 0)
        return kept.astype(jnp.int16), jnp.cumsum(a, axis=1), jnp.any(mask)

    a = np.arange(24, dtype=np.int32).reshape(4, 6)
    mask = (a % 3 == 0)

    def expected(a, mask):
        return np.where(mask, a, 0).astype(np.int16), np.cumsum(a, axis=1, dtype=np.int32), mask.any()

    return Program.from_function(count, a, mask), (a, mask), expected


def keyword_program():
    """Keyword arguments, a 0-d input, an empty input and a nested pytree."""
    import jax.numpy as jnp

    from kcoral import Program

    def scale(pair, *, factor, empty):
        left, (right,) = pair
        return [left * factor, {"right": right.T, "empty": empty * 2, "n": jnp.asarray(empty.size)}]

    left = np.arange(6, dtype=np.float32).reshape(2, 3)
    right = np.arange(6, dtype=np.float32).reshape(3, 2)[:, ::-1]  # not contiguous
    factor = np.float32(3.0)
    empty = np.zeros((0, 4), np.float32)
    args = ((left, (right,)),)
    kwargs = {"factor": factor, "empty": empty}

    def expected(pair, *, factor, empty):
        left, (right,) = pair
        return [left * factor, {"right": right.T, "empty": empty * 2, "n": np.int32(0)}]

    return Program.from_function(scale, *args, **kwargs), args, kwargs, expected


def spin_program(costly: bool = False):
    """C{spin(n, x)}: C{n} iterations of a while loop; its running time is
    proportional to C{n}, which L{spin_iterations} calibrates. C{costly}:
    each iteration multiplies a 64x64 matrix, which makes XLA's CPU client
    run it asynchronously (its call returns before it ends), as a GPU runs
    every program."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from kcoral import Program

    def spin(n, x):
        def body(carry):
            i, v = carry
            return i + 1, jnp.tanh(v @ v) if costly else jnp.sin(v) * 0.5 + v * 0.5

        return lax.while_loop(lambda carry: carry[0] < n, body, (jnp.int32(0), x))[1]

    x = np.eye(64, dtype=np.float32) / 2 if costly else np.ones(16, np.float32)
    return Program.from_function(spin, np.int32(1), x), jax.jit(spin), x


def spin_iterations(seconds: float) -> int:
    """Iterations of L{spin_program} that take about C{seconds} here."""
    _, local, x = spin_program()
    local(np.int32(10), x).block_until_ready()
    probe = 2_000_000
    started = time.perf_counter()
    local(np.int32(probe), x).block_until_ready()
    per_iteration = max((time.perf_counter() - started) / probe, 1e-9)
    return int(min(seconds / per_iteration, 2**31 - 1))


def huge_allocation_program():
    """Compiles fine, but needs a 1 TiB buffer when it runs."""
    import jax.numpy as jnp

    from kcoral import Program

    def huge(x):
        return jnp.zeros((1 << 38,), jnp.float32) + x

    return Program.from_function(huge, np.float32(1))


def uncompilable_program():
    """A program that passes the worker's check and fails to compile: it
    calls a CUDA kernel of the allow-list outside any platform's branch,
    which a CPU worker has no handler for."""
    from kcoral import Program
    from tests.forged import custom_call, forge

    return Program.from_bytes(forge(custom_call("cusolver_potrf_ffi"), "main"))


def other_platform_program(server_gpus: str | None):
    """A program exported only for a platform the test server does not run."""
    import jax.numpy as jnp

    from kcoral import Program

    platforms = ("cpu",) if server_gpus else ("cuda",)
    return Program.from_function(lambda x: jnp.cos(x), np.float32(1), platforms=platforms)
