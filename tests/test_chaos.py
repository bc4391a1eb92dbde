"""
The chaos run of C{bench.chaos} in its quick mode: two Routers, three CPU
nodes reporting to both, ~150 requests (some allowing re-dispatch) and seven
faults (each kind once: worker SIGKILL, worker SIGSTOP/SIGCONT, node SIGTERM
and restart, supervisor SIGKILL and restart, Router SIGTERM and restart,
Router SIGKILL and restart, a node cut off from one Router). Nothing is lost,
no answer is wrong, no run that allowed re-dispatch is a 502, every other 502
is explained by a worker or a Router that died, the pool recovers its
capacity by itself and the Routers' memory and descriptors are back near
their level.
"""

from __future__ import annotations

import pytest

from bench import chaos

pytest.importorskip("jax")


def test_fault_plan_has_every_kind_and_no_late_router_fault():
    """A fault plan has every kind of fault, no Router fault in its last third, and one plan per seed."""
    import random

    count = len(chaos.KINDS)
    for seed in range(50):
        plan = chaos.fault_plan(count, random.Random(seed))
        assert len(plan) == count and set(plan) == set(chaos.KINDS)
        assert not set(chaos.ROUTER_FAULTS) & set(plan[count - count // 3:])
        assert chaos.fault_plan(count, random.Random(seed)) == plan


@pytest.mark.slow
@pytest.mark.integration
def test_quick_chaos_run(tmp_path):
    """The quick chaos run loses nothing, answers nothing wrong, has no re-dispatched or unexplained 502."""
    result = chaos.run(chaos.Settings.quick(log_dir=str(tmp_path)))
    report = chaos.table(result)
    print(report)
    assert {f.kind for f in result.faults} == set(chaos.KINDS), report
    assert len(result.records) == 150, report
    assert result.failures() == [], report
    assert result.ok
