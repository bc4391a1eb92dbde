"""
BYTES tensors: the inference protocol's strings, on the wire and in a
JAX program.

JAX has no strings. A model declares each BYTES input and output with the
most bytes one of its elements holds (its C{max_length}), and its program
takes and returns a BYTES tensor of shape C{S} as two arrays, a
L{Strings}: the elements' bytes, uint8 of shape C{S + (max_length,)}, each
zero padded, and their lengths, int32 of shape C{S}.

Triton's binary form of a BYTES tensor (the binary tensor data extension,
gRPC's raw contents, shared memory) is its elements in row-major order,
each a 4-byte little-endian length and then that many bytes. A request's
BYTES tensor, once read, is a numpy array of C{bytes} objects (dtype
object), as Triton's own clients hold one.
"""

from __future__ import annotations

import struct
from typing import Any

import attrs
import numpy as np

#: The dtype of a BYTES tensor read from a request or made from a program's answer.
OBJECT = np.dtype(object)
#: The dtypes of a L{Strings}' two arrays.
DATA, LENGTHS = np.dtype(np.uint8), np.dtype(np.int32)
#: The most elements of one BYTES tensor: each becomes a Python object, so
#: a body of short elements costs the server several times its size.
MAX_ELEMENTS = 1 << 20
#: The longest element a model may declare: its program holds every
#: element at that length.
MAX_LENGTH = 1 << 20
_PREFIX = struct.Struct("<I")


class InvalidStrings(ValueError):
    """A BYTES tensor's binary form that does not hold its elements; the
    message says where it goes wrong."""


@attrs.frozen
class Strings:
    """
    A BYTES tensor as a JAX program takes and returns it: C{data}, uint8
    of its shape and then its max_length (the most bytes of one element),
    each element's bytes first and zeros after them; C{lengths}, int32 of
    its shape. The arrays are numpy's or JAX's, whatever made them.
    """

    data: Any
    lengths: Any

    @classmethod
    def of(cls, values, max_length: int) -> Strings:
        """The C{Strings} of C{values} (C{bytes}, or nested lists of them)
        at C{max_length} bytes an element: an export's example of a BYTES
        input, or a test's."""
        elements = np.empty(np.shape(values), OBJECT)
        elements[...] = values
        if longest(elements) > max_length:
            raise ValueError(f"an element is over max_length {max_length}")
        return cls(*pack(elements, max_length))


def longest(elements: np.ndarray) -> int:
    """The length of the longest of C{elements} (0 when there are none)."""
    flat = elements.reshape(-1)
    return int(np.fromiter(map(len, flat), np.int64, len(flat)).max(initial=0))


def pack(elements: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """The data and lengths arrays of C{elements} (bytes, each at most
    C{max_length} long), as a program takes them."""
    flat = elements.reshape(-1)
    lengths = np.fromiter(map(len, flat), LENGTHS, len(flat))
    data = np.zeros((len(flat), max_length), DATA)
    # The places of the elements' bytes in row-major order are those of
    # their concatenation.
    data[np.arange(max_length) < lengths[:, None]] = np.frombuffer(b"".join(flat), DATA)
    return data.reshape(*elements.shape, max_length), lengths.reshape(elements.shape)


def unpack(data: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The elements (an object array of bytes, of C{lengths}' shape) that a
    program's C{data} and C{lengths} hold; ValueError when they are not
    a BYTES tensor's."""
    data, lengths = np.asarray(data), np.asarray(lengths)
    if data.dtype != DATA or lengths.dtype != LENGTHS or data.shape[:-1] != lengths.shape:
        raise ValueError(f"a BYTES tensor is uint8 data of its shape and a length, and int32 "
                         f"lengths of its shape: the program returned {data.dtype}"
                         f"{list(data.shape)} and {lengths.dtype}{list(lengths.shape)}")
    most = data.shape[-1]
    flat = lengths.reshape(-1)
    if len(flat) and not (0 <= flat.min() and flat.max() <= most):
        raise ValueError(f"a BYTES tensor's length is outside 0 to {most}, its max_length")
    joined = data.reshape(len(flat), most)[np.arange(most) < flat[:, None]].tobytes()
    ends = np.cumsum(flat).tolist()
    elements = np.empty(len(flat), OBJECT)
    elements[:] = [joined[end - length:end] for end, length in zip(ends, flat.tolist())]
    return elements.reshape(lengths.shape)


def serialize(elements: np.ndarray) -> bytes:
    """Triton's binary form of C{elements}: each its 4-byte little-endian
    length, then its bytes, in row-major order."""
    prefix = _PREFIX.pack
    return b"".join(part for element in elements.reshape(-1)
                    for part in (prefix(len(element)), element))


def deserialize(data: bytes | memoryview, count: int) -> np.ndarray:
    """
    The C{count} elements (a flat object array of bytes) whose binary form
    is all of C{data}. L{InvalidStrings} says where a length runs past
    the end, the elements end early, or bytes are left after them; nothing
    is allocated for a length before it is known to lie within C{data}.
    """
    if count > MAX_ELEMENTS:
        raise InvalidStrings(f"{count} elements, over the {MAX_ELEMENTS} a BYTES tensor may hold")
    view = memoryview(data).cast("B")
    if count * _PREFIX.size > len(view):
        raise InvalidStrings(f"{len(view)} bytes cannot hold {count} elements: each takes a "
                             f"{_PREFIX.size}-byte length")
    # The lengths are read first, then every element sliced from one bytes
    # object: a million 8-byte elements took 0.9-1.4 s so, 1.8-3.2 s sliced
    # from the view as they were read (a loaded two-core machine).
    size, read, starts, ends, at = len(view), _PREFIX.unpack_from, [], [], 0
    for i in range(count):
        if at + _PREFIX.size > size:
            raise InvalidStrings(f"element {i} of {count}: its length prefix runs past the "
                                 f"data's {size} bytes")
        (length,) = read(view, at)
        at += _PREFIX.size
        starts.append(at)
        if length > size - at:
            raise InvalidStrings(f"element {i} of {count}: its length {length} runs past the "
                                 f"data's {size} bytes")
        at += length
        ends.append(at)
    if at != size:
        raise InvalidStrings(f"{size - at} bytes are left after the {count} elements")
    whole = view.tobytes()
    elements = np.empty(count, OBJECT)
    elements[:] = [whole[start:end] for start, end in zip(starts, ends)]
    return elements
