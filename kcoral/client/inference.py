"""
The clients' side of an inference: a model's inputs by name, sent as the
inference protocol's binary tensors (no JSON lists of numbers), its outputs
read back the same way; a BYTES tensor is a numpy array of C{bytes}
(dtype object). The exchange (L{kcoral.client.exchange}) retries it
after 503s like a run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
from zope.interface import implementer

from kcoral.client.exchange import ICall, Response, Send
from kcoral.errors import BadRequest, ProgramFailed
from kcoral.models.manifest import NAME
from kcoral.protocol.strings import OBJECT, deserialize, serialize
from kcoral.protocol.tensors import BYTES, InvalidInput, datatype_of, dtype_of
from kcoral.protocol.wire import byte_view
from kcoral.tracing import current_traceparent
from kcoral.web.family import (
    INFERENCE_HEADER_LENGTH,
    MODEL_INFER,
    MODEL_LOAD,
    MODEL_STATISTICS,
    MODEL_UNLOAD,
    STATISTICS,
)

_CONTENT_TYPE = "application/octet-stream"
_HEADER_LENGTH = INFERENCE_HEADER_LENGTH.decode()


@implementer(ICall)
@attrs.define
class InferCall:
    """An inference of C{model} on C{inputs} (L{kcoral.client.exchange.ICall})."""

    model: str
    inputs: dict[str, np.ndarray]

    @classmethod
    def prepare(cls, model: str, inputs) -> InferCall:
        """C{inputs}: one array (a model's one input, C{input}) or a dict by name."""
        if not NAME.match(model):
            raise BadRequest(f"{model[:64]!r} is no model name: 1-64 of [A-Za-z0-9_.-]")
        named = inputs if isinstance(inputs, Mapping) else {"input": inputs}
        arrays = {}
        for name, value in named.items():
            # The protocol's binary tensors are little-endian and C-ordered.
            array = np.require(value, requirements="C")
            if array.dtype.byteorder == ">":
                array = array.astype(array.dtype.newbyteorder("<"))
            if array.dtype == OBJECT:
                if not all(isinstance(v, bytes) for v in array.reshape(-1)):
                    raise BadRequest(f"input {name!r}: an array of objects is a BYTES input, "
                                     "its every element bytes")
            else:
                try:
                    datatype_of(array.dtype)
                except ValueError as e:
                    raise BadRequest(f"input {name!r}: {e}") from None
            arrays[str(name)] = array
        return cls(model, arrays)

    @property
    def path(self) -> str:
        return MODEL_INFER.path(model=self.model)

    def send(self, referenced: set[str], request_id: str | None, redispatch: bool = False) -> Send:
        data = [serialize(a) if a.dtype == OBJECT else byte_view(a) for a in self.inputs.values()]
        header = json.dumps({
            "inputs": [{"name": name, "datatype": BYTES if a.dtype == OBJECT else datatype_of(a.dtype),
                        "shape": list(a.shape), "parameters": {"binary_data_size": len(d)}}
                       for (name, a), d in zip(self.inputs.items(), data)],
            "parameters": {"binary_data_output": True},
        }).encode()
        parts = [header, *data]
        headers = {"Content-Type": _CONTENT_TYPE, _HEADER_LENGTH: str(len(header))}
        if request_id:
            headers["X-Request-ID"] = request_id
        traceparent = current_traceparent()
        if traceparent:
            headers["traceparent"] = traceparent
        return Send(parts, sum(len(p) for p in parts), headers, self.path)

    def content_digests(self) -> set[str]:
        return set()

    def reference_first(self) -> set[str]:
        return set()

    def outputs(self, response: Response) -> dict[str, np.ndarray]:
        return outputs_of(response.body, response.header_length)

    def spare(self, error) -> bool:
        return False  # an inference names no kept arrays


def _named(name: str) -> str:
    if not NAME.match(name):
        raise BadRequest(f"{name[:64]!r} is no model name: 1-64 of [A-Za-z0-9_.-]")
    return name


def statistics_path(name: str | None) -> str:
    """The path of model C{name}'s statistics (None: every model's)."""
    return STATISTICS.path() if name is None else MODEL_STATISTICS.path(model=_named(name))


def control_path(name: str, verb: str) -> str:
    """The path that loads or unloads model C{name} (C{verb}: load, unload)."""
    return {"load": MODEL_LOAD, "unload": MODEL_UNLOAD}[verb].path(model=_named(name))


def outputs_of(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    """The outputs by name of an inference's answer (binary tensors after a
    JSON part of C{header_length} bytes, or JSON alone)."""
    try:
        header: Any = json.loads(body if header_length is None else body[:header_length])
        offset = len(body) if header_length is None else header_length
        outputs = {}
        for output in header["outputs"]:
            dtype, shape = dtype_of(output["datatype"]), tuple(output["shape"])
            size = (output.get("parameters") or {}).get("binary_data_size")
            if size is None:
                data = output["data"]
                if dtype == OBJECT:
                    data = [value.encode() for value in data]
                outputs[output["name"]] = np.asarray(data, dtype).reshape(shape)
                continue
            if dtype == OBJECT:
                array = deserialize(memoryview(body)[offset:offset + size], int(np.prod(shape)))
            else:
                array = np.frombuffer(body, dtype, int(np.prod(shape)), offset)
            outputs[output["name"]] = array.reshape(shape)
            offset += size
    except (ValueError, KeyError, TypeError, AttributeError, InvalidInput) as e:
        raise ProgramFailed(f"the server's inference answer could not be read: {e}") from None
    return outputs
