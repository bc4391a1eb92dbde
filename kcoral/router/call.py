"""
A request as a Router forwards it: what its forwarder and its proxy read
of a client's request (or of a batch of inferences), taken once, when the
Router's handler has matched its route.
"""

from __future__ import annotations

import attrs

from kcoral.protocol.wire import REDISPATCH_HEADER
from kcoral.web.family import Family

_REDISPATCH = REDISPATCH_HEADER.encode()


@attrs.frozen
class Call:
    """
    A request of C{family} to C{path} (a canonical path of its routes),
    sent to a member with C{method}, its request id and C{headers} (names
    and values: those the family forwards, one value each); C{redispatch}:
    its client consents to its run being run again after the loss of its
    node.
    """

    family: Family
    path: bytes
    request_id: str
    headers: tuple[tuple[bytes, bytes], ...]
    method: bytes = b"POST"
    redispatch: bool = False

    @classmethod
    def of(cls, request, family: Family) -> Call:
        """The call that forwards C{request}, of C{family}, as it came."""
        raw = request.requestHeaders
        # Pairs, not a Headers: a copy of one costs more than a run's
        # whole lookup of them, and the proxy builds its own per attempt.
        headers = tuple([(name, values[0]) for name in family.forwarded
                         if (values := raw.getRawHeaders(name))])
        consents = raw.getRawHeaders(_REDISPATCH)
        return cls(family, request.path, request.request_id, headers, request.method,
                   bool(consents) and consents[0].strip().lower() == b"true")
