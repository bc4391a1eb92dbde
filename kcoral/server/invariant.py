"""
Batch-invariant execution of a batched model: one program that computes a
batch's rows one at a time, so that a row's outputs are the same bytes
whatever else is in its batch and wherever it sits in it.

XLA's CPU (and GPU) kernels choose their blocking, vector width and order
of summation by the shapes they are compiled for, and in a batch by where
the row falls in those blocks: the same row computed alone and inside a
batch differs in its last bits. A loop whose body runs the model on one
row, and whose trip count is an argument (so that XLA can neither unroll
nor specialise it), runs every row through the same machine code on the
same shapes, whatever the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: The dtype of the loop's trip count, the number of real rows.
COUNT_DTYPE = np.int32
#: The XLA flag that makes a GPU's executions the same run to run (no
#: atomics in its sums and scatters, the same algorithm for a shape every
#: time): without it, one row at one shape need not give the same bytes twice.
DETERMINISTIC_GPU = "--xla_gpu_deterministic_ops"


def deterministic_flags(flags: str) -> str:
    """C{flags} (an C{XLA_FLAGS} value) with GPU executions deterministic,
    unless they say otherwise themselves."""
    if DETERMINISTIC_GPU in flags:
        return flags
    return f"{flags} {DETERMINISTIC_GPU}=true".strip()


def row_size(exported, params: int, smallest: int) -> int:
    """
    The batch size at which the C{jax.export} program C{exported} (taking
    C{params} params, then the inputs) computes one row: 1 where its batch
    dimension is symbolic and it traces at 1, else C{smallest}, the
    smallest size it was exported for (the row is then padded with zero
    rows, the same whatever the batch, so its outputs still depend on
    nothing but itself).
    """
    import jax

    if all(isinstance(a.shape[0], int) for a in exported.in_avals[params:]):
        return smallest
    try:
        jax.eval_shape(exported.call, *[
            jax.ShapeDtypeStruct((1, *a.shape[1:]) if i >= params else a.shape, a.dtype)
            for i, a in enumerate(exported.in_avals)])
    except Exception:
        # A model whose shapes need more than one row (a reshape by two).
        return smallest
    return 1


def row_by_row(call: Callable[..., Sequence[Any]], params: int, size: int) -> Callable[..., Any]:
    """
    The function, to compile at a batch of C{max_batch_size} rows, of
    C{(*params, *inputs, count)}: the outputs of C{call} (the model,
    taking C{params} params then the inputs, returning its outputs) for
    the first C{count} rows of the inputs, each computed alone at batch
    size C{size}; the outputs' other rows are zeros.
    """
    import jax
    import jax.numpy as jnp

    def run(*args):
        weights, inputs, count = args[:params], args[params:-1], args[-1]

        def one(row, inputs_at):
            # The row at position 0 of a batch of `size` rows, the others zeros.
            return [jnp.pad(jax.lax.dynamic_slice_in_dim(x, row, 1),
                            [(0, size - 1)] + [(0, 0)] * (x.ndim - 1)) for x in inputs_at]

        shapes = jax.eval_shape(call, *weights, *one(0, inputs))
        rows = inputs[0].shape[0]
        empty = tuple(jnp.zeros((rows, *s.shape[1:]), s.dtype) for s in shapes)

        def body(row, outputs):
            results = call(*weights, *one(row, inputs))
            return tuple(jax.lax.dynamic_update_slice_in_dim(out, result[:1], row, 0)
                         for out, result in zip(outputs, results))

        return jax.lax.fori_loop(0, count, body, empty)

    return run
