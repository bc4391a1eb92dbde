"""
What Klein's routing costs per ``POST /v1/run``, against the bypass that
KCoral's services put before it (``kcoral.web.front``), in process:

    .venv/bin/python -m bench.routing [--requests 2000] [--rounds 30]

A Router's and a server's real resource trees, each behind a real
``KCoralSite`` over a ``StringTransport`` (one keep-alive connection), with
what lies beyond the handler answering at once: a forwarder that returns a
member's answer for the Router; for the server, an executor that returns a
result on a thread pool that runs it on the spot (the request's frame is
still decoded and its slot taken and released). Each tree is served two
ways that answer the same bytes (checked): ``resource()`` as the service
builds it (``Front`` sends ``POST /v1/run`` to its handler), and a Klein
app that declares the route for the same handler (URL map bound and
matched, the request adapted, its maybeDeferreds and error-handler chain).

Each round times ``--requests`` requests of each way in process CPU time,
the order alternating between rounds, so that other work on the machine
costs all ways alike, after the garbage collector is tuned as a running
service tunes it (``kcoral.heap.settle``); the table gives the median, quartiles and extremes
over the rounds, in microseconds of CPU per request.
"""

import argparse
import gc
import statistics
import time

import numpy as np
from klein import Klein
from prometheus_client import CollectorRegistry
from twisted.internet.address import IPv4Address
from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import Logger

from bench.support.quick import parse_quick
from kcoral.common.queue import WaitQueue
from kcoral.heap import settle
from kcoral.metrics import HttpMetrics
from kcoral.protocol.wire import encode_request, sha256, wire_array
from kcoral.router.proxy import Answer
from kcoral.router.service import RouterConfig, build_router
from kcoral.server.admission import Admission
from kcoral.server.app import OK, ServerApp
from kcoral.server.service import ROUTES
from kcoral.web.requestid import RequestIdResource
from kcoral.web.site import KCoralSite

RESULT = b"\0" * 64


class Forwarder:
    """Answers every run at once, as a member that took it would."""

    def forward(self, request, body, demand, devices=1, span=None):
        return succeed(Answer(200, {b"Content-Type": b"application/x-kcoral-result"}, RESULT))


class Executor:
    def execute(self, run, rid, span=None):
        return RESULT


class Threads(Clock):
    """A reactor and thread pool in one that run a thread's work on the spot."""

    def callInThreadWithCallback(self, on_result, f, *args, **kw):
        on_result(True, f(*args, **kw))

    def callFromThread(self, f, *args, **kw):
        f(*args, **kw)


def router():
    app, site = build_router(RouterConfig(), Clock())
    app.forwarder = Forwarder()
    return app, site


def server():
    threads = Threads()
    app = ServerApp(executor=Executor(), admission=Admission(2, WaitQueue(threads, 16, 1.0)),
                    threadpool=threads, reactor=threads, registry=CollectorRegistry())
    app.status = OK
    site = KCoralSite(app.resource(), metrics=HttpMetrics(app.registry, ROUTES),
                      max_request_bytes=1 << 20, log=Logger(), clock=threads)
    return app, site


def run_request() -> bytes:
    buffers, _ = encode_request(sha256(b"program"), None, [(wire_array(np.float32(1)), None, True)])
    body = b"".join(buffers)
    return (b"POST /v1/run HTTP/1.1\r\nHost: kcoral\r\nX-Request-ID: bench\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)


def through_klein(app) -> RequestIdResource:
    """C{app}'s run handler behind a Klein app of its own, which matches the
    route as Klein does (the service mounts its families on its Front)."""
    klein = Klein()
    klein.route("/v1/run", methods=["POST"])(lambda request: app.post_run(request))
    return RequestIdResource(klein.resource())


def connection(service, klein: bool):
    """A keep-alive connection to C{service}'s site, with or without the bypass."""
    app, site = service()
    if klein:
        site.resource = through_klein(app)
    transport = StringTransport()
    protocol = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 1234))
    protocol.makeConnection(transport)
    return protocol, transport


def answer(protocol, transport, request: bytes) -> bytes:
    transport.clear()
    protocol.dataReceived(request)
    # Its Date header is the only part of an answer that may differ.
    return b"\r\n".join(line for line in transport.value().split(b"\r\n")
                        if not line.startswith(b"Date: "))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=30)
    args = parse_quick(parser, requests=200, rounds=3)
    request = run_request()
    ways = {f"{name} {way}": connection(service, way == "Klein")
            for name, service in (("router", router), ("server", server))
            for way in ("Front", "Klein")}
    for name in ("router", "server"):
        direct, klein = (answer(*ways[f"{name} {way}"], request) for way in ("Front", "Klein"))
        assert direct == klein and direct.startswith(b"HTTP/1.1 200 OK"), (direct, klein)
    settle()  # as a service does once started
    cpu: dict[str, list[float]] = {way: [] for way in ways}
    order = list(ways)
    for _ in range(args.rounds):
        for way in order:
            protocol, transport = ways[way]
            gc.collect()
            start = time.process_time()
            for _ in range(args.requests):
                transport.clear()
                protocol.dataReceived(request)
            cpu[way].append((time.process_time() - start) / args.requests * 1e6)
        order.reverse()
    print(f"{args.rounds} rounds of {args.requests} requests; CPU us per request")
    print(f"{'':27} {'median':>7} {'q1':>7} {'q3':>7} {'min':>7} {'max':>7}")
    for name in ("router", "server"):
        cpu[f"{name} Klein - Front"] = [
            k - d for k, d in zip(cpu[f"{name} Klein"], cpu[f"{name} Front"])]
    for way, figures in cpu.items():
        q1, _, q3 = statistics.quantiles(figures, n=4, method="inclusive")
        print(f"{way:27} {statistics.median(figures):7.1f} {q1:7.1f} {q3:7.1f} "
              f"{min(figures):7.1f} {max(figures):7.1f}")


if __name__ == "__main__":
    main()
