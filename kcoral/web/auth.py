"""
Bearer tokens: who may make which requests of a service.

One mechanism for both kinds of token: the node token (node control routes
of a Router) and the client tokens (C{POST /v1/run} and C{GET /v1/nodes} of
a Router, a gateway or a standalone server). A L{TokenGuard} is the value a
route checks a request against; a L{TokensFile} holds the guard of a tokens
file and swaps in a new one when the file is read again (on SIGHUP).

A presented token is compared with every configured one, each time, in
constant time, and is never logged nor quoted in an answer.
"""

from __future__ import annotations

import hashlib
import re
import signal
from collections.abc import Callable, Iterable, Sequence
from hmac import compare_digest
from typing import Any

import attrs
from twisted.application import service
from twisted.logger import Logger
from zope.interface import Interface, implementer

from kcoral.errors import Unauthorized
from kcoral.web.responses import error_response

log = Logger()

#: The client token, where a flag does not give it (services and clients).
CLIENT_TOKEN_ENV = "KCORAL_CLIENT_TOKEN"

#: RFC 6750's C{b64token}: what a client token may hold. C{#} is not in it,
#: so a tokens file may end a line with a comment.
_CLIENT_TOKEN = re.compile(r"\A[A-Za-z0-9._~+/-]+=*\Z")

#: A tokens file is read on the reactor's thread, at start and on SIGHUP: a
#: local file this small is read in microseconds, where a thread would add a
#: reload that may finish after the next one. A larger file is refused.
MAX_TOKENS_FILE_BYTES = 64 * 1024


@attrs.frozen
class Routes:
    """What a guard guards, as its refusals say it: in the 401's message
    (C{plural}) and in the log line (C{one})."""

    plural: str
    one: str


CLIENT_ROUTES = Routes("runs and the node list", "a client request")
NODE_ROUTES = Routes("node control requests", "a control request")


class IGuard(Interface):
    """What a request must present to be served."""

    def admits(authorization: bytes | None) -> bool:
        """Whether an C{Authorization} value (None: absent) holds a token,
        logging nothing: for answers that only say less without one."""

    def refusal(request, subject: str) -> bytes | None:
        """
        None when C{request} may proceed; else its 401 answer (asking for a
        bearer token), after logging one line about C{subject} (a node id,
        a request id) that never holds what was presented.
        """

    def refused(authorization: bytes | None, subject: str) -> Unauthorized | None:
        """
        None when an C{Authorization} value (None: absent) may proceed; else
        the error to answer, after logging as L{refusal} does. For requests
        that are not HTTP ones (gRPC metadata) or answered in another form.
        """


def presented(values: Sequence[bytes] | None) -> bytes | None:
    """
    The C{Authorization} value of a request from all its lines (None:
    absent). Several lines are joined as HTTP joins a repeated field, into
    a list no guard admits: a proxy in front that reads one of them must
    never see one token where this service sees another.
    """
    return b", ".join(values) if values else None


def request_authorization(request) -> bytes | None:
    """The C{Authorization} value of an HTTP C{request}, as L{presented}."""
    return presented(request.requestHeaders.getRawHeaders(b"Authorization"))


def _digest(token: bytes) -> bytes:
    # Compared as digests, every comparison takes the same time whatever
    # the lengths, so not even a token's length leaks.
    return hashlib.sha256(token).digest()


def check_client_token(token: str, where: str) -> str:
    """C{token} when it may be sent as a bearer token; else a ValueError
    naming C{where}, never quoting the token."""
    if not _CLIENT_TOKEN.match(token):
        raise ValueError(f"{where} is not a bearer token: letters, digits and -._~+/ "
                         "(then = signs) only")
    return token


def authorization(token: str) -> str:
    """The C{Authorization} header a client sends with C{token}."""
    return "Bearer " + check_client_token(token, "the client token")


@implementer(IGuard)
@attrs.frozen
class TokenGuard:
    """
    The tokens the C{routes} take (C{digests}: their SHA-256). No tokens:
    the routes are open.
    """

    digests: tuple[bytes, ...]
    routes: Routes

    @classmethod
    def of(cls, tokens: Iterable[str], routes: Routes) -> TokenGuard:
        return cls(tuple(_digest(t.encode()) for t in tokens if t), routes)

    @property
    def open(self) -> bool:
        return not self.digests

    def admits(self, header: bytes | None) -> bool:
        """Whether an C{Authorization} header (None: absent) holds one of the
        tokens (the scheme C{Bearer} in any case)."""
        if self.open:
            return True
        scheme, _, presented = (header or b"").partition(b" ")
        presented = _digest(presented.strip())
        matched = False
        # Every token is compared, also after a match: how long this takes
        # says nothing about which token, if any, matched.
        for digest in self.digests:
            matched |= compare_digest(presented, digest)
        return matched and scheme.lower() == b"bearer"

    def refused(self, authorization: bytes | None, subject: str) -> Unauthorized | None:
        if self.admits(authorization):
            return None
        why = "no token" if not authorization else "a wrong token"
        log.warn("refused {request} for {subject} with {why}", request=self.routes.one,
                 subject=subject, why=why)
        return Unauthorized(f"{self.routes.plural} need a valid bearer token ({why} given)")

    def refusal(self, request, subject: str) -> bytes | None:
        error = self.refused(request_authorization(request), subject)
        if error is None:
            return None
        request.setHeader(b"WWW-Authenticate", b"Bearer")
        return error_response(request, error)


def read_tokens(path: str) -> list[str]:
    """
    The tokens of a tokens file: one a line; blank lines, and everything
    from a C{#} on, are left out. A ValueError (or OSError) says what is
    wrong, by line number, never quoting a line.
    """
    with open(path, "rb") as f:
        data = f.read(MAX_TOKENS_FILE_BYTES + 1)
    if len(data) > MAX_TOKENS_FILE_BYTES:
        raise ValueError(f"{path} is over {MAX_TOKENS_FILE_BYTES} bytes: not a tokens file")
    tokens = []
    for number, raw in enumerate(data.splitlines(), 1):
        line = raw.split(b"#", 1)[0].strip()
        if not line:
            continue
        tokens.append(check_client_token(line.decode("latin-1"), f"line {number} of {path}"))
    if not tokens:
        # An empty file must never mean "open": a truncated write would
        # let anyone in.
        raise ValueError(f"{path} holds no token")
    return tokens


@implementer(IGuard)
class TokensFile(service.Service):
    """
    The client tokens of a tokens file (and C{fixed} ones, from
    C{--client-token}), read again on SIGHUP while this service runs. A
    file that cannot be read again, or holds no token, keeps the tokens in
    force and logs why. Each of C{followers} is called as the file is read
    again: other processes that read the same file (a node's front
    processes) are told to.
    """

    def __init__(self, path: str, fixed: Iterable[str] = (), *, reactor):
        self.path = path
        self._fixed = tuple(fixed)
        self._reactor = reactor
        self._previous_handler: Any = None
        self.followers: list[Callable[[], object]] = []
        self.guard = self._read()

    def _read(self) -> TokenGuard:
        return TokenGuard.of([*self._fixed, *read_tokens(self.path)], CLIENT_ROUTES)

    def refusal(self, request, subject: str) -> bytes | None:
        return self.guard.refusal(request, subject)

    def refused(self, authorization: bytes | None, subject: str) -> Unauthorized | None:
        return self.guard.refused(authorization, subject)

    def admits(self, authorization: bytes | None) -> bool:
        return self.guard.admits(authorization)

    def reload(self) -> None:
        for follower in self.followers:
            follower()
        try:
            self.guard = self._read()
        except (OSError, ValueError) as e:
            log.error("kept the client tokens in force: cannot read {path} again: {why}",
                      path=self.path, why=getattr(e, "strerror", None) or e)
            return
        log.info("read the client tokens of {path} again: {count} in force", path=self.path,
                 count=len(self.guard.digests))

    def _hangup(self, signum, frame) -> None:
        # A signal arrives between any two bytecodes, maybe within the
        # reactor's own code: reload at the reactor's next turn instead.
        self._reactor.callFromThread(self.reload)

    def startService(self):
        super().startService()
        self._previous_handler = signal.signal(signal.SIGHUP, self._hangup)

    def stopService(self):
        signal.signal(signal.SIGHUP, self._previous_handler or signal.SIG_DFL)
        return super().stopService()


def client_guard(config, reactor) -> IGuard | None:
    """
    The client guard of a service with C{config} (its C{client_token} and
    C{client_tokens_file}): None when it has neither, and so serves anyone.
    A L{TokensFile} must run as a child of the service (L{watch}).
    """
    fixed = [check_client_token(config.client_token, "--client-token")] \
        if config.client_token else []
    if config.client_tokens_file:
        return TokensFile(config.client_tokens_file, fixed, reactor=reactor)
    if fixed:
        return TokenGuard.of(fixed, CLIENT_ROUTES)
    return None


def trusted(guard: IGuard | None, request) -> bool:
    """Whether C{request} may see what only clients may (worker URLs, the
    models, kept-array instance ids): where C{guard} is None (no client
    token is set), or it presents a token C{guard} admits."""
    return guard is None or guard.admits(request_authorization(request))


def watch(guard: IGuard | None, parent: service.MultiService) -> None:
    """Read C{guard}'s tokens file again on SIGHUP while C{parent} runs."""
    if isinstance(guard, TokensFile):
        guard.setServiceParent(parent)
