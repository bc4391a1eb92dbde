"""
A request's sequence controls (L{kcoral.protocol.sequence}) as tritonclient
sends them, REST and gRPC, and every hostile value refused in words.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import _utils as grpc_utils
from tritonclient.grpc import service_pb2

from kcoral.errors import BadRequest
from kcoral.protocol.sequence import (
    MAX_ID,
    MAX_ID_CHARS,
    NO_SEQUENCE,
    SequenceControls,
    controls_of_grpc,
    controls_of_rest,
    fnv1a64,
)

IDS = st.one_of(st.integers(1, (1 << 63) - 1), st.text(min_size=1, max_size=MAX_ID_CHARS))


def rest_parameters(**sequence) -> dict:
    """The request parameters tritonclient's HTTP client sends."""
    value = np.zeros((1, 1), np.int32)
    infer_input = httpclient.InferInput("INPUT", [1, 1], "INT32")
    infer_input.set_data_from_numpy(value, binary_data=False)
    body, _ = httpclient.InferenceServerClient.generate_request_body([infer_input], **sequence)
    return json.loads(body).get("parameters", {})


def grpc_parameters(sequence_id, start: bool, end: bool):
    """The request parameters tritonclient's gRPC client sends (the same
    typed fields it sets)."""
    request = service_pb2.ModelInferRequest()
    if isinstance(sequence_id, str):
        request.parameters["sequence_id"].string_param = sequence_id
    else:
        request.parameters["sequence_id"].int64_param = sequence_id
    request.parameters["sequence_start"].bool_param = start
    request.parameters["sequence_end"].bool_param = end
    return request.parameters


@given(IDS, st.booleans(), st.booleans())
def test_rest_as_tritonclient_sends_them(sequence_id, start, end):
    """The HTTP client's sequence_id, sequence_start and sequence_end are read as sent."""
    parameters = rest_parameters(sequence_id=sequence_id, sequence_start=start, sequence_end=end)
    assert controls_of_rest(parameters) == SequenceControls(sequence_id, start, end)


@given(IDS, st.booleans(), st.booleans())
def test_grpc_as_tritonclient_sends_them(sequence_id, start, end):
    """The gRPC client's typed parameters read as the REST ones, and the
    REST form of the controls reads back to the same value."""
    controls = controls_of_grpc(grpc_parameters(sequence_id, start, end))
    assert controls == SequenceControls(sequence_id, start, end)
    assert controls_of_rest(controls.rest_parameters()) == controls


def test_grpc_uint64_id():
    """An id in the uint64 field, past int64's range, is taken whole."""
    request = service_pb2.ModelInferRequest()
    request.parameters["sequence_id"].uint64_param = MAX_ID
    assert controls_of_grpc(request.parameters) == SequenceControls(MAX_ID)


def test_tritonclient_grpc_builds_the_same_parameters():
    """tritonclient's own gRPC request builder (the one its calls share)
    carries what L{grpc_parameters} makes, so the properties above hold
    for it."""
    infer_input = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    infer_input.set_data_from_numpy(np.zeros((1, 1), np.int32))
    request = grpc_utils._get_inference_request(
        model_name="m", inputs=[infer_input], model_version="", request_id="", outputs=None,
        sequence_id="abc", sequence_start=True, sequence_end=False, priority=0, timeout=None,
        parameters=None)
    assert request.parameters == grpc_parameters("abc", True, False)
    assert controls_of_grpc(request.parameters) == SequenceControls("abc", True, False)


@pytest.mark.parametrize("parameters", [{}, {"sequence_id": 0}, {"sequence_id": ""},
                                        {"sequence_id": 0, "sequence_start": True}])
def test_no_id(parameters):
    """No id, 0 or the empty string: the request names no sequence."""
    assert controls_of_rest(parameters).id is None
    assert controls_of_rest(parameters).correlation == 0
    assert NO_SEQUENCE.rest_parameters() == {}


@pytest.mark.parametrize("value", [-1, MAX_ID + 1, 1.5, True, [1], {"a": 1}])
def test_hostile_ids(value):
    """An id that is not an unsigned 64-bit integer or a string is refused in words."""
    with pytest.raises(BadRequest, match="sequence_id must be"):
        controls_of_rest({"sequence_id": value})


@given(st.one_of(st.integers(), st.floats(), st.none(), st.text(), st.lists(st.booleans())))
def test_hostile_flags(value):
    """A START or END flag that is not a boolean is refused, naming it."""
    for name in ("sequence_start", "sequence_end"):
        with pytest.raises(BadRequest, match=f"parameters.{name} must be true or false"):
            controls_of_rest({"sequence_id": 7, name: value})


def test_long_string_id():
    """A string id past the bound is refused in words."""
    with pytest.raises(BadRequest, match=f"at most {MAX_ID_CHARS}"):
        controls_of_rest({"sequence_id": "x" * (MAX_ID_CHARS + 1)})


@given(st.integers(0, MAX_ID))
def test_decimal_string_correlation(value):
    """A string id of decimal digits has their value as its correlation."""
    assert SequenceControls(str(value)).correlation == value


@given(st.text(min_size=1).filter(lambda s: not s.isascii() or not s.isdigit()))
def test_other_string_correlation(text):
    """Any other string id has the FNV-1a hash of its UTF-8 bytes."""
    assert SequenceControls(text).correlation == fnv1a64(text.encode())


def test_fnv1a64_known_values():
    """The hash is FNV-1a's 64-bit one (its published test values)."""
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8


def test_long_decimal_string_hashes():
    """Decimal digits past 64 bits are hashed, not wrapped."""
    digits = str(MAX_ID + 1)
    assert SequenceControls(digits).correlation == fnv1a64(digits.encode())


def test_require_in_tritons_words():
    """A sequence model refuses no id, and a batch over one, in Triton's words."""
    with pytest.raises(BadRequest, match="inference request to model 'm' must specify a "
                                         "non-zero or non-empty correlation ID"):
        NO_SEQUENCE.require("m", 1)
    with pytest.raises(BadRequest, match="must specify batch-size 1"):
        SequenceControls(5).require("m", 2)
    SequenceControls(5).require("m", 1)
    assert "must specify the START flag on the first request of the sequence" in str(
        SequenceControls("abc").not_started("m"))
