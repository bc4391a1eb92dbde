"""
L{AsyncClient}: the same client as L{kcoral.Client}, on treq; every method
returns a Deferred. Hashing and framing large inputs run in a thread, so the
caller's reactor never blocks on them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from io import BytesIO

import treq
from twisted.internet import error as netError
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.task import LoopingCall, deferLater
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.web.client import (
    Agent,
    FileBodyProducer,
    HTTPConnectionPool,
    ResponseFailed,
    ResponseNeverReceived,
)
from zope.interface import implementer

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
from kcoral.client.owned import FREE_AFTER_SECONDS, Owned, forgotten
from kcoral.client.progress import CountingProducer, upload_bar
from kcoral.client.remote import IArrayOwner, RemoteArray, fetched, keeper, path_of
from kcoral.client.sync import _retry_after, client_headers
from kcoral.errors import KCoralError, NodeFailure
from kcoral.web.family import INFERENCE_HEADER_LENGTH, REPOSITORY_INDEX
from kcoral.web.outgoing import tls_policy

log = Logger()

#: Inputs larger than this are prepared in a thread.
_THREAD_BYTES = 1 << 20


@implementer(IArrayOwner)
class AsyncClient:
    """
    The client of L{kcoral.Client} on treq, for programs that run a Twisted
    reactor: every method returns a Deferred. C{busy_timeout} and C{timeout}
    and C{redispatch}, one URL or several, C{token} and C{progress}, mean
    what they mean there; C{pool} is the treq connection pool to use (by
    default one of its own, kept alive between runs). Over https the service
    is verified against the CAs of C{tls_ca} (default: the platform's roots);
    C{tls_client_cert} (a PEM chain) and C{tls_client_key} (default: inside
    it) are presented to a service that asks for a certificate
    (C{--tls-client-ca}). The arrays it keeps are freed once nothing refers
    to them, and when it closes, unless C{keep_on_close}.
    """

    def __init__(self, url: str | Sequence[str], *, busy_timeout: float = 60.0,
                 timeout: float | None = None, reactor=None,
                 pool: HTTPConnectionPool | None = None, progress: bool = False,
                 token: str | None = None, tls_ca: str | None = None,
                 tls_client_cert: str | None = None, tls_client_key: str | None = None,
                 redispatch: bool = False, keep_on_close: bool = False):
        if reactor is None:
            from twisted.internet import reactor
        self._failover = Failover(urls_of(url))
        self.redispatch = redispatch
        self.busy_timeout = busy_timeout
        self.timeout = timeout
        self.progress = progress
        self._reactor = reactor
        self._pool = pool if pool is not None else HTTPConnectionPool(reactor, persistent=True)
        self._agent = Agent(reactor, contextFactory=tls_policy(tls_ca, tls_client_cert, tls_client_key),
                            pool=self._pool)
        self._held: set[str] = set()
        self._auth: dict[bytes | str, list[bytes | str]] = {
            name: [value] for name, value in client_headers(token).items()}
        self.bytes_sent = 0
        self.keep_on_close = keep_on_close
        self._owned = Owned()
        #: Frees the arrays no longer referenced that no run took along.
        self._freeing = LoopingCall(self._free_orphans)
        self._freeing.clock = reactor

    @property
    def url(self) -> str:
        """The URL in use."""
        return self._failover.current

    @inlineCallbacks
    def close(self):
        """A Deferred that fires once the arrays it kept are freed (unless
        made with C{keep_on_close}: they stay, until deleted or idle) and
        its idle connections closed."""
        if self._freeing.running:
            self._freeing.stop()
        held = self._owned.everything()
        if held and not self.keep_on_close:
            try:
                yield self._free(held)
            except (KCoralError, OSError) as e:
                log.warn("could not free {count} kept array(s) on closing: {why}",
                         count=len(held), why=e)
        yield self._pool.closeCachedConnections()

    @inlineCallbacks
    def _request(self, method: str, path: str, send: Send | None):
        """The answer of the first URL, the current one first, that neither
        could not be reached nor is draining (or, where all fail, the last)."""
        for url in self._failover.round():
            try:
                response = yield self._request_at(url, method, path, send)
            except NodeFailure as e:
                response = after_loss(e, self.redispatch and send is not None and send.repeatable)
            if not moves_on(response):
                break
        return response

    @inlineCallbacks
    def _request_at(self, url: str, method: str, path: str, send: Send | None):
        body = None
        headers: dict[bytes | str, list[bytes | str]] = dict(self._auth)
        bar = None
        if send is not None:
            body = b"".join(send.parts) if send.length < _THREAD_BYTES else \
                (yield deferToThread(b"".join, send.parts))
            headers.update({k: [v] for k, v in send.headers.items()})
            bar = upload_bar(send.length, url) if self.progress else None
            if bar is not None:
                body = CountingProducer(FileBodyProducer(BytesIO(body)), bar.update)
        try:
            answer = yield treq.request(method, url + path, data=body, headers=headers,
                                        agent=self._agent, reactor=self._reactor,
                                        timeout=self.timeout)
            content = yield treq.content(answer)
        except netError.ConnectError as e:
            return Response(None, problem=str(e))
        except (ResponseFailed, ResponseNeverReceived, netError.ConnectionLost) as e:
            raise NodeFailure(f"the connection to {url} failed: {e}") from None
        finally:
            if bar is not None:
                bar.close()
        if send is not None:
            self.bytes_sent += send.length
        retry_after = answer.headers.getRawHeaders(b"Retry-After", [None])[0]
        length = answer.headers.getRawHeaders(INFERENCE_HEADER_LENGTH, [b""])[0]
        return Response(answer.code, content,
                        _retry_after(retry_after.decode() if retry_after else None),
                        header_length=int(length) if length.isdigit() else None)

    @inlineCallbacks
    def run(self, program, *args, keep=False, free=None, request_id: str | None = None,
            **kwargs):
        """
        A Deferred of C{program}'s outputs for C{args} and C{kwargs}, in the
        structure the program returns (the ones C{keep} says, as for
        L{kcoral.Client.run}, L{kcoral.RemoteArray}s that stay on the worker
        that ran it; C{free} freed there once it succeeded); it fails with
        the L{kcoral.errors.KCoralError} of the answer. Large inputs are
        hashed and framed in a thread.
        """
        prepare = functools.partial(RunCall.prepare, program, args, kwargs, keep=keep, free=free,
                                    owner=self)
        call = prepare() if _small(args, kwargs) else (yield deferToThread(prepare))
        self._owned.sending(call)
        try:
            outputs = yield self._call(call, request_id)
        except BaseException as e:
            self._owned.failed(call, e)
            raise
        self._owned.ran(call, outputs)
        forgotten(free, self)
        if any(call.keep) and not self._freeing.running:
            self._freeing.start(FREE_AFTER_SECONDS, now=False)
        return outputs

    def put(self, tree, *, near: RemoteArray | None = None,
            request_id: str | None = None) -> Deferred:
        """A Deferred of C{tree} (an array or any pytree of them) uploaded
        and kept on one worker in one request, as L{kcoral.RemoteArray}s in
        its structure: beside C{near} where given, as L{kcoral.Client.put}
        places it."""
        program, args = keeper(tree, near)
        return self.run(program, *args, keep=True, request_id=request_id)

    @inlineCallbacks
    def fetch(self, array: RemoteArray):
        """A Deferred of the bytes of C{array}, copied back from its worker."""
        answer = yield self._request("GET", path_of(array), None)
        if answer.status != 200:
            raise error_of(answer)
        return fetched(answer.body)

    def delete(self, *arrays: RemoteArray) -> Deferred:
        """A Deferred that fires once C{arrays} are freed on their workers
        (one request for each worker)."""
        forgotten(arrays, self)
        return self._free([array.id for array in arrays], strict=True)

    def forget(self, *arrays: RemoteArray) -> None:
        """C{arrays} were freed through another client: not this one's to free."""
        self._owned.released(array.id for array in arrays)

    @inlineCallbacks
    def _free(self, ids: list[str], strict: bool = False):
        """Free C{ids} on their workers, and the orphans with them (as
        L{kcoral.Client}'s)."""
        self._owned.released(ids)
        orphans = self._owned.orphans(most=None)
        errors = []
        for send in deletions([*ids, *orphans]):
            answer = yield self._request("DELETE", send.path, send)
            if answer.status != 200:
                errors.append(error_of(answer))
        failure = deletion_error(errors, spared=orphans)
        if strict and failure is not None:
            raise failure

    @inlineCallbacks
    def _free_orphans(self):
        """Free the arrays no longer referenced that no run took along."""
        if self._owned.orphaned.empty():
            return
        try:
            yield self._free([])
        except (KCoralError, OSError) as e:
            log.warn("could not free kept arrays no longer referenced: {why}", why=e)

    def infer(self, model: str, inputs, *, request_id: str | None = None) -> Deferred:
        """A Deferred of the outputs by name of model C{model} for C{inputs}
        (one array, or a dict of arrays by input name)."""
        return self._call(InferCall.prepare(model, inputs), request_id)

    def load_model(self, name: str) -> Deferred:
        """A Deferred of model C{name} loaded (again) on every worker, as
        C{Client.load_model}."""
        return self._control(name, "load")

    def unload_model(self, name: str) -> Deferred:
        """A Deferred of model C{name} no longer served, as L{load_model}."""
        return self._control(name, "unload")

    @inlineCallbacks
    def _control(self, name: str, verb: str):
        answer = yield self._request("POST", control_path(name, verb), Send([b"{}"], 2, {}))
        if answer.status != 200:
            raise error_of(answer)
        return json.loads(answer.body)

    @inlineCallbacks
    def model_statistics(self, name: str | None = None):
        """A Deferred of the statistics of model C{name} (None: of every
        ready model), as C{Client.model_statistics}."""
        answer = yield self._request("GET", statistics_path(name), None)
        if answer.status != 200:
            raise error_of(answer)
        return json.loads(answer.body)

    @inlineCallbacks
    def models(self):
        """A Deferred of the repository index: each model's name, version, state and reason."""
        answer = yield self._request("POST", REPOSITORY_INDEX.label, Send([b"{}"], 2, {}))
        if answer.status != 200:
            raise error_of(answer)
        return json.loads(answer.body)

    @inlineCallbacks
    def _call(self, call: ICall, request_id: str | None):
        steps = exchange(call, self._held, busy_timeout=self.busy_timeout,
                         request_id=request_id, redispatch=self.redispatch,
                         clock=self._reactor.seconds)
        answer = None
        while True:
            try:
                step = steps.send(answer)
            except StopIteration as done:
                return done.value
            if isinstance(step, Send):
                answer = yield self._request("POST", step.path, step)
            else:
                yield deferLater(self._reactor, step.seconds, lambda: None)
                answer = None

    @inlineCallbacks
    def health(self):
        """A Deferred of the service's C{/health}, as a dict."""
        answer = yield self._request("GET", "/health", None)
        if answer.status is None:
            raise ConnectionError(f"could not reach {self.url}: {answer.problem}")
        return json.loads(answer.body)


def _small(args, kwargs) -> bool:
    import jax

    # From nbytes, not np.asarray: that would copy a GPU array to the host on
    # the reactor's thread, and fails for a typed PRNG key. Python scalars
    # have no nbytes, and are small.
    # A kept array's bytes stay where they are: none to hash or frame.
    leaves = jax.tree.leaves((args, kwargs))
    return sum(getattr(leaf, "nbytes", 0) for leaf in leaves
               if not isinstance(leaf, RemoteArray)) < _THREAD_BYTES
