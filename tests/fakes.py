"""
Fakes that implement the real interfaces, for in-process tests: node report
builders, C{treq.testing.StubTreq} over fake worker resources and over
servers whose answers a test sets, and a fake process reactor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
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


def node_report(session="s1", *, capacities=(2,), host="10.0.0.1", port=8000,
                healthy: bool | tuple[bool, ...] = True, gpu_target="sm_90", runtime=RUNTIME,
                draining=False) -> dict:
    """A node report with one worker per capacity, on ports C{port} and up of
    C{host}; C{healthy} is every worker's health, or each one's in turn."""
    each = healthy if isinstance(healthy, tuple) else (healthy,) * len(capacities)
    return {"session": session, "gpu_target": gpu_target, "runtime": dict(runtime),
            "draining": draining,
            "workers": [{"name": f"worker{i}", "url": f"http://{host}:{port + i}",
                         "healthy": h, "capacity": c, "active": 0}
                        for i, (c, h) in enumerate(zip(capacities, each))]}


# -- HTTP servers, reached through StubTreq --------------------------------------------------------

class FakeWorker(Resource):
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


class FakeWorkers(Resource):
    """Fake workers by host name (C{http://<name>/v1/run}), one StubTreq for all."""

    def __init__(self, **workers: FakeWorker):
        super().__init__()
        self.workers = workers
        self.treq = StubTreq(self)

    def getChild(self, path, request):
        return self.workers[request.getRequestHostname().decode()]

    def render(self, request):
        return self.getChild(b"", request).render(request)


    def client(self, *, refused=(), lost=()) -> FakeClient:
        """A L{FakeClient} of these workers, but for the hosts in C{refused}
        (nothing sent) and in C{lost} (the connection lost once sent)."""
        return FakeClient(self.treq, refuses=lambda url: _host(url) in refused,
                      loses=lambda url: _host(url) in lost)


def _host(url) -> str:
    return url.host if hasattr(url, "host") else url.split("/")[2].split(":")[0]


class FakeServers(Resource):
    """
    HTTP servers that answer what the test sets per URL, a status and a JSON
    body, reached through C{client} (a L{FakeClient} over a StubTreq); a URL
    with no answer refuses the connection, as a server that does not listen.
    """

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.answers: dict[str, tuple[int, Any]] = {}
        self.client = FakeClient(StubTreq(self), refuses=lambda url: str(url) not in self.answers)

    def answer(self, url: str, code: int, body: Any = None) -> None:
        self.answers[url] = (code, body)

    def render(self, request):
        url = f"http://{request.getHeader(b'host').decode()}{request.path.decode()}"
        code, body = self.answers[url]
        request.setResponseCode(code)
        return json.dumps(body).encode()


@attrs.frozen
class SentRequest:
    method: str
    url: str
    data: Any = None
    headers: Any = None


def _never(url) -> bool:
    return False


class FakeClient:
    """
    A treq client over C{treq} (a StubTreq) that keeps every request asked
    of it, but for URLs whose server refuses the connection (nothing is
    sent) or loses it once the request is sent: C{refuses(url)} and
    C{loses(url)} say which.
    """

    def __init__(self, treq: StubTreq, *, refuses: Callable[[Any], bool] = _never,
                 loses: Callable[[Any], bool] = _never):
        self._treq = treq
        self._refuses, self._loses = refuses, loses
        self.requests: list[SentRequest] = []
        self.flush = treq.flush

    def request(self, method: str, url, *, data: Any = None, headers: Any = None,
                **kw: Any) -> Deferred[Any]:
        self.requests.append(SentRequest(method, str(url), data, headers))
        if self._refuses(url):
            return fail(ConnectionRefusedError())
        if self._loses(url):
            return fail(ResponseFailed([Failure(ConnectionLost())]))
        return self._treq.request(method, url, data=data, headers=headers, **kw)

    def get(self, url, **kw: Any) -> Deferred[Any]:
        return self.request("GET", url, **kw)

    def post(self, url, **kw: Any) -> Deferred[Any]:
        return self.request("POST", url, **kw)

    def put(self, url, **kw: Any) -> Deferred[Any]:
        return self.request("PUT", url, **kw)

    def delete(self, url, **kw: Any) -> Deferred[Any]:
        return self.request("DELETE", url, **kw)

    def sent(self, method: str) -> list[Any]:
        """The bodies (JSON, decoded) of the C{method} requests so far."""
        return [json.loads(r.data) if r.data else None for r in self.requests if r.method == method]

    def methods(self) -> list[str]:
        return [r.method for r in self.requests]


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
        #: Whether the supervisor closed the child's standard input.
        self.stdin_closed = False
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

    def closeStdin(self) -> None:
        self.stdin_closed = True

    # The rest of IProcessTransport: nothing to do for a child that never runs.
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


# -- the supervisor's outgoing HTTP ----------------------------------------------------------

@attrs.define
class FakeOutgoing:
    """Stands in for L{kcoral.web.outgoing.Outgoing}: its C{client} reaches C{servers}."""

    servers: FakeServers = attrs.Factory(FakeServers)
    closed: bool = False

    @property
    def client(self) -> FakeClient:
        return self.servers.client

    def close(self) -> Deferred[None]:
        self.closed = True
        return succeed(None)
