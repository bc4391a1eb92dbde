"""
A request's sequence controls, as Triton's clients send them: the
C{sequence_id} (an unsigned 64-bit integer or a string), C{sequence_start}
and C{sequence_end} among a REST request's C{parameters}, or among a gRPC
request's typed C{parameters}.

Parsed once into a L{SequenceControls} wherever a request is read (a
front, a Router, a worker), so that every process agrees on which
sequence a request belongs to and what its correlation value is. Only a
model served with sequence batching acts on them; the others ignore them,
as Triton does.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

import attrs
from tritonclient.grpc import service_pb2

from kcoral.errors import BadRequest

#: The longest string sequence id taken.
MAX_ID_CHARS = 256
#: The largest integer sequence id: Triton's correlation ids are uint64.
MAX_ID = (1 << 64) - 1

#: The header in which a gateway or a Router names, to the worker it
#: forwards a step to, the client whose sequence it is (L{owner_of}): the
#: worker never sees a client's token, and keys its sequences by this.
OWNER_HEADER = b"X-KCoral-Sequence-Owner"

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_DECIMAL = re.compile(r"[0-9]{1,20}")


def fnv1a64(data: bytes) -> int:
    """The 64-bit FNV-1a hash of C{data}."""
    value = _FNV_OFFSET
    for byte in data:
        value = ((value ^ byte) * _FNV_PRIME) & MAX_ID
    return value


def owner_of(token: bytes | None) -> bytes | None:
    """How a front names the client that presented C{token} (None: none)
    to a worker: a digest, from which the token cannot be read back."""
    return None if token is None else hashlib.sha256(token).hexdigest().encode()


@attrs.frozen
class SequenceControls:
    """
    The sequence controls of one request.

    @ivar id: the sequence id as the client gave it, an C{int} or a C{str}
        (an integer and the string of its digits are different sequences,
        as for Triton); None where the request names none (no
        C{sequence_id}, or 0, or the empty string, which Triton reserves
        for requests outside any sequence).
    @ivar start: the request starts the sequence (ending a live one of the
        same id).
    @ivar end: the request ends the sequence, whose state is freed after it.
    """

    id: int | str | None
    start: bool = False
    end: bool = False

    @property
    def correlation(self) -> int:
        """
        The id as the model's CORRID control sees it, an unsigned 64-bit
        value: an integer id itself; a string id's decimal value where it
        is one (at most C{2**64 - 1}), else the FNV-1a hash of its UTF-8
        bytes; 0 where there is no id.
        """
        if self.id is None:
            return 0
        if isinstance(self.id, int):
            return self.id
        if _DECIMAL.fullmatch(self.id) and int(self.id) <= MAX_ID:
            return int(self.id)
        return fnv1a64(self.id.encode())

    def require(self, model: str, batch: int) -> None:
        """
        Refuse, in Triton's words (a L{BadRequest}), a request for a model
        with sequence batching that names no sequence, or whose batch is
        not of one row.
        """
        if self.id is None:
            raise BadRequest(f"inference request to model '{model}' must specify a non-zero or "
                             f"non-empty correlation ID")
        if batch != 1:
            raise BadRequest(f"inference request to model '{model}' must specify batch-size 1 "
                             f"due to requirements of sequence batcher")

    def not_started(self, model: str) -> BadRequest:
        """Triton's answer to a request, without C{start}, of a sequence
        that is not live (never started, ended, or freed when idle)."""
        return BadRequest(f"inference request for sequence {self.id!s:.{MAX_ID_CHARS}} to model "
                          f"'{model}' must specify the START flag on the first request of the "
                          f"sequence")

    def rest_parameters(self) -> dict:
        """The controls as a REST request's parameters carry them (none
        where the request names no sequence)."""
        if self.id is None:
            return {}
        return {"sequence_id": self.id, "sequence_start": self.start, "sequence_end": self.end}


#: A request that names no sequence.
NO_SEQUENCE = SequenceControls(None)


def controls_of_rest(parameters: Mapping[str, object]) -> SequenceControls:
    """The sequence controls among a REST request's C{parameters}; a
    L{BadRequest} says what is wrong with them."""
    return _controls(parameters.get("sequence_id"), parameters.get("sequence_start", False),
                     parameters.get("sequence_end", False))


def controls_of_grpc(parameters: Mapping[str, service_pb2.InferParameter]) -> SequenceControls:
    """The sequence controls among a gRPC request's C{parameters}; a
    L{BadRequest} says what is wrong with them."""
    return _controls(*(_grpc_value(parameters[name]) if name in parameters else default
                       for name, default in (("sequence_id", None), ("sequence_start", False),
                                             ("sequence_end", False))))


def _grpc_value(parameter: service_pb2.InferParameter) -> object:
    """The value an C{InferParameter} holds, whichever of its fields is set."""
    field = parameter.WhichOneof("parameter_choice")
    return None if field is None else getattr(parameter, field)


def _controls(sequence_id: object, start: object, end: object) -> SequenceControls:
    for name, flag in (("sequence_start", start), ("sequence_end", end)):
        if not isinstance(flag, bool):
            raise BadRequest(f"parameters.{name} must be true or false")
    if sequence_id is None or sequence_id == "" or (type(sequence_id) is int and sequence_id == 0):
        return SequenceControls(None, start=bool(start), end=bool(end))
    if isinstance(sequence_id, str):
        if len(sequence_id) > MAX_ID_CHARS:
            raise BadRequest(f"parameters.sequence_id: a string id has at most {MAX_ID_CHARS} "
                             f"characters")
        return SequenceControls(sequence_id, start=bool(start), end=bool(end))
    if type(sequence_id) is not int or not 0 < sequence_id <= MAX_ID:
        raise BadRequest("parameters.sequence_id must be an unsigned 64-bit integer or a string")
    return SequenceControls(sequence_id, start=bool(start), end=bool(end))
