"""
Fakes that implement the real interfaces, for in-process tests: node report
builders, a C{treq.testing.StubTreq} harness over fake worker resources.
"""

from __future__ import annotations

from treq.testing import StubTreq
from twisted.internet.defer import fail
from twisted.internet.error import ConnectionLost, ConnectionRefusedError
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.client import ResponseFailed
from twisted.web.resource import Resource

# -- node reports ----------------------------------------------------------------------------------

RUNTIME = {"kcoral": "0.1.0", "jax": "0.4.30", "jaxlib": "0.4.30"}


def node_report(session="s1", *, capacities=(2,), host="10.0.0.1", healthy=True,
                gpu_target="sm_90", draining=False) -> dict:
    """A node report with one worker per capacity, on ports 8000 and up of C{host}."""
    return {"session": session, "gpu_target": gpu_target, "runtime": RUNTIME, "draining": draining,
            "workers": [{"name": f"worker{i}", "url": f"http://{host}:{8000 + i}",
                         "healthy": healthy, "capacity": c, "active": 0}
                        for i, c in enumerate(capacities)]}


# -- fake workers, reached through StubTreq --------------------------------------------------------

class Worker(Resource):
    """A worker's C{/v1/run} that answers C{code} and C{body}, and keeps the
    requests it got; with C{hold}, it answers none of them."""

    isLeaf = True

    def __init__(self, code: int = 200, body: bytes = b"ran", *, hold: bool = False):
        super().__init__()
        self.code, self.body, self.hold = code, body, hold
        self.runs: list = []
        self.lost: list = []

    def render_POST(self, request):
        self.runs.append(request)
        request.notifyFinish().addErrback(lambda _: self.lost.append(request))
        if self.hold:
            return server.NOT_DONE_YET
        request.setResponseCode(self.code)
        return self.body


class Workers(Resource):
    """Fake workers by host name (C{http://<name>/v1/run}), one StubTreq for all."""

    def __init__(self, **workers: Worker):
        super().__init__()
        self.workers = workers
        self.treq = StubTreq(self)

    def getChild(self, path, request):
        return self.workers[request.getRequestHostname().decode()]

    def render(self, request):
        return self.getChild(b"", request).render(request)


class Client:
    """A treq client over C{workers}' StubTreq, but for hosts that refuse
    connections (nothing sent) and hosts that lose them once sent."""

    def __init__(self, workers: Workers, *, refused=(), lost=()):
        self._treq = workers.treq
        self._refused, self._lost = frozenset(refused), frozenset(lost)
        self.flush = self._treq.flush

    def post(self, url, **kw):
        host = url.host if hasattr(url, "host") else url.split("/")[2].split(":")[0]
        if host in self._refused:
            return fail(ConnectionRefusedError())
        if host in self._lost:
            return fail(ResponseFailed([Failure(ConnectionLost())]))
        return self._treq.post(url, **kw)
