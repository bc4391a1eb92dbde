"""
What the check of a program costs beside its deserialization.

    .venv/bin/python -m bench.programcheck [--repeat N]

A worker reads each program once per digest: C{jax.export.deserialize},
then (since programs are checked) the check of its module
(L{kcoral.server.programcheck}): reading the module (the StableHLO portable
artifact, which JAX reads again, the same way, each time it lowers the
program for a compile) and walking its operations. For programs from one
operation to thousands (an unrolled transformer), this measures side by
side, in one run, the median of each: deserialization alone, with the
check, the module's read alone, what a cached digest costs (the lookup of
the executor's table of programs, which the check never reaches), and the
program's first compile for scale. Target: the check adds at most 20 ms a
program. The exit status is 0 whatever the numbers; C{doc/benchmarks.rst}
records the results.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench.support.quick import parse_quick

os.environ.setdefault("JAX_PLATFORMS", "cpu")

TARGET_MS = 20.0


def programs():
    """(name, serialized program) from small to large, exported for the CPU and CUDA."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def export(fn, *shapes):
        return bytes(jax.export.export(jax.jit(fn), platforms=("cpu", "cuda"))(*shapes).serialize())

    f32 = jax.ShapeDtypeStruct

    def layer(x, w):
        # One transformer block: attention, a norm, an MLP.
        q, k, v = x @ w[0], x @ w[1], x @ w[2]
        attention = jax.nn.softmax(q @ k.T / np.sqrt(x.shape[-1]), axis=-1) @ v
        h = x + attention
        h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
        return h + jax.nn.gelu(h @ w[3]) @ w[3].T

    def transformer(layers):
        def fn(x, w):
            for _ in range(layers):  # unrolled: every layer's ops stand in the module
                x = layer(x, w)
            return x
        return fn

    return [
        ("x + 1", export(lambda x: x + 1, f32((), jnp.float32))),
        ("linear algebra", export(lambda a: jnp.linalg.solve(a @ a.T + jnp.eye(64), a),
                                  f32((64, 64), jnp.float32))),
        ("transformer, 4 layers", export(transformer(4), f32((128, 256), jnp.float32),
                                         f32((4, 256, 256), jnp.float32))),
        ("transformer, 48 layers", export(transformer(48), f32((128, 256), jnp.float32),
                                          f32((4, 256, 256), jnp.float32))),
    ]


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1].strip())
    parser.add_argument("--repeat", type=int, default=30)
    args = parse_quick(parser, repeat=3)

    import cachetools
    import jax
    from jax import export
    from jax.extend import mlir
    from jax.extend.mlir import ir
    from jax.extend.mlir.dialects import chlo, sdy, stablehlo

    from kcoral.server.programcheck import ProgramCheck

    check = ProgramCheck()
    rows = []
    for name, serialized in programs():
        operations = export.deserialize(bytearray(serialized)).mlir_module().count(" = ") + 1
        cached = cachetools.LRUCache(64)
        cached["digest"] = check.deserialize(serialized)
        plain = median_ms(lambda: export.deserialize(bytearray(serialized)), args.repeat)
        checked = median_ms(lambda: check.deserialize(serialized), args.repeat)
        hit = median_ms(lambda: cached.get("digest"), args.repeat)
        module = cached["digest"].mlir_module_serialized

        def read():
            with ir.Context() as context, ir.Location.unknown():
                for dialect in (stablehlo, chlo, sdy):
                    dialect.register_dialect(context)
                mlir.deserialize_portable_artifact(module)

        module_read = median_ms(read, args.repeat)
        exported = cached["digest"]
        started = time.perf_counter()
        jax.jit(exported.call).lower(*exported.in_avals).compile()
        compile_ms = (time.perf_counter() - started) * 1000
        rows.append((name, len(serialized), operations, plain, checked, checked - plain,
                     module_read, checked - plain - module_read, hit, compile_ms))

    print(f"{'program':24} {'bytes':>7} {'ops':>5} {'deserialize':>11} {'+ check':>8} "
          f"{'check':>6} {'= read':>7} {'+ walk':>7} {'cached':>7} {'compile':>8}  "
          f"(medians of {args.repeat}, ms)")
    for name, size, operations, plain, checked, added, module_read, walk, hit, compiled in rows:
        print(f"{name:24} {size:7d} {operations:5d} {plain:11.2f} {checked:8.2f} {added:6.2f} "
              f"{module_read:7.2f} {walk:7.2f} {hit:7.4f} {compiled:8.0f}")
    worst = max(row[5] for row in rows)
    print(f"target: the check adds at most {TARGET_MS:.0f} ms a program: "
          f"{'met' if worst <= TARGET_MS else 'NOT met'} (largest {worst:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
