"""
Fakes that implement the real interfaces, for in-process tests: node report
builders, a C{treq.testing.StubTreq} harness over fake worker resources, a
fake process reactor, and a scripted treq-like client.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
from treq.testing import StubTreq
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionLost, ConnectionRefusedError, ProcessDone, ProcessTerminated
from twisted.internet.interfaces import IProcessTransport, IReactorProcess
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.client import ResponseFailed
from twisted.web.resource import Resource
from zope.interface import implementer

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


# -- processes: a fake process reactor --------------------------------------------------------

@implementer(IProcessTransport)
class FakeProcess:
    """A spawned child that never runs: it records the signals it gets, and
    the test says what it writes and when it ends."""

    def __init__(self, reactor: ProcessReactor, protocol, executable, args, env, childFDs,
                 pid: int):
        self.reactor = reactor
        self.protocol, self.executable, self.args, self.env = protocol, executable, args, env
        self.childFDs = childFDs
        self.pid: int | None = pid
        self.signals: list[str] = []
        self.ended = False
        protocol.makeConnection(self)

    def signalProcess(self, signalID) -> None:
        self.signals.append(signalID)

    def write_to(self, fd: int, data: bytes) -> None:
        """The child writes C{data} on its descriptor C{fd}."""
        assert fd in self.childFDs, f"the child has no descriptor {fd}"
        self.protocol.childDataReceived(fd, data)

    def end(self, *, status: int = 0, signal: int | None = None) -> None:
        """The child exits with C{status}, or dies of C{signal}."""
        assert not self.ended
        self.ended = True
        self.pid = None
        reason = ProcessDone(0) if status == 0 and signal is None else \
            ProcessTerminated(exitCode=None if signal else status, signal=signal)
        self.protocol.processEnded(Failure(reason))

    # The rest of IProcessTransport: nothing to do for a child that never runs.
    def closeStdin(self) -> None:
        pass

    def closeStdout(self) -> None:
        pass

    def closeStderr(self) -> None:
        pass

    def closeChildFD(self, descriptor: int) -> None:
        pass

    def writeToChild(self, childFD: int, data: bytes) -> None:
        pass

    def write(self, data: bytes) -> None:
        pass

    def writeSequence(self, data) -> None:
        pass

    def loseConnection(self) -> None:
        pass

    def getPeer(self):
        return None

    def getHost(self):
        return None


@implementer(IReactorProcess)
class ProcessReactor(MemoryReactorClock):
    """A L{MemoryReactorClock} that also spawns (fake) processes."""

    def __init__(self) -> None:
        super().__init__()
        self.processes: list[FakeProcess] = []

    def spawnProcess(self, processProtocol, executable, args=(), env=None, path=None, uid=None,
                     gid=None, usePTY=False, childFDs=None) -> FakeProcess:
        process = FakeProcess(self, processProtocol, executable, list(args), env,
                              childFDs or {0: "w", 1: "r", 2: "r"}, 1000 + len(self.processes))
        self.processes.append(process)
        return process

    @property
    def process(self) -> FakeProcess:
        """The latest child."""
        return self.processes[-1]

    def advance_to(self, when: float, step: float = 0.5) -> None:
        """Advance the clock to C{when} in steps, as a running reactor would."""
        while self.seconds() < when:
            self.advance(min(step, when - self.seconds()))


# -- HTTP: a scripted treq-like client ---------------------------------------------------------

@attrs.define
class FakeResponse:
    code: int
    body: bytes = b""

    def content(self) -> Deferred[bytes]:
        return succeed(self.body)


@attrs.frozen
class SentRequest:
    method: str
    url: str
    data: Any = None
    headers: Any = None


@attrs.define
class ScriptedHTTP:
    """
    A treq-like client whose answers the test sets per URL: a status and a
    JSON body, or None (connection refused, as from a worker that does not
    listen). Every request is recorded as a L{SentRequest}.
    """

    answers: dict[str, tuple[int, Any] | None] = attrs.Factory(dict)
    requests: list[SentRequest] = attrs.Factory(list)
    #: When set, requests wait on these Deferreds instead of answering at once.
    held: list[Deferred[Any]] | None = None

    def answer(self, url: str, code: int | None, body: Any = None) -> None:
        self.answers[url] = None if code is None else (code, body)

    def _request(self, method: str, url: str, data: Any = None, headers: Any = None
                 ) -> Deferred[Any]:
        self.requests.append(SentRequest(method, url, data, headers))
        if self.held is not None:
            self.held.append(Deferred())
            return self.held[-1]
        answer = self.answers.get(url)
        if answer is None:
            return fail(ConnectionRefusedError())
        code, body = answer
        return succeed(FakeResponse(code, json.dumps(body).encode()))

    def get(self, url: str, headers: Any = None, **kwargs: Any) -> Deferred[Any]:
        return self._request("GET", url, None, headers)

    def put(self, url: str, data: Any = None, headers: Any = None, **kwargs: Any) -> Deferred[Any]:
        return self._request("PUT", url, data, headers)

    def delete(self, url: str, headers: Any = None, **kwargs: Any) -> Deferred[Any]:
        return self._request("DELETE", url, None, headers)

    def sent(self, method: str) -> list[Any]:
        """The bodies (JSON, decoded) of the C{method} requests so far."""
        return [json.loads(r.data) if r.data else None for r in self.requests if r.method == method]

    def methods(self) -> list[str]:
        return [r.method for r in self.requests]


@attrs.define
class FakeOutgoing:
    """Stands in for L{kcoral.web.outgoing.Outgoing}: its C{client} is scripted."""

    client: ScriptedHTTP = attrs.Factory(ScriptedHTTP)
    closed: bool = False

    def close(self) -> Deferred[None]:
        self.closed = True
        return succeed(None)
