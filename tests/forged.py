"""
Programs forged as a hostile client forges them: a harmless C{jax.export}
whose StableHLO module is replaced by one written here, then serialized as
JAX serializes any program. Nothing on the client's side checks them, and
they pass C{jax.export.deserialize} unchanged.

Each module takes C{x: f32[4]} and returns C{f32[4]}, exported for the CPU
and CUDA: the forged operation stands in C{main} itself (every platform) or
in the CUDA branch alone, which a CPU worker never executes but must still
refuse. Private functions may stand beside C{main} (L{calls}, L{recursion}).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

#: The operations a worker refuses, and a harmless one, each as the lines
#: that read C{%x} and define C{%f}.
OPS = {
    "stablehlo.infeed": [
        '%tok = stablehlo.after_all : !stablehlo.token',
        ('%f, %t2 = "stablehlo.infeed"(%tok) {infeed_config = ""} : '
         '(!stablehlo.token) -> (tensor<4xf32>, !stablehlo.token)')],
    "stablehlo.outfeed": [
        '%tok = stablehlo.after_all : !stablehlo.token',
        ('%t2 = "stablehlo.outfeed"(%x, %tok) {outfeed_config = ""} : '
         '(tensor<4xf32>, !stablehlo.token) -> !stablehlo.token'),
        '%f = stablehlo.add %x, %x : tensor<4xf32>'],
    "stablehlo.send": [
        '%tok = stablehlo.after_all : !stablehlo.token',
        ('%t2 = "stablehlo.send"(%x, %tok) {channel_handle = #stablehlo.channel_handle<handle = 1, '
         'type = 2>, is_host_transfer = true} : (tensor<4xf32>, !stablehlo.token) -> !stablehlo.token'),
        '%f = stablehlo.add %x, %x : tensor<4xf32>'],
    "stablehlo.recv": [
        '%tok = stablehlo.after_all : !stablehlo.token',
        ('%f, %t2 = "stablehlo.recv"(%tok) {channel_handle = #stablehlo.channel_handle<handle = 2, '
         'type = 3>, is_host_transfer = true} : (!stablehlo.token) -> (tensor<4xf32>, !stablehlo.token)')],
}
HARMLESS = ['%f = stablehlo.add %x, %x : tensor<4xf32>']
#: Where the forged lines stand.
PLACES = ("main", "cuda branch")


def custom_call(target: str, index: int = 0) -> list[str]:
    """A custom call of C{target} with the configuration JAX's host
    callbacks read (C{index}: which callback, an unchecked offset)."""
    return [(f'%f = "stablehlo.custom_call"(%x) {{call_target_name = {mlir_string(target)}, '
            f'api_version = 4 : i32, backend_config = {{index = {index} : ui64}}}} : '
            '(tensor<4xf32>) -> tensor<4xf32>')]


def mlir_string(text: str | bytes) -> str:
    """C{text} as an MLIR string literal: printable ASCII as it is, every
    other byte (of its UTF-8, for a C{str}) as C{\\XX}; bytes need not be UTF-8."""
    raw = text.encode() if isinstance(text, str) else text
    return '"' + "".join(chr(b) if 32 <= b < 127 and b not in b'"\\' else f"\\{b:02X}"
                         for b in raw) + '"'


def nested(depth: int, inner: str = "stablehlo.add %x, %x : tensor<4xf32>") -> list[str]:
    """Lines whose deepest operation stands C{depth} deep (those of C{main}
    itself stand 1 deep): C{depth - 1} C{stablehlo.case}s on an index read
    from C{%x} (one on the platform index, a constant once the platform is
    known, would be folded away before XLA's compiler sees it), one in the
    other, around C{inner} (the doubling of C{%x}, or a call), the
    outermost defining C{%f}."""
    names = ["%f", *(f"%n{i}" for i in range(1, depth))]
    lines = ["%x0 = stablehlo.slice %x [0:1] : (tensor<4xf32>) -> tensor<1xf32>",
             "%x1 = stablehlo.reshape %x0 : (tensor<1xf32>) -> tensor<f32>",
             "%i = stablehlo.convert %x1 : (tensor<f32>) -> tensor<i32>",
             *(f'{name} = "stablehlo.case"(%i) ({{' for name in names[:-1])]
    lines.append(f"{names[-1]} = {inner}")
    for name in reversed(names[1:]):
        lines += [f"stablehlo.return {name} : tensor<4xf32>", "}) : (tensor<i32>) -> tensor<4xf32>"]
    return lines


#: The call of the first private function.
CALL = "call @f0(%x) : (tensor<4xf32>) -> tensor<4xf32>"


def calls(length: int) -> tuple[list[str], list[str]]:
    """The lines and private functions of a chain of C{length} functions,
    each calling the next (the last doubles its C{%x}): its deepest
    operation stands C{length + 1} deep, calls followed."""
    functions = [_function(f"f{i}", f"%r = call @f{i + 1}(%x) : (tensor<4xf32>) -> tensor<4xf32>"
                           if i + 1 < length else "%r = stablehlo.add %x, %x : tensor<4xf32>")
                 for i in range(length)]
    return [f"%f = {CALL}"], functions


#: How a function is made to call itself: by C{func.call}, through another
#: function, or as the decomposition of a C{stablehlo.composite}.
RECURSIONS = {
    "call": f"%r = {CALL}",
    "call through another": "%r = call @f1(%x) : (tensor<4xf32>) -> tensor<4xf32>",
    "composite": '%r = stablehlo.composite "kcoral.forged" %x {decomposition = @f0} : '
                 "(tensor<4xf32>) -> tensor<4xf32>",
}


def recursion(how: str) -> tuple[list[str], list[str]]:
    """The lines and private functions of a program whose function C{f0}
    calls itself C{how} (a key of L{RECURSIONS})."""
    functions = [_function("f0", RECURSIONS[how])]
    if how == "call through another":
        functions.append(_function("f1", f"%r = {CALL}"))
    return [f"%f = {CALL}"], functions


def _function(name: str, line: str) -> str:
    return (f"  func.func private @{name}(%x: tensor<4xf32>) -> tensor<4xf32> {{\n"
            f"    {line}\n    return %r : tensor<4xf32>\n  }}\n")


def module_text(lines: list[str], place: str = "main", functions: Sequence[str] = ()) -> str:
    """The module with C{lines} at C{place}: in C{main}, or in the CUDA
    branch of a C{case} on the platform index (the CPU branch doubles C{x});
    C{functions} stand after C{main}."""
    def body(indent: str, result: str) -> str:
        return "".join(f"{indent}{line}\n" for line in lines) + f"{indent}{result} %f : tensor<4xf32>\n"

    if place == "main":
        inner = body("    ", "return")
    else:
        inner = ('    %r = "stablehlo.case"(%p) ({\n'
                 + "".join(f"      {line}\n" for line in HARMLESS)
                 + "      stablehlo.return %f : tensor<4xf32>\n    }, {\n"
                 + body("      ", "stablehlo.return")
                 + "    }) : (tensor<i32>) -> tensor<4xf32>\n    return %r : tensor<4xf32>\n")
    return ("module @forged attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {\n"
            '  func.func public @main(%p: tensor<i32> {jax.global_constant = "_platform_index"}, '
            "%x: tensor<4xf32>) -> (tensor<4xf32>) {\n"
            + inner + "  }\n" + "".join(functions) + "}\n")


def forge(lines: list[str], place: str = "main", exempt: tuple = (),
          functions: Sequence[str] = ()) -> bytes:
    """
    The serialized program of the module with C{lines} at C{place} and
    C{functions} beside C{main}, whose C{disabled_safety_checks} claim
    C{exempt} (C{jax.export.DisabledSafetyCheck}s).
    """
    import jax
    import jax.numpy as jnp
    from jax import export
    from jax.extend import mlir
    from jax.extend.mlir import ir
    from jax.extend.mlir.dialects import chlo, sdy, stablehlo

    carrier = export.export(jax.jit(lambda x: x + x), platforms=("cpu", "cuda"))(
        jax.ShapeDtypeStruct((4,), jnp.float32))
    with ir.Context() as context, ir.Location.unknown():
        for dialect in (stablehlo, chlo, sdy):
            dialect.register_dialect(context)
        # Reading the carrier's module loads every dialect its text needs
        # (func among them, which has no registration of its own here).
        mlir.deserialize_portable_artifact(carrier.mlir_module_serialized)
        module = ir.Module.parse(module_text(lines, place, functions))
        serialized = mlir.serialize_portable_artifact(module, stablehlo.get_current_version())
    return bytes(dataclasses.replace(carrier, mlir_module_serialized=serialized,
                                     disabled_safety_checks=tuple(exempt)).serialize())


def forge_mhlo(target: str) -> bytes:
    """
    A program whose C{main} calls a private function holding an
    C{mhlo.custom_call} of C{target}, its portable artifact written by hand.
    JAX's writer would have turned the call into a C{stablehlo.custom_call};
    as bytecode, it reaches a reader that knows the mhlo dialect (JAX's does)
    as it is. The artifact is a carrier's VHLO, its addition replaced by the
    call, written as MLIR bytecode with the producer a portable artifact
    carries.
    """
    import io
    import re

    import jax
    import jax.numpy as jnp
    from jax import export
    from jax.extend import mlir
    from jax.extend.mlir import ir

    carrier = export.export(jax.jit(lambda x: x + x), platforms=("cpu",))(
        jax.ShapeDtypeStruct((4,), jnp.float32))
    artifact = carrier.mlir_module_serialized
    hidden = ('  "func.func"() <{function_type = (tensor<4xf32>) -> tensor<4xf32>, '
              'sym_name = "hidden", sym_visibility = "private"}> ({\n'
              '  ^bb0(%a: tensor<4xf32>):\n'
              f'    %r = "mhlo.custom_call"(%a) {{call_target_name = {mlir_string(target)}, '
              'api_version = 4 : i32, backend_config = {index = 0 : ui64}} : '
              '(tensor<4xf32>) -> tensor<4xf32>\n'
              '    "func.return"(%r) : (tensor<4xf32>) -> ()\n  }) : () -> ()')
    with ir.Context() as context, ir.Location.unknown():
        # Reading the artifact once loads VHLO, which reading its bytecode as
        # it is needs; mhlo, unknown here, is written as it is.
        mlir.deserialize_portable_artifact(artifact)
        context.allow_unregistered_dialects = True
        text = ir.Module.parse(artifact).operation.get_asm(print_generic_op_form=True)
        text = re.sub(r'"vhlo\.add_v1"\((%\w+), %\w+\) : \(([^,]+), [^)]+\)',
                      r'"vhlo.call_v1"(\1) <{callee = #vhlo.string_v1<"hidden">}> : (\2)', text)
        head, _, tail = text.rpartition("\n})")
        written = io.BytesIO()
        ir.Module.parse(f"{head}\n{hidden}\n}}){tail}").operation.write_bytecode(
            written, desired_version=6)
    # After the magic number, the version and the producer up to its NUL.
    raw = written.getvalue()
    producer = artifact[4:artifact.index(b"\0", 4) + 1]
    return bytes(dataclasses.replace(carrier, mlir_module_serialized=(
        raw[:4] + producer + raw[raw.index(b"\0", 4) + 1:])).serialize())
