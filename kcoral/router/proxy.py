"""
The proxy: forwards one request of an API family (a C{POST /v1/run}, an
inference) to the same path on the member a lease names, with the headers
its family declares, with a treq client (in a service, over
L{kcoral.web.outgoing}'s persistent pool).

What a failure means depends on whether the node may have started the work:
a connection that could not be made, or a 503 from the node (its own queue,
or draining), means the request never ran and may go to another member
(L{NotSent}); a connection lost after the request was sent means it may have
run, and is a 502 that is never retried (L{NodeFailure}). A cancelled
forward (its client went away) is neither.
"""

from __future__ import annotations

from typing import cast

from cachetools import LRUCache
from hyperlink import EncodedURL
from twisted.internet import error as netError
from twisted.internet.defer import CancelledError, Deferred, inlineCallbacks
from twisted.logger import Logger
from twisted.web.client import RequestTransmissionFailed, ResponseFailed, ResponseNeverReceived
from twisted.web.http_headers import Headers

from kcoral.errors import KCoralError, NodeFailure, error_from_answer
from kcoral.protocol.wire import REQUEST_CONTENT_TYPE
from kcoral.router.call import Call
from kcoral.tracing import TRACEPARENT
from kcoral.web.body import IBody
from kcoral.web.outgoing import tls_problem

log = Logger()


class _RunURL(EncodedURL):
    """
    A member's URL of one path, parsed once. treq turns the URL of every
    request into text with C{to_uri().to_text()}, which IDNA-checks the host
    label by label: the largest part of treq's own work per forwarded run,
    and an error for an IPv6 literal (C{'::1'} is no IDNA label). A member
    URL is already an ASCII URI (the pool rebuilds it from checked parts), so
    this one is its own URI and keeps its text.
    """

    _text: str

    @classmethod
    def parse(cls, url: str) -> _RunURL:
        parsed = cast(_RunURL, cls.from_text(url))
        parsed._text = url if url.isascii() else EncodedURL.from_text(url).to_uri().to_text()
        return parsed

    def to_uri(self) -> EncodedURL:
        return self if hasattr(self, "_text") else super().to_uri()

    def to_text(self, with_password: bool = False) -> str:
        # A copy made by replace() has no text of its own.
        text = getattr(self, "_text", None)
        return text if text is not None else super().to_text(with_password)


#: Members' parsed URLs kept, the least recently used dropped first.
_MAX_URLS = 1024


class NotSent(Exception):
    """The member did not take the request; another member may. C{busy}:
    the member's own 503, where it answered one."""

    def __init__(self, why: str, busy: KCoralError | None = None):
        super().__init__(why)
        self.busy = busy


class Answer:
    __slots__ = ("body", "code", "headers")

    def __init__(self, code: int, headers: dict, body: bytes):
        self.code, self.headers, self.body = code, headers, body

    def missing(self) -> list[str]:
        """The digests a 409 says the member lacks (none for other answers)."""
        if self.code != 409:
            return []
        return getattr(error_from_answer(self.code, self.body), "missing", None) or []


class Proxy:
    """Forwards runs with C{client}, a treq C{HTTPClient} (or anything with
    its C{post}, such as C{treq.testing.StubTreq})."""

    def __init__(self, client):
        self._client = client
        self._urls: LRUCache = LRUCache(_MAX_URLS)

    def url_of(self, url: str, path: bytes) -> _RunURL:
        """The URL of C{path} (a path of an API family, which the Router
        has matched) on the member at C{url}, parsed once."""
        key = (url, path)
        parsed = self._urls.get(key)
        if parsed is None:
            parsed = self._urls[key] = _RunURL.parse(url + path.decode("ascii"))
        return parsed

    @inlineCallbacks
    def forward(self, url: str, call: Call, body: IBody, traceparent: bytes | None = None):
        """
        The L{Answer} of the member at C{url} to C{body} (sent afresh on each
        call: a spooled body is read again from its start), sent as C{call}
        says (and with C{traceparent}, the span of this forward, in place of
        the client's); fails with L{NotSent} or L{NodeFailure}.
        Cancelling it closes the request to the member (or stops reading its
        answer) and fails it with C{CancelledError}.
        """
        path, family = call.path, call.family
        headers = Headers({b"X-Request-ID": [call.request_id.encode()]})
        for name, value in call.headers:
            headers.setRawHeaders(name, [value])
        if traceparent is not None:
            headers.setRawHeaders(TRACEPARENT, [traceparent])
        if not headers.hasHeader(b"Content-Type"):
            headers.setRawHeaders(b"Content-Type", [REQUEST_CONTENT_TYPE.encode()])
        try:
            # A node's answer goes back as it is: never follow a redirect with
            # a program (and the body is read once, right here: no buffering).
            response = yield _cancelled_as_such(self._client.request(
                call.method.decode("ascii"), self.url_of(url, path), data=body.send(), headers=headers,
                allow_redirects=False, unbuffered=True))
            content = yield _cancelled_as_such(response.content())
        except CancelledError:
            raise
        except Exception as e:
            problem = _failure(e, url)
            if problem is e:
                raise
            raise problem from e
        if response.code == 503:
            busy = error_from_answer(response.code, content)
            raise NotSent(f"{url} turned it away with 503 {busy.reason or busy.message}", busy)
        returned = {name: response.headers.getRawHeaders(name)[0]
                    for name in family.returned if response.headers.hasHeader(name)}
        return Answer(response.code, returned, content)


def _cancelled_as_such(d: Deferred) -> Deferred:
    """
    C{d}, which fails with C{CancelledError} when cancelled, whatever C{d}
    itself then fails with: Twisted's HTTP client reports a request it was
    told to cancel as the connection it aborted (a failed response), which
    would otherwise read as a node lost after the request was sent.
    """

    def cancel(outer: Deferred) -> None:
        outer.errback(CancelledError())
        d.cancel()

    outer: Deferred = Deferred(cancel)

    def settle(result) -> None:
        # Once cancelled, whatever the request ends with goes nowhere.
        if not outer.called:
            outer.callback(result)  # a Failure errbacks

    d.addBoth(settle)
    return outer


def _failure(e: Exception, url: str) -> Exception:
    """What a failed forward means: not sent (another member may take it),
    a node failure (it may have run: a 502), or an error of our own."""
    if isinstance(e, netError.ConnectError):
        return NotSent(f"could not connect to {url}: {e.__class__.__name__}")
    if isinstance(e, (ResponseNeverReceived, RequestTransmissionFailed)):
        # A refused certificate (untrusted CA, or service-identity's host
        # check, which fails with VerificationError rather than SSL.Error)
        # ends the handshake before any byte of the request: not sent. With
        # a body to write, Twisted reports it as a failed transmission.
        tls = tls_problem(e)
        if tls is not None:
            log.error("TLS with {url} failed, the request was not sent: {why}", url=url, why=tls)
            return NotSent(f"TLS with {url} failed: {tls}")
    if isinstance(e, (ResponseNeverReceived, RequestTransmissionFailed, ResponseFailed,
                      netError.ConnectionLost)):
        return NodeFailure(f"lost the connection to the node at {url} after the request "
                           f"was sent; it may have run")
    return e
