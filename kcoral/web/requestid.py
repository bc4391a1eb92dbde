"""Request ids: taken from C{X-Request-ID} when sane, else generated."""

from __future__ import annotations

import re
import uuid

HEADER = b"X-Request-ID"
_SANE = re.compile(rb"\A[A-Za-z0-9._:-]{1,128}\Z")


def request_id_from(value: bytes | None) -> str:
    if value is not None and _SANE.match(value):
        return value.decode("ascii")
    return uuid.uuid4().hex
