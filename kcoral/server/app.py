"""
The server's HTTP API: C{/health}, C{/readyz}, C{/metrics},
C{POST /v1/run} and the kept arrays under C{/v1/arrays}.

The reactor only parses the small JSON frame header and moves bytes; digest
checks, cache I/O and JAX all run on the server's worker threads, so health
probes are answered within milliseconds while a long program runs.
"""

from __future__ import annotations

from collections.abc import Callable

from klein import Klein
from prometheus_client import CollectorRegistry, Gauge, Histogram
from twisted.internet.defer import CancelledError, Deferred, inlineCallbacks
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from kcoral._version import __version__
from kcoral.common.queue import QueueFull, QueueTimeout
from kcoral.common.report import Sandbox
from kcoral.errors import BadRequest, KCoralError, ProgramFailed, ServerBusy
from kcoral.inference.cudasharedmemory import CudaSharedMemory
from kcoral.inference.rest import InferenceRoutes
from kcoral.inference.sharedmemory import SharedMemory
from kcoral.logs import debug_enabled
from kcoral.metrics import SECONDS_BUCKETS, render
from kcoral.protocol.wire import (
    KEPT_HEADER,
    PROGRAM_HEADER,
    RESULT_CONTENT_TYPE,
    WireError,
    decode_request,
    kept_id,
    kept_ids,
)
from kcoral.server.admission import Admission
from kcoral.server.executor import Executor
from kcoral.server.inference import ServerInference
from kcoral.server.kept import lost_error
from kcoral.server.runlimit import NO_RUN_LIMIT, RunLimit
from kcoral.tracing import NO_SPAN, NO_TRACING, ISpan, ITracing
from kcoral.web import errors
from kcoral.web.auth import IGuard, trusted
from kcoral.web.family import ARRAY, ARRAYS_NAMED, RUN_ROUTE, Route
from kcoral.web.front import Front, Handler
from kcoral.web.requestid import RequestIdResource
from kcoral.web.responses import error_response, json_response, with_length

log = Logger()

STARTING, OK, DRAINING, FAILED = "starting", "ok", "draining", "failed"


class ServerApp:
    app = Klein()
    errors.install(app)

    def __init__(self, *, executor: Executor, admission: Admission, threadpool, reactor,
                 registry: CollectorRegistry, tracing: ITracing = NO_TRACING,
                 client_guard: IGuard | None = None,
                 inference: Callable[[ServerApp], ServerInference] | None = None,
                 run_limit: RunLimit = NO_RUN_LIMIT, shared_memory: SharedMemory | None = None,
                 cuda_memory: CudaSharedMemory | None = None):
        self.executor = executor
        self.admission = admission
        self._threadpool = threadpool
        self._reactor = reactor
        self.registry = registry
        #: What runs need (None: nothing).
        self.client_guard = client_guard
        self.tracing = tracing
        #: How the process confined itself (kcoral.sandbox), once it has.
        self.sandbox = Sandbox("off", no_new_privs=False, seccomp=False, landlock_abi=0)
        #: The system shared-memory regions its clients registered.
        self.shared_memory = shared_memory
        #: The CUDA shared-memory regions they registered, in the same registry.
        self.cuda_memory = cuda_memory
        #: How long a run may execute (by default, for ever).
        self.run_limit = run_limit
        self.status = STARTING
        #: When the last run arrived (reactor seconds), for the drain's quiet period.
        self.last_run_at: float | None = None
        #: The models it serves on the inference protocol, made from this app.
        self.inference = None if inference is None else inference(self)
        self._queue_wait = Histogram("kcoral_queue_wait_seconds", "Time runs waited for a slot",
                                     buckets=SECONDS_BUCKETS, registry=registry)
        Gauge("kcoral_active_runs", "Runs holding a slot", registry=registry).set_function(
            lambda: self.admission.active)
        Gauge("kcoral_queued_runs", "Runs waiting for a slot", registry=registry).set_function(
            lambda: len(self.admission.queue))

    def resource(self):
        routes: dict[Route, Handler] = {RUN_ROUTE: self.post_run, ARRAY: self.array,
                                        ARRAYS_NAMED: self.delete_arrays}
        if self.inference is not None:
            routes.update(InferenceRoutes(self.inference, self.shared_memory,
                                          from_fronts=True, cuda_memory=self.cuda_memory
                                          ).handlers())
        return RequestIdResource(Front(self.app.resource(), routes, guard=self.client_guard))

    # -- health -----------------------------------------------------------

    def health(self, full: bool = True) -> dict:
        """What C{/health} says: its cache, models, kept-array instance and
        sandbox only in the C{full} one, for a trusted client (L{kcoral.web.auth.trusted}); its
        supervisor, which reaches a worker with no token set, sees them."""
        info = self.executor.info
        health = {
            "status": self.status,
            "gpu_target": info.gpu_target if info else None,
            "capacity": self.admission.capacity,
            "active": self.admission.active,
            "queued": len(self.admission.queue),
            "runtime": info.runtime if info else None,
            "devices": info.devices if info else [],
            "version": __version__,
        }
        if full:
            health.update(cache=self.executor.cached(), instance=self.executor.kept.instance,
                          sandbox=self.sandbox.to_json(),
                          models=[] if self.inference is None else self.inference.health())
        return health

    @app.route("/health", methods=["GET"])
    def get_health(self, request):
        return json_response(request, 200 if self.status == OK else 503,
                             self.health(trusted(self.client_guard, request)))

    @app.route("/readyz", methods=["GET"])
    def get_readyz(self, request):
        ready = self.status == OK
        return json_response(request, 200 if ready else 503, {"ready": ready, "status": self.status})

    @app.route("/metrics", methods=["GET"])
    def get_metrics(self, request):
        return render(request, self.registry)

    # -- runs -------------------------------------------------------------

    # Its Front cancels the run when its client goes away.
    @inlineCallbacks
    def post_run(self, request):
        rid = request.request_id
        span = self.tracing.start("kcoral.server.run", request.requestHeaders, request_id=rid)
        try:
            refusal = self.arrived()
            if refusal is not None:
                raise refusal
            data = yield request.body.read()
            try:
                run = decode_request(data)
                run.routed_by(kept_ids(request.getHeader(KEPT_HEADER)))
            except WireError as e:
                raise BadRequest(str(e)) from None
            announced = request.getHeader(PROGRAM_HEADER)
            if announced is not None and announced != run.program.digest:
                raise BadRequest(f"{PROGRAM_HEADER} does not match the frame's program digest")
            result = yield self.in_slot(rid, self.executor.execute, run, rid, span, span=span)
        except KCoralError as e:
            span.failed(e)
            log.info("{request_id} answered {status} {type}: {message}", request_id=rid,
                     status=e.status, type=e.type, message=e.message)
            return error_response(request, e)
        finally:
            span.end()
        # Debug, not info: formatting and writing this line cost ~13% of the
        # server's CPU per trivial run, and even a dropped debug event costs
        # ~10 us to build and filter. Errors, compiles and refusals are still
        # logged at info with their request ids.
        if debug_enabled():
            log.debug("{request_id} ran program {digest} ({size} result bytes)",
                      request_id=rid, digest=(run.program.digest or "")[:12], size=len(result))
        request.setHeader(b"Content-Type", RESULT_CONTENT_TYPE.encode())
        return with_length(request, result)

    # -- kept arrays ------------------------------------------------------

    # Not in a slot: a copy from the device, or a freed reference, does not
    # wait behind the runs that hold the slots.
    def array(self, request, kept: str):
        """A kept array's bytes (C{GET}), or its end (C{DELETE})."""
        try:
            kept_id(kept)
        except WireError as e:
            return error_response(request, BadRequest(str(e)))
        if request.method == b"DELETE":
            return self._delete(request, [kept])
        return self.get_array(request, kept)

    @inlineCallbacks
    def get_array(self, request, kept):
        try:
            frame = yield deferToThreadPool(self._reactor, self._threadpool, self.executor.fetch, kept)
        except KCoralError as e:
            return error_response(request, e)
        request.setHeader(b"Content-Type", RESULT_CONTENT_TYPE.encode())
        return with_length(request, frame)

    # Many at once, named by the header a Router routes them by.
    def delete_arrays(self, request):
        try:
            ids = kept_ids(request.getHeader(KEPT_HEADER) or "", 1)
        except WireError as e:
            return error_response(request, BadRequest(str(e)))
        return self._delete(request, ids)

    def _delete(self, request, ids):
        """Frees the arrays of C{ids}: 200 naming them, or 410 naming those
        this worker did not hold (it freed the others)."""
        try:
            lost = self.executor.kept.delete(ids)
            if lost:
                raise lost_error(lost)
        except KCoralError as e:
            return error_response(request, e)
        return json_response(request, 200, {"deleted": list(dict.fromkeys(ids))})

    def arrived(self) -> ServerBusy | None:
        """
        Notes that a run or an inference arrived (a drain waits for them to
        stop arriving), and says why this server takes none now (starting,
        draining); None when it does.
        """
        self.last_run_at = self._reactor.seconds()
        if self.status == OK:
            return None
        return ServerBusy(f"the server is {self.status}",
                          reason="draining" if self.status == DRAINING else "starting")

    @inlineCallbacks
    def in_slot(self, rid: str, f: Callable, *args, span: ISpan = NO_SPAN):
        """
        The result of C{f(*args)} on a worker thread, once this request
        holds an admission slot: the one way runs and inferences reach the
        device.
        """
        yield self.admitted(rid, span)
        result = yield self.in_thread(rid, f, *args)
        return result

    @inlineCallbacks
    def admitted(self, rid: str, span: ISpan = NO_SPAN):
        """Fires once this request holds an admission slot (released by L{in_thread}
        when its work is done, or by C{admission.release()})."""
        arrived = self._reactor.seconds()
        waiting = span.child("kcoral.queue_wait")
        try:
            yield self.admission.acquire()
        except QueueFull:
            raise ServerBusy("the server's queue is full", reason="queue_full") from None
        except QueueTimeout:
            raise ServerBusy("no slot freed up in time", reason="queue_timeout") from None
        except CancelledError:
            log.info("{request_id} dropped: the client went away before it ran", request_id=rid)
            raise
        finally:
            waiting.end()
        self._queue_wait.observe(self._reactor.seconds() - arrived)

    def in_thread(self, rid: str, f: Callable, *args) -> Deferred:
        """
        The result of C{f(*args)} on a worker thread, holding its admission
        slot until the thread is done. Cancelling the result (the client went
        away) does not stop the work, which a device cannot interrupt: the
        slot stays taken until it ends, and its answer is dropped. Past
        the run limit it fails with L{kcoral.errors.RunTimeout}
        (L{kcoral.server.runlimit}).
        """
        answer: Deferred = Deferred()
        timer = self.run_limit.timer(rid, answer)

        def ran(ok: bool, result) -> None:
            # On the reactor, once the worker thread is done (result: a Failure if not ok).
            timer.stop()
            self.admission.release()
            if answer.called:
                log.info("{request_id} answer dropped: {why}", request_id=rid,
                         why="it had passed the run limit" if timer.passed
                         else "the client went away")
            elif ok:
                answer.callback(result)
            elif result.check(KCoralError):
                answer.errback(result)
            else:
                log.failure("{request_id} internal error", result, request_id=rid)
                answer.errback(ProgramFailed(f"internal error: {type(result.value).__name__}"))

        # Not deferToThreadPool: its Deferred, cancelled, would fire at once,
        # and the slot of a run still on the device would be freed with it.
        self._threadpool.callInThreadWithCallback(
            lambda ok, result: self._reactor.callFromThread(ran, ok, result), timer.timed(f), *args)
        return answer
