"""
The Router's HTTP API: the client routes it shares with servers (C{/health},
C{/readyz}, C{/metrics}, C{POST /v1/run}), the node routes (C{/v1/nodes}) and
the dashboard (C{GET /}, L{kcoral.dashboard}). The embedded gateway of a
multi-worker node serves the same resource.
"""

from __future__ import annotations

import json
import re

from klein import Klein
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from twisted.internet.defer import CancelledError, Deferred, fail
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral._version import __version__
from kcoral.common.report import InvalidReport, parse_report
from kcoral.dashboard import page
from kcoral.dashboard.history import History
from kcoral.errors import (
    ArrayLost,
    ArraysApart,
    BadRequest,
    KCoralError,
    NodeConflict,
    NodeFailure,
    NotFound,
    PayloadTooLarge,
    ServerBusy,
)
from kcoral.inference.cudasharedmemory import CudaSharedMemory
from kcoral.inference.rest import InferenceRoutes
from kcoral.inference.sharedmemory import ROUTER, SharedMemory
from kcoral.metrics import SECONDS_BUCKETS, render
from kcoral.protocol.counts import read_count
from kcoral.protocol.wire import (
    DEVICES_HEADER,
    INPUTS_HEADER,
    KEPT_HEADER,
    NEAR_HEADER,
    PROGRAM_HEADER,
    WireError,
    holder_of_all,
    kept_id,
    kept_ids,
)
from kcoral.router.call import Call
from kcoral.router.forward import MAX_REDISPATCHES, Forwarder
from kcoral.router.inference import RouterInference
from kcoral.router.pool import Pool, PoolFull, SessionConflict
from kcoral.router.proxy import NotSent, Proxy
from kcoral.router.residency import Demand, ResidencyCollector
from kcoral.router.scheduler import Scheduler
from kcoral.tracing import NO_TRACING, ITracing
from kcoral.web import errors
from kcoral.web.auth import NODE_ROUTES, IGuard, TokenGuard, trusted
from kcoral.web.body import MemoryBody, held
from kcoral.web.family import (
    ARRAY,
    ARRAYS,
    ARRAYS_NAMED,
    NODE_CONTROL,
    NODE_LIST,
    RUN,
    RUN_ROUTE,
    Route,
)
from kcoral.web.front import Front, Handler
from kcoral.web.outgoing import Outgoing
from kcoral.web.requestid import RequestIdResource
from kcoral.web.responses import error_response, json_response, with_length

log = Logger()

#: A report of 64 workers, each listing its caches' most recent entries
#: (L{kcoral.router.residency}) and its models, stays under this.
MAX_CONTROL_BYTES = 2 * 1024 * 1024
_PROGRAM_HEADER = PROGRAM_HEADER.encode()
_INPUTS_HEADER = INPUTS_HEADER.encode()
_DEVICES_HEADER = DEVICES_HEADER.encode()
_KEPT_HEADER = KEPT_HEADER.encode()
_NEAR_HEADER = NEAR_HEADER.encode()
NO_BODY = MemoryBody(b"")
#: The most devices a run may ask for (a worker reports at most as many).
MAX_DEVICES = 1024
_NODE_ID = re.compile(r"\A[A-Za-z0-9._-]{1,64}\Z")


class _PoolCollector:
    """Nodes by state and per-node active requests, read at scrape time."""

    def __init__(self, pool: Pool):
        self._pool = pool

    def collect(self):
        states = GaugeMetricFamily("kcoral_nodes", "Nodes by state", labels=["state"])
        for state, count in self._pool.counts().items():
            states.add_metric([state], count)
        active = GaugeMetricFamily("kcoral_node_active_requests",
                                   "Requests in flight on each node", labels=["node"])
        capacity = GaugeMetricFamily("kcoral_node_capacity", "Reported capacity of each node",
                                     labels=["node"])
        for node in self._pool.nodes.values():
            active.add_metric([node.node_id], node.active)
            capacity.add_metric([node.node_id], node.capacity)
        return [states, active, capacity]


class RouterApp:
    app = Klein()
    errors.install(app)

    def __init__(self, *, pool: Pool, scheduler: Scheduler, outgoing: Outgoing, reactor,
                 registry: CollectorRegistry, node_token: str | None = None,
                 client_guard: IGuard | None = None,
                 health_lists_workers: bool = False, status_check_interval: float = 1.0,
                 metrics_source=None, tracing: ITracing = NO_TRACING,
                 max_redispatches: int = MAX_REDISPATCHES,
                 shared_memory: SharedMemory | None = None,
                 cuda_memory: CudaSharedMemory | None = None):
        self.pool = pool
        #: The system shared-memory regions of its clients: a node's gateway
        #: serves them to clients on its host; a Router, whose clients are
        #: on other hosts, refuses them.
        self.shared_memory = shared_memory or SharedMemory(refused=ROUTER, max_bytes=0)
        #: Its clients' CUDA regions, kept with their system ones: a
        #: gateway on a GPU host serves them; a Router refuses them.
        self.cuda_memory = cuda_memory or CudaSharedMemory(self.shared_memory)
        self.scheduler = scheduler
        #: The HTTP client runs are forwarded with; other outgoing requests
        #: (a gateway's scrapes of its workers) share its connection pool.
        self.outgoing = outgoing
        self._reactor = reactor
        self.registry = registry
        self._node_guard = TokenGuard.of([node_token] if node_token else [], NODE_ROUTES)
        #: What runs and the node list need (None: nothing).
        self.client_guard = client_guard
        self._health_lists_workers = health_lists_workers
        self._interval = status_check_interval
        #: When set, a callable returning a Deferred of the whole /metrics
        #: text (a gateway merges its workers' series in).
        self.metrics_source = metrics_source
        self.tracing = tracing
        self._queue_wait = Histogram("kcoral_queue_wait_seconds", "Time requests waited for capacity",
                                     buckets=SECONDS_BUCKETS, registry=registry)
        Gauge("kcoral_queued_requests", "Requests waiting for capacity",
              registry=registry).set_function(lambda: len(scheduler.queue))
        registry.register(_PoolCollector(pool))
        registry.register(ResidencyCollector(pool.residency))
        #: The recent samples the dashboard plots; a service its owner starts.
        self.history = History(registry, reactor)
        self._proxy = Proxy(outgoing.client)
        self.forwarder = Forwarder(scheduler, self._proxy, reactor,
                                   observe_wait=self._queue_wait.observe,
                                   max_redispatches=max_redispatches)
        #: Its members' models, on the inference protocol.
        self.inference = RouterInference(pool=pool, forwarder=self.forwarder,
                                         get=outgoing.client.get, post=outgoing.client.post,
                                         is_ready=lambda: self.status() == "ok", clock=reactor,
                                         most_waiting=scheduler.queue.max_waiting, tracing=tracing)

    def resource(self):
        routes: dict[Route, Handler] = {
            RUN_ROUTE: self.post_run, ARRAY: self.array, ARRAYS_NAMED: self.arrays,
            NODE_LIST: self.get_nodes, NODE_CONTROL: self.node_control,
            **InferenceRoutes(self.inference, self.shared_memory,
                              cuda_memory=self.cuda_memory).handlers()}
        return RequestIdResource(Front(self.app.resource(), routes, guard=self.client_guard))

    # -- client routes --------------------------------------------------------

    def status(self) -> str:
        if self.scheduler.draining:
            return "draining"
        return "ok" if self.pool.ready_nodes() else "unavailable"

    def health(self, full: bool = True) -> dict:
        """What C{/health} says; the workers (where it lists them) only in
        the C{full} one, for a trusted client (L{kcoral.web.auth.trusted})."""
        target = self.pool.target
        health = {
            "status": self.status(),
            "gpu_target": target[0] if target else None,
            "runtime": dict(target[1]) if target else None,
            "capacity": self.pool.capacity(),
            "active": self.pool.active(),
            "queued": len(self.scheduler.queue),
            "nodes": self.pool.counts(),
            "version": __version__,
        }
        if self._health_lists_workers and full:
            health["workers"] = [
                {"name": m.name, "url": m.url, "healthy": m.healthy, "capacity": m.capacity,
                 "active": m.active, "devices": m.devices,
                 "models": [s.to_json() for s in m.models],
                 "sandbox": None if m.sandbox is None else m.sandbox.to_json()}
                for n in self.pool.nodes.values() for m in n.members.values()]
        return health

    @app.route("/health", methods=["GET"])
    def get_health(self, request):
        health = self.health(trusted(self.client_guard, request))
        return json_response(request, 200 if health["status"] == "ok" else 503, health)

    @app.route("/readyz", methods=["GET"])
    def get_readyz(self, request):
        ready = self.status() == "ok"
        return json_response(request, 200 if ready else 503, {"ready": ready, "status": self.status()})

    @app.route("/metrics", methods=["GET"])
    def get_metrics(self, request):
        if self.metrics_source is None:
            return render(request, self.registry)
        request.setHeader(b"Content-Type", CONTENT_TYPE_LATEST.encode())
        return self.metrics_source()

    # Its Front cancels the forward when its client goes away.
    def post_run(self, request) -> Deferred:
        # Callbacks, not a second inlineCallbacks around the forwarder's:
        # a generator and its Deferred chain cost 2-3 us of CPU per run.
        devices = _devices(request.getHeader(_DEVICES_HEADER))
        try:
            if devices is None:
                raise BadRequest(f"{DEVICES_HEADER} must be a device count from 1 to {MAX_DEVICES}")
            demand = Demand.of(request.getHeader(_PROGRAM_HEADER), request.getHeader(_INPUTS_HEADER),
                               request.getHeader(_KEPT_HEADER), request.getHeader(_NEAR_HEADER))
        except KCoralError as e:
            d = fail(e)
        else:
            span = self.tracing.start("kcoral.router.run", request.requestHeaders,
                                      request_id=request.request_id)
            d = self.forwarder.forward(Call.of(request, RUN), request.body, demand, devices,
                                       span)
            d.addBoth(span.ended)
        d.addCallbacks(_relayed, _refused, callbackArgs=(request,), errbackArgs=(request,))
        return d

    # -- kept arrays ----------------------------------------------------------

    # Straight to the member that holds the arrays, outside the queue: a
    # fetch or a delete does not wait behind runs, and only that member can answer.
    def array(self, request, kept: str) -> Deferred:
        try:
            ids = (kept_id(kept),)
        except WireError as e:
            return self._answered(request, fail(BadRequest(str(e))))
        return self._to_holder(request, ids)

    def arrays(self, request) -> Deferred:
        try:
            ids = kept_ids(request.getHeader(_KEPT_HEADER), 1)
        except WireError as e:
            return self._answered(request, fail(BadRequest(str(e))))
        return self._to_holder(request, ids)

    def _to_holder(self, request, ids: tuple[str, ...]) -> Deferred:
        """The answer of the member that holds the arrays of C{ids}, to C{request}."""
        try:
            instance = holder_of_all(ids)
        except ArraysApart as e:
            return self._answered(request, fail(e))
        member = None if instance is None else self.pool.holder(instance)
        if member is None:
            d = fail(ArrayLost(f"no worker of this pool holds kept array(s) {', '.join(ids[:8])} "
                               f"(it restarted, or is gone)", details={"lost": list(ids)}))
        else:
            d = self._proxy.forward(member.url, Call.of(request, ARRAYS), NO_BODY)
            d.addErrback(_not_sent)
        return self._answered(request, d)

    @staticmethod
    def _answered(request, d: Deferred) -> Deferred:
        d.addCallbacks(_relayed, _refused, callbackArgs=(request,), errbackArgs=(request,))
        return d

    # -- the dashboard --------------------------------------------------------

    @app.route("/", methods=["GET"])
    def get_dashboard_page(self, request):
        return page.serve(request)

    @app.route("/dashboard/<name>", methods=["GET"])
    def get_dashboard_file(self, request, name):
        return page.serve(request, name)

    # What /health and /metrics show openly, and nothing else: the page reads
    # the nodes from /v1/nodes, with the client's token where one is needed.
    @app.route("/v1/dashboard", methods=["GET"])
    def get_dashboard(self, request):
        return json_response(request, 200, {"health": self.health(trusted(self.client_guard, request)),
                                            "history": self.history.to_json()})

    # -- node routes ----------------------------------------------------------

    def get_nodes(self, request):
        # It lists every worker's URL, where programs could be sent directly:
        # guarded (kcoral.web.family.NODE_LIST) like the runs themselves.
        now = self._reactor.seconds()
        nodes = []
        for node in self.pool.nodes.values():
            nodes.append({
                "node_id": node.node_id, "state": node.state, "reason": node.reason,
                "gpu_target": node.gpu_target, "runtime": node.runtime,
                "capacity": node.capacity, "active": node.active,
                "draining": bool(node.report and node.report.draining),
                "last_report_age_seconds": None if node.reported_at is None
                else round(now - node.reported_at, 3),
                "endpoints": [m.url for m in node.members.values()],
                "workers": [{"name": m.name, "url": m.url, "healthy": m.healthy,
                             "capacity": m.capacity, "active": m.active, "devices": m.devices,
                             "restarts": m.restarts, "models": [s.to_json() for s in m.models],
                             "instance": m.instance,
                             "sandbox": None if m.sandbox is None else m.sandbox.to_json()}
                            for m in node.members.values()],
            })
        return json_response(request, 200, {"nodes": nodes})

    def _authorized(self, request, node_id: str) -> bytes | None:
        """None when the control request may proceed, else the 401 answer."""
        return self._node_guard.refusal(request, f"node {node_id}")

    def _control_body(self, request) -> dict:
        data = held(request.body, MAX_CONTROL_BYTES)
        if data is None:
            raise PayloadTooLarge(f"a node report is limited to {MAX_CONTROL_BYTES} bytes")
        try:
            return json.loads(data)
        except (ValueError, RecursionError):
            raise BadRequest("a node report must be JSON") from None

    def node_control(self, request, node_id: str):
        """A node's report (C{PUT}) or its leaving (C{DELETE})."""
        if request.method == b"PUT":
            return self.put_node(request, node_id)
        return self.delete_node(request, node_id)

    def put_node(self, request, node_id):
        if not _NODE_ID.match(node_id):
            return error_response(request, BadRequest("node ids are 1-64 of [A-Za-z0-9._-]"))
        refused = self._authorized(request, node_id)
        if refused is not None:
            return refused
        try:
            report = parse_report(self._control_body(request))
            node = self.pool.report(node_id, report)
        except KCoralError as e:
            return error_response(request, e)
        except InvalidReport as e:
            log.warn("refused a report from node {node_id}: {why}", node_id=node_id, why=e)
            return error_response(request, BadRequest(f"invalid node report: {e}"))
        except SessionConflict as e:
            log.warn("refused node {node_id}: {why}", node_id=node_id, why=e)
            return error_response(request, NodeConflict(str(e)))
        except PoolFull as e:
            log.warn("refused node {node_id}: {why}", node_id=node_id, why=e)
            return error_response(request, ServerBusy(str(e), reason="too_many_nodes"))
        return json_response(request, 200, {"node_id": node_id, "state": node.state,
                                            "status_check_interval_seconds": self._interval})

    def delete_node(self, request, node_id):
        # Checked before the token, as for PUT: the refusal log line names the
        # node, and a URL-escaped newline must not forge a line in the log.
        if not _NODE_ID.match(node_id):
            return error_response(request, BadRequest("node ids are 1-64 of [A-Za-z0-9._-]"))
        refused = self._authorized(request, node_id)
        if refused is not None:
            return refused
        session = (request.args.get(b"session") or [b""])[0].decode("utf-8", "replace")
        if not self.pool.leave(node_id, session):
            return error_response(request, NotFound(
                f"node {node_id} has no live session {session[:100]!r}"))
        return json_response(request, 200, {"node_id": node_id, "left": True})


def _devices(header: bytes | None) -> int | None:
    """The devices a run's program needs, from its header (absent: 1); None
    when the header is no count."""
    if header is None:
        return 1
    devices = read_count(header, MAX_DEVICES)
    return None if devices is None or devices < 1 else devices


def _not_sent(failure: Failure):
    """A member that did not take a fetch or a delete: busy, as for a run."""
    failure.trap(NotSent)
    raise ServerBusy(str(failure.value), reason="no_ready_node")


def _relayed(answer, request) -> bytes:
    """The member's answer, as the Router's."""
    request.setResponseCode(answer.code)
    for name, value in answer.headers.items():
        request.setHeader(name, value)
    return with_length(request, answer.body)


def _refused(failure: Failure, request) -> bytes | Failure:
    """The JSON answer of a run no member ran; a cancellation goes on up."""
    rid = request.request_id
    if failure.check(CancelledError):
        log.info("{request_id} cancelled: the client went away", request_id=rid)
        return failure
    error = failure.value
    if not isinstance(error, KCoralError):
        return failure
    if not isinstance(error, NodeFailure):
        log.info("{request_id} answered {status} {reason}", request_id=rid,
                 status=error.status, reason=error.reason or error.type)
    return error_response(request, error)
