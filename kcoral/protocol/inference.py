"""
The Open Inference Protocol's inference messages (KServe v2, as Triton
serves them): the REST body, a JSON header that may be followed by binary
tensors (the binary tensor data extension), and its gRPC form.

Everything here is pure and bounded: a request is parsed into arrays that
view its body where they can, and every way a body can be wrong is a
L{BadRequest} that says how. The gRPC messages are converted to and from
the REST form without a model's manifest, so that a gRPC front can forward
an inference as REST does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import attrs
import numpy as np
from tritonclient.grpc import service_pb2

from kcoral.errors import BadRequest, ProgramFailed
from kcoral.protocol.decoupled import DECOUPLED_ANSWERS
from kcoral.protocol.sequence import SequenceControls, controls_of_grpc, controls_of_rest
from kcoral.protocol.strings import OBJECT, InvalidStrings, deserialize, serialize
from kcoral.protocol.tensors import (
    BYTES,
    DATATYPES,
    MAX_RANK,
    MAX_TENSORS,
    InvalidInput,
    datatype_of,
    dtype_of,
)

#: The most elements of one dimension, and of all of them together (zeros
#: counted as one): numpy cannot shape more, even an empty array.
MAX_DIM = 1 << 48

#: The most a JSON header may hold: JSON tensors are for small inputs,
#: binary ones for the rest.
MAX_HEADER_BYTES = 16 << 20
#: The most inputs, and requested outputs, one inference may name.
MAX_INPUTS = MAX_TENSORS
#: The longest request id echoed back.
MAX_ID_CHARS = 256
#: Bodies and answers up to this size are decoded and encoded on the reactor's
#: thread (a JSON header and views of the tensors: microseconds); larger ones,
#: which may be long JSON lists of numbers, are not.
ON_REACTOR_BYTES = 64 * 1024
#: The most elements of a BYTES answer whose size is counted on the
#: reactor's thread: one of more is encoded off it, uncounted.
_COUNTED_ELEMENTS = 1024

_HALF_FLOATS = (DATATYPES["FP16"], DATATYPES["BF16"])

#: The typed fields of a gRPC input, for the datatypes that have one
#: (FP16 and BF16 travel only in raw_input_contents).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
}


#: The datatypes whose typed field holds fixed-width little-endian values.
_FIXED_WIDTH = frozenset({"FP32", "FP64"})
_FIELD_NUMBERS = {f.name: f.number for f in service_pb2.InferTensorContents.DESCRIPTOR.fields}
#: The most values of an input in a typed field of varying width (integers,
#: BOOL), each converted from a Python object: large tensors travel in
#: raw_input_contents, as every Triton client sends them.
MAX_TYPED_VALUES = 1 << 20


@attrs.frozen
class RequestedOutput:
    """An output a request names; C{binary} None: as the request-wide default."""

    name: str
    binary: bool | None


@attrs.frozen
class InferRequest:
    """A parsed inference request: its inputs by name, in the request's order."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: tuple[RequestedOutput, ...]
    binary_output_default: bool
    parameters: dict


@attrs.frozen
class InferAnswer:
    """An encoded inference answer: its REST body, and the length of its JSON
    header when binary tensors follow it (None: the body is all JSON)."""

    body: bytes
    header_length: int | None


@attrs.frozen
class RestInfer:
    """A gRPC inference in the REST form: the model, its version (None: any)
    and the body a REST front takes."""

    model: str
    version: str | None
    body: bytes
    header_length: int | None


def _header(body: bytes | memoryview, header_length: int | None) -> tuple[dict, int]:
    """The JSON header of C{body} and where its binary part starts."""
    size = len(body) if header_length is None else header_length
    if header_length is not None and not 0 <= header_length <= len(body):
        raise BadRequest(f"Inference-Header-Content-Length {header_length} is not within the "
                         f"body's {len(body)} bytes")
    if size > MAX_HEADER_BYTES:
        raise BadRequest(f"the inference request's JSON is over {MAX_HEADER_BYTES} bytes: "
                         "send large tensors as binary data")
    try:
        header = json.loads(bytes(body[:size]), parse_constant=_not_json)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise BadRequest(f"the inference request is not JSON: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise BadRequest("the inference request must be a JSON object")
    return header, size


def _not_json(constant: str):
    """Python reads NaN and Infinity where JSON has no such values: refused."""
    raise ValueError(f"{constant} is not a JSON value: send non-finite floats as binary data")


def _parameters(value: object, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{what}: parameters must be an object")
    return value


def parse_infer(body: bytes | memoryview, header_length: int | None) -> InferRequest:
    """The inference request in C{body} (C{header_length}: the value of its
    C{Inference-Header-Content-Length}); a L{BadRequest} says what is wrong."""
    view = memoryview(body).cast("B")
    header, offset = _header(view, header_length)
    return _request_of(header, view, offset, header_length or 0)


def sequence_of_infer(body: bytes | memoryview, header_length: int | None) -> SequenceControls:
    """The sequence controls of the inference request in C{body}, read from
    its JSON header alone; a L{BadRequest} says what is wrong with them."""
    header, _ = _header(memoryview(body).cast("B"), header_length)
    return controls_of_rest(_parameters(header.get("parameters"), "the request"))


def _request_of(header: dict, view: memoryview, offset: int, header_length: int) -> InferRequest:
    """The request of a REST C{header} whose binary tensors are in C{view}
    from C{offset} on (C{header_length} bytes of JSON before them)."""
    rid = header.get("id")
    if rid is not None and (not isinstance(rid, str) or len(rid) > MAX_ID_CHARS):
        raise BadRequest(f"id must be a string of at most {MAX_ID_CHARS} characters")
    parameters = _parameters(header.get("parameters"), "the request")
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise BadRequest("parameters.binary_data_output must be true or false")
    entries = header.get("inputs")
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_INPUTS:
        raise BadRequest(f"inputs must list 1 to {MAX_INPUTS} tensors")
    inputs: dict[str, np.ndarray] = {}
    for entry in entries:
        name, array, offset = _input(entry, view, offset)
        if name in inputs:
            raise BadRequest(f"input {name!r} is given twice")
        inputs[name] = array
    if offset != len(view):
        raise BadRequest(f"the inputs' binary_data_size add up to {offset - header_length} "
                         f"bytes, the body has {len(view) - header_length} after its JSON")
    return InferRequest(id=rid, inputs=inputs, outputs=_requested(header.get("outputs")),
                        binary_output_default=binary_default, parameters=parameters)


def _input(entry: object, view: memoryview, offset: int) -> tuple[str, np.ndarray, int]:
    """An input's name, its array, and where the next binary tensor starts."""
    if not isinstance(entry, dict):
        raise BadRequest("an input must be an object")
    name = entry.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise BadRequest("an input's name must be a string of 1 to 64 characters")
    try:
        dtype = dtype_of(entry.get("datatype"))
    except InvalidInput as e:
        raise BadRequest(f"input {name!r}: {e}") from None
    shape = entry.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(
            type(d) is int and 0 <= d <= MAX_DIM for d in shape) or math.prod(
            max(d, 1) for d in shape) > MAX_DIM:
        raise BadRequest(f"input {name!r}: shape must list at most {MAX_RANK} dimensions, "
                         f"each a count of 0 or more, their product at most {MAX_DIM}")
    count = math.prod(shape)
    parameters = _parameters(entry.get("parameters"), f"input {name!r}")
    unknown = sorted(set(parameters) - {"binary_data_size"})
    if unknown:
        raise BadRequest(f"input {name!r}: parameter {unknown[0][:64]!r} is not served")
    size = parameters.get("binary_data_size")
    if size is None:
        if "data" not in entry:
            raise BadRequest(f"input {name!r} has neither data nor binary_data_size")
        return name, _json_array(name, entry["data"], dtype, shape, count), offset
    if "data" in entry:
        raise BadRequest(f"input {name!r} has both data and binary_data_size")
    if type(size) is not int or size < 0:
        raise BadRequest(f"input {name!r}: binary_data_size must be a count of bytes")
    if offset + size > len(view):
        raise BadRequest(f"input {name!r}: binary_data_size {size} runs past the body's end")
    if dtype == OBJECT:
        try:
            elements = deserialize(view[offset:offset + size], count)
        except InvalidStrings as e:
            raise BadRequest(f"input {name!r}: its BYTES data does not hold its shape {shape}: "
                             f"{e}") from None
        return name, elements.reshape(shape), offset + size
    if size != count * dtype.itemsize:
        raise BadRequest(f"input {name!r}: binary_data_size is {size} bytes, its shape "
                         f"{shape} of {entry['datatype']} takes {count * dtype.itemsize}")
    array = np.frombuffer(view, dtype=dtype, count=count, offset=offset).reshape(shape)
    # A view where the body's alignment allows; else a copy, as devices and
    # numpy's fast paths want aligned arrays.
    return name, array if array.flags.aligned else array.copy(), offset + size


def _json_array(name: str, data: object, dtype: np.dtype, shape: list[int], count: int) -> np.ndarray:
    if not isinstance(data, list):
        raise BadRequest(f"input {name!r}: data must be a list")
    flat: list = []
    _flatten(name, data, max(len(shape), 1), flat)
    if len(flat) != count:
        raise BadRequest(f"input {name!r}: data holds {len(flat)} elements, its shape {shape} "
                         f"takes {count}")
    if dtype == OBJECT:
        return _json_strings(name, flat).reshape(shape)
    if dtype == np.bool_ and not all(isinstance(v, bool) for v in flat):
        raise BadRequest(f"input {name!r}: BOOL data must be true or false")
    if dtype != np.bool_ and not all(type(v) in (int, float) for v in flat):
        raise BadRequest(f"input {name!r}: data must be numbers")
    if dtype.kind in "iu" and not all(type(v) is int for v in flat):
        raise BadRequest(f"input {name!r}: integer data must be integers")
    try:
        with np.errstate(over="ignore"):
            array = np.array(flat, dtype=dtype).reshape(shape)
    except (OverflowError, ValueError) as e:
        raise BadRequest(f"input {name!r}: {str(e)[:200]}") from None
    # JSON numbers are finite: one past the datatype's range (1e400, or 1e39
    # for FP32) would become an infinity the client never wrote.
    if (dtype.kind == "f" or dtype in _HALF_FLOATS) and not np.isfinite(array).all():
        raise BadRequest(f"input {name!r}: a number is past the finite range of "
                         f"{datatype_of(dtype)}: send non-finite floats as binary data")
    return array


def _json_strings(name: str, flat: list) -> np.ndarray:
    """The elements of a BYTES input that JSON holds, each a string (its
    UTF-8 bytes are the element's)."""
    elements = np.empty(len(flat), OBJECT)
    try:
        elements[:] = [value.encode() for value in flat]
    except (AttributeError, UnicodeEncodeError):
        raise BadRequest(f"input {name!r}: BYTES data must be strings (of UTF-8: send other "
                         "bytes as binary data)") from None
    return elements


def _flatten(name: str, data: list, depth: int, into: list) -> None:
    """The elements of C{data}, row-major, into C{into}: lists nested at
    most C{depth} deep (a flat list, or nested as the shape)."""
    for value in data:
        if isinstance(value, list):
            if depth <= 1:
                raise BadRequest(f"input {name!r}: data is nested deeper than its shape")
            _flatten(name, value, depth - 1, into)
        else:
            into.append(value)


def _requested(value: object) -> tuple[RequestedOutput, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_INPUTS:
        raise BadRequest(f"outputs must list at most {MAX_INPUTS} outputs")
    requested = []
    for entry in value:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise BadRequest("a requested output must be an object with a name")
        binary = _parameters(entry.get("parameters"), f"output {entry['name'][:64]!r}").get(
            "binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise BadRequest(f"output {entry['name'][:64]!r}: binary_data must be true or false")
        requested.append(RequestedOutput(entry["name"], binary))
    return tuple(requested)


def encode_infer(model_name: str, model_version: str, request: InferRequest,
                 outputs: Mapping[str, np.ndarray], parameters: dict | None = None) -> InferAnswer:
    """The answer to C{request} with C{outputs} (by name, in the model's
    order): those it asks for, else all, each binary or JSON as it asks;
    with C{parameters}, if given."""
    tensors, buffers = [], []
    for name, binary in _chosen(model_name, request, outputs):
        array = outputs[name]
        tensor: dict = {"name": name, "datatype": _datatype(name, array), "shape": list(array.shape)}
        if binary:
            data = _binary(array)
            tensor["parameters"] = {"binary_data_size": len(data)}
            buffers.append(data)
        else:
            tensor["data"] = _json_values(name, array)
        tensors.append(tensor)
    answer: dict = {"model_name": model_name, "model_version": model_version, "outputs": tensors}
    if request.id is not None:
        answer["id"] = request.id
    if parameters:
        answer["parameters"] = parameters
    header = json.dumps(answer, allow_nan=False).encode()
    if not buffers:
        return InferAnswer(header, None)
    return InferAnswer(b"".join([header, *buffers]), len(header))


def _chosen(model_name: str, request: InferRequest, outputs: Mapping[str, np.ndarray]
            ) -> list[tuple[str, bool]]:
    """The outputs C{request} is answered with, each binary or not: those
    it asks for, else all."""
    if request.outputs:
        unknown = [r.name for r in request.outputs if r.name not in outputs]
        if unknown:
            raise BadRequest(f"model {model_name} has no output {unknown[0][:64]!r} "
                             f"(its outputs: {', '.join(outputs)})")
        return [(r.name, request.binary_output_default if r.binary is None else r.binary)
                for r in request.outputs]
    return [(name, request.binary_output_default) for name in outputs]


def encoded_size(array: np.ndarray) -> int:
    """About the bytes C{array} takes in an answer, to choose where it is
    encoded: a BYTES tensor's are its elements' (an array of them holds
    only pointers), and one of many elements is taken as large unread."""
    if array.dtype != OBJECT:
        return array.nbytes
    if array.size > _COUNTED_ELEMENTS:
        return ON_REACTOR_BYTES + 1
    return 4 * array.size + sum(map(len, array.reshape(-1)))


def _binary(array: np.ndarray) -> bytes | memoryview:
    """A tensor's bytes in the binary tensor data extension (and gRPC's
    raw contents): its values little-endian, or a BYTES tensor's
    length-prefixed elements."""
    if array.dtype == OBJECT:
        return serialize(array)
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return data.reshape(-1).view(np.uint8).data


def _datatype(name: str, array: np.ndarray) -> str:
    if array.dtype == OBJECT:
        return BYTES
    try:
        return datatype_of(array.dtype)
    except ValueError as e:
        raise ProgramFailed(f"output {name!r}: {e}") from None


def merge_infer(requests: list[InferRequest], outputs: tuple[str, ...]) -> tuple[bytes, int]:
    """
    One request of the rows of C{requests} together (their inputs of the
    same names, datatypes and dimensions past the first, in the same order),
    as its body and the length of its JSON header: every input a binary
    tensor, C{outputs} (none: all) each asked for in binary.
    """
    entries, buffers = [], []
    for name, array in requests[0].inputs.items():
        joined = np.concatenate([request.inputs[name] for request in requests])
        data = _binary(joined)
        entries.append({"name": name, "datatype": _datatype(name, array),
                        "shape": list(joined.shape), "parameters": {"binary_data_size": len(data)}})
        buffers.append(data)
    header: dict = {"inputs": entries, "parameters": {"binary_data_output": True}}
    if outputs:
        header["outputs"] = [{"name": name} for name in outputs]
    encoded = json.dumps(header).encode()
    return b"".join([encoded, *buffers]), len(encoded)


def parse_answer(body: bytes | memoryview, header_length: int | None
                 ) -> tuple[str, str, dict[str, np.ndarray]]:
    """The model name, model version and outputs by name (in the answer's
    order) of a REST inference answer; L{ProgramFailed} if it is malformed."""
    view = memoryview(body).cast("B")
    outputs: dict[str, np.ndarray] = {}
    try:
        header, offset = _header(view, header_length)
        for output in header["outputs"]:
            dtype, shape = dtype_of(output["datatype"]), output["shape"]
            size = _parameters(output.get("parameters"), "an output").get("binary_data_size")
            if size is None and dtype == OBJECT:
                array = _json_strings(output["name"], output["data"]).reshape(shape)
            elif size is None:
                array = np.array(output["data"], dtype=dtype).reshape(shape)
            elif dtype == OBJECT:
                array = deserialize(view[offset:offset + size], math.prod(shape)).reshape(shape)
                offset += size
            else:
                array = np.frombuffer(view, dtype=dtype, count=math.prod(shape),
                                      offset=offset).reshape(shape)
                offset += size
            outputs[output["name"]] = array
        return str(header["model_name"]), str(header["model_version"]), outputs
    except (BadRequest, InvalidInput, KeyError, TypeError, ValueError) as e:
        raise ProgramFailed(f"a malformed inference answer: {str(e)[:200]}") from None


def _json_values(name: str, array: np.ndarray) -> list:
    """The values of output C{name} as JSON holds them; L{BadRequest} for
    NaN or an infinity, which JSON has no value for (the binary form carries
    them as they are)."""
    flat = array.reshape(-1)
    if flat.dtype == OBJECT:
        try:
            return [element.decode() for element in flat]
        except UnicodeDecodeError:
            raise BadRequest(f"output {name!r} holds bytes that are not UTF-8, which JSON "
                             "cannot carry: ask for it as binary data (parameters.binary_data "
                             "true)") from None
    if flat.dtype in _HALF_FLOATS:
        # FP16 and BF16 have no Python type of their own: JSON holds their floats.
        flat = flat.astype(np.float32)
    if flat.dtype.kind == "f" and not np.isfinite(flat).all():
        raise BadRequest(f"output {name!r} holds NaN or infinite values, which JSON cannot "
                         f"carry: ask for it as binary data (parameters.binary_data true)")
    return flat.tolist()


# -- gRPC -----------------------------------------------------------------------------------------

def rest_of_grpc_infer(pb: service_pb2.ModelInferRequest) -> RestInfer:
    """The REST form of a gRPC inference: its inputs as binary tensors,
    every output asked for in binary."""
    header, buffers = _rest_parts(pb)
    encoded = json.dumps(header).encode()
    return RestInfer(pb.model_name, pb.model_version or None, b"".join([encoded, *buffers]),
                     len(encoded))


def request_of_grpc_infer(pb: service_pb2.ModelInferRequest) -> InferRequest:
    """The request of a gRPC inference, as L{parse_infer} reads its REST
    form (the same checks, the same errors), without making that form."""
    header, buffers = _rest_parts(pb)
    # One input's bytes are joined as they are, without a copy.
    return _request_of(header, memoryview(b"".join(buffers)), 0, 0)


def grpc_infer_answer(model_name: str, model_version: str, request: InferRequest,
                      outputs: Mapping[str, np.ndarray]) -> bytes:
    """The serialized gRPC answer to C{request} with C{outputs}: those it
    asks for, else all, each in raw_output_contents, as
    L{grpc_of_rest_answer} makes of L{encode_infer}'s answer."""
    response = service_pb2.ModelInferResponse(model_name=model_name, model_version=model_version,
                                              id=request.id or "")
    for name, _ in _chosen(model_name, request, outputs):
        array = outputs[name]
        response.outputs.add(name=name, datatype=_datatype(name, array), shape=list(array.shape))
        response.raw_output_contents.append(bytes(_binary(array)))
    return response.SerializeToString()


def _rest_parts(pb: service_pb2.ModelInferRequest) -> tuple[dict, list[bytes]]:
    """The REST header of a gRPC inference, and its inputs' bytes in order."""
    if not 1 <= len(pb.inputs) <= MAX_INPUTS:
        raise BadRequest(f"inputs must list 1 to {MAX_INPUTS} tensors")
    raw = list(pb.raw_input_contents)
    if raw:
        for tensor in pb.inputs:
            if tensor.HasField("contents"):
                # Triton's words, which its clients look for.
                raise BadRequest(f"contents field must not be specified when using "
                                 f"raw_input_contents for '{tensor.name[:64]}' for model "
                                 f"'{pb.model_name[:64]}'")
    if raw and len(raw) != len(pb.inputs):
        raise BadRequest(f"raw_input_contents holds {len(raw)} tensors for {len(pb.inputs)} inputs")
    inputs, buffers = [], []
    for i, tensor in enumerate(pb.inputs):
        if len(tensor.shape) > MAX_RANK:
            raise BadRequest(f"input {tensor.name[:64]!r}: shape has more than {MAX_RANK} dimensions")
        data = raw[i] if raw else _typed_contents(tensor)
        inputs.append({"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                       "parameters": {"binary_data_size": len(data)}})
        buffers.append(data)
    # A sequence's controls travel as the REST form's parameters.
    header: dict = {"inputs": inputs, "parameters": {
        "binary_data_output": True, **controls_of_grpc(pb.parameters).rest_parameters()}}
    if pb.id:
        header["id"] = pb.id
    if pb.outputs:
        header["outputs"] = [{"name": o.name} for o in pb.outputs]
    return header, buffers


def _typed_contents(tensor: service_pb2.ModelInferRequest.InferInputTensor) -> bytes:
    """The little-endian bytes of an input sent in its typed contents field."""
    try:
        dtype = dtype_of(tensor.datatype)
    except InvalidInput as e:
        raise BadRequest(f"input {tensor.name[:64]!r}: {e}") from None
    if dtype == OBJECT:
        values = tensor.contents.bytes_contents
        if len(values) > MAX_TYPED_VALUES:
            raise BadRequest(f"input {tensor.name[:64]!r}: {len(values)} values in bytes_contents, "
                             f"over {MAX_TYPED_VALUES}: send large tensors in raw_input_contents")
        # Triton's binary form, which the REST form of the request carries.
        return serialize(np.array(list(values), OBJECT))
    field = _CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        raise BadRequest(f"input {tensor.name[:64]!r}: {tensor.datatype} travels only in "
                         "raw_input_contents")
    if tensor.datatype in _FIXED_WIDTH:
        # Their packed wire form is their little-endian bytes: taken as
        # they are, where a Python float apiece costs a core seconds for a
        # large tensor.
        return _packed(tensor.contents, _FIELD_NUMBERS[field])
    values = getattr(tensor.contents, field)
    if len(values) > MAX_TYPED_VALUES:
        raise BadRequest(f"input {tensor.name[:64]!r}: {len(values)} values in {field}, over "
                         f"{MAX_TYPED_VALUES}: send large tensors in raw_input_contents")
    try:
        return np.array(values, dtype=dtype.newbyteorder("<")).tobytes()
    except (OverflowError, ValueError) as e:
        raise BadRequest(f"input {tensor.name[:64]!r}: {str(e)[:200]}") from None


def _packed(contents: service_pb2.InferTensorContents, number: int) -> bytes:
    """The payload of field C{number} in the wire form of C{contents}, whose
    fields are all length-delimited (packed numbers, or bytes)."""
    wire = contents.SerializeToString()
    view, parts, at = memoryview(wire), [], 0
    while at < len(wire):
        key, at = _varint(wire, at)
        size, at = _varint(wire, at)
        if key >> 3 == number:
            parts.append(view[at:at + size])
        at += size
    return b"".join(parts)


def _varint(wire: bytes, at: int) -> tuple[int, int]:
    """The varint at C{at} in C{wire}, and where the next field starts."""
    value = shift = 0
    while True:
        byte = wire[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            return value, at


def grpc_of_rest_answer(body: bytes | memoryview, header_length: int | None
                        ) -> service_pb2.ModelInferResponse:
    """The gRPC form of a REST inference answer, every output in
    raw_output_contents (the only place gRPC clients read tensors from),
    and whether it holds a decoupled model's answers
    (L{kcoral.protocol.decoupled})."""
    view = memoryview(body).cast("B")
    try:
        header, offset = _header(view, header_length)
        response = service_pb2.ModelInferResponse(
            model_name=str(header.get("model_name", "")),
            model_version=str(header.get("model_version", "")), id=str(header.get("id", "")))
        for output in header.get("outputs", []):
            name, datatype, shape = output["name"], output["datatype"], output["shape"]
            parameters = _parameters(output.get("parameters"), f"output {name!r}")
            size = parameters.get("binary_data_size")
            if "shared_memory_region" in parameters:
                # Written into the client's region: an empty placeholder
                # keeps the later outputs at their places.
                data = b""
            elif size is None and datatype == BYTES:
                data = serialize(_json_strings(name, output["data"]))
            elif size is None:
                data = np.array(output["data"], dtype=dtype_of(datatype).newbyteorder("<")).tobytes()
            else:
                data = bytes(view[offset:offset + size])
                offset += size
            response.outputs.add(name=name, datatype=datatype, shape=shape)
            response.raw_output_contents.append(data)
        if _parameters(header.get("parameters"), "the answer").get(DECOUPLED_ANSWERS) is True:
            response.parameters[DECOUPLED_ANSWERS].bool_param = True
    except (BadRequest, InvalidInput, KeyError, TypeError, ValueError) as e:
        raise ProgramFailed(f"a malformed inference answer: {str(e)[:200]}") from None
    return response
