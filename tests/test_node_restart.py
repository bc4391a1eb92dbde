"""
The supervisor's restart policy, on its own: its documented defaults,
backoff and jitter, stable reset, failure threshold, startup grace, and one
verdict per start. The worker that follows it is tested in test_worker.py.
"""

from __future__ import annotations

import random

import pytest

from kcoral.node.restart import RestartPolicy, RestartSettings


def policy(seed=0, **settings):
    return RestartPolicy(RestartSettings(**settings), random=random.Random(seed))


# -- backoff --------------------------------------------------------------------------

def test_defaults_are_the_documented_ones():
    """The settings default to the documented supervisor options."""
    s = RestartSettings()
    assert (s.failure_threshold, s.startup_grace_seconds, s.stable_reset_seconds,
            s.termination_grace_seconds, s.restart_min_delay_seconds,
            s.restart_max_delay_seconds, s.restart_jitter, s.health_interval_seconds,
            s.health_timeout_seconds) == (3, 30.0, 60.0, 5.0, 1.0, 30.0, 0.2, 2.0, 1.0)


def test_backoff_doubles_from_min_to_max_without_jitter():
    """Without jitter, delays double from the minimum up to the maximum; each counts a restart."""
    p = policy(restart_jitter=0.0)
    assert [p.next_delay() for _ in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert p.restarts == 8


def test_backoff_with_other_bounds():
    """The doubling follows other minimum and maximum delays."""
    p = policy(restart_jitter=0.0, restart_min_delay_seconds=0.25, restart_max_delay_seconds=1.0)
    assert [p.next_delay() for _ in range(5)] == [0.25, 0.5, 1.0, 1.0, 1.0]


def test_zero_min_delay_restarts_at_once():
    """A zero minimum delay restarts at once, whatever the jitter."""
    p = policy(restart_jitter=0.5, restart_min_delay_seconds=0.0)
    assert [p.next_delay() for _ in range(4)] == [0.0] * 4


@pytest.mark.parametrize("jitter", [0.0, 0.2, 0.5])
def test_jitter_stays_within_its_fraction(jitter):
    """Jitter moves each delay by at most its fraction of the delay."""
    for seed in range(20):
        p = policy(seed, restart_jitter=jitter)
        for base in [1, 2, 4, 8, 16, 30, 30, 30, 30, 30]:
            delay = p.next_delay()
            assert base * (1 - jitter) - 1e-9 <= delay <= base * (1 + jitter) + 1e-9


def test_jitter_varies_the_delay():
    """Jitter spreads the delays of different workers around the base delay."""
    delays = set()
    for seed in range(20):
        p = policy(seed, restart_jitter=0.2)
        delays.add(round(p.next_delay(), 6))
    assert len(delays) > 10
    assert min(delays) < 1.0 < max(delays)


def test_jitter_is_reproducible_with_a_seed():
    """The same random seed gives the same delays."""
    a, b = policy(42), policy(42)
    assert [a.next_delay() for _ in range(6)] == [b.next_delay() for _ in range(6)]


def test_jitter_applies_to_the_max_delay_as_well():
    """The cap applies before jitter, so capped delays vary too."""
    p = policy(3, restart_jitter=0.5)
    delays = [p.next_delay() for _ in range(40)][10:]
    assert all(15.0 <= d <= 45.0 for d in delays)
    assert max(delays) > 30.0  # the cap is before jitter


# -- stable reset ---------------------------------------------------------------------

def test_backoff_resets_after_stable_reset_seconds_healthy():
    """The backoff starts over once the worker has been healthy for the stable reset time."""
    p = policy(restart_jitter=0.0)
    p.next_delay(), p.next_delay(), p.next_delay()
    p.started(100.0)
    for t in range(100, 160, 2):
        assert not p.probe(True, float(t))
        assert p.restarts == 3
    assert not p.probe(True, 161.0)  # first healthy at 100: 61 s later
    assert p.restarts == 0
    assert p.next_delay() == 1.0


def test_a_failed_probe_restarts_the_stable_clock():
    """A failed probe starts the stable time over."""
    p = policy(restart_jitter=0.0, failure_threshold=5, startup_grace_seconds=0)
    p.next_delay(), p.next_delay()
    p.started(0.0)
    p.probe(True, 0.0)
    p.probe(True, 50.0)
    p.probe(False, 52.0)
    p.probe(True, 54.0)
    p.probe(True, 110.0)
    assert p.restarts == 2  # healthy since 54 only: 56 s
    p.probe(True, 114.0)
    assert p.restarts == 0


def test_a_restart_restarts_the_stable_clock():
    """A new start starts the stable time over."""
    p = policy(restart_jitter=0.0)
    p.next_delay()
    p.started(0.0)
    p.probe(True, 10.0)
    p.started(50.0)  # restarted before it was stable
    p.probe(True, 70.0)
    p.probe(True, 100.0)
    assert p.restarts == 1
    p.probe(True, 130.0)
    assert p.restarts == 0


# -- failure threshold and grace ------------------------------------------------------------

def test_failure_threshold_consecutive_failures_trigger_a_restart():
    """The threshold of failed probes in a row condemns the worker."""
    p = policy(failure_threshold=3, startup_grace_seconds=30)
    p.started(0.0)
    assert not p.probe(True, 40.0)
    assert not p.probe(False, 42.0)
    assert not p.probe(False, 44.0)
    assert p.probe(False, 46.0)
    assert p.failures == 3


def test_a_good_probe_resets_the_failure_count():
    """A good probe sets the count of failures back to zero."""
    p = policy(failure_threshold=3, startup_grace_seconds=0)
    p.started(0.0)
    results = [p.probe(ok, float(t)) for t, ok in enumerate([False, False, True, False, False, True])]
    assert results == [False] * 6
    assert p.probe(False, 10.0) is False
    assert p.probe(False, 11.0) is False
    assert p.probe(False, 12.0) is True


def test_no_restart_within_startup_grace():
    """Failed probes within the startup grace condemn no worker."""
    p = policy(failure_threshold=1, startup_grace_seconds=30)
    p.started(100.0)
    for t in range(100, 130, 2):
        assert not p.probe(False, float(t))
    assert p.probe(False, 130.0)


def test_grace_starts_again_with_every_start():
    """Every start has its own grace and its own count."""
    p = policy(failure_threshold=2, startup_grace_seconds=10)
    p.started(0.0)
    p.probe(False, 10.0)
    assert p.probe(False, 12.0)
    p.started(20.0)
    assert p.failures == 0
    assert not p.probe(False, 22.0)
    assert not p.probe(False, 24.0)
    assert not p.probe(False, 29.9)
    assert p.probe(False, 30.0)


@pytest.mark.parametrize("threshold", [1, 3, 5])
def test_threshold_is_respected_exactly(threshold):
    """The worker is condemned on exactly the threshold-th failure."""
    p = policy(failure_threshold=threshold, startup_grace_seconds=0)
    p.started(0.0)
    verdicts = [p.probe(False, float(t)) for t in range(threshold)]
    assert verdicts == [False] * (threshold - 1) + [True]


def test_a_start_is_condemned_once():
    """After its verdict, failed probes do not condemn the same start again."""
    p = policy(failure_threshold=2, startup_grace_seconds=0)
    p.started(0.0)
    assert [p.probe(False, float(t)) for t in range(6)] == [False, True, False, False, False, False]
    p.started(10.0)
    assert [p.probe(False, 10.0 + t) for t in range(2)] == [False, True]


def test_the_termination_grace_is_the_setting():
    """SIGKILL follows SIGTERM after the termination grace of the settings."""
    assert policy(termination_grace_seconds=2.5).termination_grace == 2.5


def test_a_worker_that_ended_a_run_past_its_limit_restarts_at_once():
    """After exit status 3 (a run passed --max-run-seconds) the delay is 0 and no restart
    counts towards the backoff."""
    p = policy()
    assert [p.next_delay(3) for _ in range(3)] == [0.0] * 3
    assert p.restarts == 0
