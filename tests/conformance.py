"""
Programs nobody wrote for KCoral, for L{tests.test_conformance}: JAX's own
primitives across the dtypes each accepts, control flow, linear algebra,
random numbers, pytrees, large, empty and 0-d arrays, and shape-polymorphic
programs.

A L{Case} is a function, the arguments it is exported at and the calls it is
run with. L{cases} builds them all; L{run_in_process} and L{run_through}
give the two sides the test compares.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import jax.numpy as jnp
import ml_dtypes
import numpy as np

BOOL = ["bool"]
SIGNED = ["int8", "int16", "int32", "int64"]
UNSIGNED = ["uint8", "uint16", "uint32", "uint64"]
INTEGER = SIGNED + UNSIGNED
FLOAT = ["float32", "float16", "bfloat16", "float64"]
COMPLEX = ["complex64", "complex128"]
#: Every float8 type JAX takes: jax.numpy names each one (ml_dtypes may
#: already offer newer ones, such as float8_e5m3fnu, that JAX does not take).
FLOAT8 = sorted(name for name in dir(jnp) if name.startswith("float8_"))
#: Narrower than a byte: packed on a device, one per byte in numpy. (int2
#: and uint2 are left out: jax.export cannot serialize programs over them.)
SUB_BYTE = ["int4", "uint4", "float4_e2m1fn"]
REAL = FLOAT + INTEGER
NUMERIC = FLOAT + COMPLEX + INTEGER
ALL = FLOAT + COMPLEX + INTEGER + BOOL + FLOAT8 + SUB_BYTE

WIDE = {"int64", "uint64", "float64", "complex128"}


def dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, name))


@attrs.frozen
class Call:
    """One call of a program: its arguments."""

    args: tuple
    kwargs: dict = attrs.field(factory=dict)


@attrs.frozen
class Case:
    """
    A program and how it is exercised: exported at C{example} (arrays or
    C{jax.ShapeDtypeStruct}s; the first call's arguments when None), then run
    with each of C{calls}, under C{jax_enable_x64} when C{x64}. C{quick} cases
    make up the part of the suite that runs by default.
    """

    name: str
    function: Callable = attrs.field(repr=False)
    calls: tuple[Call, ...] = attrs.field(repr=False)
    example: Call | None = attrs.field(default=None, repr=False)
    x64: bool = False
    quick: bool = False
    #: The mesh a program for several devices was exported over: in process,
    #: its calls' inputs are placed on it with the program's shardings.
    mesh: Any = attrs.field(default=None, repr=False)


def sample(name: str, shape: tuple[int, ...] = (3, 4), seed: int = 0) -> np.ndarray:
    """Varied values of dtype C{name}: the whole range of an integer type;
    for floats, normal values led by zeros, infinities and a NaN."""
    rng = np.random.default_rng([seed, *name.encode()])
    target = dtype(name)
    size = int(np.prod(shape))
    values: np.ndarray
    if name == "bool":
        values = rng.random(size) < 0.5
    elif name in INTEGER:
        values = np.frombuffer(rng.bytes(size * target.itemsize), target)
    elif name in ("int4", "uint4"):
        info = ml_dtypes.iinfo(target)
        values = rng.integers(int(info.min), int(info.max), size, endpoint=True, dtype=np.int64)
        values = values.astype(target)
    elif name in COMPLEX:
        values = (rng.standard_normal(size) + 1j * rng.standard_normal(size)) * 2
    else:
        values = rng.standard_normal(size) * 3
        values[:5] = [0.0, -0.0, np.inf, -np.inf, np.nan][:size]
    return np.asarray(values).astype(target).reshape(shape)


def positive(name: str, shape: tuple[int, ...] = (3, 4), seed: int = 0) -> np.ndarray:
    """Finite values of dtype C{name} away from zero, for a function's domain."""
    rng = np.random.default_rng([seed, *name.encode()])
    return (rng.random(shape) * 4 + 0.25).astype(dtype(name))


def small(name: str, shape: tuple[int, ...] = (3, 4), seed: int = 0) -> np.ndarray:
    """Small values of dtype C{name} (products and sums of a few of them fit)."""
    rng = np.random.default_rng([seed, *name.encode()])
    if name == "bool":
        return rng.random(shape) < 0.5
    if name in COMPLEX:
        return (rng.integers(-3, 4, shape) + 1j * rng.integers(-3, 4, shape)).astype(dtype(name))
    low = 0 if name.startswith("uint") else -3
    return rng.integers(low, 4, shape).astype(dtype(name))


def _case(name: str, function: Callable, *args, dtypes: tuple[str, ...] = (), quick: bool = False,
          **kwargs) -> Case:
    return Case(name, function, (Call(args, kwargs),), x64=bool(WIDE.intersection(dtypes)),
                quick=quick)


def _each(op: str, function: Callable, names: list[str], make: Callable[[str], tuple]) -> Iterator[Case]:
    """C{function} over the inputs C{make(name)} gives, for each dtype name;
    the first dtype's case is in the quick part."""
    for i, name in enumerate(names):
        yield _case(f"{op}[{name}]", function, *make(name), dtypes=(name,), quick=i == 0)


def _unary(name: str) -> tuple:
    return (sample(name),)


def _binary(name: str) -> tuple:
    return sample(name), sample(name, seed=1)


def _elementwise() -> Iterator[Case]:
    import jax.numpy as jnp
    from jax import lax

    unary: dict[str, tuple[Callable, list[str]]] = {
        "neg": (lax.neg, NUMERIC + FLOAT8),
        "abs": (lax.abs, FLOAT + COMPLEX + SIGNED + FLOAT8),
        "sign": (lax.sign, NUMERIC),
        "square": (lax.square, NUMERIC),
        "exp": (lax.exp, FLOAT + COMPLEX + FLOAT8[:2]),
        "exp2": (lax.exp2, FLOAT),
        "log": (lax.log, FLOAT + COMPLEX),
        "log1p": (lax.log1p, FLOAT + COMPLEX),
        "expm1": (lax.expm1, FLOAT + COMPLEX),
        "sin": (lax.sin, FLOAT + COMPLEX),
        "cos": (lax.cos, FLOAT + COMPLEX),
        "tan": (lax.tan, FLOAT + COMPLEX),
        "tanh": (lax.tanh, FLOAT + COMPLEX),
        "atan": (lax.atan, FLOAT),
        "asinh": (lax.asinh, FLOAT + COMPLEX),
        "logistic": (lax.logistic, FLOAT),
        "erf": (lax.erf, FLOAT),
        "erf_inv": (lax.erf_inv, FLOAT),
        "lgamma": (lax.lgamma, FLOAT),
        "digamma": (lax.digamma, FLOAT),
        "cbrt": (lax.cbrt, FLOAT),
        "floor": (lax.floor, FLOAT),
        "ceil": (lax.ceil, FLOAT),
        "round": (lax.round, FLOAT),
        "is_finite": (lax.is_finite, FLOAT + FLOAT8),
        "real": (lax.real, COMPLEX),
        "imag": (lax.imag, COMPLEX),
        "conj": (lax.conj, COMPLEX),
        "not": (lax.bitwise_not, BOOL + INTEGER),
        "population_count": (lax.population_count, INTEGER),
        "clz": (lax.clz, INTEGER),
    }
    for op, (function, names) in unary.items():
        yield from _each(f"lax.{op}", function, names, _unary)
    for op, (function, names) in {"sqrt": (lax.sqrt, FLOAT + COMPLEX),
                                  "rsqrt": (lax.rsqrt, FLOAT + COMPLEX)}.items():
        yield from _each(f"lax.{op}", function, names, lambda n: (positive(n),))

    binary: dict[str, tuple[Callable, list[str]]] = {
        "add": (lax.add, NUMERIC + FLOAT8),
        "sub": (lax.sub, NUMERIC),
        "mul": (lax.mul, NUMERIC + FLOAT8),
        "div": (lax.div, FLOAT + COMPLEX),
        "max": (lax.max, REAL + FLOAT8),
        "min": (lax.min, REAL),
        "pow": (lax.pow, FLOAT + COMPLEX),
        "atan2": (lax.atan2, FLOAT),
        "nextafter": (lax.nextafter, ["float32", "float64"]),
        "rem": (lax.rem, FLOAT),
        "and": (lax.bitwise_and, BOOL + INTEGER),
        "or": (lax.bitwise_or, BOOL + INTEGER),
        "xor": (lax.bitwise_xor, BOOL + INTEGER),
        "shift_left": (lax.shift_left, INTEGER),
        "shift_right_logical": (lax.shift_right_logical, INTEGER),
        "shift_right_arithmetic": (lax.shift_right_arithmetic, INTEGER),
    }
    for op, (function, names) in binary.items():
        yield from _each(f"lax.{op}", function, names, _binary)
    # Integer division and remainder by zero are defined by XLA, not by
    # numpy: the divisor keeps away from zero so that both sides agree on
    # what is tested.
    for op, function in {"div": lax.div, "rem": lax.rem}.items():
        yield from _each(f"lax.{op}", function, INTEGER,
                         lambda n: (sample(n), np.where(small(n) == 0, 1, small(n)).astype(dtype(n))))
    numpy_binary: dict[str, Callable] = {"floor_divide": jnp.floor_divide, "logaddexp": jnp.logaddexp,
                    "copysign": jnp.copysign, "hypot": jnp.hypot}
    for op, function in numpy_binary.items():
        yield from _each(f"jnp.{op}", function, FLOAT, _binary)

    comparisons: dict[str, Callable] = {"eq": lax.eq, "ne": lax.ne, "lt": lax.lt, "le": lax.le,
                                        "gt": lax.gt, "ge": lax.ge}
    for op, function in comparisons.items():
        names = ALL if op in ("eq", "ne") else REAL + BOOL + FLOAT8 + SUB_BYTE
        yield from _each(f"lax.{op}", function, names, _binary)
    yield from _each("lax.select", lambda p, a, b: lax.select(p, a, b), ALL,
                     lambda n: (sample("bool"), sample(n), sample(n, seed=1)))
    yield from _each("lax.clamp", lambda x: lax.clamp(np.asarray(-1, x.dtype), x, np.asarray(2, x.dtype)),
                     FLOAT + SIGNED, _unary)


def _reductions() -> Iterator[Case]:
    import jax.numpy as jnp
    from jax import lax

    reductions: dict[str, tuple[Callable, list[str]]] = {
        "sum": (lambda x: (jnp.sum(x), jnp.sum(x, axis=0)), NUMERIC),
        "prod": (lambda x: jnp.prod(x, axis=1), NUMERIC),
        "max": (lambda x: (jnp.max(x), jnp.max(x, axis=1)), REAL + BOOL),
        "min": (lambda x: jnp.min(x, axis=0), REAL + BOOL),
        "argmax": (lambda x: jnp.argmax(x, axis=1), REAL),
        "argmin": (lambda x: jnp.argmin(x, axis=0), REAL),
        "all": (lambda x: (jnp.all(x), jnp.all(x, axis=0)), BOOL),
        "any": (lambda x: (jnp.any(x), jnp.any(x, axis=1)), BOOL),
        "mean": (lambda x: jnp.mean(x, axis=0), FLOAT + COMPLEX),
        "var": (lambda x: jnp.var(x, axis=1), FLOAT),
        "logsumexp": (lambda x: jax_logsumexp(x, axis=1), FLOAT),
        "reduce_and": (lambda x: lax.reduce_and(x, axes=(0,)), INTEGER),
        "reduce_xor": (lambda x: lax.reduce_xor(x, axes=(1,)), INTEGER),
    }
    for op, (function, names) in reductions.items():
        yield from _each(f"reduce.{op}", function, names, _unary)
    yield from _each("lax.reduce_window", lambda x: lax.reduce_window(
        x, np.asarray(0, x.dtype), lax.add, (2, 2), (1, 1), "VALID"), REAL, lambda n: (small(n),))


def jax_logsumexp(x, axis):
    from jax.scipy.special import logsumexp

    return logsumexp(x, axis=axis)


def _contractions() -> Iterator[Case]:
    import jax.numpy as jnp
    from jax import lax

    contracting = FLOAT + COMPLEX + ["int32", "int8", "int64", "uint8"]
    yield from _each("lax.dot", lambda a, b: lax.dot(a, b), contracting + ["bool"],
                     lambda n: (small(n, (3, 4)), small(n, (4, 5), seed=1)))
    yield from _each("jnp.matmul.batched", jnp.matmul, contracting,
                     lambda n: (small(n, (2, 3, 4)), small(n, (2, 4, 2), seed=1)))
    yield from _each("jnp.einsum", lambda a, b: jnp.einsum("ij,kj->ki", a, b), contracting,
                     lambda n: (small(n, (3, 4)), small(n, (2, 4), seed=1)))
    yield from _each("lax.dot_general", lambda a, b: lax.dot_general(
        a, b, (((2,), (1,)), ((0,), (0,)))), FLOAT, lambda n: (sample(n, (2, 3, 4)), sample(n, (2, 4, 3))))

    def conv(x, w):
        return lax.conv_general_dilated(x, w, window_strides=(1, 2), padding="SAME",
                                        lhs_dilation=(1, 1), rhs_dilation=(2, 1),
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"))

    yield from _each("lax.conv_general_dilated", conv, FLOAT + COMPLEX + ["int32"],
                     lambda n: (small(n, (1, 2, 6, 7)), small(n, (3, 2, 2, 3), seed=1)))
    yield from _each("lax.conv_transpose", lambda x, w: lax.conv_transpose(
        x, w, (2,), "SAME", dimension_numbers=("NCH", "OIH", "NCH")), ["float32", "float64"],
        lambda n: (sample(n, (1, 2, 5)), sample(n, (3, 2, 3), seed=1)))


def _structure() -> Iterator[Case]:
    import jax.numpy as jnp
    from jax import lax

    structural: dict[str, tuple[Callable, Callable[[str], tuple]]] = {
        "reshape": (lambda x: x.reshape(2, 6), lambda n: (sample(n),)),
        "transpose": (lambda x: x.transpose(1, 0, 2), lambda n: (sample(n, (2, 3, 4)),)),
        "slice": (lambda x: lax.slice(x, (0, 1), (3, 4), (2, 2)), lambda n: (sample(n),)),
        "rev": (lambda x: lax.rev(x, (0, 1)), lambda n: (sample(n),)),
        "concatenate": (lambda a, b: jnp.concatenate([a, b, a], axis=1), _binary),
        "pad": (lambda x: lax.pad(x, np.zeros((), x.dtype), ((1, -1, 1), (0, 2, 0))),
                lambda n: (sample(n),)),
        "broadcast": (lambda x: jnp.broadcast_to(x[:, None, :], (3, 2, 4)), lambda n: (sample(n),)),
        "gather": (lambda x, i: x[i, ::-1], lambda n: (sample(n), np.array([2, 0, 2, 1], np.int32))),
        "scatter": (lambda x, y: x.at[np.array([2, 0]), 1:3].set(y),
                    lambda n: (sample(n), sample(n, (2, 2), seed=1))),
        "dynamic_slice": (lambda x, i: lax.dynamic_slice(x, (i, i + 1), (2, 2)),
                          lambda n: (sample(n), np.int32(1))),
        "dynamic_update_slice": (lambda x, y, i: lax.dynamic_update_slice(x, y, (i, i + 1)),
                                 lambda n: (sample(n), sample(n, (2, 2), seed=1), np.int32(1))),
        "squeeze_expand": (lambda x: (jnp.squeeze(x, 1), jnp.expand_dims(x, 0)),
                           lambda n: (sample(n, (3, 1, 2)),)),
    }
    # The identity of every dtype is in the quick part: every type's wire
    # path, both ways, is checked by default.
    for name in ALL:
        yield _case(f"identity[{name}]", lambda x: x, sample(name), dtypes=(name,), quick=True)
    for op, (function, make) in structural.items():
        yield from _each(f"structure.{op}", function, ALL, make)
    yield from _each("scatter_add", lambda x, i, y: x.at[i].add(y), NUMERIC,
                     lambda n: (small(n), np.array([1, 1, 0], np.int32), small(n, (3, 4), seed=1)))
    yield from _each("scatter_max", lambda x, i, y: x.at[i].max(y), REAL,
                     lambda n: (sample(n), np.array([1, 1, 0], np.int32), sample(n, (3, 4), seed=1)))
    yield from _each("iota", lambda x: x + lax.broadcasted_iota(x.dtype, x.shape, 1), REAL,
                     lambda n: (small(n),))


def _cumulative() -> Iterator[Case]:
    from jax import lax

    cumulative: dict[str, tuple[Callable, list[str]]] = {
        "cumsum": (lambda x: lax.cumsum(x, axis=1), NUMERIC),
        "cumprod": (lambda x: lax.cumprod(x, axis=0), NUMERIC),
        "cummax": (lambda x: lax.cummax(x, axis=1, reverse=True), REAL),
        "cummin": (lambda x: lax.cummin(x, axis=0), REAL),
        "cumlogsumexp": (lambda x: lax.cumlogsumexp(x, axis=1), FLOAT),
    }
    for op, (function, names) in cumulative.items():
        yield from _each(f"lax.{op}", function, names, lambda n: (small(n, (5, 6)),))


def _sorting() -> Iterator[Case]:
    import jax.numpy as jnp
    from jax import lax

    yield from _each("jnp.sort", lambda x: jnp.sort(x, axis=1), REAL + BOOL, _unary)
    yield from _each("jnp.argsort", lambda x: jnp.argsort(x, axis=0, stable=True), REAL,
                     lambda n: (small(n),))
    yield from _each("lax.top_k", lambda x: lax.top_k(x, 2), REAL, lambda n: (small(n),))
    yield from _each("lax.sort.multiple", lambda k, v: lax.sort((k, v), num_keys=1), REAL,
                     lambda n: (small(n, (12,)), sample(n, (12,), seed=1)))


def _casts() -> Iterator[Case]:
    """Each type converted to every other: one program per source type,
    and the quick part casts float32."""
    from jax import lax

    for name in ALL:
        targets = [t for t in ALL if t != name and not (name in COMPLEX and t not in COMPLEX)]

        def cast(x, targets=tuple(targets)):
            return {t: lax.convert_element_type(x, dtype(t)) for t in targets}

        yield Case(f"convert_element_type[{name}]", cast, (Call((sample(name),)),), x64=True,
                   quick=name == "float32")
    yield from _each("lax.bitcast_convert_type", lambda x: lax.bitcast_convert_type(
        x, np.uint8), ["float32", "int16", "float64", "bfloat16"], _unary)
    yield from _each("lax.reduce_precision", lambda x: lax.reduce_precision(x, 5, 10), FLOAT, _unary)


def _control_flow() -> Iterator[Case]:
    import jax.numpy as jnp
    from jax import lax

    def cond(p, x):
        return lax.cond(p, lambda v: jnp.sin(v) if v.dtype.kind == "f" else v * 2, lambda v: -v, x)

    def switch(i, x):
        return lax.switch(i, [lambda v: v + 1, lambda v: v * 3, lambda v: -v], x)

    def while_loop(x):
        return lax.while_loop(lambda c: c[0] < 7, lambda c: (c[0] + 1, c[1] * 2 + c[0].astype(c[1].dtype)),
                              (jnp.int32(0), x))

    def fori(x):
        return lax.fori_loop(0, 5, lambda i, v: v * v - i.astype(v.dtype), x)

    def scan(x):
        return lax.scan(lambda c, row: (c + row, (c * row, jnp.max(row))), jnp.zeros_like(x[0]), x)

    def nested(x):
        return lax.map(lambda row: lax.cond(row[0] > 0, jnp.cumsum, jnp.flip, row), x)

    for name in ["float32", "int32", "float64", "bfloat16", "uint8"]:
        quick = name == "float32"
        x = small(name)
        yield _case(f"lax.cond[{name}]", cond, np.bool_(True), x, dtypes=(name,), quick=quick)
        yield _case(f"lax.cond.false[{name}]", cond, np.bool_(False), x, dtypes=(name,))
        yield _case(f"lax.switch[{name}]", switch, np.int32(1), x, dtypes=(name,), quick=quick)
        yield _case(f"lax.switch.clamped[{name}]", switch, np.int32(7), x, dtypes=(name,))
        yield _case(f"lax.while_loop[{name}]", while_loop, x, dtypes=(name,), quick=quick)
        yield _case(f"lax.fori_loop[{name}]", fori, x, dtypes=(name,), quick=quick)
        yield _case(f"lax.scan[{name}]", scan, x, dtypes=(name,), quick=quick)
        yield _case(f"lax.map.cond[{name}]", nested, x, dtypes=(name,))


def _linalg() -> Iterator[Case]:
    import jax.numpy as jnp

    def spd(name: str) -> np.ndarray:
        a = sample(name, (4, 4)).astype(np.float64)
        a = np.nan_to_num(a, nan=1.0, posinf=2.0, neginf=-2.0)
        return (a @ a.T + 4 * np.eye(4)).astype(dtype(name))

    linalg: dict[str, tuple[Callable, Callable[[str], tuple]]] = {
        "solve": (jnp.linalg.solve, lambda n: (spd(n), small(n, (4, 2)))),
        "cholesky": (jnp.linalg.cholesky, lambda n: (spd(n),)),
        "qr": (_plain(jnp.linalg.qr), lambda n: (spd(n)[:, :3],)),
        "svd": (_plain(jnp.linalg.svd), lambda n: (spd(n)[:3],)),
        "eigh": (_plain(jnp.linalg.eigh), lambda n: (spd(n),)),
        "inv": (jnp.linalg.inv, lambda n: (spd(n),)),
        "det": (jnp.linalg.det, lambda n: (spd(n),)),
        "slogdet": (_plain(jnp.linalg.slogdet), lambda n: (spd(n),)),
        "lstsq": (lambda a, b: jnp.linalg.lstsq(a, b)[0], lambda n: (spd(n)[:, :3], small(n, (4,)))),
        "triangular_solve": (lambda a, b: jax_solve_triangular(a, b),
                             lambda n: (spd(n), small(n, (4, 2)))),
    }
    for op, (function, make) in linalg.items():
        yield from _each(f"jnp.linalg.{op}", function, ["float32", "float64"], make)


def _plain(function: Callable) -> Callable:
    """C{function} with its named tuple of results made a tuple: jax.export
    serializes no named tuple it was not told about."""
    return lambda *args: tuple(function(*args))


def jax_solve_triangular(a, b):
    from jax.scipy.linalg import solve_triangular

    return solve_triangular(a, b, lower=False)


def _random() -> Iterator[Case]:
    import jax

    draws: dict[str, Callable] = {
        "normal": lambda k: jax.random.normal(k, (3, 4)),
        "uniform": lambda k: jax.random.uniform(k, (5,), minval=-2, maxval=3),
        "bernoulli": lambda k: jax.random.bernoulli(k, 0.3, (6,)),
        "categorical": lambda k: jax.random.categorical(k, np.log(np.array([0.1, 0.6, 0.3])), shape=(8,)),
        "permutation": lambda k: jax.random.permutation(k, 10),
        "randint": lambda k: jax.random.randint(k, (4,), -5, 50),
        "gamma": lambda k: jax.random.gamma(k, 2.5, (3,)),
        "split": lambda k: jax.random.split(k, 3),
        "fold_in.key_data": lambda k: jax.random.key_data(jax.random.fold_in(k, 7)),
    }
    for impl in ["threefry2x32", "rbg", "unsafe_rbg"]:
        for op, draw in draws.items():
            yield Case(f"random.{op}[{impl}]", draw, (Call((jax.random.key(0, impl=impl),)),),
                       quick=impl == "threefry2x32")
    yield Case("random.normal.float64[threefry2x32]",
               lambda k: jax.random.normal(k, (4,), dtype=np.float64),
               (Call((jax.random.key(1),)),), x64=True)


def _pytrees() -> Iterator[Case]:
    import jax.numpy as jnp

    def nested(tree, *, scale, offset=None):
        a, (b, c) = tree["pair"]
        return {"out": [a * scale, (b + c,)], "none": None, "empty": (), "same": (a, a),
                "offset": None if offset is None else offset + 1}

    args = ({"pair": (sample("float32"), [sample("int32"), sample("int32", seed=1)])},)
    yield Case("pytree.nested", nested, (Call(args, {"scale": np.float32(2), "offset": sample("int8")}),),
               quick=True)
    yield Case("pytree.none_leaf", nested, (Call(args, {"scale": np.float32(2), "offset": None}),))
    yield Case("pytree.no_inputs", lambda: jnp.arange(5) * 2, (Call(()),), quick=True)
    yield Case("pytree.no_outputs", lambda x: (), (Call((sample("float32"),)),), quick=True)
    yield Case("pytree.constant_output", lambda x: (x, jnp.full((2,), 7, jnp.int16)),
               (Call((sample("uint8"),)),))
    yield Case("pytree.keyword_only", lambda *, a, b: a - b,
               (Call((), {"b": sample("float32"), "a": sample("float32", seed=1)}),))
    yield Case("pytree.jax_arrays", lambda x, y: (x @ y, y.T),
               (Call((jnp.asarray(sample("float32")), jnp.asarray(sample("float32", (4, 2))))),))
    yield Case("pytree.deep", lambda t: [[[t[0][0][0] + 1]], {"k": {"j": t[1]}}],
               (Call(((((sample("int16"),),), [sample("bool")]),)),))


def _scalars() -> Iterator[Case]:
    import jax.numpy as jnp

    for name in NUMERIC + BOOL:
        yield _case(f"scalar[{name}]", lambda x: (x, jnp.stack([x, x])), sample(name, ()),
                    dtypes=(name,), quick=name in ("float32", "bool"))
    # Python scalars are weakly typed: exported and called as such.
    yield Case("scalar.python_float", lambda x, y: x * y + 1, (Call((2.5, sample("float32"))),), quick=True)
    yield Case("scalar.python_int", lambda n, y: y * n, (Call((3, sample("int16"))),))
    yield Case("scalar.python_bool", lambda b, y: jnp.where(b, y, -y), (Call((True, sample("float32"))),))
    yield Case("scalar.python_complex", lambda z, y: y * z, (Call((1 + 2j, sample("complex64"))),))
    yield Case("scalar.python_float.x64", lambda x, y: x * y, (Call((2.5, sample("float64"))),), x64=True)


def _sizes() -> Iterator[Case]:
    import jax.numpy as jnp

    for shape in [(0,), (3, 0), (0, 5)]:
        label = "x".join(map(str, shape))
        yield Case(f"empty.{label}", lambda x: (x * 2, jnp.sum(x), x.reshape(-1), jnp.sort(x, axis=-1)),
                   (Call((np.zeros(shape, np.float32),)),), quick=shape == (3, 0))
    yield Case("empty.matmul", lambda a, b: a @ b,
               (Call((np.ones((3, 0), np.float32), np.ones((0, 4), np.float32))),), quick=True)
    yield Case("empty.concatenate", lambda a, b: jnp.concatenate([a, b]),
               (Call((np.zeros((0, 2), np.int32), small("int32", (2, 2)))),))
    yield Case("empty.from_slice", lambda x: (x[2:1], jnp.max(x[:, :0], axis=1, initial=-1)),
               (Call((small("int32"),)),))

    # A few MiB: content-addressed, sent by reference on the second run.
    weights = sample("float32", (1024, 768))
    yield Case("large.matvec", lambda w, v: (w @ v, w[::256, ::256]),
               (Call((weights, small("float32", (768,)))), Call((weights, small("float32", (768,), seed=1)))),
               quick=True)
    yield Case("large.output", lambda x: jnp.tile(x, (512, 1)),
               (Call((sample("float64", (4, 512)),)),), x64=True)
    yield Case("large.int8", lambda x: jnp.sum(x.astype(jnp.int32), axis=0),
               (Call((sample("int8", (2048, 2048)),)), Call((sample("int8", (2048, 2048)),))))


def _polymorphic() -> Iterator[Case]:
    import jax
    import jax.numpy as jnp
    from jax import export

    n, m = export.symbolic_shape("n, m")
    (b,) = export.symbolic_shape("b")

    def spec(shape, name="float32"):
        return jax.ShapeDtypeStruct(shape, dtype(name))

    # Each program, its input specs, and the shapes of its inputs in each call.
    programs: dict[str, tuple[Callable, tuple, list[list[tuple[int, ...]]]]] = {
        "sum": (lambda x: jnp.sum(x, axis=1), (spec((n, 3)),), [[(2, 3)], [(7, 3)]]),
        "matmul": (lambda x, y: x @ y, (spec((n, m)), spec((m, 2))), [[(2, 4), (4, 2)], [(5, 1), (1, 2)]]),
        "reshape": (lambda x: x.reshape(-1), (spec((b, 4)),), [[(1, 4)], [(6, 4)]]),
        "concatenate": (lambda x: jnp.concatenate([x, x[::-1]]), (spec((b,), "int32"),), [[(3,)], [(10,)]]),
        "cumsum": (lambda x: (jnp.cumsum(x, axis=0), x.shape[0] * jnp.ones((), x.dtype)),
                   (spec((b, 2)),), [[(4, 2)], [(9, 2)]]),
        "scan": (lambda x: jax.lax.scan(lambda c, r: (c + r, c), jnp.zeros(3), x), (spec((b, 3)),),
                 [[(2, 3)], [(8, 3)]]),
        "empty": (lambda x: (x * 2, jnp.sum(x, axis=1)), (spec((b, 0)),), [[(1, 0)], [(4, 0)]]),
    }
    for op, (function, specs, shapes) in programs.items():
        calls = tuple(Call(tuple(small(str(s.dtype), shape, seed) for s, shape in zip(specs, call)))
                      for seed, call in enumerate(shapes))
        yield Case(f"polymorphic.{op}", function, calls, example=Call(specs), quick=op == "matmul")


def _sharded() -> Iterator[Case]:
    """Programs for two devices, their inputs and outputs sharded over a
    mesh of two (none when this process has fewer devices)."""
    import jax
    import jax.numpy as jnp
    from jax import export
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < 2:
        return
    mesh = jax.make_mesh((2,), ("x",))
    auto = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))
    rows, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())

    def sharded(name, function, *calls, mesh=mesh, example=None, x64=False, quick=False, **jit):
        return Case(f"sharded.{name}", jax.jit(function, **jit), tuple(Call(c) for c in calls),
                    example=example, x64=x64, quick=quick, mesh=mesh)

    x, w = sample("float32", (8, 4)), sample("float32", (4, 3), seed=1)
    yield sharded("elementwise", lambda x: jnp.sin(x) * 2 + 1, (x,), in_shardings=rows,
                  out_shardings=rows, quick=True)
    yield sharded("matmul", lambda x, w: x @ w, (x, w), in_shardings=(rows, whole),
                  out_shardings=rows, quick=True)
    yield sharded("reduce", lambda x: (jnp.sum(x), jnp.max(x, axis=0)), (small("int32", (8, 4)),),
                  in_shardings=rows, out_shardings=whole)
    yield sharded("out_resharded", lambda x: x.T, (x,), in_shardings=rows,
                  out_shardings=NamedSharding(mesh, P(None, "x")))
    yield sharded("psum.shard_map", jax.shard_map(
        lambda block: (jax.lax.psum(jnp.sum(block, axis=0), "x"), block * 2), mesh=auto,
        in_specs=P("x"), out_specs=(P(), P("x"))), (x,), mesh=auto, quick=True)
    yield sharded("auto_axes", lambda x, w: jnp.tanh(x @ w), (x, w), mesh=auto,
                  in_shardings=(NamedSharding(auto, P("x")), NamedSharding(auto, P())),
                  out_shardings=NamedSharding(auto, P("x")), quick=True)
    yield sharded("pytree", lambda t: {"sum": t["a"] + t["b"], "n": t["n"] * 2},
                  ({"a": x, "b": sample("float32", (8, 4), seed=2), "n": small("int16", (2,))},),
                  in_shardings=({"a": rows, "b": rows, "n": whole},))
    yield sharded("float64", lambda x: jnp.cumsum(x, axis=1), (sample("float64", (8, 4)),),
                  in_shardings=rows, out_shardings=rows, x64=True)
    # Inputs unspecified, sharded inside: they go whole to both devices.
    yield sharded("unspecified_inputs", lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(
        auto, P("x"))) * 3, (x,), mesh=auto)
    (b,) = export.symbolic_shape("2*b")
    yield sharded("polymorphic", lambda v: (v * 2, jnp.sum(v)), (small("float32", (4,)),),
                  (small("float32", (10,)),), example=Call((jax.ShapeDtypeStruct((b,), np.float32),)),
                  in_shardings=rows, out_shardings=(rows, whole), quick=True)


def refused() -> list[Case]:
    """Calls that C{Exported.call} refuses: a wrong shape, a wrong structure,
    dimension variables that no shape satisfies."""
    import jax
    from jax import export

    (n,) = export.symbolic_shape("n")
    vector = jax.ShapeDtypeStruct((n,), np.float32)
    return [
        Case("refused.shape", lambda x: x + 1, (Call((small("float32", (4, 3)),)),),
             example=Call((small("float32"),))),
        Case("refused.structure", lambda t: t[0] * t[1], (Call(([small("int32")] * 3,)),),
             example=Call(((small("int32"), small("int32")),))),
        Case("refused.dimension_below_1", lambda x: x * 2, (Call((small("float32", (0,)),)),),
             example=Call((vector,))),
        Case("refused.inconsistent_dimension", lambda x, y: x + y,
             (Call((small("float32", (2,)), small("float32", (3,)))),), example=Call((vector, vector))),
    ]


@functools.cache
def cases(full: bool) -> list[Case]:
    """Every case (C{full}), or the quick part of them."""
    every = [case for group in (_elementwise, _reductions, _contractions, _structure, _cumulative,
                                _sorting, _casts, _control_flow, _linalg, _random, _pytrees, _scalars,
                                _sizes, _polymorphic, _sharded)
             for case in group()]
    names = [case.name for case in every]
    assert len(names) == len(set(names)), "case names are unique"
    return every if full else [case for case in every if case.quick]


def export(case: Case):
    """The case's L{kcoral.Program}."""
    import jax

    from kcoral import Program

    with jax.enable_x64(case.x64):
        example = case.example or case.calls[0]
        return Program.from_function(case.function, *example.args, **example.kwargs)


def run_in_process(case: Case, program) -> list:
    """Each call's outputs from C{jax.jit(exported.call)} in this process (on
    the case's mesh, for a program of several devices)."""
    import jax

    with jax.enable_x64(case.x64), _on(case.mesh):
        call = jax.jit(program.exported.call)
        return [call(*c.args, **c.kwargs) for c in case.calls]


def _on(mesh):
    """The context a program runs in here: the mesh of a program for several
    devices, whose shardings JAX then places the inputs with."""
    import contextlib

    import jax

    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def run_through(case: Case, program, client) -> list:
    """Each call's outputs through C{client}."""
    import jax

    with jax.enable_x64(case.x64):
        return [client.run(program, *c.args, **c.kwargs) for c in case.calls]
