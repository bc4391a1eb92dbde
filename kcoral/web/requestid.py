"""Request ids: taken from C{X-Request-ID} when sane, else generated."""

from __future__ import annotations

import itertools
import re
import secrets

from twisted.web.resource import Resource

from kcoral.errors import BadRequest
from kcoral.web.responses import error_response

HEADER = b"X-Request-ID"
#: The longest request id taken from a client.
_LONGEST = 128
_SANE = re.compile(rb"\A[A-Za-z0-9._:-]{1,%d}\Z" % _LONGEST)


#: What every id this process makes starts with: 16 random hex digits,
#: drawn once, so that ids are unique across processes and their restarts.
_PROCESS = secrets.token_hex(8)
#: The ids this process has made: each one's 16 hex digits after the prefix.
_made = itertools.count()


def request_id_from(value: bytes | None) -> str:
    if value is not None and _SANE.match(value):
        return value.decode("ascii")
    # 32 hex digits, as a version-4 UUID's, made without drawing random
    # bytes for each request: a request id names a request in logs and
    # answers, it admits to nothing, so unique is all it must be.
    return f"{_PROCESS}{next(_made):016x}"


def numbered(request_id: str, index: int) -> str:
    """The id of request C{index} of those made under C{request_id} (the
    messages of one gRPC stream): that id, a dot and the index, the id cut
    short where the two would be longer than an id may be."""
    suffix = f".{index}"
    return request_id[:_LONGEST - len(suffix)] + suffix


class RequestIdResource(Resource):
    """
    Gives every request a request id and every response its C{X-Request-ID},
    under any C{Site}: L{kcoral.web.site.KCoralSite} assigns them as a request
    arrives (also for answers it sends itself, such as 413), and this wrapper
    makes a service's resource tree keep that promise on its own, e.g. under
    C{treq.testing.StubTreq} or a plain C{twisted.web.server.Site}.
    """

    isLeaf = True

    def __init__(self, wrapped):
        super().__init__()
        self._wrapped = wrapped

    def render(self, request):
        rid = getattr(request, "request_id", None)
        if rid is None:
            rid = request_id_from(request.requestHeaders.getRawHeaders(HEADER, [None])[0])
            request.request_id = rid
        request.setHeader(HEADER, rid.encode("ascii"))
        if _decodable(request):
            body = self._wrapped.render(request)
        else:
            # Klein answers a path or Host that is not UTF-8 with an HTML 400
            # (and logs a traceback for each one): answer in JSON, as always.
            body = error_response(request, BadRequest("the request's path or Host header is not UTF-8"))
        if request.method == b"HEAD" and isinstance(body, bytes) and body:
            # Twisted leaves a HEAD's body out, but logs a line for each
            # one it drops: a client could fill the log with HEADs.
            request.setHeader(b"Content-Length", b"%d" % len(body))
            return b""
        return body


def _decodable(request) -> bool:
    """Whether Klein can decode the request's URL parts (its C{extractURLparts})."""
    try:
        request.getRequestHostname().decode("utf-8")
        for segment in list(request.prepath or ()) + list(request.postpath or ()):
            segment.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
