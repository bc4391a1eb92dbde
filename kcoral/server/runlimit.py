"""
A run's time limit (C{--max-run-seconds}): a run or an inference batch
still executing that long after it entered its worker thread ends the
process that runs it.

Nothing short of that ends it. XLA has no way to interrupt an execution,
and a Python thread inside one can be neither stopped nor joined: its slot
would stay taken for ever, and a drain, which waits for every slot, would
never end. So the run's client is answered 504 C{run_timeout} at once,
and the process makes way for a fresh one (L{kcoral.server.service}).

Every run and every inference batch reaches the device through one
place, L{kcoral.server.app.ServerApp.in_thread}, which times each with
a L{RunTimer} of the server's L{RunLimit}.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger

from kcoral.errors import RunTimeout

log = Logger()


class RunLimit:
    """
    A limit of C{seconds} (0: none) on each run of one server, timed on
    C{reactor} (an C{IReactorTime}, and an C{IReactorThreads} for the runs
    that L{RunTimer.timed} starts): a run that passes it is answered
    L{RunTimeout}, and C{passed} is told its request id.
    """

    def __init__(self, seconds: float, reactor, passed: Callable[[str], object]):
        self.seconds = seconds
        self.reactor = reactor
        self.passed = passed

    def timer(self, rid: str, answer: Deferred) -> RunTimer:
        """The timer, not yet started, of the run C{rid} whose answer is C{answer}."""
        return RunTimer(self, rid, answer)


#: No limit: runs execute for as long as they take.
NO_RUN_LIMIT = RunLimit(0.0, None, lambda rid: None)


class RunTimer:
    """
    One run's timer: L{start}ed on the reactor once the run entered its
    thread, L{stop}ped once it left. Should it pass the limit first, the
    run's answer fails with L{RunTimeout} (unless its client went away),
    and its limit's C{passed} is told.
    """

    def __init__(self, limit: RunLimit, rid: str, answer: Deferred):
        self._limit = limit
        self._rid = rid
        self._answer = answer
        self._expiry: IDelayedCall | None = None
        #: Whether the run passed the limit.
        self.passed = False

    def timed(self, f: Callable) -> Callable:
        """C{f}, for a worker thread to run, starting this timer as it
        enters that thread; C{f} itself when runs have no limit."""
        if not self._limit.seconds:
            return f

        def entered(*args):
            # Its time counts from here: a kept array's copy or a model's
            # compile may hold the pool's threads while it waits for one.
            self._limit.reactor.callFromThread(self.start)
            return f(*args)

        return entered

    def start(self) -> None:
        self._expiry = self._limit.reactor.callLater(self._limit.seconds, self._expired)

    def stop(self) -> None:
        if self._expiry is not None and self._expiry.active():
            self._expiry.cancel()
        self._expiry = None

    def _expired(self) -> None:
        self._expiry = None
        self.passed = True
        seconds = self._limit.seconds
        log.warn("{request_id} was still running {seconds:g} s after it started "
                 "(--max-run-seconds): answered 504 run_timeout; ending this process, which "
                 "cannot stop it otherwise", request_id=self._rid, seconds=seconds)
        if not self._answer.called:
            self._answer.errback(RunTimeout(
                f"still executing {seconds:g} s after it started (the server's "
                "--max-run-seconds): the process running it was ended", request_id=self._rid))
        self._limit.passed(self._rid)
