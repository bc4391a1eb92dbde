"""
Proxies with nothing of the Router in them, for ``bench.router --bare``
to measure side by side with the Router.

    python -m bench.peers.bare_proxy WORKER_URL[,WORKER_URL...] [--plain] [--capacity N]

Each sends every ``POST /v1/run`` to a worker, over a persistent connection
pool, and its answer back, and does nothing else a Router does: no queue, no
capacity accounting, no request ids, metrics or logs, no cancellation when a
client leaves, no failure classification, no bounds. With several workers a
run goes to the one its ``X-KCoral-Program`` header hashes highest with
(rendezvous hashing: HAProxy's ``balance hdr(X-KCoral-Program)``, for
``bench.affinity``). With ``--capacity N`` it sends a worker at most N
runs at a time, the rest waiting in the proxy (a ``DeferredSemaphore`` a
worker), the bound the Router keeps and HAProxy's ``maxconn``. Both run on
Twisted's HTTP server and treq, as the Router does:

- by default, with the outgoing client the Router uses
  (``kcoral.web.outgoing.Outgoing`` and its parsed member URL), its writes
  sent at once on both sides (``kcoral.web.sendnow``) and its settled heap:
  the floor under the Router, whose distance to it is what the Router's own
  work costs;
- with ``--plain``, with treq as its documentation shows (``HTTPClient``
  on an ``Agent``): what the stack costs before KCoral's tuning of it.
"""

import argparse
import hashlib

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import DeferredSemaphore
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.web import resource, server
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.http_headers import Headers

from kcoral.heap import settle
from kcoral.protocol.wire import PROGRAM_HEADER
from kcoral.router.proxy import Proxy
from kcoral.web.outgoing import MAX_PER_HOST, Outgoing
from kcoral.web.sendnow import SendNowFactory

_PROGRAM = PROGRAM_HEADER.encode()
_FORWARDED = (b"Content-Type", _PROGRAM)


class BareProxy(resource.Resource):
    isLeaf = True

    def __init__(self, client: HTTPClient, urls, capacity: int | None = None):
        super().__init__()
        self._client = client
        self._urls = urls
        self._slots = None if capacity is None else {
            url: DeferredSemaphore(capacity) for url in urls}

    def _url(self, program: bytes | None):
        if len(self._urls) == 1 or program is None:
            return self._urls[0]
        return max(self._urls, key=lambda url: hashlib.blake2b(
            program + str(url).encode(), digest_size=8).digest())

    def render_POST(self, request):
        headers = Headers()
        for name in _FORWARDED:
            value = request.requestHeaders.getRawHeaders(name)
            if value:
                headers.setRawHeaders(name, value[:1])
        url = self._url(request.getHeader(_PROGRAM))
        data = request.content.read()

        def exchange():
            d = self._client.post(url, data=data, headers=headers, allow_redirects=False,
                                  unbuffered=True)
            return d.addCallback(lambda response: response.content().addCallback(
                lambda content: (response, content)))

        outgoing = exchange() if self._slots is None else self._slots[url].run(exchange)

        def answer(got):
            response, content = got
            request.setResponseCode(response.code)
            for value in response.headers.getRawHeaders(b"Content-Type", [])[:1]:
                request.setHeader(b"Content-Type", value)
            return content

        def failed(failure):
            # Answered, so that the benchmark's load generator reports it
            # instead of waiting for an answer for ever.
            request.setResponseCode(502)
            return failure.getErrorMessage().encode("utf-8", "replace")

        def send(content):
            request.setHeader(b"Content-Length", b"%d" % len(content))
            request.write(content)
            request.finish()

        outgoing.addCallback(answer).addErrback(failed).addCallback(send)
        return server.NOT_DONE_YET


class _Site(server.Site):
    noisy = False

    def log(self, request):
        pass  # no access log: the Router writes none either


def main(worker_urls: list[str], plain: bool, capacity: int | None) -> None:
    if plain:
        pool = HTTPConnectionPool(reactor, persistent=True)
        pool.maxPersistentPerHost = MAX_PER_HOST  # as the Router's
        proxy = BareProxy(HTTPClient(Agent(reactor, pool=pool)),
                          [url + "/v1/run" for url in worker_urls], capacity)
    else:
        client = Outgoing(reactor).client
        runs = Proxy(client)
        proxy = BareProxy(client, [runs.url_of(url, b"/v1/run") for url in worker_urls], capacity)
        reactor.callWhenRunning(settle)

    def listening(port):
        print(f"bare proxy listening on http://127.0.0.1:{port.getHost().port}", flush=True)

    endpoint = TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1")
    site = _Site(proxy)
    # The Router's site sends its writes at once (kcoral.web.sendnow).
    endpoint.listen(site if plain else SendNowFactory(site)).addCallback(listening)
    reactor.run()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("workers", help="comma list of worker URLs")
    parser.add_argument("--plain", action="store_true", help="treq as its documentation shows")
    parser.add_argument("--capacity", type=int, help="runs each worker is sent at a time")
    args = parser.parse_args()
    main(args.workers.split(","), args.plain, args.capacity)
