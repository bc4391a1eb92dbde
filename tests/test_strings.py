"""
BYTES tensors (L{kcoral.protocol.strings}): Triton's length-prefixed
binary form against tritonclient's own serializer, the two arrays a program
holds them in, their REST and gRPC forms against tritonclient's request
builders and answer parsers, a manifest's BYTES tensors, and hostile
binary forms.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from kcoral.errors import BadRequest, ProgramFailed
from kcoral.models.manifest import InvalidManifest, ModelManifest, TensorSpec
from kcoral.protocol.inference import (
    ON_REACTOR_BYTES,
    InferRequest,
    RequestedOutput,
    encode_infer,
    encoded_size,
    grpc_infer_answer,
    grpc_of_rest_answer,
    merge_infer,
    parse_answer,
    parse_infer,
    request_of_grpc_infer,
    rest_of_grpc_infer,
)
from kcoral.protocol.strings import (
    MAX_ELEMENTS,
    OBJECT,
    InvalidStrings,
    Strings,
    deserialize,
    pack,
    serialize,
    unpack,
)
from kcoral.protocol.tensors import InvalidInput

ELEMENTS = st.lists(st.binary(max_size=24), min_size=1, max_size=12)


def objects(values, shape=None) -> np.ndarray:
    array = np.empty(len(values), OBJECT)
    array[:] = values
    return array.reshape(shape or (len(values),))


@settings(max_examples=200, deadline=None)
@given(values=ELEMENTS)
def test_binary_form_is_tritonclients(values):
    """serialize writes what tritonclient's serialize_byte_tensor writes,
    and deserialize reads it back, NULs and any bytes included."""
    array = objects(values)
    theirs = serialize_byte_tensor(array).item()
    assert serialize(array) == theirs
    read = deserialize(theirs, len(values))
    assert read.dtype == OBJECT and list(read) == values
    assert list(deserialize_bytes_tensor(serialize(array))) == values


@settings(max_examples=200, deadline=None)
@given(values=ELEMENTS, extra=st.integers(0, 8))
def test_pack_and_unpack_round_trip(values, extra):
    """A program's two arrays hold each element zero padded to max_length,
    its length beside it, and give the same elements back."""
    most = max(map(len, values)) + extra or 1
    data, lengths = pack(objects(values, (1, len(values))), most)
    assert data.dtype == np.uint8 and data.shape == (1, len(values), most)
    assert lengths.dtype == np.int32 and lengths.tolist() == [[len(v) for v in values]]
    for value, row in zip(values, data[0]):
        assert bytes(row) == value + b"\0" * (most - len(value))
    assert unpack(data, lengths).tolist() == [values]


def test_unpack_refuses_what_no_bytes_tensor_is():
    """A program's lengths outside 0 to max_length, or arrays of other
    dtypes or shapes, are refused, not read past."""
    data = np.zeros((2, 4), np.uint8)
    for lengths in ([5, 0], [-1, 0]):
        with pytest.raises(ValueError, match="outside 0 to 4"):
            unpack(data, np.array(lengths, np.int32))
    with pytest.raises(ValueError, match="uint8 data"):
        unpack(data.astype(np.int32), np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="uint8 data"):
        unpack(data, np.zeros(3, np.int32))


def test_strings_of_values():
    """Strings.of makes an export's example: the values packed at max_length,
    and refuses one longer."""
    example = Strings.of([[b"ab", b""]], 3)
    assert example.data.tolist() == [[[97, 98, 0], [0, 0, 0]]]
    assert example.lengths.tolist() == [[2, 0]]
    with pytest.raises(ValueError, match="max_length 1"):
        Strings.of([[b"ab"]], 1)


@settings(max_examples=500, deadline=None)
@given(data=st.one_of(st.binary(max_size=64), ELEMENTS.map(lambda v: serialize(objects(v)))),
       cut=st.integers(0, 8), count=st.integers(0, 16))
def test_hostile_binary_forms_are_refused_in_words(data, cut, count):
    """Any bytes and any count either are exactly count elements (written
    back the same) or an InvalidStrings saying why: lengths past the end,
    elements missing, bytes left over; never another error."""
    data = data[:len(data) - cut] if cut else data
    try:
        elements = deserialize(data, count)
    except InvalidStrings as e:
        assert str(e)
        return
    assert len(elements) == count and serialize(elements) == data


def test_a_huge_length_prefix_is_refused_before_any_allocation():
    """A prefix claiming 4 GiB in a few bytes is refused by comparing it
    with the bytes there are; a count past MAX_ELEMENTS, or one the bytes
    cannot hold, is refused before reading."""
    with pytest.raises(InvalidStrings, match="length 4294967295 runs past"):
        deserialize(struct.pack("<I", 0xFFFFFFFF) + b"abc", 1)
    with pytest.raises(InvalidStrings, match=f"over the {MAX_ELEMENTS}"):
        deserialize(b"", MAX_ELEMENTS + 1)
    with pytest.raises(InvalidStrings, match="cannot hold 3 elements"):
        deserialize(b"\0" * 11, 3)


# -- the protocol's forms -----------------------------------------------------------------------

VALUES = [b"0", b"he\x00llo", b"\x00\x01\x02\x03", "é".encode()]


@pytest.mark.parametrize("binary", [True, False])
def test_rest_inputs_of_tritonclient(binary):
    """tritonclient's BYTES inputs, binary or JSON, parse to arrays of the
    same bytes and shape."""
    array = objects(VALUES, (2, 2))
    tensor = httpclient.InferInput("x", [2, 2], "BYTES")
    tensor.set_data_from_numpy(array, binary_data=binary)
    body, length = httpclient.InferenceServerClient.generate_request_body([tensor])
    parsed = parse_infer(body, length).inputs["x"]
    assert parsed.dtype == OBJECT and parsed.tolist() == array.tolist()


@pytest.mark.parametrize("raw", [True, False])
def test_grpc_inputs_of_tritonclient(raw):
    """gRPC BYTES inputs, in raw_input_contents (as tritonclient sends them)
    or in bytes_contents, parse to the same arrays, directly and through
    their REST form."""
    array = objects(VALUES, (1, 4))
    if raw:
        tensor = grpcclient.InferInput("x", [1, 4], "BYTES")
        tensor.set_data_from_numpy(array)
        pb = service_pb2.ModelInferRequest(model_name="m", inputs=[tensor._get_tensor()],
                                           raw_input_contents=[tensor._get_content()])
    else:
        pb = service_pb2.ModelInferRequest(model_name="m")
        pb.inputs.add(name="x", datatype="BYTES", shape=[1, 4]).contents.bytes_contents.extend(VALUES)
    assert request_of_grpc_infer(pb).inputs["x"].tolist() == array.tolist()
    rest = rest_of_grpc_infer(pb)
    assert parse_infer(rest.body, rest.header_length).inputs["x"].tolist() == array.tolist()


def _request(binary: bool) -> InferRequest:
    return InferRequest(id="r", inputs={}, outputs=(RequestedOutput("y", binary),),
                        binary_output_default=False, parameters={})


@pytest.mark.parametrize("binary", [True, False])
def test_answers_read_by_tritonclient(binary):
    """A BYTES output answered in binary or JSON is what tritonclient's
    InferResult reads back (JSON: as text); its gRPC form, raw contents."""
    outputs = {"y": objects(VALUES, (1, 4))}
    answer = encode_infer("m", "1", _request(binary), outputs)
    result = httpclient.InferResult.from_response_body(answer.body, header_length=answer.header_length)
    expected = VALUES if binary else [v.decode() for v in VALUES]
    assert result.as_numpy("y").reshape(-1).tolist() == expected
    assert result.get_output("y")["datatype"] == "BYTES"
    pb = service_pb2.ModelInferResponse.FromString(grpc_infer_answer("m", "1", _request(binary), outputs))
    assert grpcclient.InferResult(pb).as_numpy("y").reshape(-1).tolist() == VALUES
    assert grpcclient.InferResult(grpc_of_rest_answer(answer.body, answer.header_length)).as_numpy(
        "y").reshape(-1).tolist() == VALUES


def test_a_bytes_answers_size_is_its_elements():
    """Where an answer is encoded is chosen by its elements' bytes (an
    object array's nbytes counts pointers): a few large elements, or very
    many small ones, are large."""
    large = objects([b"x" * ON_REACTOR_BYTES] * 2)
    assert encoded_size(large) == 2 * (4 + ON_REACTOR_BYTES) > large.nbytes
    assert encoded_size(objects([b"ab"] * 3)) == 18
    assert encoded_size(objects([b""] * 5000)) > ON_REACTOR_BYTES
    assert encoded_size(np.zeros(4, np.float32)) == 16


def test_bytes_json_cannot_carry_are_refused_in_json():
    """An output of bytes that are not UTF-8 is refused in JSON (JSON
    strings are text), saying to ask for binary data; JSON inputs must be
    strings."""
    with pytest.raises(BadRequest, match="not UTF-8.*binary data"):
        encode_infer("m", "1", _request(False), {"y": objects([b"\xff"])})
    body = json.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2],
                                   "data": ["a", 7]}]}).encode()
    with pytest.raises(BadRequest, match="BYTES data must be strings"):
        parse_infer(body, None)


def test_merged_requests_and_their_answer():
    """Requests merged by a front carry their BYTES rows in binary, and a
    merged answer's BYTES rows parse back."""
    a = parse_infer(*httpclient.InferenceServerClient.generate_request_body([_input([[b"a", b""]])]))
    b = parse_infer(*httpclient.InferenceServerClient.generate_request_body([_input([[b"xyz", b"\0"]])]))
    body, length = merge_infer([a, b], ())
    merged = parse_infer(body, length).inputs["x"]
    assert merged.tolist() == [[b"a", b""], [b"xyz", b"\0"]]
    answer = encode_infer("m", "1", _request(True), {"y": merged})
    _, _, outputs = parse_answer(answer.body, answer.header_length)
    assert outputs["y"].tolist() == merged.tolist()


def _input(rows) -> httpclient.InferInput:
    array = np.array(rows, dtype=OBJECT)
    tensor = httpclient.InferInput("x", list(array.shape), "BYTES")
    tensor.set_data_from_numpy(array)
    return tensor


def test_a_malformed_bytes_answer_is_the_workers_failure():
    """A worker's answer whose BYTES data does not hold its shape is a
    ProgramFailed at the front, not a crash."""
    header = json.dumps({"model_name": "m", "model_version": "1", "outputs": [{
        "name": "y", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 5}}]})
    with pytest.raises(ProgramFailed, match="malformed"):
        parse_answer(header.encode() + b"\x09\0\0\0a", len(header))


# -- a manifest's BYTES tensors -----------------------------------------------------------------

def _manifest(inputs) -> ModelManifest:
    return ModelManifest.from_json({
        "format": 1, "name": "m", "max_batch_size": 2, "batch_sizes": [2], "platforms": ["cpu"],
        "inputs": inputs, "outputs": [{"name": "y", "datatype": "INT32", "shape": [-1]}],
        "programs": [{"file": "p", "sha256": "0" * 64, "batch_sizes": [2]}], "params": None})


def test_a_manifests_bytes_tensor_declares_its_max_length():
    """A BYTES tensor needs a max_length within the bound; no other tensor
    may have one; its program holds it as bytes and lengths."""
    spec = _manifest([{"name": "x", "datatype": "BYTES", "shape": [-1, 3], "max_length": 8}]).inputs[0]
    assert spec == TensorSpec("x", "BYTES", (-1, 3), 8)
    assert spec.program_tensors == ((np.dtype(np.uint8), (-1, 3, 8)), (np.dtype(np.int32), (-1, 3)))
    for bad in ({"datatype": "BYTES"}, {"datatype": "BYTES", "max_length": 0},
                {"datatype": "BYTES", "max_length": 1 << 30}, {"datatype": "INT32", "max_length": 4}):
        with pytest.raises(InvalidManifest, match="max_length"):
            _manifest([{"name": "x", "shape": [-1], **bad}])


def test_inputs_are_checked_against_max_length_and_datatype():
    """An element over an input's max_length is refused naming the input and
    the bound; a BYTES input to a model of numbers is refused naming both
    datatypes."""
    strings = _manifest([{"name": "x", "datatype": "BYTES", "shape": [-1], "max_length": 4}])
    assert strings.check({"x": objects([b"abcd", b""])}) == 2
    with pytest.raises(InvalidInput, match="'x' has an element of 5 bytes, over its max_length of 4"):
        strings.check({"x": objects([b"abcde"])})
    numbers = _manifest([{"name": "x", "datatype": "INT32", "shape": [-1]}])
    with pytest.raises(InvalidInput, match="'x' has datatype BYTES, the model takes INT32"):
        numbers.check({"x": objects([b"1"])})
