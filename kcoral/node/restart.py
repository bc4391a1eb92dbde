"""
The restart policy of a supervised worker, whole: a restart after
C{failure_threshold} failed probes in a row, except during the
C{startup_grace_seconds} after a start, and never twice for one start (the
probes that fail while a worker is being replaced do not replace it again);
SIGTERM, then SIGKILL after C{termination_grace_seconds}; capped exponential
backoff with jitter between restarts, reset after the worker has been healthy
for C{stable_reset_seconds}; none after a worker ended itself because a run
passed its C{--max-run-seconds}, which counts no restart towards the backoff.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import attrs
from twisted.application.internet import backoffPolicy

from kcoral.common.serverconfig import RUN_TIMEOUT_EXIT_STATUS


@attrs.frozen
class RestartSettings:
    """The supervisor's options, with their documented defaults."""

    failure_threshold: int = 3
    startup_grace_seconds: float = 30.0
    stable_reset_seconds: float = 60.0
    termination_grace_seconds: float = 5.0
    restart_min_delay_seconds: float = 1.0
    restart_max_delay_seconds: float = 30.0
    restart_jitter: float = 0.2
    health_interval_seconds: float = 2.0
    health_timeout_seconds: float = 1.0


@attrs.define
class RestartPolicy:
    """What one worker's probes and exits mean: when to replace it, how long
    to wait before starting it again."""

    settings: RestartSettings
    random: random.Random = attrs.Factory(random.Random)
    #: Restarts since the worker was last stable.
    restarts: int = 0
    started_at: float | None = None
    healthy_since: float | None = None
    failures: int = 0
    #: Whether this start has been condemned already (once is enough).
    condemned: bool = False
    _backoff: Callable[[int], float] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        s = self.settings
        # Twisted's policy gives the capped exponential; our jitter is a
        # fraction of the delay, not Twisted's additive seconds.
        self._backoff = backoffPolicy(s.restart_min_delay_seconds, s.restart_max_delay_seconds,
                                      factor=2.0, jitter=lambda: 0.0)

    @property
    def termination_grace(self) -> float:
        """Seconds between SIGTERM and SIGKILL."""
        return self.settings.termination_grace_seconds

    def next_delay(self, status: int | None = None) -> float:
        """The delay before the next start of a worker that exited with
        C{status} (None: a signal ended it); each call counts one restart,
        but for a worker that ended itself because a run passed its limit."""
        if status == RUN_TIMEOUT_EXIT_STATUS:
            # It served until then, and ended only to end that run: no sign
            # of the crash loop a backoff slows down. The process is gone
            # (its port and device free), and the node's capacity should be
            # whole again as soon as a fresh worker starts.
            return 0.0
        base = self._backoff(self.restarts)
        self.restarts += 1
        jitter = self.settings.restart_jitter
        return max(0.0, base * (1.0 + self.random.uniform(-jitter, jitter)))

    def started(self, now: float) -> None:
        self.started_at, self.healthy_since, self.failures = now, None, 0
        self.condemned = False

    def probe(self, ok: bool, now: float) -> bool:
        """Record one health probe; True, once per start, when the worker
        must be replaced."""
        if ok:
            self.failures = 0
            if self.healthy_since is None:
                self.healthy_since = now
            if self.restarts and now - self.healthy_since >= self.settings.stable_reset_seconds:
                self.restarts = 0
            return False
        self.healthy_since = None
        self.failures += 1
        in_grace = self.started_at is not None and \
            now - self.started_at < self.settings.startup_grace_seconds
        if self.condemned or in_grace or self.failures < self.settings.failure_threshold:
            return False
        self.condemned = True
        return True
