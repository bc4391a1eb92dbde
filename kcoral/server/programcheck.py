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
ever. XLA's compiler itself is taken down by a module nested deep enough,
or by a function that calls itself (L{MAX_DEPTH}). C{jax.export} checks
custom calls only where a program is exported, on the client's side, and
honours the exemptions the program carries; nothing checks them where it is
deserialized or compiled. So the worker checks here,
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

#: How deep a program's operations may stand, regions in regions and calls
#: followed (those of a function's body stand 1 deep; each region a level
#: more, each call the callee's depth more). XLA's compiler recurses once a
#: level, on a thread of its own: about 220 levels overflowed its stack and
#: crashed the worker (SIGSEGV), and a function that calls itself, however
#: small, did the same. What JAX exports stands a few levels deep (a scan in
#: a cond in a jitted function); 64 keeps well clear of both.
MAX_DEPTH = 64

#: The operations that call a function of the module, and the attribute
#: that names it (or, for a custom call, a list of them).
CALLS = {"func.call": "callee", "stablehlo.composite": "decomposition",
         "stablehlo.custom_call": "called_computations"}

#: The labels of C{kcoral_programs_rejected_total}.
CUSTOM_CALL, OP, NESTING, UNREADABLE = "custom_call", "op", "nesting", "unreadable"
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
        # Of each operation that holds others: the function it stands in
        # and how deep what it holds stands; filled as the walk, parents
        # first, meets their first child.
        places: dict = {}
        # Each function's calls (how deep each stands, and the callee), and
        # how deep its operations stand.
        calls: dict[str, list[tuple[int, str]]] = {}
        deepest: dict[str, int] = {}

        def place(parent) -> tuple[str, int]:
            found = places.get(parent)
            if found is None:
                grandparent = parent.parent
                if parent.name == "func.func":
                    found = (_symbol(parent.attributes["sym_name"]), 1)
                elif grandparent is None:  # the module: its functions stand 0 deep
                    found = ("", 0)
                else:
                    function, depth = place(grandparent)
                    found = (function, depth + 1)
                places[parent] = found
                deepest[found[0]] = max(deepest.get(found[0], 0), found[1])
                if found[1] > MAX_DEPTH:
                    refused.append(_too_deep(what))
            return found

        def visit(op):
            name = op.name
            parent = op.parent
            function, depth = ("", 0) if parent is None else place(parent)
            if name == "stablehlo.custom_call":
                spelled = ir.StringAttr(op.attributes["call_target_name"]).value_bytes
                target = spelled.decode("utf-8", "backslashreplace")
                # Bytes that are not UTF-8 are no target of the list, whatever they read as.
                if target.encode() != spelled or target not in self.allowed:
                    refused.append(Refused(
                        f"{what} calls the custom-call target {target!r}, which a worker does "
                        "not run (see --allow-custom-call)", CUSTOM_CALL))
            elif name in REFUSED_OPS:
                refused.append(Refused(f"{what} holds the operation {name!r}, which waits on a "
                                       "host or peer a worker does not provide", OP))
            if name in CALLS and CALLS[name] in op.attributes:
                callees = op.attributes[CALLS[name]]
                for callee in callees if isinstance(callees, ir.ArrayAttr) else [callees]:
                    calls.setdefault(function, []).append((depth, _symbol(callee)))
            return ir.WalkResult.INTERRUPT if refused else ir.WalkResult.ADVANCE

        # MLIR's own walk, every region of every operation: about a
        # microsecond an operation, where one in Python costs several.
        # Parents first, so that a module nested too deep is refused
        # before the walk, which recurses as the compiler does, goes deep.
        root.walk(visit, ir.WalkOrder.PRE_ORDER)
        if refused:
            raise refused[0]
        _deepest_call(calls, deepest, what)


def _symbol(attribute) -> str:
    """The name a function's C{sym_name} or a symbol reference holds, as
    MLIR writes it (escaped: its bytes need not be UTF-8, which the
    binding's C{value} insists on), the same for both."""
    text = str(attribute).removeprefix("@")
    return text[1:-1] if text.startswith('"') else text


def _deepest_call(calls: dict[str, list[tuple[int, str]]], deepest: dict[str, int],
                  what: str) -> None:
    """Raise L{Refused} if a function calls itself, or if following the
    calls leads past L{MAX_DEPTH}."""
    reached: dict[str, int] = {}

    def reach(function: str, path: tuple[str, ...]) -> int:
        if function in path:
            raise Refused(f"{what} calls the function {function!r} from itself, which a "
                          "worker's compiler would follow without end", NESTING)
        if function not in reached:
            if len(path) > MAX_DEPTH:
                raise _too_deep(what)
            reached[function] = max([deepest.get(function, 0), *(
                depth + reach(callee, (*path, function))
                for depth, callee in calls.get(function, ()))])
            if reached[function] > MAX_DEPTH:
                raise _too_deep(what)
        return reached[function]

    for function in list(calls):
        reach(function, ())


def _too_deep(what: str) -> Refused:
    return Refused(f"{what} nests its operations more than {MAX_DEPTH} deep (regions in "
                   "regions, calls followed), past what a worker's compiler can take", NESTING)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
