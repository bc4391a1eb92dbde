"""
A client's several URLs (Routers with the same pool behind them): it keeps
to one while it answers, and goes on with the next on a connection that
could not be made, or a 503 C{draining} (a Router on its way out). Any other
answer, a 503 for a full queue included, would be the same from every
Router, and is the client's to retry where it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from kcoral.client.exchange import Response
from kcoral.errors import NodeFailure, error_from_answer

T = TypeVar("T")


def urls_of(url_or_urls: str | Sequence[str]) -> list[str]:
    """The URLs a client was given: one, or a list (a comma list in one
    string too, as C{KCORAL_ROUTER_ENDPOINT} has it)."""
    given = [url_or_urls] if isinstance(url_or_urls, str) else list(url_or_urls)
    urls = [u.strip().rstrip("/") for text in given for u in text.split(",") if u.strip()]
    if not urls:
        raise ValueError("a client needs at least one URL")
    return urls


def moves_on(response: Response) -> bool:
    """Whether C{response} sends the client on to its next URL."""
    if response.status is None:
        return True
    return response.status == 503 and \
        error_from_answer(response.status, response.body).reason == "draining"


def after_loss(failure: NodeFailure, may_run_twice: bool) -> Response:
    """
    What a request lost after it was sent counts as: it may have run, so only
    a run allowed to run twice goes on (here to the next URL, where the last
    Router in reach is); anything else fails with C{failure}.
    """
    if not may_run_twice:
        raise failure
    return Response(None, problem=str(failure))


class Failover(Generic[T]):
    """The endpoints of a client, the one in use first."""

    def __init__(self, endpoints: Sequence[T]):
        self.endpoints = list(endpoints)
        self._current = 0

    @property
    def current(self) -> T:
        return self.endpoints[self._current]

    def round(self) -> Iterator[T]:
        """The current endpoint, then (each time the caller comes back for
        one) the others once each in turn, each becoming the current one."""
        yield self.current
        for _ in range(len(self.endpoints) - 1):
            self._current = (self._current + 1) % len(self.endpoints)
            yield self.current
