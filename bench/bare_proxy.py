"""
Proxies with nothing of the Router in them, for ``bench/router.py --bare``
to measure side by side with the Router.

    python bench/bare_proxy.py WORKER_URL [--plain]

Each sends every ``POST /v1/run`` to the one worker at WORKER_URL, over a
persistent connection pool, and its answer back, and does nothing else a
Router does: no queue, no capacity accounting, no request ids, metrics or
logs, no cancellation when a client leaves, no failure classification, no
bounds. Both run on Twisted's HTTP server and treq, as the Router does:

- by default, with the outgoing client the Router uses
  (``kcoral.web.outgoing.Outgoing`` and its parsed member URL) and its
  settled heap: the floor under the Router, whose distance to it is what
  the Router's own work costs;
- with ``--plain``, with treq as its documentation shows (``HTTPClient``
  on an ``Agent``): what the stack costs before KCoral's tuning of it.
"""

import sys
from pathlib import Path

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.web import resource, server
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.http_headers import Headers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kcoral.heap import settle
from kcoral.protocol.wire import PROGRAM_HEADER
from kcoral.router.proxy import Proxy
from kcoral.web.outgoing import MAX_PER_HOST, Outgoing

_FORWARDED = (b"Content-Type", PROGRAM_HEADER.encode())


class BareProxy(resource.Resource):
    isLeaf = True

    def __init__(self, client: HTTPClient, url):
        super().__init__()
        self._client = client
        self._url = url

    def render_POST(self, request):
        headers = Headers()
        for name in _FORWARDED:
            value = request.requestHeaders.getRawHeaders(name)
            if value:
                headers.setRawHeaders(name, value[:1])
        outgoing = self._client.post(self._url, data=request.content.read(), headers=headers,
                                     allow_redirects=False, unbuffered=True)

        def answer(response):
            request.setResponseCode(response.code)
            for value in response.headers.getRawHeaders(b"Content-Type", [])[:1]:
                request.setHeader(b"Content-Type", value)
            return response.content()

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


def main(worker_url: str, plain: bool) -> None:
    if plain:
        pool = HTTPConnectionPool(reactor, persistent=True)
        pool.maxPersistentPerHost = MAX_PER_HOST  # as the Router's
        proxy = BareProxy(HTTPClient(Agent(reactor, pool=pool)), worker_url + "/v1/run")
    else:
        client = Outgoing(reactor).client
        proxy = BareProxy(client, Proxy(client).run_url(worker_url))
        reactor.callWhenRunning(settle)

    def listening(port):
        print(f"bare proxy listening on http://127.0.0.1:{port.getHost().port}", flush=True)

    endpoint = TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1")
    endpoint.listen(_Site(proxy)).addCallback(listening)
    reactor.run()


if __name__ == "__main__":
    main(sys.argv[1], "--plain" in sys.argv[2:])
