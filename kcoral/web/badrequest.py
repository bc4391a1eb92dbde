"""
KCoral's JSON 400, with its request id, in place of the bare one Twisted's
channel answers to HTTP it cannot parse.
"""

from __future__ import annotations

from kcoral.errors import BadRequest
from kcoral.web.channel import KCoralChannel
from kcoral.web.request import KCoralRequest
from kcoral.web.requestid import request_id_from
from kcoral.web.responses import raw_error_response
from kcoral.web.seams import BAD_REQUEST as TWISTED_BAD_REQUEST
from kcoral.web.seams import requests_of
from kcoral.web.sendnow import SendNow


class JSONBadRequest(SendNow):
    """
    The transport of a L{KCoralChannel}, which answers HTTP that Twisted
    cannot parse with KCoral's JSON 400 and its request id in place of
    Twisted's bare one: KCoral's errors are JSON with a request id, always.
    Its writes are sent at once (L{SendNow}).
    """

    wrappedProtocol: KCoralChannel

    def write(self, data):
        if data == TWISTED_BAD_REQUEST:
            channel = self.wrappedProtocol
            requests = requests_of(channel)
            request = requests[-1] if requests else None
            rid = request.request_id if isinstance(request, KCoralRequest) else request_id_from(None)
            channel.site.metrics.observe(b"other", 400, 0.0)
            data = raw_error_response(BadRequest("malformed HTTP request"), rid)
        super().write(data)
