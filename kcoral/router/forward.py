"""
The forward-and-retry loop of a Router's C{POST /v1/run}: wait for a lease
on a member with free capacity, forward the run there, and try another
member while members turn it away unsent, up to L{MAX_NOT_SENT} tries.

A run that may have started on a node is never sent again: its loss is a
502. A cancelled forward (the client went away) leaves the queue or closes
its request to the member, releases its lease, and is tried nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import inlineCallbacks
from twisted.logger import Logger

from kcoral.errors import NodeFailure, ServerBusy
from kcoral.logs import debug_enabled
from kcoral.router.proxy import NotSent, Proxy
from kcoral.router.residency import Demand
from kcoral.router.scheduler import Scheduler
from kcoral.tracing import NO_SPAN, ISpan

log = Logger()

#: Tries of a request that members did not take (refused connections, 503s)
#: before the Router gives up on it.
MAX_NOT_SENT = 8


class Forwarder:
    """Forwards runs to the members the C{scheduler} leases, with C{proxy};
    C{observe_wait} is told how long each one waited for its lease."""

    def __init__(self, scheduler: Scheduler, proxy: Proxy, clock,
                 observe_wait: Callable[[float], object] = lambda seconds: None):
        self._scheduler = scheduler
        self._proxy = proxy
        self._clock = clock
        self._observe_wait = observe_wait

    @inlineCallbacks
    def forward(self, request, body: bytes, demand: Demand | None, devices: int = 1,
                span: ISpan = NO_SPAN):
        """
        The L{kcoral.router.proxy.Answer} of the member that took C{body}
        (the run of C{request}, needing the content C{demand} if known, exported
        for C{devices} devices; its steps traced within C{span}). Fails with
        L{ServerBusy} (no capacity, or no member took it), L{NotEnoughDevices}
        (no ready member owns as many devices) or L{NodeFailure} (lost after
        it was sent).
        """
        rid = request.request_id
        arrived = self._clock.seconds()
        for tries in range(MAX_NOT_SENT):
            with span.child("kcoral.queue_wait"):
                lease = yield self._scheduler.acquire(demand, devices)
            leased = self._clock.seconds()
            if not tries:
                # Once a run: how long it waited for capacity (not again for
                # each member that turned it away).
                self._observe_wait(leased - arrived)
            member = lease.member
            if debug_enabled():
                log.debug("{request_id} -> {node_id}/{worker}", request_id=rid,
                          node_id=member.node.node_id, worker=member.name)
            forwarding = span.child("kcoral.forward", node_id=member.node.node_id, worker=member.name)
            try:
                answer = yield self._proxy.forward(member.url, request, body,
                                                   traceparent=forwarding.traceparent())
            except NotSent as e:
                forwarding.failed(e)
                member.suspect = True
                log.info("{request_id} not taken by {node_id}/{worker}: {why}", request_id=rid,
                         node_id=member.node.node_id, worker=member.name, why=e)
                continue
            except NodeFailure as e:
                forwarding.failed(e)
                log.warn("{request_id} failed on {node_id}/{worker}: {why}", request_id=rid,
                         node_id=member.node.node_id, worker=member.name, why=e.message)
                raise
            finally:
                lease.release()
                forwarding.end()
            self._scheduler.pool.residency.settled(
                member.held, demand, answer.code, answer.missing(),
                self._clock.seconds() - leased, len(body))
            if answer.code >= 400:
                # Successes stay at debug (cost per run); an error answer names
                # the node, so the request can be followed into that node's log.
                log.info("{request_id} answered {status} from {node_id}/{worker}", request_id=rid,
                         status=answer.code, node_id=member.node.node_id, worker=member.name)
            return answer
        raise ServerBusy("no node took the request", reason="no_ready_node")
