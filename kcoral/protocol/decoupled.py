"""
A decoupled model's answers, as Triton's clients take them on gRPC's
ModelStreamInfer: a request gets several answers (none, one or more), each
a C{ModelInferResponse} with C{triton_final_response} false among its
parameters; then, where the request asked for it with
C{triton_enable_empty_final_response}, an answer with no outputs and
C{triton_final_response} true, which says that no more will come.

A server computes all of a request's answers in one execution, as outputs
with a first dimension of answers, and answers them as one inference
answer (L{DECOUPLED_ANSWERS} among its parameters, when it travels as
REST's from a worker to a front): the gRPC front that answers the stream
makes the answers of its rows here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from tritonclient.grpc import service_pb2

from kcoral.errors import BadRequest, ProgramFailed
from kcoral.protocol.strings import InvalidStrings, deserialize, serialize
from kcoral.protocol.tensors import BYTES, InvalidInput, dtype_of

#: The header in which a front that can answer a request several times (a
#: stream's) says so to the worker it forwards the request to.
DECOUPLED_HEADER = b"X-KCoral-Decoupled"
#: The parameter of an inference answer holding all the answers of a
#: decoupled model's request, one a row of its outputs.
DECOUPLED_ANSWERS = "kcoral_decoupled"
#: Triton's parameters: the request's, asking for an answer that ends its
#: answers; each answer's, saying whether it is the last.
EMPTY_FINAL = "triton_enable_empty_final_response"
FINAL = "triton_final_response"

#: What makes an answer its request's last: merged into a serialized
#: ModelInferResponse, appended (a message's fields may come in any order).
LAST = service_pb2.ModelInferResponse(
    parameters={FINAL: service_pb2.InferParameter(bool_param=True)}).SerializeToString()


def empty_final(parameters: Mapping[str, service_pb2.InferParameter]) -> bool:
    """Whether a request with C{parameters} asks for an answer that ends
    its answers; L{BadRequest} in Triton's words when it asks otherwise
    than with a bool."""
    value = parameters.get(EMPTY_FINAL)
    if value is None:
        return False
    if value.WhichOneof("parameter_choice") != "bool_param":
        raise BadRequest(f"invalid value type for '{EMPTY_FINAL}' parameter, expected bool_param.")
    return value.bool_param


def answers_of(response: service_pb2.ModelInferResponse, ended: bool) -> list[bytes]:
    """
    The serialized answers of C{response}, which holds all of a decoupled
    model's answers to one request, one a row of its outputs: answer i has
    row i of each output; with C{ended}, then the answer that ends them.
    L{ProgramFailed} when its outputs do not have the same number of rows,
    or their contents are not their shapes' (a decoupled model's outputs
    are not written to shared memory).
    """
    counts = {tuple(o.shape[:1]) for o in response.outputs}
    if len(counts) > 1 or () in counts or len(response.raw_output_contents) != len(response.outputs):
        raise ProgramFailed("a decoupled model's outputs must each have a row an answer, "
                            "the same number of rows")
    count = next(iter(counts))[0] if counts else 0
    rows = [_rows(output, data, count)
            for output, data in zip(response.outputs, response.raw_output_contents)]
    answers = []
    for i in range(count):
        answer = _header(response, last=False)
        for output, data in zip(response.outputs, rows):
            answer.outputs.add(name=output.name, datatype=output.datatype, shape=output.shape[1:])
            answer.raw_output_contents.append(data[i])
        answers.append(answer.SerializeToString())
    if ended:
        answers.append(_header(response, last=True).SerializeToString())
    return answers


def _header(response: service_pb2.ModelInferResponse, last: bool) -> service_pb2.ModelInferResponse:
    """An answer of C{response}'s request, with no outputs yet."""
    return service_pb2.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id,
        parameters={FINAL: service_pb2.InferParameter(bool_param=last)})


def _rows(output: service_pb2.ModelInferResponse.InferOutputTensor, data: bytes,
          count: int) -> list[bytes]:
    """The raw contents of each of the C{count} rows of C{output}, whose
    raw contents are C{data}."""
    elements = math.prod(output.shape[1:])
    if output.datatype != BYTES:
        try:
            size = dtype_of(output.datatype).itemsize * elements
        except InvalidInput as e:
            raise ProgramFailed(f"output {output.name!r}: {e}") from None
        if len(data) != size * count:
            raise ProgramFailed(f"output {output.name!r} holds {len(data)} bytes, not its "
                                f"{count} answers' {size} each (a decoupled model's outputs "
                                "are not written to shared memory)")
        return [data[i * size:(i + 1) * size] for i in range(count)]
    try:
        flat = deserialize(data, elements * count)
    except InvalidStrings as e:
        raise ProgramFailed(f"output {output.name!r}: {e} (a decoupled model's outputs are not "
                            "written to shared memory)") from None
    return [serialize(flat[i * elements:(i + 1) * elements]) for i in range(count)]
