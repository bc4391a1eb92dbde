"""
L{Client}: the blocking client, on the standard library's C{http.client}.

A blocking client cannot use treq without running a reactor in a hidden
thread of the caller's process (and a reactor cannot be restarted); keep-alive
HTTP/1.1 with C{http.client} needs no such machinery. L{AsyncClient} is the
treq client for code that already runs a reactor.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from urllib.parse import urlsplit

from kcoral.client.exchange import Response, RunCall, Send, exchange
from kcoral.errors import NodeFailure
from kcoral.program import Program


def _dropped(sock: socket.socket) -> bool:
    """Whether the peer has closed C{sock} (readable before any request)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class Client:
    """
    A blocking client for one KCoral server or Router. Keeps one keep-alive
    connection; calls from several threads are serialised.
    """

    def __init__(self, url: str, *, busy_timeout: float = 60.0, timeout: float | None = None,
                 ssl_context=None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url.rstrip("/")
        self.busy_timeout = busy_timeout
        self.timeout = timeout
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl_context = ssl_context
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self._held: set[str] = set()
        #: Bytes of request bodies sent, for callers that watch traffic.
        self.bytes_sent = 0

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is not None and conn.sock is not None and _dropped(conn.sock):
            # The server closed this idle keep-alive connection (its idle
            # timeout, a restart): a request sent on it would be lost.
            self.close()
            conn = None
        if conn is None:
            if self._scheme == "https":
                conn = http.client.HTTPSConnection(self._host, self._port, context=self._ssl_context)
            else:
                conn = http.client.HTTPConnection(self._host, self._port)
            self._conn = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _request(self, method: str, path: str, send: Send | None, deadline: float | None) -> Response:
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        conn = self._connection(remaining)
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for name, value in (send.headers.items() if send else ()):
                conn.putheader(name, value)
            conn.putheader("Content-Length", str(send.length if send else 0))
            conn.endheaders()
            for part in (send.parts if send else ()):
                conn.send(part)
            answer = conn.getresponse()
            body = answer.read()
        except (ConnectionRefusedError, socket.gaierror) as e:
            self.close()
            return Response(None, problem=str(e))
        except socket.timeout:
            self.close()
            raise TimeoutError(f"no answer from {self.url} within the client's timeout") from None
        except (http.client.HTTPException, OSError) as e:
            self.close()
            raise NodeFailure(f"the connection to {self.url} failed: {e}") from None
        if send is not None:
            self.bytes_sent += send.length
        if answer.will_close:
            self.close()
        return Response(answer.status, body, _retry_after(answer.getheader("Retry-After")))

    def run(self, program: Program, *args, request_id: str | None = None, **kwargs):
        """Run C{program} on C{args}; returns outputs in the structure it returns."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._lock:
            steps = exchange(RunCall.prepare(program, args, kwargs), self._held,
                             busy_timeout=self.busy_timeout, request_id=request_id)
            answer = None
            while True:
                try:
                    step = steps.send(answer)
                except StopIteration as done:
                    return done.value
                if isinstance(step, Send):
                    answer = self._request("POST", "/v1/run", step, deadline)
                else:
                    if deadline is not None and time.monotonic() + step.seconds > deadline:
                        raise TimeoutError("the client's timeout passed while the server was busy")
                    time.sleep(step.seconds)
                    answer = None

    def health(self) -> dict:
        """The service's C{/health} document (also when it answers 503)."""
        with self._lock:
            answer = self._request("GET", "/health", None, None if self.timeout is None
                                   else time.monotonic() + self.timeout)
        if answer.status is None:
            raise ConnectionError(f"could not reach {self.url}: {answer.problem}")
        return json.loads(answer.body)
