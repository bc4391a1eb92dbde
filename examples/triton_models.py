"""
The model repository that Triton's example clients (tritonclient's
src/python/examples) expect, made with kcoral.export_bundle:

- simple and simple_int8: INPUT0 and INPUT1, [-1, 16] INT32 (INT8), to
  OUTPUT0 their sum and OUTPUT1 their difference, as version 1;
- custom_identity_int32: INPUT0 [-1, 16] INT32 to OUTPUT0 the same
  (memory_growth_test.py);
- filler models (filler0, ...) up to --models folders in all: the model
  control clients count the repository index (7 for HTTP's, 8 for gRPC's).

Usage: python examples/triton_models.py DIR [--models N]
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import kcoral


def sum_and_difference(a, b):
    return a + b, a - b


def identity(x):
    return x


def doubled(x):
    return x * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="the model repository to write")
    parser.add_argument("--models", type=int, default=7,
                        help="model folders in all, fillers included (default 7)")
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
    for i in range(max(args.models - 3, 0)):
        kcoral.export_bundle(doubled, None, np.zeros((1, 4), np.float32),
                             dir=os.path.join(args.dir, f"filler{i}"), name=f"filler{i}",
                             batch_sizes=[1])


if __name__ == "__main__":
    main()
