"""
The forward-and-retry loop of a Router's C{POST /v1/run}: wait for a lease
on a member with free capacity, forward the run there, and try another
member while members turn it away unsent, up to L{MAX_NOT_SENT} tries.

A 409 from a member believed to hold all the run needs (an eviction, a
restart, content still on its way there) places the run again, only on
members believed to hold what it lacked, up to L{MAX_HOLDER_TRIES} times;
where none does, the client gets the 409 and sends the content inline. A
409 from a member the run was placed on knowing it lacked content (a cold
start, chosen over waiting for a warm member) goes back to the client: its
upload is that cold start. A fleet of clients then sends content about once
per worker that needs it, not once per client; each member still runs only
content it holds, verified when it was stored.

A run that may have started on a node is sent again only when its client
asked for it (C{X-KCoral-Redispatch: true}: an exported program is a pure
function of its inputs, so a second run is safe), up to C{max_redispatches}
times, with the same request id; otherwise, and past that, its loss is a
502. A run of state kept on one worker (kept arrays, a sequence's state) is
never run again, and a sequence's step that its worker turns away with a
503 is answered that 503. A cancelled forward (the client went away) leaves
the queue or closes its request to the member, releases its lease, and is
tried nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
from twisted.internet.defer import inlineCallbacks
from twisted.logger import Logger

from kcoral.errors import NodeFailure, RequestTimeout, ServerBusy
from kcoral.logs import debug_enabled
from kcoral.router.call import Call
from kcoral.router.proxy import NotSent, Proxy
from kcoral.router.residency import Demand
from kcoral.router.scheduler import Lease, Scheduler
from kcoral.tracing import NO_SPAN, ISpan
from kcoral.web.body import IBody

log = Logger()

#: Tries of a request that members did not take (refused connections, 503s)
#: before the Router gives up on it.
MAX_NOT_SENT = 8
#: Runs again of a request that asked for it, after the node running it was
#: lost (C{--max-redispatches}).
MAX_REDISPATCHES = 2
#: Tries of a run on another member believed to hold what a warm member's
#: 409 said it lacked, before the 409 goes back to the client.
MAX_HOLDER_TRIES = 2

class Forwarder:
    """Forwards runs to the members the C{scheduler} leases, with C{proxy};
    C{observe_wait} is told how long each one waited for its lease, and a run
    whose client asks for it is sent again up to C{max_redispatches} times
    after the loss of its node."""

    def __init__(self, scheduler: Scheduler, proxy: Proxy, clock,
                 observe_wait: Callable[[float], object] = lambda seconds: None,
                 max_redispatches: int = MAX_REDISPATCHES):
        self.scheduler = scheduler
        self._proxy = proxy
        self._clock = clock
        self.observe_wait = observe_wait
        self.max_redispatches = max_redispatches

    @inlineCallbacks
    def forward(self, call: Call, body: IBody, demand: Demand | None, devices: int = 1,
                span: ISpan = NO_SPAN, lease: Lease | None = None, waited: bool = False):
        """
        The L{kcoral.router.proxy.Answer} of the member that took C{body}
        (the run C{call} forwards, needing the content C{demand} if known, exported
        for C{devices} devices; its steps traced within C{span}). Fails with
        L{ServerBusy} (no capacity, or no member took it), L{NotEnoughDevices}
        (no ready member owns as many devices) or L{NodeFailure} (lost after
        it was sent, and not to be sent again).

        C{body} is the request body (within C{--max-request-bytes}): read
        whole by the Router's site before the run gets here, or, a large one
        of known length, still arriving (L{kcoral.web.request}). Each attempt
        sends it again from its start, and it is kept until the client has
        its answer.

        C{lease}, when given, is one already held for the first try (whoever
        acquired it observed the wait); it is released like the others.
        C{waited}: the request's wait was observed already (it is sent again
        after waiting once), so this forward's is not.
        """
        rid = call.request_id
        arrived = self._clock.seconds()
        # A run of kept arrays is never run again: they live on its node.
        redispatches = self.max_redispatches if call.redispatch and (
            demand is None or demand.kept is None) else 0
        not_sent = lost = moved = 0
        residency = self.scheduler.pool.residency
        while not_sent < MAX_NOT_SENT:
            held, lease = lease, None
            if held is None:
                with span.child("kcoral.queue_wait"):
                    held = yield self.scheduler.acquire(demand, devices)
                if not (not_sent or lost or moved or waited):
                    # Once a run: how long it waited for capacity (not again
                    # for each member that turned it away).
                    self.observe_wait(self._clock.seconds() - arrived)
            leased = self._clock.seconds()
            member = held.member
            if lost:
                log.info("{request_id} attempt {attempt} -> {node_id}/{worker}", request_id=rid,
                         attempt=lost + 1, node_id=member.node.node_id, worker=member.name)
            elif debug_enabled():
                log.debug("{request_id} -> {node_id}/{worker}", request_id=rid,
                          node_id=member.node.node_id, worker=member.name)
            forwarding = span.child("kcoral.forward", node_id=member.node.node_id, worker=member.name)
            try:
                answer = yield member.node.running(self._proxy.forward(
                    member.url, call, body, traceparent=forwarding.traceparent()))
            except NotSent as e:
                forwarding.failed(e)
                if e.busy is not None and demand is not None and demand.sequence is not None:
                    # No other worker holds the sequence: its worker's refusal
                    # (sequences_full, its queue full) is the client's answer,
                    # and says nothing against the worker.
                    raise e.busy from None
                member.suspect = True
                not_sent += 1
                log.info("{request_id} not taken by {node_id}/{worker}: {why}", request_id=rid,
                         node_id=member.node.node_id, worker=member.name, why=e)
                continue
            except NodeFailure as e:
                forwarding.failed(e)
                if body.behind():
                    # The member gave up on a client that let it wait (its
                    # own bound on a body's rate, or its idle timeout): the
                    # run never had its whole body, and the member is fine.
                    log.info("{request_id} failed on {node_id}/{worker} while its body was "
                             "late: {why}", request_id=rid, node_id=member.node.node_id,
                             worker=member.name, why=e.message)
                    raise RequestTimeout("the request body arrived too slowly to be "
                                         "forwarded") from e
                log.warn("{request_id} failed on {node_id}/{worker}: {why}", request_id=rid,
                         node_id=member.node.node_id, worker=member.name, why=e.message)
                if lost >= redispatches:
                    raise
                # Out of rotation until its supervisor reports it again
                # (restored, or not): the next attempt goes elsewhere first.
                member.suspect = True
                lost += 1
                log.info("{request_id} re-dispatched ({lost} of at most {most}): its client "
                         "allows a second run", request_id=rid, lost=lost, most=redispatches)
                continue
            finally:
                held.release()
                forwarding.end()
            missing = answer.missing()
            residency.settled(member.held, demand, answer.code, missing,
                              self._clock.seconds() - leased, body.length)
            if missing and held.warm and demand is not None and moved < MAX_HOLDER_TRIES:
                # The residency has just forgotten them on this member; the
                # scheduler refuses the run with a 409 of its own if no
                # member holds them.
                demand = attrs.evolve(demand, required=tuple(missing))
                moved += 1
                log.info("{request_id} lacked {count} upload(s) on {node_id}/{worker}: to a "
                         "member that holds them ({moved} of at most {most})", request_id=rid,
                         count=len(missing), node_id=member.node.node_id, worker=member.name,
                         moved=moved, most=MAX_HOLDER_TRIES)
                continue
            if answer.code >= 400:
                # Successes stay at debug (cost per run); an error answer names
                # the node, so the request can be followed into that node's log.
                log.info("{request_id} answered {status} from {node_id}/{worker}", request_id=rid,
                         status=answer.code, node_id=member.node.node_id, worker=member.name)
            return answer
        raise ServerBusy("no node took the request", reason="no_ready_node")
