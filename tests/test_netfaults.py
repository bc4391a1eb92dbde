"""
The run of faults between hosts of C{bench.netfaults} in its quick mode:
two Routers, three CPU nodes and the clients each on a test host of their
own (network namespaces), TLS and tokens between them, ~150 requests and
each kind of fault once (a node cut off from one Router or from everyone,
a Router cut off from its clients, a half-open link, a frozen host, and the
chaos run's process faults). Nothing is lost or wrong, no request outlasts
the stated bound, the pool recovers within its bound after each heal, and a
long run on a live node is answered 200.
"""

from __future__ import annotations

import random

import pytest

from bench import netfaults


def test_the_plan_has_every_kind_and_no_late_router_fault():
    """A plan has every kind of fault (between hosts and of processes), no late Router fault."""
    count = len(netfaults.KINDS)
    for seed in range(50):
        plan = netfaults.chaos.fault_plan(count, random.Random(seed), netfaults.KINDS,
                                          netfaults.WEIGHTS)
        assert len(plan) == count and set(plan) == set(netfaults.KINDS)
        assert not set(netfaults.ROUTER_FAULTS) & set(plan[count - count // 3:])


def test_the_stated_bounds_are_the_documented_formulas():
    """The hang and recovery bounds are the formulas of the options that doc/operations.rst states."""
    s = netfaults.NetSettings.quick()
    assert s.keepalive_bound == 2 + 1 * 3
    assert s.silent_bound == max(5, s.silent_node_seconds + s.status_interval)
    assert s.recovery_bound == pytest.approx(
        s.health_interval * 5.2 + (s.recovery_threshold + 1) * s.status_interval + s.slack)


@pytest.mark.slow
@pytest.mark.integration
def test_quick_run_of_faults_between_hosts(tmp_path):
    """The quick run loses, breaks and hangs nothing, recovers in bound, and keeps its long run."""
    net = netfaults.run(netfaults.NetSettings.quick(log_dir=str(tmp_path)))
    report = netfaults.table(net)
    print(report)
    result = net.result
    assert {f.kind for f in result.faults} == set(netfaults.KINDS), report
    assert len(result.records) == 150, report
    assert result.failures() == [], report
    assert not net.over_bound, report
    assert not net.slow_recoveries, report
    assert net.long_run.outcome == "200", report
    assert net.ok
