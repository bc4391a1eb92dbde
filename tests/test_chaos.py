"""
The chaos run of C{bench/chaos.py} in its quick mode: a
Router, three CPU nodes, ~150 requests and six faults (each kind at least
once: worker SIGKILL, worker SIGSTOP/SIGCONT, node SIGTERM and restart,
supervisor SIGKILL and restart, Router SIGTERM and restart). Nothing is lost, no answer is wrong, every 502
is explained by a worker that died, the pool recovers its capacity by itself
and the Router's memory and descriptors are back near their level.
"""

from __future__ import annotations

import pytest

import chaos

pytest.importorskip("jax")


def test_fault_plan_has_every_kind_and_no_late_router_restart():
    """A fault plan has every kind of fault, no Router restart in the last two, and one plan per seed."""
    import random

    for seed in range(50):
        plan = chaos.fault_plan(6, random.Random(seed))
        assert len(plan) == 6 and set(plan) == set(chaos.KINDS)
        assert chaos.ROUTER_RESTART not in plan[4:]
        assert chaos.fault_plan(6, random.Random(seed)) == plan


@pytest.mark.integration
def test_quick_chaos_run(tmp_path):
    """The quick chaos run loses no request, gets no wrong answer, and has no unexplained 502."""
    result = chaos.run(chaos.Settings.quick(log_dir=str(tmp_path)))
    report = chaos.table(result)
    print(report)
    assert len(result.faults) == 6 and {f.kind for f in result.faults} == set(chaos.KINDS), report
    assert len(result.records) == 150, report
    assert not result.lost, report
    assert not result.wrong, report
    assert not result.unexplained_502(), report
    assert not result.problems, report
    assert result.ok
