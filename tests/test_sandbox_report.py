"""
How each worker confined itself, as its C{/health} says (C{"sandbox"}:
mode, no_new_privs, seccomp, landlock_abi), carried by its supervisor's
report to the node's gateway and to a Router, which list it in C{/health}
and C{/v1/nodes}. A report is untrusted input to the Router: the field is
checked like the others (a property over any JSON), a malformed one refuses
the report, and a supervisor leaves out what its worker says malformed.
The real node's case is in L{tests.test_worker_environment}.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kcoral.common.report import (
    MAX_LANDLOCK_ABI,
    InvalidReport,
    Sandbox,
    parse_report,
    parse_sandbox,
)
from kcoral.sandbox import SANDBOX_MODES
from tests.fakes import node_report
from tests.test_router_app import Router
from tests.test_worker import HEALTHY, URL, Supervised

CONFINED = {"mode": "auto", "no_new_privs": True, "seccomp": True, "landlock_abi": 7}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=5),
    max_leaves=12)
#: A sandbox object with each field of the right name but any value.
near_sandboxes = st.fixed_dictionaries({
    "mode": st.sampled_from(SANDBOX_MODES) | json_values,
    "no_new_privs": st.booleans() | json_values,
    "seccomp": st.booleans() | json_values,
    "landlock_abi": st.integers(-5, MAX_LANDLOCK_ABI + 5) | json_values,
}, optional={"extra": json_values})


def with_sandbox(sandbox, **report) -> dict:
    body = node_report(**report)
    body["workers"][0]["sandbox"] = sandbox
    return body


def test_a_workers_sandbox_is_read_and_sent_on_as_it_was():
    """A valid sandbox is read whole, and a report's JSON carries it back unchanged."""
    report = parse_report(with_sandbox(CONFINED))
    assert report.workers[0].sandbox == Sandbox("auto", True, True, 7)
    assert parse_report(json.loads(json.dumps(report.to_json()))) == report
    assert report.to_json()["workers"][0]["sandbox"] == CONFINED


def test_a_worker_that_says_nothing_of_a_sandbox_has_none():
    """A server of a version before the field: no sandbox, and none in the JSON."""
    report = parse_report(node_report())
    assert report.workers[0].sandbox is None
    assert "sandbox" not in report.to_json()["workers"][0]


@given(json_values | near_sandboxes)
def test_any_sandbox_a_report_holds_is_refused_or_well_formed(value):
    """Whatever a worker's sandbox holds, the report is refused, or what is kept has
    a known mode, true-or-false layers and an ABI in bounds, and nothing else."""
    try:
        sandbox = parse_sandbox(value, "worker 0 sandbox")
    except InvalidReport as e:
        assert "worker 0 sandbox" in str(e)
        with pytest.raises(InvalidReport):
            parse_report(with_sandbox(value))
        return
    if sandbox is None:
        assert value is None
        return
    assert sandbox.mode in SANDBOX_MODES
    assert type(sandbox.no_new_privs) is bool and type(sandbox.seccomp) is bool
    assert type(sandbox.landlock_abi) is int and 0 <= sandbox.landlock_abi <= MAX_LANDLOCK_ABI
    assert set(sandbox.to_json()) == {"mode", "no_new_privs", "seccomp", "landlock_abi"}


@pytest.mark.parametrize("value", [
    "auto", [], {}, dict(CONFINED, mode="none"), dict(CONFINED, seccomp=1),
    dict(CONFINED, no_new_privs="true"), dict(CONFINED, landlock_abi=True),
    dict(CONFINED, landlock_abi=-1), dict(CONFINED, landlock_abi=MAX_LANDLOCK_ABI + 1),
    dict(CONFINED, landlock_abi=7.0)])
def test_a_malformed_sandbox_refuses_the_report(value):
    """A sandbox of the wrong shape makes the whole report invalid."""
    with pytest.raises(InvalidReport, match="worker 0 sandbox"):
        parse_report(with_sandbox(value))


def test_the_router_lists_each_workers_sandbox():
    """/v1/nodes and a gateway's /health list each worker's sandbox (null when it says none)."""
    router = Router(health_lists_workers=True)
    report = with_sandbox(CONFINED, capacities=(2, 2))
    router.ready("gpu-a", report)
    _, body = router.json("GET", "/v1/nodes")
    assert [w["sandbox"] for w in body["nodes"][0]["workers"]] == [CONFINED, None]
    _, health = router.json("GET", "/health")
    assert [w["sandbox"] for w in health["workers"]] == [CONFINED, None]


def test_a_report_with_a_malformed_sandbox_is_refused_400():
    """The Router answers 400 to a report whose sandbox is malformed; the pool is unchanged."""
    router = Router()
    response, body = router.put("gpu-a", with_sandbox(dict(CONFINED, seccomp="yes")))
    assert response.code == 400 and "sandbox" in body["error"]["message"]
    assert router.pool.nodes == {}


def test_a_supervisor_reports_the_sandbox_its_worker_says():
    """The supervisor's report carries the sandbox of the worker's /health, and leaves
    out one that is malformed rather than have the Router refuse the whole report."""
    s = Supervised()
    s.worker.startService()
    s.listening()
    s.http.answer(URL + "/health", 200, dict(HEALTHY, sandbox=CONFINED))
    s.reactor.advance(2)
    assert s.worker.report(URL).sandbox == Sandbox("auto", True, True, 7)
    s.http.answer(URL + "/health", 200, dict(HEALTHY, sandbox=dict(CONFINED, mode="sure")))
    s.reactor.advance(2)
    assert s.worker.healthy and s.worker.report(URL).sandbox is None
