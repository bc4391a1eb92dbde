"""
The inference protocol's tensors: the datatypes KCoral serves (the
protocol's names, C{FP32}, C{BF16} ...) and their arrays' dtypes, and the
bounds on the tensors of one model and one inference. A model's manifest
describes its tensors in these terms; requests and answers carry them.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kcoral.protocol.strings import OBJECT

#: The inference protocol's datatypes of numbers KCoral serves, and their
#: arrays' dtypes. BYTES (strings) has no JAX type: a model declares it and
#: its program holds it in arrays of these (L{kcoral.protocol.strings}).
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
}
_DATATYPE_OF = {dtype: name for name, dtype in DATATYPES.items()}
BYTES = "BYTES"

#: The most inputs (and outputs) a model or an inference has, and the most
#: dimensions of one tensor.
MAX_TENSORS = 64
MAX_RANK = 16


class InvalidInput(ValueError):
    """An inference's inputs do not fit the model (answered with 400)."""


def datatype_of(dtype) -> str:
    """The protocol's name of C{dtype}; ValueError for a type it has none of."""
    try:
        return _DATATYPE_OF[np.dtype(dtype).newbyteorder("=")]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} has no inference-protocol datatype") from None


def dtype_of(datatype: object) -> np.dtype:
    """The dtype of the protocol's C{datatype} (BYTES: object, an array of
    C{bytes}); InvalidInput for an unknown name."""
    if datatype == BYTES:
        return OBJECT
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise InvalidInput(f"unknown datatype {str(datatype)[:32]!r}")
    return DATATYPES[datatype]


def config_type(datatype: str) -> str:
    """Triton's model-configuration name of C{datatype} (C{TYPE_FP32} ...;
    BYTES is C{TYPE_STRING})."""
    return "TYPE_STRING" if datatype == BYTES else "TYPE_" + datatype
