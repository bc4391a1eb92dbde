"""
The front door: every request's one canonical path (L{kcoral.web.path}),
read alike by the guard, the resources and the metrics, so that no spelling
of a path is routed one way and guarded another.
"""

from __future__ import annotations

import json

import pytest
from twisted.internet.task import Clock
from twisted.web.resource import Resource

from kcoral.errors import BadRequest
from kcoral.web.auth import CLIENT_ROUTES, TokenGuard
from kcoral.web.path import canonical
from tests.httputil import connect, fake_site, parse_raw

TOKEN = "front-door-token"


@pytest.mark.parametrize("target, path", [
    (b"/v1/run", b"/v1/run"), (b"/v1/ru%6E", b"/v1/run"), (b"/v1/ru%6e", b"/v1/run"),
    (b"/%761/n%6Fdes?x=%41", b"/v1/nodes?x=%41"), (b"/", b"/"), (b"*", b"*"),
    (b"/v2/models/a.b-c~d_1/infer", b"/v2/models/a.b-c~d_1/infer"),
    (b"/v2/models/%7E%2d%2E%5F/infer", b"/v2/models/~-._/infer"), (b"/.well", b"/.well"),
    (b"/V1/run", b"/V1/run"), (b"/v1/run?a=b/../c;d", b"/v1/run?a=b/../c;d"),
])
def test_escapes_of_unreserved_characters_are_decoded_once(target, path):
    """An escaped unreserved character is the character; case and the query are kept as sent."""
    assert canonical(target) == path


@pytest.mark.parametrize("target, says", [
    (b"//v1/run", "empty segment"), (b"/v1//nodes", "empty segment"), (b"/v1/run/", "empty segment"),
    (b"/v1%2Frun", "escaped '/'"), (b"/v1%2frun", "escaped '/'"), (b"/v1/r%3Bun", "escaped ';'"),
    (b"/v1/ru%256E", "escaped '%'"), (b"/v1/run%00", "escaped"), (b"/v1/run%", "starts no escape"),
    (b"/v1/run%6", "starts no escape"), (b"/v1/./run", "dot segment"), (b"/x/../v1/run", "dot segment"),
    (b"/v1/run/..", "dot segment"), (b"/v1/%2e%2E/run", "dot segment"), (b"/v1/run;x=1", ";parameters"),
    (b"/v1/run;", ";parameters"), (b"http://host/v1/run", "must be a path"), (b"v1/run", "must be a path"),
    (b"/v1/r\xc3\xbcn", "not allowed"), (b"/v1/run\\", "not allowed"), (b"/v1/<run>", "not allowed"),
])
def test_spellings_that_would_change_routing_are_refused(target, says):
    """Reserved escapes (a slash too), empty and dot segments, ;params, foreign bytes: refused."""
    with pytest.raises(BadRequest, match=says):
        canonical(target)


class Seen(Resource):
    """Answers 200, keeping what each request's path, URI and segments read."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.seen: list[tuple] = []

    def render(self, request):
        self.seen.append((request.path, request.uri, request.prepath + request.postpath))
        return b"ok"


def exchange(site, head: bytes) -> tuple[int, dict, bytes, bytes]:
    """Status, headers and body of C{site}'s answer to C{head}; and all it wrote."""
    channel, transport = connect(site)
    channel.dataReceived(head)
    status, headers, body = parse_raw(transport.value())
    return status, headers, body, transport.value()


def test_everything_downstream_reads_the_canonical_path():
    """The resource sees one path, in C{path}, C{uri} and the segments alike; the metrics label it."""
    resource = Seen()
    site = fake_site(Clock(), resource=resource)
    status, _, _, _ = exchange(site, b"GET /%761/ru%6E?q=%2F HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200
    assert resource.seen == [(b"/v1/run", b"/v1/run?q=%2F", [b"v1", b"run"])]
    assert site.metrics.requests.labels("/v1/run", "200")._value.get() == 1


def test_an_escaped_guarded_path_is_guarded_from_its_head():
    """C{POST /v1/ru%6E} without the token is refused from its head, as C{/v1/run} is."""
    resource = Seen()
    site = fake_site(Clock(), max_request_bytes=1 << 30, resource=resource,
                     client_guard=TokenGuard.of([TOKEN], CLIENT_ROUTES))
    status, headers, _, raw = exchange(
        site, b"POST /v1/ru%6E HTTP/1.1\r\nHost: x\r\nContent-Length: 268435456\r\n"
              b"Expect: 100-continue\r\n\r\n")
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert b"100 Continue" not in raw and resource.seen == []


@pytest.mark.parametrize("method, target", [
    (b"POST", b"//v1/run"), (b"POST", b"/v1%2Frun"), (b"GET", b"/v1//nodes"), (b"POST", b"/v1//run"),
    (b"DELETE", b"//v1/arrays/x"), (b"GET", b"/v1/nodes;x"), (b"POST", b"/v1/./run"),
])
def test_a_refused_spelling_is_a_json_400_from_its_head(method, target):
    """A path refused is a JSON 400 with the request id, its body never read, nothing routed."""
    resource = Seen()
    site = fake_site(Clock(), max_request_bytes=1 << 30, resource=resource,
                     client_guard=TokenGuard.of([TOKEN], CLIENT_ROUTES))
    status, headers, body, raw = exchange(
        site, method + b" " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 268435456\r\n"
              b"Expect: 100-continue\r\nX-Request-ID: odd-1\r\n\r\n")
    assert status == 400 and headers["x-request-id"] == "odd-1"
    error = json.loads(body)["error"]
    assert error["request_id"] == "odd-1" and error["type"] == "bad_request"
    assert b"100 Continue" not in raw and resource.seen == []


def test_a_refused_inference_path_takes_the_protocols_error_form():
    """Under C{/v2}, spelled plainly or escaped, a refused path's 400 is C{{"error": message}}."""
    for target in [b"/v2/models/a%2Fb/infer", b"/%762/models//infer"]:
        status, _, body, _ = exchange(fake_site(Clock(), resource=Seen()),
                                      b"POST " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 400 and isinstance(json.loads(body)["error"], str)
