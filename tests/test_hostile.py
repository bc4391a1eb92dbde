"""
Hostile input, against a real C{kcoral server} and through
a real C{kcoral router} with a node behind it, plus L{KCoralSite} on a fake
clock for the deadlines:

 - property-based fuzzing (hypothesis) of C{POST /v1/run} bodies: arbitrary
   bytes, frames around random and hostile JSON headers, truncations and
   mutations of a valid frame; and of whole HTTP requests (framing garbage).
   Every answer is a 4xx JSON error naming its request id (a well-formed
   frame may also run: 200), never a 5xx, and the service stays healthy;
 - lying C{Content-Length}, chunked bodies past the limit, headers past
   Twisted's bounds, deep and huge JSON headers, shapes whose element count
   overflows, digests that do not match their bytes, path-like digests;
 - node control requests with missing, wrong and almost-right tokens (401,
   and the token never reaches a log), node reports with absurd capacities
   or foreign endpoints, node ids that would forge a log line;
 - slow clients (the request-head deadline), slow readers (the deadline never
   truncates a response being read) and many idle connections.

The fuzz runs a few thousand cases in well under a minute. Set
C{KCORAL_FUZZ_EXAMPLES=N} to run N examples per property instead (and have
the counts printed at the end of the module).
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import re
import resource
import socket
import sys
import threading
import time

import numpy as np
import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import Site

from kcoral import Program
from kcoral.common.report import InvalidReport, parse_report
from kcoral.protocol.wire import ALIGN, MAGIC, PREFIX, REQUEST_CONTENT_TYPE, sha256
from kcoral.web.badrequest import TWISTED_BAD_REQUEST
from kcoral.web.fdlimit import RESERVED, WANTED, connection_limit
from tests.conftest import server_args, server_env
from tests.harness import LISTENING, SERVER_READY, kcoral_argv, until
from tests.httputil import connect, fake_site, parse_raw, raw_exchange, request
from tests.test_routed import FAST_ROUTER, pool_nodes, start_node, start_router, until_ready
from tests.test_server import run_frame

jax = pytest.importorskip("jax")

#: Body limit of this module's server and Router.
LIMIT = 200_000
#: The Router's node token: distinctive, so that a log line holding it is found.
TOKEN = "hostile-token-7f3a9c2e51d04b86"
#: Examples per property; KCORAL_FUZZ_EXAMPLES overrides every default below.
FUZZ_EXAMPLES = int(os.environ.get("KCORAL_FUZZ_EXAMPLES", "0"))
#: (target, property) -> Counter of outcomes, printed when KCORAL_FUZZ_EXAMPLES is set.
COUNTS: dict = collections.defaultdict(collections.Counter)


def examples(default: int) -> int:
    return FUZZ_EXAMPLES or default


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def program():
    """A tiny program, and a valid frame that runs it."""
    p = Program.from_function(lambda v: v * 2, np.ones(4, np.float32))
    return p, run_frame(p, [np.arange(4, dtype=np.float32)])


@pytest_twisted.async_fixture(scope="module")
async def server(module_processes, tmp_path_factory):
    """A server with a small body limit and a disk cache (to check that no
    client string becomes a path)."""
    cache = tmp_path_factory.mktemp("hostile") / "uploads"
    service = await module_processes.start_service(
        server_args("--max-request-bytes", str(LIMIT), "--cache-dir", str(cache)),
        name="hostile-server", ready=SERVER_READY, env=server_env())
    return Target("server", service, cache)


@pytest_twisted.async_fixture(scope="module")
async def routed(module_processes):
    """A Router with a node token and the same body limit, and one node."""
    router = await start_router(module_processes, "--max-request-bytes", str(LIMIT),
                                "--node-token", TOKEN, name="hostile-router")
    node = await start_node(module_processes, router.url, "hostile-node",
                            env={"KCORAL_NODE_TOKEN": TOKEN})
    await until_ready(router, "hostile-node")
    return Target("router", router, None, node.process)


class Target:
    """A service under attack: its port, its process and its log."""

    def __init__(self, name, service, cache=None, node=None):
        self.name = name
        self.service = service
        self.port = service.port
        self.url = service.url
        self.process = service.process
        self.cache = cache
        self.node = node

    def logs(self) -> str:
        lines = list(self.process.output.lines)
        if self.node is not None:
            lines += self.node.output.lines
        return "\n".join(lines)


@pytest.fixture(params=["server", "router"])
def target(request):
    """Each test taking C{target} runs against the server and through the Router."""
    return request.getfixturevalue("server" if request.param == "server" else "routed")


@pytest.fixture(scope="module", autouse=True)
def fuzz_report(request):
    yield
    if FUZZ_EXAMPLES and COUNTS:
        total = sum(sum(c.values()) for c in COUNTS.values())
        lines = [f"fuzz: {total} cases"]
        for (target, prop), counter in sorted(COUNTS.items()):
            lines.append(f"  {target:6} {prop:16} {sum(counter.values()):6}  "
                         + ", ".join(f"{k}: {v}" for k, v in sorted(counter.items(), key=str)))
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print("\n" + "\n".join(lines), flush=True)


# -- blocking HTTP helpers (run in threads: the reactor must keep reading the
#    children's output, or their logging would block them) -------------------------------------

class Poster:
    """One persistent HTTP/1.1 connection, for fast sequential requests."""

    def __init__(self, port: int):
        self.port = port
        self.conn = None

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict | None = None) -> tuple[int, dict, bytes]:
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        self.conn.request(method, path, body=body, headers=headers or {})
        response = self.conn.getresponse()
        data = response.read()
        if response.will_close:
            self.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data

    def run(self, body: bytes, rid: str) -> tuple[int, dict, bytes]:
        return self.request("POST", "/v1/run", body,
                            {"Content-Type": REQUEST_CONTENT_TYPE, "X-Request-ID": rid})

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def post_once(port: int, body: bytes, rid: str) -> tuple[int, dict, bytes]:
    poster = Poster(port)
    try:
        return poster.run(body, rid)
    finally:
        poster.close()


def check_error(status: int, headers: dict, body: bytes, rid: str | None = None) -> dict:
    """A JSON error naming the response's request id."""
    assert headers.get("content-type") == "application/json", (status, headers, body[:200])
    info = json.loads(body)["error"]
    assert isinstance(info["type"], str) and isinstance(info["message"], str) and info["message"]
    assert info["request_id"] == headers.get("x-request-id"), (info, headers)
    if rid is not None:
        assert info["request_id"] == rid
    return info


def check_run(answer, rid: str, allowed: frozenset) -> int:
    status, headers, body = answer
    assert status < 500, (status, body[:300])
    assert status in allowed, (status, body[:300])
    assert headers.get("x-request-id") == rid
    if status >= 400:
        check_error(status, headers, body, rid)
    return status


def health_of(port: int) -> tuple[int, float]:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        return response.status, time.monotonic() - started
    finally:
        conn.close()


async def assert_healthy(target, within: float = 2.0):
    status, seconds = await deferToThread(health_of, target.port)
    assert status == 200 and seconds < within, (status, seconds)
    assert target.process.running


def frame(header, payload: bytes = b"", *, length: int | None = None) -> bytes:
    """A frame around C{header} (JSON-encoded unless bytes), optionally with
    a lying header length."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    head = PREFIX.pack(MAGIC, len(text) if length is None else length) + text
    return head + b"\0" * (-len(head) % ALIGN) + payload


# -- strategies -----------------------------------------------------------------------------------

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=16))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
#: Digests: path-like, uppercase, one short, one long, other types.
HOSTILE_DIGESTS = ["../../etc/passwd", "/etc/passwd", "..", ".", "", "A" * 64, "a" * 63,
                   "a" * 65, "a" * 63 + "\n", "a" * 64 + "\n", "%2e%2e%2fetc%2fpasswd",
                   "..\\..\\windows", "a" * 32 + "/" + "a" * 31, "\0" * 64]
digests = st.one_of(st.sampled_from(HOSTILE_DIGESTS), st.from_regex(r"\A[0-9a-fA-F]{62,66}\Z"),
                    st.just(sha256(b"")), json_values)
segments = st.one_of(st.lists(st.integers(-2, 2 ** 66), max_size=3),
                     st.tuples(st.integers(0, 600), st.integers(0, 600)).map(list), json_values)
DIMS = [0, 1, 2, 3, 2 ** 31, 2 ** 32, 2 ** 61, 2 ** 62, 2 ** 62 + 1, 2 ** 63, 2 ** 64, -1]
shapes = st.one_of(st.lists(st.sampled_from(DIMS), max_size=8),
                   st.lists(st.integers(0, 3), min_size=60, max_size=70),
                   st.lists(st.integers(-2 ** 70, 2 ** 70), max_size=4), json_values)
dtypes = st.one_of(st.sampled_from(["float32", "int8", "bool", "bfloat16", "float8_e4m3fn",
                                    "int4", "complex128", "float128", "object", "<f4", "V8",
                                    "S10", "../float32", "float32\0", ""]), json_values)
array_entries = st.fixed_dictionaries({}, optional={
    "dtype": dtypes, "shape": shapes, "data": segments, "digest": digests, "extra": json_values})
programs_ = st.one_of(st.fixed_dictionaries({"digest": digests}, optional={"data": segments}),
                      json_values)
headers = st.one_of(
    st.fixed_dictionaries({"program": programs_,
                           "inputs": st.one_of(st.lists(array_entries, max_size=5), json_values)},
                          optional={"outputs": json_values}),
    json_values)
hostile_frames = st.builds(
    lambda header, payload, length: frame(header, payload, length=length),
    headers, st.binary(max_size=600),
    st.one_of(st.none(), st.none(), st.integers(0, 2 ** 32 - 1)))


def mutations(valid: bytes):
    """Truncations, byte flips, insertions and deletions of a valid frame."""
    size = len(valid)
    truncated = st.integers(0, size - 1).map(lambda n: ("truncated", valid[:n]))
    flipped = st.lists(st.tuples(st.integers(0, size - 1), st.integers(1, 255)),
                       min_size=1, max_size=4).map(
        lambda flips: ("mutated", _flip(valid, flips)))
    spliced = st.tuples(st.integers(0, size), st.integers(0, 16), st.binary(max_size=16)).map(
        lambda t: ("mutated", valid[:t[0]] + t[2] + valid[t[0] + t[1]:]))
    return st.one_of(truncated, flipped, spliced)


def _flip(data: bytes, flips) -> bytes:
    out = bytearray(data)
    for at, xor in flips:
        out[at] ^= xor
    return bytes(out)


def fuzz(strategy, count: int, check) -> None:
    """Run C{check} on C{count} examples of C{strategy} (call from a thread)."""

    @settings(max_examples=count, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def prop(example):
        check(example)

    prop()


# -- fuzzing /v1/run bodies -----------------------------------------------------------------------

#: What a fuzzed body may get: errors the client should fix (400), references
#: the server lacks (409), a rejected program (422); never a 5xx.
REFUSED = frozenset({400, 409, 422})


def _fuzz_bodies(target, valid: bytes) -> None:
    poster = Poster(target.port)
    serial = iter(range(10 ** 9))

    def send(body: bytes, prop: str, allowed=REFUSED) -> None:
        rid = f"fz-{target.name}-{next(serial)}"
        status = check_run(poster.run(body, rid), rid, allowed)
        COUNTS[(target.name, prop)][status] += 1

    scale = 1 if target.name == "server" else 0.6
    try:
        fuzz(st.binary(max_size=400), examples(int(250 * scale)),
             lambda body: send(body, "arbitrary bytes"))
        fuzz(hostile_frames, examples(int(700 * scale)),
             lambda body: send(body, "hostile headers"))

        def mutated(case):
            kind, body = case
            # A truncated frame always ends inside its header or a buffer; a
            # mutation may leave it valid (padding, the input's bytes): 200.
            send(body, kind, REFUSED if kind == "truncated" else REFUSED | {200})

        fuzz(mutations(valid), examples(int(700 * scale)), mutated)
    finally:
        poster.close()


@pytest.mark.slow
@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_fuzzed_run_bodies(target, program):
    """Fuzzed run bodies get a 4xx JSON error with their request id (a valid mutation 200), never a 5xx."""
    _, valid = program
    await deferToThread(_fuzz_bodies, target, valid)
    await assert_healthy(target)
    # The valid frame still runs.
    status, _, _ = await deferToThread(post_once, target.port, valid, "after-fuzz")
    assert status == 200


def read_response(sock: socket.socket, timeout: float, *, bodiless: bool = False):
    """One HTTP response from C{sock}: (status, headers, body); None if the
    server closed the connection without one; "silent" if it sent nothing
    within C{timeout} (it waits for more of the request)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return None if not data else ("partial", data)
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length:\s*(\d+)\s*$", head)
        if bodiless:  # the answer to a HEAD request
            body, length = b"", None
        while length and len(body) < int(length.group(1)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        if length:
            body = body[:int(length.group(1))]  # a second (pipelined) answer may follow
    except TimeoutError:
        if not data:
            return "silent"
        if b"\r\n\r\n" not in data:
            raise
        head, _, body = data.partition(b"\r\n\r\n")  # a HEAD answer: no body
    except ConnectionResetError:
        return None
    return parse_raw(head + b"\r\n\r\n" + body)


methods = st.one_of(st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS",
                                     b"CONNECT", b"", b"G\0T", b"post"]), st.binary(max_size=8))
request_targets = st.one_of(
    st.sampled_from([b"/v1/run", b"/health", b"/v1/nodes/x", b"/v1/nodes/%0a", b"*", b"",
                     b"http://x/v1/run", b"/%00", b"/../../etc/passwd", b"/" + b"a" * 3000]),
    st.binary(max_size=40))
versions = st.one_of(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9",
                                      b"HTTP/1.1 extra", b"", b"http/1.1"]), st.binary(max_size=8))
header_lines = st.lists(st.one_of(
    st.sampled_from([b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip",
                     b"Transfer-Encoding: chunked, identity", b"Content-Length: -1",
                     b"Content-Length: 1e3", b"Content-Length: 0x10", b"Content-Length: 0",
                     b"Content-Length: 5, 5", b"Content-Length: 99999999999999999999999",
                     b"Expect: 100-continue", b" folded", b"Host:", b": empty name",
                     b"Connection: close", b"X-Request-ID: \xff\xfe",
                     b"Authorization: Bearer " + TOKEN[:-1].encode()]),
    st.tuples(st.binary(max_size=16), st.binary(max_size=40)).map(lambda t: t[0] + b": " + t[1]),
    st.binary(max_size=60)), max_size=8)
garbage_requests = st.builds(
    lambda m, t, v, h, body: b"\r\n".join([m + b" " + t + b" " + v, *h]) + b"\r\n\r\n" + body,
    methods, request_targets, versions, header_lines, st.binary(max_size=80))


def _fuzz_framing(target) -> None:
    def send(raw: bytes) -> None:
        with socket.create_connection(("127.0.0.1", target.port), timeout=10) as sock:
            try:
                sock.sendall(raw)
            except (BrokenPipeError, ConnectionResetError):
                COUNTS[(target.name, "http framing")]["dropped"] += 1
                return
            answer = read_response(sock, 0.5, bodiless=raw.startswith(b"HEAD "))
        if answer is None or answer == "silent":
            # Dropped, or waiting for a body the garbage announced (cut off
            # later by the idle timeout).
            COUNTS[(target.name, "http framing")]["dropped" if answer is None else "silent"] += 1
            return
        assert isinstance(answer, tuple) and len(answer) == 3 and isinstance(answer[0], int), answer
        status, headers, body = answer
        assert status < 500, (raw[:200], answer)
        if status >= 400 and not raw.startswith(b"HEAD "):
            # Twisted's own answer to unparseable HTTP is JSON too.
            check_error(status, headers, body)
        COUNTS[(target.name, "http framing")][status] += 1

    fuzz(garbage_requests, examples(200 if target.name == "server" else 120), send)


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_fuzzed_http_framing(target):
    """Fuzzed HTTP requests get no 5xx, every 4xx is a JSON error, and the service stays healthy."""
    await deferToThread(_fuzz_framing, target)
    await assert_healthy(target)


# -- specific hostile frames ------------------------------------------------------------------

def _deep(depth: int) -> bytes:
    return b'{"program": ' + b"[" * depth + b"]" * depth + b', "inputs": []}'


def _input(**entry):
    return frame({"program": {"digest": "b" * 64}, "inputs": [entry]}, b"\0" * 64)


HOSTILE = {
    "deep JSON header": (frame(_deep(60_000)), "not valid JSON"),
    "deep JSON objects": (frame(b'{"a":' * 30_000 + b"1" + b"}" * 30_000), "not valid JSON"),
    "header length over 1 MiB": (frame({"program": {}}, length=(1 << 20) + 1), "exceeds"),
    "header length of 4 GiB": (frame({"program": {}}, length=2 ** 32 - 1), "exceeds"),
    "a 5000-digit number": (frame(b'{"program": {"digest": ' + b"9" * 5000 + b"}}"), "not valid JSON"),
    "a 150 kB string": (frame({"program": {"digest": "a" * 150_000}, "inputs": []}), "digest"),
    "4097 inputs": (frame({"program": {"digest": "b" * 64}, "inputs": [{}] * 4097}), "at most 4096"),
    "element count over 2**62": (_input(dtype="float32", shape=[2 ** 31, 2 ** 31], data=[0, 64]),
                                 "too large"),
    "element count overflowing 64 bits": (_input(dtype="int8", shape=[2 ** 40] * 4, digest="c" * 64),
                                          "too large"),
    "a dimension over 2**62": (_input(dtype="int8", shape=[2 ** 63], digest="c" * 64), "each dimension"),
    "a negative dimension": (_input(dtype="int8", shape=[-1], digest="c" * 64), "each dimension"),
    "a float dimension": (_input(dtype="int8", shape=[1.5], digest="c" * 64), "each dimension"),
    "a bool dimension": (_input(dtype="int8", shape=[True], digest="c" * 64), "each dimension"),
    "rank 65": (_input(dtype="int8", shape=[1] * 65, digest="c" * 64), "at most 64"),
    "shape larger than its bytes": (_input(dtype="float32", shape=[1000], data=[0, 64]), "needs 4000 bytes"),
    "a segment outside the body": (_input(dtype="int8", shape=[64], data=[2 ** 62, 64]), "outside the body"),
    "a negative segment": (_input(dtype="int8", shape=[64], data=[-64, 64]), "[offset, length]"),
    "program bytes not matching their digest": (
        frame({"program": {"digest": sha256(b"other"), "data": [0, 5]}, "inputs": []}, b"bytes"),
        "does not match its digest"),
    "input bytes not matching their digest": (
        frame({"program": {"digest": sha256(b"prog!"), "data": [0, 5]},
               "inputs": [{"dtype": "int8", "shape": [4], "data": [64, 4], "digest": sha256(b"1234")}]},
              b"prog!" + b"\0" * 59 + b"4321"),
        "does not match its digest"),
}
HOSTILE.update({
    f"program digest {d!r}": (frame({"program": {"digest": d, "data": [0, 5]}, "inputs": []}, b"bytes"),
                              "64 lowercase hex")
    for d in ("../../etc/passwd", "A" * 64, "a" * 63, "../" * 21 + "a")})
HOSTILE.update({
    f"input digest {d!r}": (_input(dtype="int8", shape=[4], digest=d), "64 lowercase hex")
    for d in ("../../etc/passwd", "/tmp/" + "a" * 59, "F" * 64)})


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest_twisted.ensureDeferred
async def test_hostile_frames(target, case):
    """Each hostile frame is a 400 bad_request saying what is wrong, and the service stays healthy."""
    body, message = HOSTILE[case]
    assert len(body) < LIMIT
    rid = "hf-" + re.sub(r"[^A-Za-z0-9]+", "-", case)[:100]
    answer = await deferToThread(post_once, target.port, body, rid)
    check_run(answer, rid, frozenset({400}))
    info = check_error(*answer, rid)
    assert info["type"] == "bad_request" and message in info["message"], info
    await assert_healthy(target)


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_no_client_string_becomes_a_path(server, program):
    """No hostile digest becomes a path: the cache holds only files named by a digest."""
    p, _ = program
    for d in HOSTILE_DIGESTS:
        body = frame({"program": {"digest": p.digest},
                      "inputs": [{"dtype": "int8", "shape": [4], "digest": d}]})
        answer = await deferToThread(post_once, server.port, body, "path-1")
        check_run(answer, "path-1", frozenset({400}))
    # A valid run with content over the cache threshold writes its uploads:
    # every file in the cache directory is named by a digest, nothing else.
    big = np.ones(32 * 1024, np.float32)
    prog = Program.from_function(lambda v: v.sum(), big)
    answer = await deferToThread(post_once, server.port, run_frame(prog, [big]), "path-2")
    assert answer[0] == 200, answer
    names = os.listdir(server.cache)
    assert names and all(re.fullmatch(r"[0-9a-f]{64}", n) for n in names), names
    assert not (server.cache.parent / "passwd").exists()


# -- lying Content-Length, chunked bodies, headers ------------------------------------------------

def _head(rid: str, *lines: bytes, path=b"/v1/run") -> bytes:
    return b"\r\n".join([b"POST " + path + b" HTTP/1.1", b"Host: 127.0.0.1",
                         b"Content-Type: application/x-kcoral-run",
                         b"X-Request-ID: " + rid.encode(), *lines]) + b"\r\n\r\n"


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_content_length_shorter_than_the_body(target, program):
    """A Content-Length shorter than the body is read as announced: half a frame, a 400."""
    _, valid = program
    head = _head("short-cl", b"Content-Length: %d" % (len(valid) // 2))
    # The server reads what the header announced: half a frame, a 400. The
    # rest is read as the next request: garbage, refused or left waiting.
    status, headers, body = await deferToThread(_first_answer, target.port, head + valid)
    assert status == 400 and check_error(status, headers, body, "short-cl")["type"] == "bad_request"
    await assert_healthy(target)


def _first_answer(port: int, raw: bytes):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        return read_response(sock, 5)


def _longer_than_sent(port: int, head: bytes, part: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + part)
        sock.settimeout(1.5)
        try:
            return sock.recv(65536)
        except TimeoutError:
            return b"(silent)"


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_content_length_longer_than_the_body(target, program):
    """A Content-Length longer than the body sent gets no answer until the rest comes."""
    _, valid = program
    head = _head("long-cl", b"Content-Length: %d" % (len(valid) + 1000))
    # The service waits for the rest (the idle timeout ends it: see
    # test_a_stalled_body_is_cut_by_the_idle_timeout); it never answers from
    # half a body, nor crashes when the client gives up.
    got = await deferToThread(_longer_than_sent, target.port, head, valid)
    assert got in (b"(silent)", b""), got
    await assert_healthy(target)


def _chunked(size: int, count: int):
    chunk = b"%x\r\n" % size + b"\0" * size + b"\r\n"
    return [chunk] * count + [b"0\r\n\r\n"]


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_chunked_body_past_the_limit(target):
    """A chunked body is refused with a JSON 413 once it passes the limit, and the refusal logged."""
    head = _head("chunked-413", b"Transfer-Encoding: chunked")
    # 5 MB offered against a 200 kB limit: answered as soon as it passes.
    raw = await deferToThread(raw_exchange, target.port, head, _chunked(50_000, 100), timeout=30)
    status, headers, body = parse_raw(raw)
    assert status == 413
    info = check_error(status, headers, body, "chunked-413")
    assert info["type"] == "payload_too_large"
    await target.process.wait_for_line(r"chunked-413 refused: request body exceeds the limit", 10)
    await assert_healthy(target)


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_declared_body_past_the_limit(target):
    """A Content-Length past the limit is refused with a JSON 413 before any body is read."""
    raw = await deferToThread(raw_exchange, target.port,
                              _head("cl-413", b"Content-Length: %d" % (LIMIT + 1)), timeout=30)
    status, headers, body = parse_raw(raw)
    assert status == 413 and check_error(status, headers, body, "cl-413")["type"] == "payload_too_large"
    await assert_healthy(target)


BAD_HEADS = {
    "600 headers": b"GET /health HTTP/1.1\r\nHost: x\r\n"
                   + b"".join(b"X-Filler-%d: y\r\n" % i for i in range(600)) + b"\r\n",
    "17 kB of headers": b"GET /health HTTP/1.1\r\nHost: x\r\n"
                        + b"".join(b"X-Filler-%d: %s\r\n" % (i, b"y" * 1000) for i in range(17)) + b"\r\n",
    "one 20 kB header line": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 20_000 + b"\r\n\r\n",
    "a 20 kB request line": b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "two Content-Lengths": b"POST /v1/run HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    "Content-Length and chunked": b"POST /v1/run HTTP/1.1\r\nContent-Length: 3\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "a negative Content-Length": b"POST /v1/run HTTP/1.1\r\nContent-Length: -3\r\n\r\nabc",
    "an unknown transfer coding": b"POST /v1/run HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
    "a malformed chunk": b"POST /v1/run HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
    "a path that is not UTF-8": b"GET /health\xff HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    "an escaped path that is not UTF-8": b"GET /v1/nodes/%ff%fe HTTP/1.1\r\nConnection: close\r\n\r\n",
    "a Host that is not UTF-8": b"GET /health HTTP/1.1\r\nHost: \xff\xfe\r\nConnection: close\r\n\r\n",
    "a garbage request line": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
}


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(BAD_HEADS))
@pytest_twisted.ensureDeferred
async def test_malformed_http_is_refused(target, case):
    """Malformed HTTP heads are dropped or answered 400/431 in JSON, the service left healthy."""
    raw = await deferToThread(raw_exchange, target.port, BAD_HEADS[case], timeout=10)
    if raw:  # some are dropped without a word (a line past Twisted's line limit)
        status, headers, body = parse_raw(raw)
        assert status in (400, 431), raw[:300]
        check_error(status, headers, body)
    await assert_healthy(target)


# -- node control requests and reports (the Router) --------------------------------------------

def _report(**worker) -> dict:
    w = {"name": "w0", "url": "http://127.0.0.1:1", "healthy": True, "capacity": 1, "active": 0}
    w.update(worker)
    return {"session": "intruder", "runtime": {}, "gpu_target": "cpu", "workers": [w]}


ALMOST_RIGHT = [None, "", "Bearer", "Bearer ", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x",
                f"Bearer {TOKEN.upper()}", f"Bearer {TOKEN[:-1]}{chr(ord(TOKEN[-1]) + 1)}",
                f"Basic {TOKEN}", TOKEN, f"Bearer{TOKEN}", f"Bearer {TOKEN} {TOKEN}",
                f"Bearer {TOKEN[::-1]}", "Bearer " + "x" * 10_000]


def _control_attempts(port: int) -> list:
    poster = Poster(port)
    answers = []
    try:
        for i, authorization in enumerate(ALMOST_RIGHT):
            headers = {"Content-Type": "application/json", "X-Request-ID": f"tok-{i}"}
            if authorization is not None:
                headers["Authorization"] = authorization
            body = json.dumps(_report()).encode()
            answers.append(poster.request("PUT", "/v1/nodes/intruder", body, headers))
            answers.append(poster.request("DELETE", "/v1/nodes/hostile-node?session=x", None, headers))
    finally:
        poster.close()
    return answers


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_control_requests_with_wrong_tokens(routed):
    """Almost-right tokens get a 401 each, logged by node id; the token is in no answer or log."""
    mark = routed.process.mark()
    answers = await deferToThread(_control_attempts, routed.port)
    for status, headers, body in answers:
        assert status == 401, (status, body)
        info = check_error(status, headers, body)
        assert info["type"] == "unauthorized" and TOKEN not in body.decode()
        assert headers.get("www-authenticate") == "Bearer"
    await routed.process.wait_for_line(r"refused a control request for node intruder with a wrong token",
                                       10, since=mark)
    refusals = routed.process.matching(r"refused a control request for node (intruder|hostile-node)",
                                       since=mark)
    assert len(refusals) == 2 * len(ALMOST_RIGHT), refusals
    nodes = await pool_nodes(routed.service)
    assert set(nodes) == {"hostile-node"} and nodes["hostile-node"]["state"] == "ready"
    # The token is in neither log: the Router's, nor the node's.
    assert TOKEN not in routed.logs() and TOKEN[:-1] not in routed.logs()


FORGED = "2026-01-01T00:00:00+0000 info  [kcoral.router.pool] node forged joined"


@pytest.mark.integration
@pytest.mark.parametrize("method", ["PUT", "DELETE"])
@pytest_twisted.ensureDeferred
async def test_node_ids_cannot_forge_log_lines(routed, method):
    """A node id holding a newline is refused (400 or 404) and forges no log line."""
    from urllib.parse import quote

    path = "/v1/nodes/" + quote("evil\n" + FORGED, safe="")
    answer = await request(method, routed.url + path, body=b"{}",
                           headers={"Authorization": "Bearer wrong"})
    # 400 for the bad id (404 if the escaped text stops matching the route).
    assert answer.code in (400, 404) and answer.error()["type"] in ("bad_request", "not_found")
    assert not routed.process.matching(r"node forged joined")


FOREIGN = {
    "absurd capacity": _report(capacity=10 ** 9),
    "capacity 2**64": _report(capacity=2 ** 64),
    "negative capacity": _report(capacity=-5),
    "fractional capacity": _report(capacity=1.5),
    "infinite capacity": json.loads('{"session": "s", "workers": [{"name": "w", "url": '
                                    '"http://127.0.0.1:1", "healthy": true, "capacity": 1e999}]}'),
    "a file URL": _report(url="file:///etc/passwd"),
    "a gopher URL": _report(url="gopher://127.0.0.1:70"),
    "a URL with userinfo": _report(url="http://admin:secret@127.0.0.1:8000"),
    "a URL with an empty userinfo": _report(url="http://@127.0.0.1:8000"),
    "a URL with a path": _report(url="http://127.0.0.1:8000/admin"),
    "a URL with a query": _report(url="http://127.0.0.1:8000?next=x"),
    "port 0": _report(url="http://127.0.0.1:0"),
    "port 65536": _report(url="http://127.0.0.1:65536"),
    "no port": _report(url="http://127.0.0.1"),
    "a newline": _report(url="http://127.0.0.1:8000\nforged"),
    "a trailing newline": _report(url="http://127.0.0.1:8000\n"),
    "a tab in the host": _report(url="http://127.0.0.\t1:8000"),
    "a space in the host": _report(url="http://127.0.0 .1:8000"),
    "an escaped host": _report(url="http://%31%32%37.0.0.1:8000"),
    "a bad IPv6 literal": _report(url="http://[::g]:8000"),
    "65 workers": {"session": "s", "workers": [
        {"name": f"w{i}", "url": f"http://127.0.0.1:{2000 + i}", "healthy": True, "capacity": 1024}
        for i in range(65)]},
}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_reports_with_foreign_endpoints_are_invalid(case):
    """Reports with absurd capacities, non-HTTP or odd worker URLs, or 65 workers are invalid."""
    with pytest.raises(InvalidReport):
        parse_report(FOREIGN[case])


@pytest.mark.parametrize("url,normal", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("https://GPU-a.Example:8443/", "https://gpu-a.example:8443"),
    ("http://[::1]:8000", "http://[::1]:8000"),
    ("http://10.1.2.3:08000", "http://10.1.2.3:8000"),
])
def test_worker_urls_are_rebuilt_from_their_checked_parts(url, normal):
    """A worker URL is rebuilt from its checked parts (lower-case host, no slash, port)."""
    assert parse_report(_report(url=url)).workers[0].url == normal


def _put_reports(port: int) -> list:
    poster = Poster(port)
    try:
        return [poster.request("PUT", f"/v1/nodes/foreign-{i}", json.dumps(report).encode(),
                               {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
                for i, report in enumerate(FOREIGN[c] for c in sorted(FOREIGN))]
    finally:
        poster.close()


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_node_report_with_absurd_capacity_or_a_foreign_endpoint(routed):
    # With the right token: the token authenticates, the report is still
    # validated field by field.
    """Foreign reports with the right token are still refused 400, the pool unchanged."""
    answers = await deferToThread(_put_reports, routed.port)
    for case, (status, headers, body) in zip(sorted(FOREIGN), answers):
        assert status == 400, (case, body)
        assert "invalid node report" in check_error(status, headers, body)["message"]
    nodes = await pool_nodes(routed.service)
    assert set(nodes) == {"hostile-node"}
    health = (await request("GET", routed.url + "/health")).json
    assert health["status"] == "ok" and health["capacity"] == 2
    assert not routed.process.matching(r"forged")


# -- slow clients, slow readers, idle connections (a real process) ------------------------------

def _idle_sockets(port: int, count: int) -> list:
    sockets = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % 2:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head never finished
        sockets.append(sock)
    return sockets


def _trickle(port: int, stop: threading.Event) -> int:
    """A client sending its request head a byte every 0.2 s until told to stop."""
    sent = 0
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"z" * 1000
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        while not stop.is_set() and sent < len(head):
            sock.sendall(head[sent:sent + 1])
            sent += 1
            stop.wait(0.2)
    return sent


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_many_idle_connections_and_a_slow_client(target):
    """500 idle connections and a byte-dribbling client do not slow /health down."""
    sockets = await deferToThread(_idle_sockets, target.port, 500)
    stop = threading.Event()
    slow = deferToThread(_trickle, target.port, stop)
    try:
        # The service still answers at once, through 500 idle connections and
        # a client dribbling its head.
        for _ in range(5):
            status, seconds = await deferToThread(health_of, target.port)
            assert status == 200 and seconds < 1.0, seconds
        assert target.process.running
    finally:
        stop.set()
        await slow
        for sock in sockets:
            sock.close()
    await assert_healthy(target)


# -- connections beyond the cap (a real Router with few file descriptors) ----------------------

#: The Router's file limit in the test: it takes 128 - 64 = 64 connections.
#: Without the cap, the 150 the test opens would exhaust its descriptors.
FEW_FILES = 128


def _connect(port: int) -> socket.socket | None:
    """A connection to C{port} on loopback; None when the peer reset it
    before C{connect} returned: a service at its connection cap aborts a
    connection as soon as it accepts it, which may come before the
    connecting thread reads the handshake's outcome."""
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=10)
    except ConnectionResetError:
        return None


def _closed(sockets: list) -> int:
    """How many of C{sockets} the peer has closed (without a word; None:
    reset while connecting)."""
    closed = 0
    for sock in sockets:
        if sock is None:
            closed += 1
            continue
        sock.setblocking(False)
        try:
            closed += sock.recv(1) == b""
        except BlockingIOError:
            pass
        except ConnectionResetError:
            closed += 1
    return closed


class _Worker(Resource):
    """Stands for a node's worker: answers every run with the same bytes."""

    isLeaf = True

    def render_POST(self, request):
        return b"ran " + request.content.read()


def _exchange(sock, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request on an open connection; its status and body."""
    sock.setblocking(True)
    sock.settimeout(30)
    sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, response.read()


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_at_the_connection_cap_the_router_still_reaches_its_nodes(processes):
    """Past its connection cap the Router closes new ones, logging once, and still reaches nodes."""
    worker = reactor.listenTCP(0, Site(_Worker()), interface="127.0.0.1")
    limited = [sys.executable, "-c",
               ("import os, resource, sys; "
                f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FEW_FILES}, {FEW_FILES})); "
                "os.execv(sys.argv[1], sys.argv[1:])"),
               *kcoral_argv("router", "--port", "0", *FAST_ROUTER)]
    router = processes.spawn(limited, name="few-files")
    port = int((await router.wait_for_line(LISTENING, 60)).group("url").rsplit(":", 1)[1])
    sockets = await deferToThread(lambda: [_connect(port) for _ in range(150)])
    try:
        # 64 taken, the other 86 closed at once, with one line saying so.
        await router.wait_for_line(r"64 connections are open, the most this service takes", 10)

        async def closed_86():
            return await deferToThread(_closed, sockets) >= 86

        await until(closed_86, "86 connections closed", 10)
        assert await deferToThread(_closed, sockets) == 86
        held = [sock for sock in sockets if sock is not None and not _closed([sock])]
        # On connections it holds, a node registers and a run is forwarded:
        # the Router opens its connection to the worker with a descriptor the
        # clients could not take.
        report = json.dumps({
            "session": "s1", "gpu_target": "cpu", "runtime": {"kcoral": "x"}, "draining": False,
            "workers": [{"name": "worker0", "url": f"http://127.0.0.1:{worker.getHost().port}",
                         "healthy": True, "capacity": 1, "active": 0}]}).encode()
        status, _ = await deferToThread(_exchange, held[0], b"PUT /v1/nodes/capped HTTP/1.1\r\n"
                                        b"Host: x\r\nContent-Type: application/json\r\n", report)
        assert status == 200
        await router.wait_for_line(r"node capped: joining -> ready", 10)
        status, body = await deferToThread(_exchange, held[1], b"POST /v1/run HTTP/1.1\r\n"
                                           b"Host: x\r\nX-Request-ID: capped-1\r\n"
                                           b"Content-Type: " + REQUEST_CONTENT_TYPE.encode() + b"\r\n",
                                           b"program")
        assert (status, body) == (200, b"ran program")
    finally:
        for sock in sockets:
            if sock is not None:
                sock.close()
        await worker.stopListening()
    await router.wait_for_line(r"taking connections again; 86 were closed at the limit", 10)
    assert len([line for line in router.output.lines if "the most this service takes" in line]) == 1


def test_the_connection_limit_leaves_descriptors_for_the_rest():
    """connection_limit() raises the file limit and leaves descriptors reserved."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        limit = connection_limit()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)
    assert soft >= min(hard, WANTED) or hard == resource.RLIM_INFINITY
    assert limit == soft - min(RESERVED, soft // 2) and 0 < limit < soft


# -- KCoralSite's deadlines, on a fake clock ------------------------------------------------------

def test_answers_do_not_name_the_server_software():
    """Answers carry a Date header but no Server header naming Twisted."""
    channel, transport = connect(fake_site(Clock()))
    channel.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    head = transport.value().split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 200") and b"\r\ndate: " in head
    assert b"\r\nserver:" not in head and b"twisted" not in head


@pytest.mark.parametrize("method, status", [(b"GET", 405), (b"POST", 405), (b"OPTIONS", 200)])
def test_a_request_for_star_is_answered_like_any_other(method, status):
    """Twisted answers "*" itself (an empty 405 but for OPTIONS): here the
    405 is a JSON error with the request id, like every other error."""
    channel, transport = connect(fake_site(Clock()))
    channel.dataReceived(method + b" * HTTP/1.1\r\nHost: x\r\nX-Request-ID: star-1\r\n"
                         b"Content-Length: 0\r\n\r\n")
    code, headers, body = parse_raw(transport.value())
    assert code == status and headers["x-request-id"] == "star-1" and "server" not in headers
    if status == 405:
        assert headers["allow"] == "OPTIONS"
        check_error(code, headers, body, "star-1")
    else:
        assert body == b""


def test_a_byte_a_second_client_is_cut_off_by_the_head_deadline():
    """A client still sending its head at the head deadline is closed, unanswered."""
    clock = Clock()
    channel, transport = connect(fake_site(clock, header_timeout=10.0))
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"z" * 100
    for byte in head[:9]:
        channel.dataReceived(bytes([byte]))
        clock.advance(1)
    assert not transport.disconnecting
    channel.dataReceived(head[9:10])
    clock.advance(1)  # 10 s since the connection opened
    assert transport.disconnecting and transport.value() == b""


def _post_slowly(clock, body: bytes, per_second: int, seconds: int):
    """A POST whose body arrives at C{per_second} bytes each second."""
    channel, transport = connect(fake_site(clock, max_request_bytes=1 << 20))
    channel.dataReceived(b"POST /v1/run HTTP/1.1\r\nHost: x\r\nX-Request-ID: slow-1\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
    for second in range(seconds):
        if transport.disconnecting:
            break
        clock.advance(1)
        channel.dataReceived(body[second * per_second:(second + 1) * per_second])
    return transport


def test_a_body_that_trickles_in_is_refused_with_408():
    """A body under the least rate is refused with a JSON 408 at its first bytes past the grace."""
    clock = Clock()
    transport = _post_slowly(clock, b"x" * 3000, per_second=100, seconds=30)
    # 100 bytes a second, under the least of 1 KiB/s: refused once the 10 s
    # grace has passed, at the first bytes that arrive after it.
    assert transport.disconnecting and clock.seconds() == 11
    code, headers, body = parse_raw(transport.value())
    assert code == 408
    info = check_error(code, headers, body, "slow-1")
    assert info["type"] == "request_timeout" and "arrives at 100 bytes/s" in info["message"]


def test_a_slow_but_steady_body_is_served():
    """A body that arrives slowly but above the least rate is served."""
    clock = Clock()
    transport = _post_slowly(clock, b"x" * 2048 * 30, per_second=2048, seconds=30)
    assert transport.value().endswith(b"got %d" % (2048 * 30))
    assert not transport.disconnecting


def test_a_head_in_time_is_served_and_the_deadline_rearmed():
    """A head before the deadline is served, and the deadline rearmed for the next head."""
    clock = Clock()
    channel, transport = connect(fake_site(clock, header_timeout=10.0))
    clock.advance(9)
    channel.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200 OK" in transport.value() and transport.value().endswith(b"hello")
    assert not transport.disconnecting
    # A keep-alive connection gets the same deadline for its next head.
    clock.advance(9.9)
    assert not transport.disconnecting
    clock.advance(0.2)
    assert transport.disconnecting


def test_a_stalled_body_is_cut_by_the_idle_timeout():
    """A body that stops arriving is closed by the idle timeout, not before."""
    clock = Clock()
    channel, transport = connect(fake_site(clock, header_timeout=10.0, idle_timeout=60.0))
    channel.dataReceived(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\nabc")
    # Nothing more arrives: no byte to check the body's rate on, so the idle
    # timeout ends it (one that trickles in gets a 408, above).
    clock.advance(59)
    assert not transport.disconnecting
    clock.advance(2)
    assert transport.disconnecting and transport.value() == b""


def test_unparseable_http_is_a_json_400():
    """HTTP Twisted cannot parse (600 headers) is a JSON 400 with the request id, then closed."""
    clock = Clock()
    channel, transport = connect(fake_site(clock))
    channel.dataReceived(b"GET / HTTP/1.1\r\nX-Request-ID: bad-1\r\n"
                                    + b"".join(b"X-%d: y\r\n" % i for i in range(600)) + b"\r\n")
    status, headers, body = parse_raw(transport.value())
    assert status == 400 and transport.disconnecting
    info = check_error(status, headers, body, "bad-1")
    assert info["type"] == "bad_request" and "malformed HTTP" in info["message"]


def test_a_body_refused_from_its_length_gets_no_100_continue():
    """A client that asks whether to send a body already too large gets only the 413."""
    channel, transport = connect(fake_site(Clock(), max_request_bytes=10))
    channel.dataReceived(b"POST / HTTP/1.1\r\nHost: x\r\nX-Request-ID: big-1\r\n"
                         b"Expect: 100-continue\r\nContent-Length: 11\r\n\r\n")
    assert b"100 Continue" not in transport.value()
    code, headers, body = parse_raw(transport.value())
    assert code == 413 and check_error(code, headers, body, "big-1")["type"] == "payload_too_large"


def test_the_bad_request_wrapper_passes_every_other_write_through():
    """JSONBadRequest rewrites only Twisted's bare 400; anything else reaches the transport as is."""
    wrapper, transport = connect(fake_site(Clock()))  # the channel's transport
    wrapper.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert transport.value() == b"HTTP/1.1 200 OK\r\n\r\n"
    wrapper.write(TWISTED_BAD_REQUEST)
    status, headers, body = parse_raw(transport.value()[len(b"HTTP/1.1 200 OK\r\n\r\n"):])
    assert status == 400 and check_error(status, headers, body)["message"] == "malformed HTTP request"


class _Big(Resource):
    isLeaf = True
    size = 32 << 20

    def render_GET(self, request):
        request.setHeader(b"Content-Length", b"%d" % self.size)
        return b"x" * self.size


def _slow_read(port: int, ready: threading.Event) -> int:
    """The body bytes received by a client that reads only once C{ready} is set."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        # Meanwhile the response sits in the server's buffers.
        assert ready.wait(30), "the head deadline never passed"
        head, received = b"", 0
        while True:
            try:
                data = sock.recv(1 << 20)
            except ConnectionResetError:
                break
            if not data:
                break
            if b"\r\n\r\n" not in head:
                head += data
                if b"\r\n\r\n" in head:
                    received = len(head.partition(b"\r\n\r\n")[2])
            else:
                received += len(data)
            if received >= _Big.size:
                break
        return received


@pytest_twisted.ensureDeferred
async def test_the_head_deadline_never_truncates_a_response_being_read():
    # Regression: the deadline for the next request head starts when a
    # response is handed to the transport, and used to abort the connection,
    # dropping the part of a large response the client had not read yet.
    """The head deadline never cuts a large response a slow reader is still reading."""
    passed = threading.Event()

    def observe(event):
        if event.get("log_format", "").startswith("closing a connection that sent no complete"):
            passed.set()

    site = fake_site(reactor, resource=_Big(), header_timeout=0.3, log=Logger(observer=observe))
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    try:
        # The client reads only once the deadline has passed.
        got = await deferToThread(_slow_read, port.getHost().port, passed)
    finally:
        await port.stopListening()
    assert got == _Big.size


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
