"""
How large a request body may be and how slowly it may arrive: bounds that a
request checks while its body is still arriving, which C{twisted.web} itself
does not offer.
"""

from __future__ import annotations

import attrs

from kcoral.errors import KCoralError, PayloadTooLarge, RequestTimeout

#: A body must arrive at this average rate or better, counted from the end of
#: the head once this grace has passed: a client sending a byte every minute
#: (under the idle timeout) would otherwise hold its connection for as long
#: as a 256 MiB body takes at that pace. A slow link (1 Mbit/s) is far above.
MIN_BODY_BYTES_PER_SECOND = 1024
BODY_GRACE_SECONDS = 10.0


@attrs.frozen
class BodyBounds:
    """The most bytes a body may hold, and the least rate it must arrive at."""

    max_bytes: int
    min_bytes_per_second: int = MIN_BODY_BYTES_PER_SECOND
    grace_seconds: float = BODY_GRACE_SECONDS

    def refuse_length(self, length: int | None) -> KCoralError | None:
        """Why a body announcing C{length} bytes (None: chunked) is refused
        before it is read, or None."""
        if length is not None and length > self.max_bytes:
            return PayloadTooLarge(f"request body of {length} bytes exceeds the limit of "
                                   f"{self.max_bytes} bytes")
        return None

    def refuse_received(self, received: int, elapsed: float) -> KCoralError | None:
        """Why a body of which C{received} bytes arrived in C{elapsed}
        seconds since its head is refused now, or None."""
        if received > self.max_bytes:
            return PayloadTooLarge(f"request body exceeds the limit of {self.max_bytes} bytes")
        if elapsed > self.grace_seconds and received < self.min_bytes_per_second * elapsed:
            return RequestTimeout(f"request body arrives at {received / elapsed:.0f} bytes/s, "
                                  f"under the least of {self.min_bytes_per_second}")
        return None
