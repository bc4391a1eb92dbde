"""
The supervised worker's state machine on a fake process reactor: spawn,
URL pipe, probes, SIGTERM then SIGKILL, restarts with backoff, draining stop.
"""

from __future__ import annotations

import itertools
import random
import sys

from prometheus_client import CollectorRegistry, Counter

from kcoral.common.announce import URL_FD, URL_FD_ENV
from kcoral.node.devices import WorkerSpec
from kcoral.node.restart import RestartPolicy, RestartSettings
from kcoral.node.worker import Worker
from tests.fakes import FakeServers, ProcessReactor

URL = "http://127.0.0.1:8123"
ARGV = [sys.executable, "-m", "kcoral", "server", "--port", "8000"]
HEALTHY = {"status": "ok", "capacity": 2, "active": 1, "gpu_target": "cpu"}


class Supervised:
    """One worker on a fake reactor, its /health answered through StubTreq."""

    def __init__(self, *, spec=None, **settings):
        settings = {"failure_threshold": 3, "startup_grace_seconds": 30,
                    "termination_grace_seconds": 5, "health_interval_seconds": 2,
                    "restart_jitter": 0.0, **settings}
        self.reactor = ProcessReactor()
        self.http = FakeServers()
        self.restarts = Counter("kcoral_worker_restarts", "restarts", ["worker"],
                                registry=CollectorRegistry())
        self.changes = 0
        self.worker = Worker(spec or WorkerSpec("worker0", 0, None),
                             ARGV,
                             RestartPolicy(RestartSettings(**settings), random=random.Random(0)),
                             self.reactor, self.http.client, on_change=self._changed,
                             restarts=self.restarts)

    def _changed(self):
        self.changes += 1

    @property
    def process(self):
        return self.reactor.process

    def listening(self, url=URL):
        self.process.write_to(URL_FD, url.encode() + b"\n")

    def restart_count(self):
        return self.restarts.labels("worker0")._value.get()


def test_a_worker_is_spawned_with_its_device_environment_and_url_pipe():
    """The child runs the server argv with its device, supervision and URL-pipe settings."""
    s = Supervised(spec=WorkerSpec("worker1", 1, "3"))
    s.worker.startService()
    process = s.process
    assert process.executable == sys.executable
    assert process.args == ARGV
    assert process.env["CUDA_VISIBLE_DEVICES"] == "3"
    assert process.env["KCORAL_SUPERVISED"] == "1"
    assert process.env[URL_FD_ENV] == str(URL_FD) and process.childFDs[URL_FD] == "r"
    assert s.worker.running and not s.worker.healthy


def test_the_worker_learns_its_url_from_its_pipe_not_its_log():
    """The URL comes from the child's pipe, whole lines only; its log line sets nothing."""
    s = Supervised()
    s.worker.startService()
    s.process.write_to(1, b"kcoral server listening on http://127.0.0.1:9999\n")
    assert s.worker.url is None
    s.process.write_to(URL_FD, b"http://127.0.0.1:81")
    assert s.worker.url is None
    s.process.write_to(URL_FD, b"23\n")
    assert s.worker.url == URL
    report = s.worker.report(URL)
    assert report.name == "worker0" and report.healthy is False and report.capacity == 0


def test_the_first_good_probe_makes_the_worker_healthy():
    """A 200 from /health makes the worker healthy, with the capacity it reports."""
    s = Supervised()
    s.worker.startService()
    s.listening()
    s.http.answer(URL + "/health", 200, HEALTHY)
    before = s.changes
    s.reactor.advance(2)
    assert s.worker.healthy and s.changes == before + 1
    report = s.worker.report("http://10.0.0.1:8123")
    assert (report.url, report.healthy, report.capacity, report.active) == (
        "http://10.0.0.1:8123", True, 2, 1)
    s.http.answer(URL + "/health", 503, {"status": "starting"})
    s.reactor.advance(2)
    assert not s.worker.healthy and s.worker.report(URL).capacity == 0


def test_a_worker_compiling_its_models_past_the_startup_grace_is_left_alone():
    """A worker that answers 503 starting (its models still compiling) is alive: no signal,
    however long past the startup grace, and not healthy until it answers 200."""
    s = Supervised()
    s.worker.startService()
    s.listening()
    s.http.answer(URL + "/health", 503, {"status": "starting"})
    s.reactor.advance_to(300)
    assert s.process.signals == [] and not s.worker.healthy
    s.http.answer(URL + "/health", 200, HEALTHY)
    s.reactor.advance(2)
    assert s.worker.healthy


def test_an_unresponsive_worker_is_left_alone_during_startup_grace():
    """Failed probes within the startup grace send no signal."""
    s = Supervised()
    s.worker.startService()
    s.reactor.advance_to(29.5)
    assert s.process.signals == []
    assert s.worker.policy.failures >= 3
    s.reactor.advance_to(30)
    assert s.process.signals == ["TERM"]


def test_an_unresponsive_worker_gets_term_then_kill_then_a_new_start():
    """Threshold failures: SIGTERM, SIGKILL after the grace, a new start after the backoff."""
    s = Supervised(startup_grace_seconds=0)
    s.worker.startService()
    s.reactor.advance_to(5.9)
    assert s.process.signals == []  # probes at 2 and 4 failed: 2 < 3
    s.reactor.advance_to(6)
    assert s.process.signals == ["TERM"]
    s.reactor.advance_to(10.9)
    assert s.process.signals == ["TERM"]  # further failed probes change nothing
    s.reactor.advance_to(11)
    assert s.process.signals == ["TERM", "KILL"]
    s.process.end(signal=9)
    assert not s.worker.healthy
    assert s.restart_count() == 1
    assert len(s.reactor.processes) == 1
    s.reactor.advance(0.99)
    assert len(s.reactor.processes) == 1
    s.reactor.advance(0.01)  # restart_min_delay_seconds
    assert len(s.reactor.processes) == 2
    assert s.worker.url is None and not s.worker.healthy


def test_a_worker_being_replaced_is_never_restarted_twice():
    """Probes that fail while a worker is being replaced neither signal it again nor restart it."""
    s = Supervised(startup_grace_seconds=0, termination_grace_seconds=60)
    s.worker.startService()
    s.reactor.advance_to(6)
    assert s.process.signals == ["TERM"]
    s.reactor.advance_to(50)
    assert s.process.signals == ["TERM"] and len(s.reactor.processes) == 1
    s.process.end(status=0)
    s.reactor.advance(1)
    assert len(s.reactor.processes) == 2 and s.restart_count() == 1


def test_a_worker_being_replaced_is_not_made_healthy_by_a_late_answer():
    """A 200 that comes back after the worker was condemned leaves it unhealthy until it restarts."""
    s = Supervised(startup_grace_seconds=0, termination_grace_seconds=60)
    s.worker.startService()
    s.listening()
    s.reactor.advance_to(6)  # three failed probes: TERM
    assert s.process.signals == ["TERM"] and not s.worker.healthy
    s.http.answer(URL + "/health", 200, HEALTHY)
    s.reactor.advance_to(10)
    assert not s.worker.healthy and not s.worker.report(URL).healthy


def test_a_worker_that_stops_on_term_is_not_killed():
    """A child that exits within the grace gets no SIGKILL, and is started again."""
    s = Supervised(startup_grace_seconds=0)
    s.worker.startService()
    s.reactor.advance_to(6)
    first = s.process
    assert first.signals == ["TERM"]
    first.end(status=0)
    s.reactor.advance_to(30)
    assert first.signals == ["TERM"]
    assert len(s.reactor.processes) > 1


def test_a_worker_that_misses_a_probe_names_its_instance_until_it_exits():
    """A live worker that missed a probe is reported unhealthy with the instance it holds
    arrays and sequences in; once it exits, until its next start answers, with none."""
    s = Supervised()
    s.worker.startService()
    s.listening()
    s.http.answer(URL + "/health", 200, {**HEALTHY, "instance": "a" * 16})
    s.reactor.advance(2)
    assert s.worker.report(URL).instance == "a" * 16
    del s.http.answers[URL + "/health"]  # it stops answering
    s.reactor.advance(2)
    report = s.worker.report(URL)
    assert (report.healthy, report.instance) == (False, "a" * 16)
    s.process.end(status=1)
    assert s.worker.report(URL).instance is None


def test_crashes_are_restarted_with_doubling_delays():
    """A child that keeps crashing is restarted after 1, 2, 4 s... up to the maximum delay."""
    s = Supervised(restart_max_delay_seconds=4)
    s.worker.startService()
    starts = [s.reactor.seconds()]
    for _ in range(5):
        s.process.end(status=1)
        count = len(s.reactor.processes)
        while len(s.reactor.processes) == count:
            s.reactor.advance(0.25)
        starts.append(s.reactor.seconds())
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert s.restart_count() == 5


def test_stop_sends_term_and_waits_without_killing():
    """Stopping a serving worker sends SIGTERM and waits for its exit as long as it answers."""
    s = Supervised()
    s.worker.startService()
    s.listening()
    s.http.answer(URL + "/health", 503, {"status": "draining"})
    stopped = []
    s.worker.stopService().addCallback(stopped.append)
    assert s.process.signals == ["TERM"]
    assert not s.worker.running and not s.worker.healthy
    s.reactor.advance_to(120)
    assert s.process.signals == ["TERM"]
    assert not stopped
    s.process.end(status=0)
    assert stopped == [0]
    s.reactor.advance_to(200)
    assert len(s.reactor.processes) == 1
    assert s.restart_count() == 0
    assert s.reactor.getDelayedCalls() == []


def test_a_draining_worker_is_not_counted_healthy():
    """While stopping, even a 200 from /health does not make the worker take work."""
    s = Supervised()
    s.worker.startService()
    s.listening()
    s.http.answer(URL + "/health", 200, HEALTHY)
    s.worker.stopService()
    s.reactor.advance_to(10)
    assert not s.worker.healthy


def test_stop_during_the_restart_delay_cancels_the_start():
    """Stopping between a crash and its restart starts nothing and leaves no timer."""
    s = Supervised()
    s.worker.startService()
    s.process.end(status=1)
    stopped = []
    s.worker.stopService().addCallback(stopped.append)
    assert stopped == [None]
    s.reactor.advance_to(100)
    assert len(s.reactor.processes) == 1
    assert s.reactor.getDelayedCalls() == []


def test_stop_while_being_replaced_keeps_the_kill_on_time():
    """A stop during a replacement waits for that exit; SIGKILL still comes at the end of the grace."""
    s = Supervised(startup_grace_seconds=0)
    s.worker.startService()
    s.reactor.advance_to(6)
    stopped = []
    s.worker.stopService().addCallback(stopped.append)
    s.reactor.advance_to(10.9)
    assert s.process.signals == ["TERM"]
    s.reactor.advance_to(11)
    assert s.process.signals == ["TERM", "KILL"]
    s.process.end(signal=9)
    assert stopped == [None] and s.restart_count() == 0
    assert s.reactor.getDelayedCalls() == []


def test_a_draining_worker_that_stops_answering_gets_the_grace_before_sigkill():
    """A draining worker that closes its port first gets the termination grace, not a kill."""
    s = Supervised(startup_grace_seconds=0)
    s.worker.startService()
    s.listening("http://127.0.0.1:9")
    stopped = []
    s.worker.stopService().addCallback(stopped.append)
    s.reactor.advance_to(10.9)  # probes at 2, 4 and 6 failed; termination grace 5 s
    assert s.process.signals == ["TERM"]
    s.process.end(status=0)
    assert stopped == [0] and s.restart_count() == 0
    assert s.reactor.getDelayedCalls() == []


def test_a_draining_worker_that_never_exits_is_killed_after_the_grace():
    """A draining worker that stops answering and never exits gets SIGKILL after the grace."""
    s = Supervised(startup_grace_seconds=0)
    s.worker.startService()
    s.listening("http://127.0.0.1:9")
    s.worker.stopService()
    s.reactor.advance_to(10.9)
    assert s.process.signals == ["TERM"]
    s.reactor.advance_to(11)
    assert s.process.signals == ["TERM", "KILL"]
    s.process.end(signal=9)
    assert not s.worker.running and s.restart_count() == 0
    assert s.reactor.getDelayedCalls() == []


def test_a_worker_that_was_never_started_stops_at_once():
    """Stopping a worker that never started fires at once and spawns nothing."""
    s = Supervised()
    stopped = []
    s.worker.stopService().addCallback(stopped.append)
    assert stopped == [None] and s.reactor.processes == []


def test_a_worker_that_ended_a_run_past_its_limit_is_started_again_at_once():
    """A child that exits 3 (it ended a run past --max-run-seconds) is started again at once
    and counted as a restart, while a later crash still waits the first backoff delay."""
    s = Supervised()
    s.worker.startService()
    s.process.end(status=3)
    s.reactor.advance(0)
    assert len(s.reactor.processes) == 2 and s.restart_count() == 1
    s.process.end(status=1)
    s.reactor.advance(0.999)
    assert len(s.reactor.processes) == 2
    s.reactor.advance(0.001)
    assert len(s.reactor.processes) == 3
