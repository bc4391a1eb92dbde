"""
An inference's message as the front that received it holds it: a REST body,
or a parsed gRPC message. A server reads the inputs from either and answers
in the message's own form; a front that forwards it (a gateway, a Router)
sends its REST form on, and answers in REST's. So a gRPC inference that a
server answers is read once, from its message into arrays, and answered
once, from the arrays into its answer, with no REST body made in between.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np
from tritonclient.grpc import service_pb2
from twisted.internet.defer import Deferred, fail, succeed
from zope.interface import Attribute, Interface, implementer

from kcoral.common.offreactor import off_reactor
from kcoral.protocol.decoupled import DECOUPLED_ANSWERS
from kcoral.protocol.inference import (
    InferAnswer,
    InferRequest,
    encode_infer,
    grpc_infer_answer,
    parse_infer,
    request_of_grpc_infer,
    rest_of_grpc_infer,
    sequence_of_infer,
)
from kcoral.protocol.sequence import SequenceControls, controls_of_grpc

__all__ = ["GrpcAnswer", "GrpcMessage", "IInferMessage", "RestMessage"]


class IInferMessage(Interface):
    """An inference's message, in the form it arrived in."""

    size = Attribute("How many bytes it arrived as.")

    def request() -> InferRequest:
        """Its inputs, and the outputs it asks for (L{BadRequest}: what is wrong)."""

    def rest() -> RestMessage:
        """Its REST form, to forward."""

    def rest_formed() -> Deferred[RestMessage]:
        """Its REST form, made off the reactor when it is large."""

    def sequence() -> Deferred[SequenceControls]:
        """The sequence it names, read off the reactor when it is large
        (L{BadRequest}: what is wrong with its controls)."""

    def answer(model_name: str, model_version: str, request: InferRequest,
               outputs: Mapping[str, np.ndarray], decoupled: bool = False
               ) -> InferAnswer | GrpcAnswer:
        """The answer to C{request} with C{outputs}, in this message's form;
        C{decoupled}: the answers of a decoupled model, one a row of the
        outputs, as one (L{kcoral.protocol.decoupled})."""


@implementer(IInferMessage)
@attrs.frozen
class RestMessage:
    """A REST body: its JSON header, then binary tensors when
    C{header_length} (its C{Inference-Header-Content-Length}) is set."""

    body: bytes | memoryview
    header_length: int | None

    @property
    def size(self) -> int:
        return len(self.body)

    def request(self) -> InferRequest:
        return parse_infer(self.body, self.header_length)

    def rest(self) -> RestMessage:
        return self

    def rest_formed(self) -> Deferred[RestMessage]:
        return succeed(self)

    def sequence(self) -> Deferred[SequenceControls]:
        # Only the JSON header is read, which holds every tensor where the
        # body has no binary part.
        size = len(self.body) if self.header_length is None else self.header_length
        return off_reactor(size, sequence_of_infer, self.body, self.header_length)

    def answer(self, model_name: str, model_version: str, request: InferRequest,
               outputs: Mapping[str, np.ndarray], decoupled: bool = False) -> InferAnswer:
        return encode_infer(model_name, model_version, request, outputs,
                            {DECOUPLED_ANSWERS: True} if decoupled else None)


@attrs.frozen
class GrpcAnswer:
    """A serialized C{ModelInferResponse}; C{decoupled}: a decoupled
    model's answers, one a row of its outputs."""

    message: bytes
    decoupled: bool = False


@implementer(IInferMessage)
@attrs.frozen
class GrpcMessage:
    """A C{ModelInferRequest}, parsed from its C{size} bytes."""

    message: service_pb2.ModelInferRequest
    size: int

    def request(self) -> InferRequest:
        return request_of_grpc_infer(self.message)

    def rest(self) -> RestMessage:
        rest = rest_of_grpc_infer(self.message)
        return RestMessage(rest.body, rest.header_length)

    def rest_formed(self) -> Deferred[RestMessage]:
        return off_reactor(self.size, self.rest)

    def sequence(self) -> Deferred[SequenceControls]:
        try:
            return succeed(controls_of_grpc(self.message.parameters))
        except Exception:
            return fail()

    def answer(self, model_name: str, model_version: str, request: InferRequest,
               outputs: Mapping[str, np.ndarray], decoupled: bool = False) -> GrpcAnswer:
        return GrpcAnswer(grpc_infer_answer(model_name, model_version, request, outputs), decoupled)
