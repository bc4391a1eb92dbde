"""
The binary framing of C{POST /v1/run} requests and their results.

A frame is a fixed 8-byte prefix (magic, header length), a small JSON header
and a payload of raw array buffers, each aligned to L{ALIGN} bytes so that
C{numpy.frombuffer} can view them without copying. The JSON header names each
buffer by C{[offset, length]} within the payload. C{doc/protocol.rst} is the
specification; this module is its reference implementation, used by the
client and the server alike.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from kcoral.errors import ArraysApart
from kcoral.protocol.dtypes import UnknownDType, dtype_from_name, name_of

MAGIC = b"KCR\x01"
PREFIX = struct.Struct("<4sI")
ALIGN = 64
MAX_HEADER_BYTES = 1 << 20
MAX_RANK = 64
MAX_DIM = 1 << 62
#: Bound on an array's extent: the product of its dimensions (zeros counted as
#: one) times its item size. Larger shapes are refused even when empty, as
#: numpy cannot represent them.
MAX_EXTENT_BYTES = 1 << 62
MAX_ARRAYS = 4096
REQUEST_CONTENT_TYPE = "application/x-kcoral-run"
RESULT_CONTENT_TYPE = "application/x-kcoral-result"
PROGRAM_HEADER = "X-KCoral-Program"
#: The content-addressed inputs a run uses, C{digest=bytes} comma-separated,
#: largest first: a Router places the run by them without reading the body.
INPUTS_HEADER = "X-KCoral-Inputs"
#: Entries the client puts in that header at most.
MAX_INPUTS_LISTED = 64
#: A client's consent to a second run of its request where a node was lost
#: after it may have started ("true"; anything else, or none, is no consent).
REDISPATCH_HEADER = "X-KCoral-Redispatch"
#: The devices the run's program was exported for (absent: 1), so that a
#: Router picks a member that owns as many without reading the body.
DEVICES_HEADER = "X-KCoral-Devices"
#: The kept arrays a request names (a run's inputs and those it frees, a
#: deletion's), their ids comma-separated: a Router sends it to the worker
#: that holds them without reading the body.
KEPT_HEADER = "X-KCoral-Kept"
#: The kept array beside which a run that keeps outputs, and names no kept
#: array, would keep them (its id): a Router sends it to the worker that
#: holds that array while that worker has a free slot. A preference, never
#: a refusal; the worker does not read it.
NEAR_HEADER = "X-KCoral-Near"
#: Ids a client lists in that header at most, so that it fits a request head
#: of 16 KiB with room to spare (34 bytes an id).
MAX_KEPT_LISTED = 256
#: Arrays at least this large are content-addressed, so a repeated call can
#: send a reference instead of the bytes.
CACHE_THRESHOLD_BYTES = 64 * 1024

_DIGEST = re.compile(r"\A[0-9a-f]{64}\Z")
#: A kept array's id: the id of the worker instance that holds it, a dash,
#: and its own random part.
_KEPT_ID = re.compile(r"\A([0-9a-f]{16})-[0-9a-f]{16}\Z")
#: The name of a PRNG implementation, as C{jax.random.key_impl} gives it.
_KEY_TYPE = re.compile(r"\A[A-Za-z0-9_]{1,64}\Z")


class WireError(ValueError):
    """The frame is malformed; the message says how (answered with 400)."""


def sha256(data) -> str:
    return hashlib.sha256(byte_view(data)).hexdigest()


def is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST.match(value) is not None


def holder_of(kept: str) -> str | None:
    """The instance id of the worker that holds kept array C{kept}; None
    when C{kept} is no kept array's id."""
    match = _KEPT_ID.match(kept)
    return None if match is None else match.group(1)


def kept_id(value: str) -> str:
    """C{value}, a kept array's id as a path names it; L{WireError} for
    anything else, as for an entry of the C{X-KCoral-Kept} header."""
    if holder_of(value) is None:
        raise WireError(f"{value[:40]!r} is no kept array's id")
    return value


def kept_ids(value: str | bytes | None, least: int = 0) -> tuple[str, ...]:
    """The ids an C{X-KCoral-Kept} header lists (none for an empty or
    absent one); L{WireError} for an entry that is no kept array's id, for
    fewer than C{least} or more than L{MAX_ARRAYS}. Every route and front
    reads the header through this, whatever else the request says."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    value = (value or "").strip()
    ids = tuple(value.split(",")) if value else ()
    if not least <= len(ids) <= MAX_ARRAYS:
        raise WireError(f"{KEPT_HEADER} must list {least} to {MAX_ARRAYS} kept arrays")
    if any(holder_of(kept) is None for kept in ids):
        raise WireError(f"{KEPT_HEADER} must list kept arrays' ids")
    return ids


def holder_of_all(ids: Iterable[str]) -> str | None:
    """The instance id of the one worker that holds the arrays of C{ids}
    (None for no ids); L{ArraysApart} when they name several, which no one
    request reaches together."""
    holders = {holder_of(kept) for kept in ids}
    if len(holders) > 1:
        raise ArraysApart("the request's kept arrays are held by different workers; "
                          "a request takes them where they are, all on one worker")
    return holders.pop() if holders else None


def _pad(size: int) -> int:
    return -size % ALIGN


@attrs.frozen
class Blob:
    """
    Content named by its sha256 C{digest}; C{data} is None when the sender
    sent only the reference.
    """

    digest: str | None
    data: memoryview | None = attrs.field(default=None, eq=False)


@attrs.frozen
class ArraySpec:
    """
    One array of a frame. With a C{key_type}, the array is the key data of
    typed PRNG keys of that implementation (C{jax.random.key_data}).
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    blob: Blob
    key_type: str | None = None
    #: The id of a kept array this input names, in place of content (C{blob}
    #: then has neither digest nor data).
    kept: str | None = None

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize

    def view(self, data) -> np.ndarray:
        """The array over C{data}, without a copy."""
        if len(data) != self.nbytes:
            raise WireError(
                f"array of shape {list(self.shape)} and dtype {name_of(self.dtype)} "
                f"needs {self.nbytes} bytes, got {len(data)}")
        return np.frombuffer(data, dtype=self.dtype).reshape(self.shape)


@attrs.frozen
class KeptInput:
    """An input a frame names by a kept array's id; C{described}, where its
    entry also gives a dtype and shape, is what the array must be."""

    kept: str
    described: ArraySpec | None = None


@attrs.frozen
class RunRequest:
    program: Blob
    inputs: tuple[ArraySpec | KeptInput, ...]
    #: Which of its outputs stay on the worker (the answer names them): all
    #: or none, or one flag for each.
    keep: bool | tuple[bool, ...] = False
    #: The kept arrays it frees once it succeeded.
    free: tuple[str, ...] = ()

    @property
    def kept(self) -> tuple[str, ...]:
        """The kept arrays it names: its kept inputs, then those it frees."""
        inputs = (spec.kept for spec in self.inputs if isinstance(spec, KeptInput))
        return tuple(dict.fromkeys([*inputs, *self.free]))

    def routed_by(self, listed: Sequence[str]) -> None:
        """L{WireError} unless C{listed}, the ids of its C{X-KCoral-Kept}
        header, name the worker of the kept arrays it uses: a Router places
        a run by the header alone, and a run placed elsewhere would be told
        that arrays another worker holds are lost. L{ArraysApart} when either
        names several workers."""
        named = self.kept
        if named and holder_of_all(listed) != holder_of_all(named):
            raise WireError(f"{KEPT_HEADER} must list the kept arrays the run uses (or some of "
                            f"them), so that it is sent to the worker that holds them")

    def keeps(self, outputs: int) -> tuple[bool, ...]:
        """Whether each of its C{outputs} outputs stays on the worker;
        L{WireError} when C{keep} lists another number of them."""
        if isinstance(self.keep, bool):
            return (self.keep,) * outputs
        if len(self.keep) != outputs:
            raise WireError(f"'keep' has {len(self.keep)} entries, the program has {outputs} outputs")
        return self.keep


@attrs.frozen
class Reference:
    """A kept array as a frame names it: its id, dtype, shape and key type."""

    kept: str
    dtype: np.dtype
    shape: tuple[int, ...]
    key_type: str | None = None

    def entry(self) -> dict:
        entry = {"dtype": name_of(self.dtype), "shape": list(self.shape), "kept": self.kept}
        if self.key_type is not None:
            entry["key_type"] = self.key_type
        return entry


def byte_view(buffer) -> memoryview:
    """The bytes of C{buffer} (bytes or a C-contiguous array), without a copy."""
    if isinstance(buffer, np.ndarray):
        # Through uint8: numpy exports no buffer format for ml-dtypes types.
        buffer = buffer.reshape(-1).view(np.uint8)
    return memoryview(buffer).cast("B")


class FrameWriter:
    """Lays out buffers in a payload and produces the frame's parts."""

    def __init__(self) -> None:
        self._parts: list = []
        self._size = 0

    def add(self, buffer) -> list[int]:
        view = byte_view(buffer)
        if self._size % ALIGN:
            padding = _pad(self._size)
            self._parts.append(b"\0" * padding)
            self._size += padding
        where = [self._size, view.nbytes]
        self._parts.append(view)
        self._size += view.nbytes
        return where

    def finish(self, header: dict) -> tuple[list, int]:
        """The parts to send, in order, and their total length."""
        text = json.dumps(header, separators=(",", ":")).encode()
        head = PREFIX.pack(MAGIC, len(text)) + text
        head += b"\0" * _pad(len(head))
        return [head] + self._parts, len(head) + self._size


def read_frame(body) -> tuple[dict, memoryview]:
    """Split a frame into its JSON header and its payload."""
    view = memoryview(body).cast("B")
    if view.nbytes < PREFIX.size:
        raise WireError("body is shorter than the 8-byte frame prefix")
    magic, length = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireError("body does not start with the KCoral frame magic")
    if length > MAX_HEADER_BYTES:
        raise WireError(f"frame header of {length} bytes exceeds {MAX_HEADER_BYTES}")
    end = PREFIX.size + length
    if end > view.nbytes:
        raise WireError("body ends inside the frame header")
    try:
        header = json.loads(bytes(view[PREFIX.size:end]))
    except (ValueError, RecursionError) as e:
        raise WireError(f"frame header is not valid JSON: {str(e)[:80]}") from None
    if not isinstance(header, dict):
        raise WireError("frame header must be a JSON object")
    start = end + _pad(end)
    return header, view[min(start, view.nbytes):]


def _segment(payload: memoryview, where: object, what: str) -> memoryview:
    if (not isinstance(where, list) or len(where) != 2
            or not all(type(n) is int and n >= 0 for n in where)):
        raise WireError(f"{what}: 'data' must be [offset, length]")
    offset, length = where
    if offset + length > payload.nbytes:
        raise WireError(f"{what}: data [{offset}, {length}] lies outside the body")
    return payload[offset:offset + length]


def _blob(payload: memoryview, entry: dict, what: str, *, digest_required: bool) -> Blob:
    digest = entry.get("digest")
    if digest is not None and not is_digest(digest):
        raise WireError(f"{what}: digest must be 64 lowercase hex characters")
    if "data" not in entry:
        if digest is None:
            raise WireError(f"{what}: needs 'data', 'digest' or both")
        return Blob(digest)
    if digest is None and digest_required:
        raise WireError(f"{what}: needs a 'digest'")
    return Blob(digest, _segment(payload, entry["data"], what))


def _shape(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_RANK:
        raise WireError(f"{what}: shape must be a list of at most {MAX_RANK} dimensions")
    if not all(type(d) is int and 0 <= d <= MAX_DIM for d in value):
        raise WireError(f"{what}: each dimension must be an integer in [0, 2**62]")
    return tuple(value)


def _array_spec(payload: memoryview, entry: object, what: str) -> ArraySpec:
    if not isinstance(entry, dict):
        raise WireError(f"{what} must be a JSON object")
    unknown = set(entry) - {"dtype", "shape", "data", "digest", "key_type", "kept"}
    if unknown:
        raise WireError(f"{what}: unknown field {sorted(unknown)[0][:40]!r}")
    kept = entry.get("kept")
    if kept is not None and not (isinstance(kept, str) and holder_of(kept) is not None):
        raise WireError(f"{what}: 'kept' must be a kept array's id")
    key_type = entry.get("key_type")
    if key_type is not None and not (isinstance(key_type, str) and _KEY_TYPE.match(key_type)):
        raise WireError(f"{what}: key_type must be 1 to 64 letters, digits or underscores")
    try:
        dtype = dtype_from_name(entry.get("dtype"))
    except UnknownDType as e:
        raise WireError(f"{what}: {e}") from None
    shape = _shape(entry.get("shape"), what)
    extent = dtype.itemsize
    for dim in shape:
        extent *= max(dim, 1)
        if extent > MAX_EXTENT_BYTES:
            raise WireError(f"{what}: shape {list(shape)[:8]} is too large")
    if kept is not None:
        if "data" in entry or "digest" in entry:
            raise WireError(f"{what}: a kept array has neither 'data' nor 'digest'")
        return ArraySpec(dtype, shape, Blob(None), key_type, kept)
    spec = ArraySpec(dtype, shape, _blob(payload, entry, what, digest_required=False), key_type)
    if spec.blob.data is not None:
        spec.view(spec.blob.data)  # checks the length against the shape
    return spec


def _input(payload: memoryview, entry: object, what: str) -> ArraySpec | KeptInput:
    """An input entry: content, or a kept array named by its id alone or
    with its description."""
    if isinstance(entry, dict) and set(entry) == {"kept"}:
        kept = entry["kept"]
        if not (isinstance(kept, str) and holder_of(kept) is not None):
            raise WireError(f"{what}: 'kept' must be a kept array's id")
        return KeptInput(kept)
    spec = _array_spec(payload, entry, what)
    return spec if spec.kept is None else KeptInput(spec.kept, spec)


def _kept_list(value: object, what: str) -> tuple[str, ...]:
    if not (isinstance(value, list) and len(value) <= MAX_ARRAYS and all(
            isinstance(kept, str) and holder_of(kept) is not None for kept in value)):
        raise WireError(f"'{what}' must be a list of at most {MAX_ARRAYS} kept arrays' ids")
    return tuple(dict.fromkeys(value))


def decode_request(body) -> RunRequest:
    header, payload = read_frame(body)
    unknown = set(header) - {"program", "inputs", "keep", "free"}
    if unknown:
        raise WireError(f"unknown header field {sorted(unknown)[0][:40]!r}")
    program = header.get("program")
    if not isinstance(program, dict) or set(program) - {"digest", "data"}:
        raise WireError("'program' must be an object with 'digest' and optional 'data'")
    blob = _blob(payload, program, "program", digest_required=True)
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or len(inputs) > MAX_ARRAYS:
        raise WireError(f"'inputs' must be a list of at most {MAX_ARRAYS} arrays")
    specs = tuple(_input(payload, e, f"input {i}") for i, e in enumerate(inputs))
    keep = header.get("keep", False)
    if isinstance(keep, list) and len(keep) <= MAX_ARRAYS and all(isinstance(k, bool) for k in keep):
        keep = tuple(keep)
    elif not isinstance(keep, bool):
        raise WireError(f"'keep' must be true, false, or a list of at most {MAX_ARRAYS} of them")
    return RunRequest(blob, specs, keep, _kept_list(header.get("free", []), "free"))


def _describe(writer: FrameWriter, array: np.ndarray, digest: str | None,
              inline: bool, key_type: str | None) -> dict:
    entry = {"dtype": name_of(array.dtype), "shape": list(array.shape)}
    if key_type is not None:
        entry["key_type"] = key_type
    if digest is not None:
        entry["digest"] = digest
    if inline:
        entry["data"] = writer.add(array)
    return entry


def wire_array(array) -> np.ndarray:
    """C{array} as a C-contiguous little-endian numpy array."""
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return array if array.flags.c_contiguous else array.copy(order="C")


def encode_request(program_digest: str, program: bytes | None,
                   inputs: Sequence[tuple[np.ndarray, str | None, bool] | Reference],
                   key_types: Sequence[str | None] = (), keep: Sequence[bool] = (),
                   free: Sequence[str] = ()) -> tuple[list, int]:
    """
    Frame a run. Each input is C{(array, digest or None, send inline)}, or
    the L{Reference} of a kept array (named by its id alone: its worker
    knows the rest); the arrays must already be L{wire_array}s.
    C{key_types}, when given, has one entry per input: the key type of an
    input that is key data, else None. C{keep}, when given, has one flag per
    output: whether it is to stay on the worker. C{free} names kept arrays
    to free once the run succeeded.
    """
    writer = FrameWriter()
    head: dict = {"program": {"digest": program_digest}}
    if program is not None:
        head["program"]["data"] = writer.add(program)
    head["inputs"] = [{"kept": i.kept} if isinstance(i, Reference) else _describe(writer, *i, k)
                      for i, k in zip(inputs, _each(key_types, len(inputs)), strict=True)]
    if any(keep):
        head["keep"] = True if all(keep) else list(keep)
    if free:
        head["free"] = list(free)
    return writer.finish(head)


def encode_result(outputs: Sequence[np.ndarray | Reference],
                  key_types: Sequence[str | None] = ()) -> tuple[list, int]:
    """Frame a run's outputs: each one's bytes, or the L{Reference} of the
    kept array it stayed on the worker as (no buffer follows for it; it
    carries its own key type)."""
    writer = FrameWriter()
    entries = [o.entry() if isinstance(o, Reference) else _describe(writer, wire_array(o), None, True, k)
               for o, k in zip(outputs, _each(key_types, len(outputs)), strict=True)]
    return writer.finish({"outputs": entries})


def _each(key_types: Sequence[str | None], count: int) -> Iterable[str | None]:
    return key_types or [None] * count


def decode_outputs(body) -> tuple[list[np.ndarray | Reference], list[str | None]]:
    """The outputs of a result frame, each an array or the L{Reference} of
    the kept array it stayed as, and beside each the key type of an array
    of key data (None for the rest, references included)."""
    header, payload = read_frame(body)
    outputs = header.get("outputs")
    if not isinstance(outputs, list):
        raise WireError("result frame lacks an 'outputs' list")
    arrays: list[np.ndarray | Reference] = []
    key_types: list[str | None] = []
    for i, entry in enumerate(outputs):
        spec = _array_spec(payload, entry, f"output {i}")
        if spec.kept is not None:
            arrays.append(Reference(spec.kept, spec.dtype, spec.shape, spec.key_type))
            key_types.append(None)
            continue
        if spec.blob.data is None:
            raise WireError(f"output {i} has no data")
        arrays.append(spec.view(spec.blob.data))
        key_types.append(spec.key_type)
    return arrays, key_types


def decode_result(body) -> list[np.ndarray]:
    """The output arrays of a result frame that kept none."""
    outputs = decode_outputs(body)[0]
    arrays = [a for a in outputs if isinstance(a, np.ndarray)]
    if len(arrays) != len(outputs):
        raise WireError("the result names kept arrays")
    return arrays
