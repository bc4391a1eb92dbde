"""JSON answers and errors, the same from every KCoral service."""

from __future__ import annotations

import json
from collections.abc import Iterable

from twisted.web import http

from kcoral.errors import KCoralError, ServerBusy, error_body
from kcoral.web.family import flat_errors

#: Seconds a 503 asks the client to wait before retrying.
RETRY_AFTER_SECONDS = 1


def json_response(request, status: int, body: dict) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", b"application/json")
    return with_length(request, json.dumps(body).encode() + b"\n")


def with_length(request, body: bytes) -> bytes:
    """
    C{body}, with its C{Content-Length} set. Klein writes a handler's answer
    after render() returns, so without this Twisted frames every answer with
    chunked transfer encoding, which costs both ends time to write and parse.
    """
    request.setHeader(b"Content-Length", b"%d" % len(body))
    return body


def _document(error: KCoralError, request_id: str, path: bytes) -> dict:
    """The JSON of C{error} on C{path}: the message alone under an API family
    that answers so (L{kcoral.web.family.flat_errors}), else KCoral's error
    object. The request id is in the C{X-Request-ID} header either way."""
    if flat_errors(path):
        return {"error": error.message}
    return error_body(error, request_id)


def error_response(request, error: KCoralError) -> bytes:
    if isinstance(error, ServerBusy):
        request.setHeader(b"Retry-After", str(RETRY_AFTER_SECONDS).encode())
    return json_response(request, error.status or 500,
                         _document(error, request.request_id, request.path or b""))


def raw_response(status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> bytes:
    """A whole HTTP/1.1 response of C{status}, C{headers} and C{body}, for
    answers sent before Twisted's request machinery runs (a request refused
    from its head): the connection closes after it."""
    head = [b"HTTP/1.1 %d %s" % (status, http.RESPONSES[status])]
    head.extend(name + b": " + value for name, value in headers)
    head.append(b"Connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def raw_error_response(error: KCoralError, request_id: str, path: bytes = b"") -> bytes:
    """The whole HTTP/1.1 response (L{raw_response}) of C{error}, to a
    request for C{path}."""
    body = json.dumps(_document(error, request_id, path)).encode() + b"\n"
    return raw_response(error.status, [(b"Content-Type", b"application/json"),
                                       (b"Content-Length", b"%d" % len(body)),
                                       (b"X-Request-ID", request_id.encode())], body)
