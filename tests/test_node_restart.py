"""
The supervisor's restart policy (its documented defaults) and the
supervised worker's restart cycle on a fake clock: backoff and jitter,
stable reset, failure threshold, startup grace, SIGTERM then SIGKILL.
"""

from __future__ import annotations

import random
import sys

import pytest
from prometheus_client import CollectorRegistry, Counter
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from kcoral.node.devices import WorkerSpec
from kcoral.node.restart import RestartPolicy, RestartSettings
from kcoral.node.worker import Worker


def policy(seed=0, **settings):
    return RestartPolicy(RestartSettings(**settings), random=random.Random(seed))


# -- backoff --------------------------------------------------------------------------

def test_defaults_are_the_documented_ones():
    s = RestartSettings()
    assert (s.failure_threshold, s.startup_grace_seconds, s.stable_reset_seconds,
            s.termination_grace_seconds, s.restart_min_delay_seconds,
            s.restart_max_delay_seconds, s.restart_jitter, s.health_interval_seconds,
            s.health_timeout_seconds) == (3, 30.0, 60.0, 5.0, 1.0, 30.0, 0.2, 2.0, 1.0)


def test_backoff_doubles_from_min_to_max_without_jitter():
    p = policy(restart_jitter=0.0)
    assert [p.next_delay() for _ in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert p.restarts == 8


def test_backoff_with_other_bounds():
    p = policy(restart_jitter=0.0, restart_min_delay_seconds=0.25, restart_max_delay_seconds=1.0)
    assert [p.next_delay() for _ in range(5)] == [0.25, 0.5, 1.0, 1.0, 1.0]


def test_zero_min_delay_restarts_at_once():
    p = policy(restart_jitter=0.5, restart_min_delay_seconds=0.0)
    assert [p.next_delay() for _ in range(4)] == [0.0] * 4


@pytest.mark.parametrize("jitter", [0.0, 0.2, 0.5])
def test_jitter_stays_within_its_fraction(jitter):
    for seed in range(20):
        p = policy(seed, restart_jitter=jitter)
        for base in [1, 2, 4, 8, 16, 30, 30, 30, 30, 30]:
            delay = p.next_delay()
            assert base * (1 - jitter) - 1e-9 <= delay <= base * (1 + jitter) + 1e-9


def test_jitter_varies_the_delay():
    delays = set()
    for seed in range(20):
        p = policy(seed, restart_jitter=0.2)
        delays.add(round(p.next_delay(), 6))
    assert len(delays) > 10
    assert min(delays) < 1.0 < max(delays)


def test_jitter_is_reproducible_with_a_seed():
    a, b = policy(42), policy(42)
    assert [a.next_delay() for _ in range(6)] == [b.next_delay() for _ in range(6)]


def test_jitter_applies_to_the_max_delay_as_well():
    p = policy(3, restart_jitter=0.5)
    delays = [p.next_delay() for _ in range(40)][10:]
    assert all(15.0 <= d <= 45.0 for d in delays)
    assert max(delays) > 30.0  # the cap is before jitter


# -- stable reset ---------------------------------------------------------------------

def test_backoff_resets_after_stable_reset_seconds_healthy():
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
    p = policy(failure_threshold=3, startup_grace_seconds=30)
    p.started(0.0)
    assert not p.probe(True, 40.0)
    assert not p.probe(False, 42.0)
    assert not p.probe(False, 44.0)
    assert p.probe(False, 46.0)
    assert p.failures == 3


def test_a_good_probe_resets_the_failure_count():
    p = policy(failure_threshold=3, startup_grace_seconds=0)
    p.started(0.0)
    results = [p.probe(ok, float(t)) for t, ok in enumerate([False, False, True, False, False, True])]
    assert results == [False] * 6
    assert p.probe(False, 10.0) is False
    assert p.probe(False, 11.0) is False
    assert p.probe(False, 12.0) is True


def test_no_restart_within_startup_grace():
    p = policy(failure_threshold=1, startup_grace_seconds=30)
    p.started(100.0)
    for t in range(100, 130, 2):
        assert not p.probe(False, float(t))
    assert p.probe(False, 130.0)


def test_grace_starts_again_with_every_start():
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
    p = policy(failure_threshold=threshold, startup_grace_seconds=0)
    p.started(0.0)
    verdicts = [p.probe(False, float(t)) for t in range(threshold)]
    assert verdicts == [False] * (threshold - 1) + [True]


# -- the worker's restart cycle ---------------------------------------------------------------

class FakeProcess:
    """Stands in for the OS process: records signals; the test ends it."""

    def __init__(self, protocol, args, env, pid):
        self.protocol, self.args, self.env, self.pid = protocol, args, env, pid
        self.signals = []
        self.ended = False
        protocol.makeConnection(self)

    def signalProcess(self, name):
        self.signals.append(name)

    def end(self, *, status=0, signal=None):
        assert not self.ended
        self.ended = True
        reason = ProcessDone(0) if status == 0 and signal is None else \
            ProcessTerminated(exitCode=None if signal else status, signal=signal)
        self.protocol.processEnded(Failure(reason))

    # the bits of ITransport a ProcessProtocol may touch
    def closeStdin(self):
        pass


class ProcessClock(Clock):
    """A fake clock that can also 'spawn' processes."""

    def __init__(self):
        super().__init__()
        self.processes = []

    def spawnProcess(self, protocol, executable, args=(), env=None, path=None, uid=None,
                     gid=None, usePTY=False, childFDs=None):
        self.processes.append(FakeProcess(protocol, args, env, 1000 + len(self.processes)))
        self.processes[-1].executable = executable
        return self.processes[-1]


class Supervised:
    def __init__(self, *, spec=None, **settings):
        settings = dict(dict(failure_threshold=3, startup_grace_seconds=30,
                             termination_grace_seconds=5, health_interval_seconds=2,
                             restart_jitter=0.0), **settings)
        self.clock = ProcessClock()
        self.restarts = Counter("kcoral_worker_restarts", "restarts", ["worker"],
                                registry=CollectorRegistry())
        self.changes = 0
        self.worker = Worker(spec or WorkerSpec("worker0", 0, None),
                             ["-m", "kcoral", "server", "--port", "8000"],
                             policy(**settings), self.clock, None, on_change=self._changed,
                             metrics=self.restarts)

    def _changed(self):
        self.changes += 1

    @property
    def process(self):
        return self.clock.processes[-1]

    def advance_to(self, t):
        while self.clock.seconds() < t:
            self.clock.advance(min(0.5, t - self.clock.seconds()))

    def restart_count(self):
        return self.restarts.labels("worker0")._value.get()


def test_a_worker_is_spawned_with_its_device_environment():
    s = Supervised(spec=WorkerSpec("worker1", 1, "3"))
    s.worker.start()
    process = s.process
    assert process.executable == sys.executable
    assert process.args == ["-m", "kcoral", "server", "--port", "8000"]
    assert process.env["CUDA_VISIBLE_DEVICES"] == "3"
    assert process.env["KCORAL_SUPERVISED"] == "1"
    assert s.worker.state == Worker.STARTING


def test_the_worker_learns_its_url_from_its_output():
    s = Supervised()
    s.worker.start()
    s.process.protocol.childDataReceived(1, b"starting\nkcoral server listen")
    assert s.worker.url is None
    s.process.protocol.childDataReceived(1, b"ing on http://127.0.0.1:8123\n")
    assert s.worker.url == "http://127.0.0.1:8123"
    report = s.worker.report()
    assert report["name"] == "worker0" and report["healthy"] is False and report["capacity"] == 0


def test_an_unresponsive_worker_is_left_alone_during_startup_grace():
    s = Supervised()
    s.worker.start()
    s.advance_to(29.5)
    assert s.process.signals == []
    assert s.worker.policy.failures >= 3
    s.advance_to(30)
    assert s.process.signals == ["TERM"]


def test_an_unresponsive_worker_gets_term_then_kill_then_a_new_start():
    s = Supervised(startup_grace_seconds=0)
    s.worker.start()
    s.advance_to(5.9)
    assert s.process.signals == []  # probes at 2 and 4 failed: 2 < 3
    s.advance_to(6)
    assert s.process.signals == ["TERM"]
    s.advance_to(10.9)
    assert s.process.signals == ["TERM"]  # further failed probes change nothing
    s.advance_to(11)
    assert s.process.signals == ["TERM", "KILL"]
    s.process.end(signal=9)
    assert s.worker.state == Worker.STOPPED
    assert s.restart_count() == 1
    assert len(s.clock.processes) == 1
    s.clock.advance(0.99)
    assert len(s.clock.processes) == 1
    s.clock.advance(0.01)  # restart_min_delay_seconds
    assert len(s.clock.processes) == 2
    assert s.worker.state == Worker.STARTING


def test_a_worker_that_stops_on_term_is_not_killed():
    s = Supervised(startup_grace_seconds=0)
    s.worker.start()
    s.advance_to(6)
    first = s.process
    assert first.signals == ["TERM"]
    first.end(status=0)
    s.advance_to(30)
    assert first.signals == ["TERM"]
    assert len(s.clock.processes) > 1


def test_crashes_are_restarted_with_doubling_delays():
    s = Supervised(restart_max_delay_seconds=4)
    s.worker.start()
    starts = [s.clock.seconds()]
    for _ in range(5):
        s.process.end(status=1)
        count = len(s.clock.processes)
        while len(s.clock.processes) == count:
            s.clock.advance(0.25)
        starts.append(s.clock.seconds())
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert s.restart_count() == 5


def test_stop_sends_term_and_waits_without_killing():
    s = Supervised()
    s.worker.start()
    stopped = []
    s.worker.stop().addCallback(stopped.append)
    assert s.process.signals == ["TERM"]
    assert s.worker.state == Worker.STOPPING
    s.advance_to(120)
    assert s.process.signals == ["TERM"]
    assert not stopped
    s.process.end(status=0)
    assert stopped == [0]
    assert s.worker.state == Worker.STOPPED
    s.advance_to(200)
    assert len(s.clock.processes) == 1
    assert s.restart_count() == 0
    assert s.clock.getDelayedCalls() == []


def test_stop_during_the_restart_delay_cancels_the_start():
    s = Supervised()
    s.worker.start()
    s.process.end(status=1)
    stopped = []
    s.worker.stop().addCallback(stopped.append)
    assert stopped == [None]
    s.advance_to(100)
    assert len(s.clock.processes) == 1
    assert s.clock.getDelayedCalls() == []


def test_a_draining_worker_that_stops_answering_gets_the_grace_before_sigkill():
    # A draining worker closes its port before it exits, and its exit (JAX's
    # teardown) can take seconds: failed probes start the grace, not a kill.
    s = Supervised(startup_grace_seconds=0)
    s.worker.start()
    s.process.protocol.childDataReceived(1, b"kcoral server listening on http://127.0.0.1:9\n")
    stopped = []
    s.worker.stop().addCallback(stopped.append)
    s.advance_to(10.9)  # probes at 2, 4 and 6 failed; termination grace 5 s
    assert s.process.signals == ["TERM"]
    s.process.end(status=0)
    assert stopped == [0] and s.restart_count() == 0
    assert s.clock.getDelayedCalls() == []


def test_a_draining_worker_that_never_exits_is_killed_after_the_grace():
    s = Supervised(startup_grace_seconds=0)
    s.worker.start()
    s.process.protocol.childDataReceived(1, b"kcoral server listening on http://127.0.0.1:9\n")
    s.worker.stop()
    s.advance_to(10.9)
    assert s.process.signals == ["TERM"]
    s.advance_to(11)
    assert s.process.signals == ["TERM", "KILL"]
    s.process.end(signal=9)
    assert s.worker.state == Worker.STOPPED and s.restart_count() == 0
