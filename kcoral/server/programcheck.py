"""
The check every program passes before it is compiled: a serialized
C{jax.export} program is read, each operation of its module is looked at,
and only then is it handed to XLA.

A program is a StableHLO module, and two kinds of operation in it reach
past the computation itself. A C{stablehlo.custom_call} names a function of
the worker's own process by its target name, with operands and a
configuration the client wrote: JAX's host callbacks read a client-chosen
index as a pointer, Pallas and Mosaic kernels are device code the client
wrote. And C{infeed}, C{outfeed}, C{send} and C{recv} wait for a host or a
peer that a worker never provides, so a program that holds one runs for
ever. C{jax.export} checks custom calls only where a program is exported, on
the client's side, and honours the exemptions the program carries; nothing
checks them where it is deserialized or compiled. So the worker checks here,
once per program (its callers cache what this returns by digest), with an
allow-list of its own and never the program's exemptions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import attrs

from kcoral.errors import ProgramRejected

#: The custom-call targets a program may hold: those JAX guarantees stable
#: (its export checks against the same list; tests/test_programcheck.py pins
#: this copy against the installed JAX's), less those that carry code the
#: client wrote (see L{CLIENT_CODE}). Host callbacks were never on it. The
#: same list on every platform: each platform's branch of a program is
#: checked, and a target a worker's platform has no handler for is refused
#: by its compiler.
ALLOWED_CUSTOM_CALLS = frozenset({
    # Sharding annotations, placement, shape polymorphism, lax.empty.
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement",
    "shape_assertion", "AllocateBuffer",
    # Linear algebra on the CPU (LAPACK), one kernel per element type.
    *(f"lapack_{t}{kernel}_ffi" for t in "sdcz"
      for kernel in ("gees", "geev", "gehrd", "geqrf", "gesdd", "getrf", "gtsv", "potrf", "trsm")),
    *(f"lapack_{t}{kernel}_ffi" for t in "sd" for kernel in ("orgqr", "syevd", "sytrd")),
    *(f"lapack_{t}{kernel}_ffi" for t in "cz" for kernel in ("ungqr", "heevd", "hetrd")),
    # Linear algebra and random bits on NVIDIA and AMD GPUs.
    *(f"cusolver_{kernel}_ffi" for kernel in ("geqrf", "gesvd", "gesvdj", "getrf", "orgqr",
                                              "potrf", "syevd", "sytrd")),
    *(f"hipsolver_{kernel}_ffi" for kernel in ("geqrf", "gesdd", "gesvd", "gesvdj", "getrf",
                                               "orgqr", "potrf", "syevd", "sytrd")),
    "cusparse_gtsv2_ffi", "cu_lu_pivots_to_permutation", "hip_lu_pivots_to_permutation",
    "cu_threefry2x32_ffi", "hip_threefry2x32_ffi",
    # TPU linear algebra and top-k.
    "Eigh", "Qr", "ProductOfElementaryHouseholderReflectors", "LuDecomposition", "ApproxTopK",
    # Dynamic-shape forms of StableHLO operations.
    "stablehlo.dynamic_approx_top_k", "stablehlo.dynamic_reduce_window",
    "stablehlo.dynamic_rng_bit_generator", "stablehlo.dynamic_top_k",
})

#: JAX's stable targets that run code the client wrote: Pallas kernels (for
#: TPUs and, through Mosaic, GPUs) and TensorFlow functions.
CLIENT_CODE = frozenset({"tpu_custom_call", "mosaic_gpu_v2", "tf.call_tf_function"})

#: Operations that wait on a host or a peer that a worker never provides.
REFUSED_OPS = frozenset({"stablehlo.infeed", "stablehlo.outfeed", "stablehlo.send",
                         "stablehlo.recv"})

#: The labels of C{kcoral_programs_rejected_total}.
CUSTOM_CALL, OP, UNREADABLE = "custom_call", "op", "unreadable"
REASON = "program_rejected"


class Refused(ProgramRejected):
    """422, reason C{program_rejected}: the program holds what a worker
    never compiles; C{what} is the metrics label of why."""

    def __init__(self, message: str, what: str) -> None:
        super().__init__(message, reason=REASON)
        self.what = what


@attrs.frozen
class ProgramCheck:
    """
    Reads programs for a worker: C{allowed} are the custom-call targets a
    program may hold; C{rejected} is called with the label of each refusal
    (a counter's C{inc} through its labels).
    """

    allowed: frozenset[str] = ALLOWED_CUSTOM_CALLS
    rejected: Callable[[str], object] = lambda what: None

    @classmethod
    def with_additions(cls, targets: Iterable[str], rejected: Callable[[str], object]) -> ProgramCheck:
        """The check of a worker whose operator allows C{targets} as well."""
        return cls(ALLOWED_CUSTOM_CALLS | frozenset(targets), rejected)

    def deserialize(self, serialized, what: str = "the program"):
        """
        The C{jax.export.Exported} of C{serialized}, once its module passed
        the check, without the safety checks the program says were disabled
        when it was exported (a worker honours none of them); L{Refused}
        (or L{ProgramRejected} for bytes that are no program) otherwise.
        Blocking: call it off the reactor.
        """
        from jax import export

        try:
            exported = export.deserialize(bytearray(serialized))
        except Exception as e:
            raise ProgramRejected(f"{what}: not a jax.export program: {_first_line(e)}") from None
        try:
            self.check(exported.mlir_module_serialized, what)
        except Refused as e:
            self.rejected(e.what)
            raise
        return dataclasses.replace(exported, disabled_safety_checks=())

    def check(self, module: bytes, what: str = "the program") -> None:
        """Raise L{Refused} unless the StableHLO module C{module} (a
        portable artifact) holds only allowed custom calls and operations."""
        from jax.extend import mlir
        from jax.extend.mlir import ir
        from jax.extend.mlir.dialects import chlo, sdy, stablehlo

        # A context of its own each time: a context keeps every name and
        # type it ever read, so one shared by all programs would grow with
        # each forged one.
        with ir.Context() as context, ir.Location.unknown():
            # Only the dialects JAX's programs are made of: a module that
            # holds another (one a compiler might still take) is not read.
            for dialect in (stablehlo, chlo, sdy):
                dialect.register_dialect(context)
            try:
                parsed = mlir.deserialize_portable_artifact(module)
            except Exception as e:
                raise Refused(f"{what}'s module could not be read: {_first_line(e)}",
                              UNREADABLE) from None
            self._walk(parsed.operation, what)

    def _walk(self, root, what: str) -> None:
        from jax.extend.mlir import ir

        refused: list[Refused] = []

        def visit(op):
            name = op.name
            if name == "stablehlo.custom_call":
                target = ir.StringAttr(op.attributes["call_target_name"]).value
                if target not in self.allowed:
                    refused.append(Refused(
                        f"{what} calls the custom-call target {target!r}, which a worker does "
                        "not run (see --allow-custom-call)", CUSTOM_CALL))
            elif name in REFUSED_OPS:
                refused.append(Refused(f"{what} holds the operation {name!r}, which waits on a "
                                       "host or peer a worker does not provide", OP))
            return ir.WalkResult.INTERRUPT if refused else ir.WalkResult.ADVANCE

        # MLIR's own walk, every region of every operation: about a
        # microsecond an operation, where one in Python costs several.
        root.walk(visit)
        if refused:
            raise refused[0]


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
