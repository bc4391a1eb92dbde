"""
L{Client}: the blocking client, on a plain keep-alive HTTP/1.1 connection
(L{kcoral.client.connection}).

A blocking client cannot use treq without running a reactor in a hidden
thread of the caller's process (and a reactor cannot be restarted); a
keep-alive socket needs no such machinery. L{AsyncClient} is the treq client
for code that already runs a reactor.
"""

from __future__ import annotations

import json
import os
import ssl
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import attrs
import numpy as np
from zope.interface import implementer

from kcoral.client.connection import Connection, ProtocolError
from kcoral.client.exchange import (
    ICall,
    Response,
    RunCall,
    Send,
    deletion_error,
    deletions,
    error_of,
    exchange,
)
from kcoral.client.failover import Failover, after_loss, moves_on, urls_of
from kcoral.client.inference import InferCall
from kcoral.client.progress import upload_bar
from kcoral.client.remote import IArrayOwner, RemoteArray, fetched, identity, path_of
from kcoral.errors import NodeFailure
from kcoral.program import Program
from kcoral.web.auth import CLIENT_TOKEN_ENV, authorization
from kcoral.web.family import INFERENCE_HEADER_LENGTH, REPOSITORY_INDEX


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def client_headers(token: str | None) -> dict[str, str]:
    """The headers that authenticate a client with C{token} (None: the
    environment's C{KCORAL_CLIENT_TOKEN}, if set)."""
    if token is None:
        token = os.environ.get(CLIENT_TOKEN_ENV) or None
    return {"Authorization": authorization(token)} if token else {}


@attrs.frozen
class Endpoint:
    """Where one URL of a client connects, and what it sends there."""

    url: str
    host: str
    port: int
    host_header: str
    prefix: str
    ssl_context: ssl.SSLContext | None

    @classmethod
    def parse(cls, url: str, ssl_context) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        if parts.scheme == "https" and ssl_context is None:
            ssl_context = ssl.create_default_context()
        return cls(url.rstrip("/"), parts.hostname,
                   parts.port or (443 if parts.scheme == "https" else 80),
                   parts.netloc.rpartition("@")[2], parts.path.rstrip("/"),
                   ssl_context if parts.scheme == "https" else None)


@implementer(IArrayOwner)
class Client:
    """
    A blocking client for a KCoral server or Router, or for several Routers
    (a list of URLs: it goes on with the next when one cannot be reached or
    answers 503 C{draining}). Keeps one keep-alive connection; calls from
    several threads are serialised. With C{redispatch}, each run says it may
    run twice (C{X-KCoral-Redispatch: true}): a Router that loses the node
    running it runs it again elsewhere instead of answering 502, and a
    connection to a Router lost after sending is not a C{NodeFailure} but
    sent again, to the next URL. C{token} is the client token sent with
    every request (default: C{KCORAL_CLIENT_TOKEN}); an C{ssl_context} with a
    certificate loaded (C{load_cert_chain}) presents it to a service that
    asks for one (C{--tls-client-ca}). With C{progress}, request bodies of
    64 MiB or more show a progress bar as they are sent.
    """

    def __init__(self, url: str | Sequence[str], *, busy_timeout: float = 60.0,
                 timeout: float | None = None, ssl_context=None, progress: bool = False,
                 token: str | None = None, redispatch: bool = False):
        self._failover = Failover([Endpoint.parse(u, ssl_context) for u in urls_of(url)])
        self.busy_timeout = busy_timeout
        self.timeout = timeout
        self.progress = progress
        self.redispatch = redispatch
        self._auth = client_headers(token)
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._held: set[str] = set()
        #: Bytes of request bodies sent, for callers that watch traffic.
        self.bytes_sent = 0

    @property
    def url(self) -> str:
        """The URL in use."""
        return self._failover.current.url

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (a later call opens a new one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self, timeout: float | None) -> Connection:
        conn = self._conn
        if conn is not None and conn.dropped():
            # The server closed this idle keep-alive connection (its idle
            # timeout, a restart): a request sent on it would be lost.
            self.close()
            conn = None
        if conn is None:
            endpoint = self._failover.current
            conn = self._conn = Connection(endpoint.host, endpoint.port,
                                           ssl_context=endpoint.ssl_context, timeout=timeout)
        conn.settimeout(timeout)
        return conn

    def _request(self, method: str, path: str, send: Send | None,
                 deadline: float | None) -> Response:
        """The answer of the first URL, the current one first, that neither
        could not be reached nor is draining (or, where all fail, the last)."""
        for tried, endpoint in enumerate(self._failover.round()):
            if tried:
                self.close()  # the connection was to the one before
            try:
                response = self._request_at(endpoint, method, path, send, deadline)
            except NodeFailure as e:
                response = after_loss(e, self.redispatch and send is not None and send.repeatable)
            if not moves_on(response):
                break
        return response

    def _request_at(self, endpoint: Endpoint, method: str, path: str, send: Send | None,
                    deadline: float | None, retried: bool = False) -> Response:
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        try:
            conn = self._connection(remaining)
        except TimeoutError:
            raise TimeoutError(f"could not connect to {self.url} within the client's timeout") from None
        except ssl.SSLError as e:
            raise NodeFailure(f"TLS with {self.url} failed: {e}") from None
        except OSError as e:
            # Nothing was sent: retried like a busy answer, within busy_timeout.
            return Response(None, problem=str(e))
        try:
            if send is None:
                answer = conn.request(method, endpoint.prefix + path, endpoint.host_header,
                                      self._auth)
            else:
                bar = upload_bar(send.length, self.url) if self.progress else None
                try:
                    answer = conn.request(method, endpoint.prefix + path, endpoint.host_header,
                                          {**send.headers, **self._auth}, send.parts, send.length,
                                          None if bar is None else bar.update)
                finally:
                    if bar is not None:
                        bar.close()
        except TimeoutError:
            self.close()
            raise TimeoutError(f"no answer from {self.url} within the client's timeout") from None
        except (ProtocolError, OSError) as e:
            self.close()
            if conn.answers and not conn.answering and not retried:
                # A reused keep-alive connection the server closed as we sent
                # on it (an idle close racing our request, as when a Router
                # stops): no byte of an answer came, so, as browsers do, send
                # it once more on a fresh connection.
                return self._request_at(endpoint, method, path, send, deadline, retried=True)
            raise NodeFailure(f"the connection to {self.url} failed: {e}") from None
        if send is not None:
            self.bytes_sent += send.length
        if answer.will_close:
            self.close()
        length = answer.header(INFERENCE_HEADER_LENGTH)
        return Response(answer.status, answer.body, _retry_after(answer.header(b"Retry-After")),
                        header_length=int(length) if length and length.isdigit() else None)

    def run(self, program: Program, *args, keep=False, free=None, request_id: str | None = None,
            **kwargs):
        """
        Run C{program} on C{args}; returns outputs in the structure it
        returns. With C{keep=True}, the outputs stay on the worker that ran
        it: L{kcoral.RemoteArray}s, which later runs take as inputs where
        they are; C{keep} may also be a prefix of the outputs' structure
        with a bool at each leaf (C{(False, True)}: the first output comes
        back, the second stays). C{free}, L{kcoral.RemoteArray}s or a
        structure of them (the state this run replaces), are freed on their
        worker in the same request, once the run succeeded.
        """
        return self._call(RunCall.prepare(program, args, kwargs, keep=keep, free=free, owner=self),
                          request_id)

    def put(self, array, *, request_id: str | None = None) -> RemoteArray:
        """Upload C{array} and keep it on a worker (a run of the identity program)."""
        import jax

        aval = jax.typeof(array)
        return self.run(identity(aval.shape, aval.dtype), array, keep=True, request_id=request_id)

    def fetch(self, array: RemoteArray):
        """The bytes of C{array}, copied back from its worker."""
        answer = self._simple("GET", path_of(array))
        if answer.status != 200:
            raise error_of(answer)
        return fetched(answer.body)

    def delete(self, *arrays: RemoteArray) -> None:
        """Free C{arrays} on their workers, one request for each worker;
        L{kcoral.errors.ArrayLost} naming those already gone (the others are freed)."""
        errors = [error_of(answer) for answer in
                  (self._simple("DELETE", send.path, send) for send in deletions(arrays))
                  if answer.status != 200]
        if errors:
            raise deletion_error(errors)

    def infer(self, model: str, inputs, *, request_id: str | None = None) -> dict[str, np.ndarray]:
        """
        The outputs by name of model C{model} (of the service's repository)
        for C{inputs}: one array (the model's one input) or a dict of arrays
        by input name.
        """
        return self._call(InferCall.prepare(model, inputs), request_id)

    def models(self) -> list[dict]:
        """The repository index: each model's name, version, state and reason."""
        answer = self._simple("POST", REPOSITORY_INDEX.label, Send([b"{}"], 2, {}))
        if answer.status != 200:
            raise error_of(answer)
        return json.loads(answer.body)

    def _simple(self, method: str, path: str, send: Send | None = None) -> Response:
        """The answer to one request, within the client's timeout."""
        with self._lock:
            return self._request(method, path, send,
                                 None if self.timeout is None else time.monotonic() + self.timeout)

    def _call(self, call: ICall, request_id: str | None):
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._lock:
            steps = exchange(call, self._held, busy_timeout=self.busy_timeout,
                             request_id=request_id, redispatch=self.redispatch)
            answer = None
            while True:
                try:
                    step = steps.send(answer)
                except StopIteration as done:
                    return done.value
                if isinstance(step, Send):
                    answer = self._request("POST", step.path, step, deadline)
                else:
                    if deadline is not None and time.monotonic() + step.seconds > deadline:
                        raise TimeoutError("the client's timeout passed while the server was busy")
                    time.sleep(step.seconds)
                    answer = None

    def health(self) -> dict:
        """The service's C{/health} document (also when it answers 503)."""
        answer = self._simple("GET", "/health")
        if answer.status is None:
            raise ConnectionError(f"could not reach {self.url}: {answer.problem}")
        return json.loads(answer.body)
