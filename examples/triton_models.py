"""
The model repository that Triton's example clients (tritonclient's
src/python/examples) expect, made with kcoral.export_bundle:

- simple and simple_int8: INPUT0 and INPUT1, [-1, 16] INT32 (INT8), to
  OUTPUT0 their sum and OUTPUT1 their difference, as version 1;
- custom_identity_int32: INPUT0 [-1, 16] INT32 to OUTPUT0 the same
  (memory_growth_test.py);
- simple_string: INPUT0 and INPUT1, [-1, 16] BYTES, each element a decimal
  integer, to OUTPUT0 their sum and OUTPUT1 their difference, as decimal
  BYTES (the string clients, and grpc_explicit_byte_content_client.py);
- simple_identity: INPUT0 [-1, 16] BYTES to OUTPUT0 the same, any bytes;
- repeat_int32, a decoupled model (simple_grpc_custom_repeat.py): IN [10]
  INT32, DELAY [10] UINT32 and WAIT [1] UINT32 to ten answers, answer i
  OUT [1] INT32 holding IN[i] and IDX [1] UINT32 holding i (DELAY and WAIT,
  Triton's pacing of its answers, are taken and not used);
- filler models (filler0, ...) up to --models folders in all: the model
  control clients count the repository index (7 for HTTP's, 8 for gRPC's);
- with --sequences, the sequence (stateful) models of the sequence clients
  instead of the fillers, each INPUT [-1, 1] INT32 to OUTPUT [-1, 1] INT32,
  its steps batched (oldest): simple_sequence answers a step's input, plus
  one on a sequence's first step (its state counts the steps);
  simple_dyna_sequence the same, plus the sequence's correlation id on its
  last step; simple_string_dyna_sequence the running sum of the inputs (its
  state), plus the correlation id on the last step.

Usage: python examples/triton_models.py DIR [--models N | --sequences]
"""

from __future__ import annotations

import argparse
import os

import jax.numpy as jnp
import numpy as np

import kcoral
from kcoral import Strings

#: The longest element of simple_string's tensors (an int32 in decimal
#: takes at most 11 bytes), and of simple_identity's.
DECIMAL_LENGTH = 16
IDENTITY_LENGTH = 64


def sum_and_difference(a, b):
    return a + b, a - b


def identity(x):
    return x


def decimal_value(strings):
    """The int32 value of each decimal element of C{strings} (an optional
    '-', then digits)."""
    data, lengths = strings.data.astype(jnp.int32), strings.lengths[..., None]
    place = jnp.arange(data.shape[-1])
    negative = (data[..., 0] == ord("-")) & (strings.lengths > 0)
    digit = (place < lengths) & ~((place == 0) & negative[..., None])
    # Each digit's weight: 10 to the power of the places after it.
    weight = jnp.where(digit, 10 ** jnp.clip(lengths - 1 - place, 0, 9), 0)
    value = jnp.sum((data - ord("0")) * weight, axis=-1)
    return jnp.where(negative, -value, value)


def decimal_strings(values):
    """Each int32 of C{values} in decimal, as a BYTES tensor."""
    negative = values < 0
    magnitude = jnp.abs(values)
    powers = 10 ** jnp.arange(10)
    digits = (magnitude[..., None] // powers) % 10  # the least significant first
    count = jnp.maximum(1, jnp.sum(magnitude[..., None] >= powers, axis=-1))
    lengths = count + negative
    place = jnp.arange(DECIMAL_LENGTH)
    which = jnp.clip(lengths[..., None] - 1 - place, 0, 9)
    chars = jnp.take_along_axis(digits, which, axis=-1) + ord("0")
    chars = jnp.where(negative[..., None] & (place == 0), ord("-"), chars)
    chars = jnp.where(place < lengths[..., None], chars, 0)
    return Strings(chars.astype(jnp.uint8), lengths.astype(jnp.int32))


def string_sum_and_difference(a, b):
    x, y = decimal_value(a), decimal_value(b)
    return decimal_strings(x + y), decimal_strings(x - y)


def doubled(x):
    return x * 2


#: The elements of repeat_int32's IN, as simple_grpc_custom_repeat.py sends it.
REPEATS = 10


def repeated(values, delay, wait):
    """repeat_int32: an answer for each element of C{values}, the element
    and its index (a program cannot wait: C{delay} and C{wait} are not used)."""
    del delay, wait
    return values[:, None], jnp.arange(values.shape[0], dtype=jnp.uint32)[:, None]


def counted_step(count, start, ready, x):
    """simple_sequence: its input, plus one on its sequence's first step."""
    count = jnp.where(start == 1, 0, count) + ready
    return count, x + (count == 1).astype(x.dtype)


def dyna_step(count, start, end, ready, corrid, x):
    """simple_dyna_sequence: simple_sequence's, plus the id on the last step."""
    count, output = counted_step(count, start, ready, x)
    return count, output + end * corrid.astype(x.dtype)


def summed_step(total, start, end, ready, corrid, x):
    """simple_string_dyna_sequence: the sum so far, plus the id on the last step."""
    total = jnp.where(start == 1, 0, total) + x * ready
    return total, total + end * corrid.astype(x.dtype)


def sequence_models(folder: str) -> None:
    """The sequence models of Triton's sequence clients, in C{folder}."""
    one = np.zeros((1, 1), np.int32)
    for name, step, controls in (
            ("simple_sequence", counted_step, ("START", "READY")),
            ("simple_dyna_sequence", dyna_step, ("START", "END", "READY", "CORRID")),
            ("simple_string_dyna_sequence", summed_step, ("START", "END", "READY", "CORRID"))):
        kcoral.export_bundle(step, None, one, dir=os.path.join(folder, name, "1"), name=name,
                             batch_sizes=[1, 8], input_names=["INPUT"], output_names=["OUTPUT"],
                             state=one, controls=controls, sequence_batching="oldest")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="the model repository to write")
    parser.add_argument("--models", type=int, default=7,
                        help="model folders in all, fillers included (default 7)")
    parser.add_argument("--sequences", action="store_true",
                        help="write the sequence clients' models in place of the fillers")
    args = parser.parse_args()
    for name, dtype in (("simple", np.int32), ("simple_int8", np.int8)):
        x = np.zeros((1, 16), dtype)
        kcoral.export_bundle(sum_and_difference, None, x, x, dir=os.path.join(args.dir, name, "1"),
                             name=name, batch_sizes=[1, 8], input_names=["INPUT0", "INPUT1"],
                             output_names=["OUTPUT0", "OUTPUT1"])
    kcoral.export_bundle(identity, None, np.zeros((1, 16), np.int32),
                         dir=os.path.join(args.dir, "custom_identity_int32", "1"),
                         name="custom_identity_int32", batch_sizes=[1, 8],
                         input_names=["INPUT0"], output_names=["OUTPUT0"])
    strings = Strings.of([[b""] * 16], DECIMAL_LENGTH)
    kcoral.export_bundle(string_sum_and_difference, None, strings, strings,
                         dir=os.path.join(args.dir, "simple_string", "1"), name="simple_string",
                         batch_sizes=[1, 8], input_names=["INPUT0", "INPUT1"],
                         output_names=["OUTPUT0", "OUTPUT1"])
    kcoral.export_bundle(identity, None, Strings.of([[b""] * 16], IDENTITY_LENGTH),
                         dir=os.path.join(args.dir, "simple_identity", "1"),
                         name="simple_identity", batch_sizes=[1, 8],
                         input_names=["INPUT0"], output_names=["OUTPUT0"])
    kcoral.export_bundle(repeated, None, np.zeros(REPEATS, np.int32), np.zeros(REPEATS, np.uint32),
                         np.zeros(1, np.uint32), dir=os.path.join(args.dir, "repeat_int32", "1"),
                         name="repeat_int32", input_names=["IN", "DELAY", "WAIT"],
                         output_names=["OUT", "IDX"], decoupled=True)
    if args.sequences:
        sequence_models(args.dir)
        return
    for i in range(max(args.models - 6, 0)):
        kcoral.export_bundle(doubled, None, np.zeros((1, 4), np.float32),
                             dir=os.path.join(args.dir, f"filler{i}"), name=f"filler{i}",
                             batch_sizes=[1])


if __name__ == "__main__":
    main()
