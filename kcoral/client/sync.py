"""
L{Client}: the blocking client, on a plain keep-alive HTTP/1.1 connection
(L{kcoral.client.connection}).

A blocking client cannot use treq without running a reactor in a hidden
thread of the caller's process (and a reactor cannot be restarted); a
keep-alive socket needs no such machinery. L{AsyncClient} is the treq client
for code that already runs a reactor.
"""

from __future__ import annotations

import errno
import json
import os
import ssl
import threading
import time
import weakref
from collections.abc import Sequence
from urllib.parse import urlsplit

import attrs
import numpy as np
from twisted.logger import Logger
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
from kcoral.client.inference import InferCall, control_path, statistics_path
from kcoral.client.owned import FREE_AFTER_SECONDS, STOP, Owned, forgotten
from kcoral.client.progress import upload_bar
from kcoral.client.remote import IArrayOwner, RemoteArray, fetched, keeper, path_of
from kcoral.errors import KCoralError, NodeFailure
from kcoral.program import Program
from kcoral.web.auth import CLIENT_TOKEN_ENV, authorization
from kcoral.web.family import INFERENCE_HEADER_LENGTH, REPOSITORY_INDEX

log = Logger()

#: Default of C{Client(connect_timeout=...)}: seconds to make a connection.
CONNECT_TIMEOUT = 5.0


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
    64 MiB or more show a progress bar as they are sent. The arrays it keeps
    are freed once nothing refers to them, and when it closes, unless
    C{keep_on_close}. A URL whose connection (with its TLS handshake) is not
    made within C{connect_timeout} seconds counts as one that cannot be
    reached: a silent host answers no connection attempt, and the kernel
    would try for two minutes.
    """

    def __init__(self, url: str | Sequence[str], *, busy_timeout: float = 60.0,
                 timeout: float | None = None, ssl_context=None, progress: bool = False,
                 token: str | None = None, redispatch: bool = False,
                 keep_on_close: bool = False, connect_timeout: float = CONNECT_TIMEOUT):
        self._failover = Failover([Endpoint.parse(u, ssl_context) for u in urls_of(url)])
        self.busy_timeout = busy_timeout
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.progress = progress
        self.redispatch = redispatch
        self._auth = client_headers(token)
        self._conn: Connection | None = None
        # Reentrant: a run holds it from the orphans it takes to the
        # arrays it made, around the exchange that holds it too.
        self._lock = threading.RLock()
        self._held: set[str] = set()
        self.keep_on_close = keep_on_close
        self._owned = Owned()
        #: The thread that frees the arrays no longer referenced, once there are some.
        self._freer: threading.Thread | None = None
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
        """Free the arrays it kept (unless made with C{keep_on_close}: they
        stay, until deleted or idle) and close the connection. A later call
        opens a new one."""
        with self._lock:
            held = self._owned.everything()
            if held and not self.keep_on_close:
                try:
                    self._free(held)
                except (KCoralError, OSError) as e:
                    log.warn("could not free {count} kept array(s) on closing: {why}",
                             count=len(held), why=e)
            if self._freer is not None:
                self._owned.orphaned.put(STOP)
                self._freer = None
            self._disconnect()

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self, timeout: float | None, connect_timeout: float) -> Connection:
        conn = self._conn
        if conn is not None and conn.dropped():
            # The server closed this idle keep-alive connection (its idle
            # timeout, a restart): a request sent on it would be lost.
            self._disconnect()
            conn = None
        if conn is None:
            endpoint = self._failover.current
            conn = self._conn = Connection(endpoint.host, endpoint.port,
                                           ssl_context=endpoint.ssl_context,
                                           timeout=connect_timeout)
        conn.settimeout(timeout)
        return conn

    def _request(self, method: str, path: str, send: Send | None,
                 deadline: float | None) -> Response:
        """The answer of the first URL, the current one first, that neither
        could not be reached nor is draining (or, where all fail, the last)."""
        for tried, endpoint in enumerate(self._failover.round()):
            if tried:
                self._disconnect()  # the connection was to the one before
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
        connect_timeout = self.connect_timeout if remaining is None else \
            min(remaining, self.connect_timeout)
        try:
            conn = self._connection(remaining, connect_timeout)
        except TimeoutError:
            if connect_timeout == remaining:
                raise TimeoutError(f"could not connect to {self.url} within the client's "
                                   f"timeout") from None
            # Nothing was sent: the next URL, or a retry within busy_timeout.
            return Response(None, problem=f"no connection to {self.url} within "
                                          f"{self.connect_timeout:g} s")
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
        except TimeoutError as e:
            self._disconnect()
            if e.errno == errno.ETIMEDOUT:
                # The kernel's keepalive probes went unanswered: the Router
                # (or the link to it) went silent after the request was sent.
                # Not the idle race below: it may have run.
                raise NodeFailure(f"the connection to {self.url} went silent: no answer to "
                                  f"TCP keepalive probes") from None
            raise TimeoutError(f"no answer from {self.url} within the client's timeout") from None
        except (ProtocolError, OSError) as e:
            self._disconnect()
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
            self._disconnect()
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
        worker in the same request, once the run succeeded. A run that keeps
        outputs and takes no kept array keeps them beside the arrays this
        client holds, while that worker has room.
        """
        call = RunCall.prepare(program, args, kwargs, keep=keep, free=free, owner=self)
        with self._lock:
            self._owned.sending(call)
            try:
                outputs = self._call(call, request_id)
            except BaseException as e:
                self._owned.failed(call, e)
                raise
            self._owned.ran(call, outputs)
            forgotten(free, self)
            if any(call.keep) and self._freer is None:
                self._freer = threading.Thread(target=_freeing, name="kcoral-client-frees",
                                               args=(self._owned, weakref.ref(self)), daemon=True)
                self._freer.start()
        return outputs

    def put(self, tree, *, near: RemoteArray | None = None, request_id: str | None = None):
        """
        Upload C{tree}, an array or any pytree of them, and keep it all on
        one worker, in one request: L{kcoral.RemoteArray}s in its
        structure. Beside C{near} where given (or L{kcoral.errors.KeptMemoryFull},
        L{kcoral.errors.ArrayLost}); else beside the arrays this client
        holds while that worker has room for it (where it has not, or is
        gone, on any worker).
        """
        program, args = keeper(tree, near)
        return self.run(program, *args, keep=True, request_id=request_id)

    def fetch(self, array: RemoteArray):
        """The bytes of C{array}, copied back from its worker."""
        answer = self._simple("GET", path_of(array))
        if answer.status != 200:
            raise error_of(answer)
        return fetched(answer.body)

    def delete(self, *arrays: RemoteArray) -> None:
        """Free C{arrays} on their workers, one request for each worker;
        L{kcoral.errors.ArrayLost} naming those already gone (the others are freed)."""
        forgotten(arrays, self)
        ids = [array.id for array in arrays]
        with self._lock:
            self._free(ids, strict=True)

    def forget(self, *arrays: RemoteArray) -> None:
        """C{arrays} were freed through another client: not this one's to free."""
        self._owned.released(array.id for array in arrays)

    def _free(self, ids: list[str], strict: bool = False) -> None:
        """Free C{ids} on their workers, and the orphans with them: one
        request for each worker. With C{strict}, the error of those of
        C{ids} that were gone, or of another refusal."""
        self._owned.released(ids)
        orphans = self._owned.orphans(most=None)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        errors = []
        for send in deletions([*ids, *orphans]):
            answer = self._request("DELETE", send.path, send, deadline)
            if answer.status != 200:
                errors.append(error_of(answer))
        failure = deletion_error(errors, spared=orphans)
        if strict and failure is not None:
            raise failure

    def infer(self, model: str, inputs, *, request_id: str | None = None) -> dict[str, np.ndarray]:
        """
        The outputs by name of model C{model} (of the service's repository)
        for C{inputs}: one array (the model's one input) or a dict of arrays
        by input name.
        """
        return self._call(InferCall.prepare(model, inputs), request_id)

    def load_model(self, name: str) -> dict:
        """
        Load model C{name} (again) from the service's repository, on every
        worker behind it; returns once all are done, with the model's states
        (C{{"models": [...]}}), or raises with each worker's reason. The
        service must run with C{--model-control-mode explicit}.
        """
        return self._control(name, "load")

    def unload_model(self, name: str) -> dict:
        """Stop serving model C{name} on every worker, as L{load_model}."""
        return self._control(name, "unload")

    def _control(self, name: str, verb: str) -> dict:
        answer = self._simple("POST", control_path(name, verb), Send([b"{}"], 2, {}))
        if answer.status != 200:
            raise error_of(answer)
        return json.loads(answer.body)

    def model_statistics(self, name: str | None = None) -> dict:
        """
        The statistics of model C{name} (None: of every ready model), as
        Triton's statistics extension gives them: C{{"model_stats": [...]}},
        summed over the workers behind a gateway or a Router.
        """
        answer = self._simple("GET", statistics_path(name))
        if answer.status != 200:
            raise error_of(answer)
        return json.loads(answer.body)

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

    def _free_orphans(self) -> None:
        """Free the arrays no longer referenced that no request took along."""
        with self._lock:
            try:
                self._free([])
            except (KCoralError, OSError, TimeoutError) as e:
                log.warn("could not free kept arrays no longer referenced: {why}", why=e)

    def health(self) -> dict:
        """The service's C{/health} document (also when it answers 503)."""
        answer = self._simple("GET", "/health")
        if answer.status is None:
            raise ConnectionError(f"could not reach {self.url}: {answer.problem}")
        return json.loads(answer.body)


def _freeing(owned: Owned, client: weakref.ref) -> None:
    """
    The body of a client's freeing thread: once an array's last reference
    goes, give the client's next request L{FREE_AFTER_SECONDS} to free it in
    passing, then free what is left. It ends when the client closes (or is
    gone): it holds no reference to the client meanwhile.
    """
    while owned.wait():
        time.sleep(FREE_AFTER_SECONDS)
        alive = client()
        if alive is None:
            return
        alive._free_orphans()
        del alive
