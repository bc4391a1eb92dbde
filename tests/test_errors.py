"""
The error table (kcoral.errors): status codes, JSON bodies, and the client-side
exceptions rebuilt from them.
"""

from __future__ import annotations

import json

import pytest

import kcoral
from kcoral.errors import (
    ERRORS_BY_STATUS,
    BadRequest,
    KCoralError,
    MissingContent,
    ModelNotReady,
    NodeFailure,
    NotFound,
    PayloadTooLarge,
    ProgramExportError,
    ProgramFailed,
    ProgramRejected,
    RunTimeout,
    ServerBusy,
    error_body,
    error_from_answer,
    error_from_body,
)

DOCUMENTED_TABLE = {
    400: BadRequest,
    409: MissingContent,
    413: BadRequest,  # BadRequest covers 400 and 413
    422: ProgramRejected,
    500: ProgramFailed,
    502: NodeFailure,
    503: ServerBusy,
    504: RunTimeout,
}


@pytest.mark.parametrize("status, cls", sorted(DOCUMENTED_TABLE.items()))
def test_status_codes_map_to_the_spec_exceptions(status, cls):
    """Each documented status maps to its client exception class, a KCoralError carrying that status."""
    assert issubclass(ERRORS_BY_STATUS[status], cls)
    assert ERRORS_BY_STATUS[status].status == status
    assert issubclass(ERRORS_BY_STATUS[status], KCoralError)


def test_public_exceptions_are_importable_from_kcoral():
    """The public exceptions are KCoralErrors importable from kcoral; ProgramExportError is a ValueError."""
    for name in ("KCoralError", "ServerBusy", "NodeFailure", "ProgramRejected", "ProgramFailed",
                 "BadRequest", "ProgramExportError", "RunTimeout"):
        assert issubclass(getattr(kcoral, name), kcoral.KCoralError)
    assert issubclass(ProgramExportError, ValueError)


@pytest.mark.parametrize("status", sorted(ERRORS_BY_STATUS))
def test_error_body_round_trip(status):
    """An error's JSON body (type, message, request id, reason) rebuilds the same class and fields."""
    cls = ERRORS_BY_STATUS[status]
    error = cls("something went wrong", reason="draining" if status == 503 else None)
    body = json.loads(json.dumps(error_body(error, "rid-1")))
    info = body["error"]
    assert info["type"] == cls.type
    assert info["message"] == "something went wrong"
    assert info["request_id"] == "rid-1"
    back = error_from_body(status, body, "fallback")
    assert type(back) is cls
    assert back.message == "something went wrong"
    assert back.request_id == "rid-1"
    assert back.reason == error.reason
    assert "rid-1" in str(back)


def test_a_run_timeout_is_a_program_failure_with_its_reason():
    """A 504 run_timeout rebuilds as RunTimeout, caught as the ProgramFailed it refines."""
    back = error_from_body(504, error_body(RunTimeout("still running"), "slow-1"), "")
    assert type(back) is RunTimeout and isinstance(back, ProgramFailed)
    assert (back.reason, back.request_id) == ("run_timeout", "slow-1")


def test_a_run_timeout_is_deadline_exceeded_over_grpc():
    """A gRPC client of a run timeout gets DEADLINE_EXCEEDED."""
    import grpc

    from kcoral.inference.grpcmethods import status_code_of

    assert status_code_of(RunTimeout("still running")) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_missing_digests_survive_the_round_trip():
    """A 409's missing digests are in its JSON body and on the MissingContent rebuilt from it."""
    error = MissingContent("gone", details={"missing": ["a" * 64, "b" * 64]})
    body = error_body(error, "r")
    assert body["error"]["missing"] == ["a" * 64, "b" * 64]
    back = error_from_body(409, body, "")
    assert isinstance(back, MissingContent)
    assert back.missing == ["a" * 64, "b" * 64]


def test_busy_reason_is_kept():
    """A 503's reason survives the round trip onto the ServerBusy rebuilt from it."""
    back = error_from_body(503, error_body(ServerBusy("full", reason="queue_full"), "r"), "")
    assert isinstance(back, ServerBusy) and back.reason == "queue_full"


@pytest.mark.parametrize("status, cls", [(418, BadRequest), (421, BadRequest), (451, BadRequest),
                                         (506, ProgramFailed), (505, ProgramFailed)])
def test_unknown_statuses_fall_back_by_class(status, cls):
    """An unknown 4xx rebuilds as BadRequest and an unknown 5xx as ProgramFailed."""
    assert type(error_from_body(status, {"error": {"message": "x"}}, "")) is cls


@pytest.mark.parametrize("body", [None, [], "text", {"other": 1}])
def test_bodies_without_an_error_object(body):
    """A body with no error object gives a NodeFailure naming the status and quoting the content."""
    error = error_from_body(502, body, "<html>bad gateway</html>")
    assert isinstance(error, NodeFailure)
    assert "HTTP 502" in error.message and "bad gateway" in error.message
    assert error.request_id is None


def test_the_inference_protocols_flat_error_gives_its_message():
    """The inference protocol's C{{"error": "message"}} rebuilds as the status's class with that message."""
    error = error_from_body(400, {"error": "input 'x' has shape [3]"}, "")
    assert type(error) is BadRequest and error.message == "input 'x' has shape [3]"
    assert type(error_from_body(503, {"error": "flat"}, "")) is ServerBusy


def test_payload_too_large_is_a_bad_request():
    """PayloadTooLarge is a BadRequest whose JSON type is payload_too_large."""
    error = PayloadTooLarge("too big")
    assert isinstance(error, BadRequest)
    assert error_body(error, "r")["error"]["type"] == "payload_too_large"


@pytest.mark.parametrize("content", [b"<html>busy</html>", b"[" * 100_000, b"\xff\xfe"])
def test_an_answer_that_is_not_a_kcoral_error_still_maps_to_its_status(content):
    """Content that is not a KCoral error (HTML, deep JSON, bad UTF-8) still maps by status."""
    error = error_from_answer(503, content)
    assert isinstance(error, ServerBusy) and error.message.startswith("HTTP 503: ")


def _documented_rows() -> tuple[set[tuple[int, str]], str]:
    """The (status, type) rows of doc/protocol.rst's error table, and the table's text."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "doc" / "protocol.rst").read_text()
    table = text[text.index("\nErrors\n"):text.index("\nBounds a server enforces\n")]
    rows = {(int(code), kind) for code, kind in re.findall(r"^(\d{3})\s+``([a-z_]+)``", table, re.M)}
    return rows, table


def test_every_error_a_service_sends_is_in_the_documented_table():
    """Each error class a KCoral service answers with has its status and type in the table."""
    from kcoral.errors import ERRORS

    rows, _ = _documented_rows()
    sent = {(cls.status, cls.type) for cls in ERRORS}
    assert sent <= rows, sorted(sent - rows)
    assert {kind for _, kind in rows} <= {cls.type for cls in ERRORS}


def test_every_reason_a_service_sends_is_documented():
    """Each reason the services' code gives an error is named in the table (the client's own are not sent)."""
    import ast
    import pathlib

    _, table = _documented_rows()
    root = pathlib.Path(kcoral.__file__).parent
    reasons = set()
    for path in root.rglob("*.py"):
        if "client" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "reason" \
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                reasons.add(node.value.value)
    assert reasons, "no reason found: the scan is broken"
    assert {r for r in reasons if f"``{r}``" not in table} == set()


def test_an_inference_404_is_not_found_and_names_its_request():
    """An inference protocol 404 is NotFound (a BadRequest), with the request id the client sent."""
    error = error_from_answer(404, b'{"error": "unknown model \'m\'"}', "req-404")
    assert type(error) is NotFound and isinstance(error, BadRequest)
    assert error.request_id == "req-404" and "req-404" in str(error)
    assert error_from_answer(404, b'{"error": {"message": "m", "request_id": "own"}}',
                             "sent").request_id == "own"


def test_a_model_that_cannot_serve_is_a_400_that_says_so():
    """A model that failed to load is a 400 (fix or load it), never a 503 to wait on."""
    assert ModelNotReady.status == 400 and issubclass(ModelNotReady, BadRequest)
    assert not issubclass(ModelNotReady, ServerBusy)
