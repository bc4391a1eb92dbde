"""
The dtype names the wire format accepts.

Names are numpy's (and jax's) canonical names; the extended float types come
from ml-dtypes, which is what jax itself uses for them.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_NUMPY = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "float16", "float32", "float64", "complex64", "complex128",
]
_ML = [
    "bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
    "float8_e8m0fnu", "float4_e2m1fn", "int2", "int4", "uint2", "uint4",
]

DTYPES: dict[str, np.dtype] = {name: np.dtype(name) for name in _NUMPY}
DTYPES.update({name: np.dtype(getattr(ml_dtypes, name))
               for name in _ML if hasattr(ml_dtypes, name)})
# Wire buffers are little-endian, whatever the sender's byte order.
DTYPES = {name: dt.newbyteorder("<") if dt.byteorder == ">" else dt
          for name, dt in DTYPES.items()}
_NAMES = {dt: name for name, dt in DTYPES.items()}


def _bits(dtype: np.dtype) -> int:
    for info in (ml_dtypes.iinfo, ml_dtypes.finfo):
        try:
            return info(dtype).bits
        except (ValueError, TypeError):
            pass
    return dtype.itemsize * 8


#: Types narrower than a byte (int4, float4_e2m1fn ...): one per byte on the
#: wire and in numpy, packed on a device.
SUB_BYTE = frozenset(dt for dt in DTYPES.values() if _bits(dt) < 8)


class UnknownDType(ValueError):
    pass


def dtype_from_name(name: object) -> np.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise UnknownDType(f"unknown dtype {str(name)[:40]!r}")
    return DTYPES[name]


def name_of(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    try:
        return _NAMES[dtype]
    except KeyError:
        raise UnknownDType(f"dtype {dtype} cannot be sent to a KCoral server") from None
