"""
Request buffering on disk, as production proxies do it: a body over
L{SPOOL_THRESHOLD} bytes is written, while it arrives, to an anonymous
temporary file (in C{tempfile}'s directory: C{TMPDIR}, else the system's),
so that a Router's memory does not grow by the size of each large body in
flight. Smaller bodies stay in memory, untouched by any of this.

The writes run in a small thread pool of their own, in order, never on the
reactor thread; while more than L{WAITING_BYTES} wait to be written, the
client's transport is paused, so what waits in memory stays bounded. A body
forwarded while it arrives (L{kcoral.web.intake}) also holds its client
while no reader follows it (L{Holds}): it is read at the pace it is sent on;
it is kept in memory instead, as it arrived, while all those kept fit in
L{KEPT_BYTES} (L{Spool.kept}).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from functools import partial
from typing import IO, Any

from twisted.internet.defer import Deferred, DeferredLock, fail, succeed
from twisted.internet.interfaces import IPushProducer
from twisted.internet.threads import deferToThreadPool
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from kcoral.web.body import IBody, InThread, MemoryBody, SpooledBody

#: Bodies larger than this go to a file (those of unknown length once they
#: grow past it).
SPOOL_THRESHOLD = 8 << 20
#: Bytes received but not yet written beyond which the client is paused.
WAITING_BYTES = 4 << 20
#: Bytes of the bodies forwarded while they arrive that a service keeps in
#: memory, all of them together, as the chunks they arrived in (no copy;
#: small ones joined, L{kcoral.web.intake.JOIN_BYTES}, so that their bytes
#: are nearly all they cost): a body that would take it past this goes to a file.
KEPT_BYTES = 48 << 20
#: Threads writing and reading spooled bodies: disk bandwidth, not threads,
#: bounds them, and the reactor's own pool stays free for name lookups.
SPOOL_THREADS = 2

class Spool:
    """Where a service's large bodies go: files of C{directory} (None: the
    system's temporary directory), written by C{in_thread} (default: a pool
    of L{SPOOL_THREADS} threads of C{reactor}'s, started when first needed)."""

    def __init__(self, reactor, threshold: int = SPOOL_THRESHOLD, directory: str | None = None,
                 in_thread: InThread | None = None, kept_bytes: int = KEPT_BYTES):
        self.threshold = threshold
        self.directory = directory
        self.kept_bytes = kept_bytes
        self._kept = 0
        self._reactor = reactor
        #: What times the bodies it holds (L{kcoral.web.body.SpooledBody.behind}).
        self.clock = reactor
        self._in_thread = in_thread
        self._pool: ThreadPool | None = None

    def in_thread(self, f: Callable[..., Any], *args: Any) -> Deferred:
        if self._in_thread is not None:
            return self._in_thread(f, *args)
        if self._pool is None:
            self._pool = ThreadPool(0, SPOOL_THREADS, "kcoral-spool")
            self._pool.start()
            self._reactor.addSystemEventTrigger("during", "shutdown", self._pool.stop)
        return deferToThreadPool(self._reactor, self._pool, f, *args)

    def kept(self, length: int) -> SpooledBody | None:
        """A body of C{length} bytes, forwarded while it arrives, kept in
        memory if all those kept fit in L{KEPT_BYTES} with it; else None (it
        goes to a file)."""
        if self._kept + length > self.kept_bytes:
            return None
        self._kept += length

        def closed() -> None:
            self._kept -= length

        return SpooledBody(length, serial(self.in_thread), chunks=[], kept=closed,
                           clock=self.clock)

    def writer(self, holds: Holds, failed: Callable[[Failure], object],
               length: int | None = None) -> SpoolWriter:
        """A writer for one body of C{length} bytes (None: unknown), holding
        its client's transport (C{holds}) while writes lag; C{failed} is
        told of a write that failed."""
        return SpoolWriter(self, holds, failed, length)


def _write(file: IO[bytes] | None, directory: str | None, chunks: list[bytes]) -> IO[bytes]:
    if file is None:
        file = tempfile.TemporaryFile(dir=directory)
    file.writelines(chunks)  # as they arrived: no copy joins them
    file.flush()  # it is read back by its descriptor (os.pread)
    return file


#: Why a client is held: writes of its body lag behind.
LAGGING = "lagging"
#: Why a client is held: its body is forwarded while it arrives, and no
#: reader follows it (none has started, or the one that did is paused).
UNREAD = "unread"


class Holds:
    """
    A client's transport (C{producer}, None: nothing to pause), paused while
    anything holds it (L{LAGGING}, L{UNREAD}). While it is L{UNREAD}, which
    may last as long as a run waits for a member, the idle timeout of its
    connection (C{channel}, a C{TimeoutMixin}) is off: a client that cannot
    send is not idle. How long it was held in all is kept, for the bound on
    the rate its body arrives at.
    """

    def __init__(self, producer: IPushProducer | None, channel=None, clock=None):
        self._producer = producer
        self._channel = channel
        self._clock = clock
        self._reasons: set[str] = set()
        self._idle: float | None = None
        self._since = 0.0
        self._held = 0.0

    def hold(self, reason: str) -> None:
        if reason in self._reasons:
            return
        if not self._reasons:
            if self._producer is not None:
                self._producer.pauseProducing()
            if self._clock is not None:
                self._since = self._clock.seconds()
        if reason == UNREAD and self._channel is not None:
            self._idle = self._channel.setTimeout(None)
        self._reasons.add(reason)

    def release(self, reason: str) -> None:
        if reason not in self._reasons:
            return
        self._reasons.discard(reason)
        if reason == UNREAD and self._channel is not None:
            self._channel.setTimeout(self._idle)
        if not self._reasons:
            if self._clock is not None:
                self._held += self._clock.seconds() - self._since
            if self._producer is not None:
                self._producer.resumeProducing()

    def release_all(self) -> None:
        for reason in list(self._reasons):
            self.release(reason)

    def drop(self) -> None:
        """The connection is gone: nothing is to be resumed or re-armed."""
        self._reasons.clear()
        self._producer = self._channel = None

    def held_seconds(self) -> float:
        """How long the transport was held in all, until now."""
        if self._reasons and self._clock is not None:
            return self._held + self._clock.seconds() - self._since
        return self._held


class SpoolWriter:
    """
    One body as it arrives, written to a file, one write in flight at a time
    with what arrived meanwhile handed to the next (in the thread, without
    joining them). A body of known length (over the threshold: the site
    spools no other) goes to its file from its first byte, and L{body} can
    be read while it arrives; one of unknown length is held in memory up to
    the spool's threshold.
    """

    def __init__(self, spool: Spool, holds: Holds, failed: Callable[[Failure], object],
                 length: int | None = None):
        self.length = 0
        self._spool = spool
        self._serial = serial(spool.in_thread)
        self._holds = holds
        self._failed = failed
        self._pending: list[bytes] = []
        self._waiting = 0  # pending or being written
        self._file: IO[bytes] | None = None
        self._on_disk = 0
        self._writing = self._discarded = False
        self._spilled = length is not None
        #: The body, readable while it arrives (None: of unknown length).
        self.body = None if length is None else SpooledBody(length, self._serial,
                                                               clock=spool.clock)
        self._failure: Failure | None = None
        self._done: Deferred[IBody] | None = None

    def write(self, data: bytes) -> None:
        if self._discarded:
            return
        self.length += len(data)
        self._pending.append(data)
        self._waiting += len(data)
        if self.body is not None:
            self.body.arrived(data)
        if not self._spilled and self.length <= self._spool.threshold:
            return
        self._spilled = True
        if not self._writing:
            self._flush()
        if self._waiting > WAITING_BYTES:
            self._holds.hold(LAGGING)

    def _flush(self) -> None:
        chunks, self._pending = self._pending, []
        self._writing = True
        d = self._serial(_write, self._file, self._spool.directory, chunks)
        d.addCallbacks(self._written, self._write_failed, callbackArgs=(sum(map(len, chunks)),))

    def _written(self, file: IO[bytes], size: int) -> None:
        self._file = file
        self._writing = False
        self._waiting -= size
        self._on_disk += size
        if self._discarded:
            self._serial(file.close)
            return
        if self.body is not None:
            self.body.grew(file, self._on_disk)
        if self._pending:
            self._flush()
        if self._waiting <= WAITING_BYTES:
            self._holds.release(LAGGING)
        if not self._writing and self._done is not None:
            done, self._done = self._done, None
            done.callback(self._whole())

    def _write_failed(self, failure: Failure) -> None:
        self._writing = False
        self._failure = failure
        # A body discarded already (its request done, or refused) has no
        # one to tell but a caller of finish.
        unwanted = self._discarded
        self.discard()
        if self._done is not None:
            done, self._done = self._done, None
            done.errback(failure)
        elif not unwanted:
            self._failed(failure)

    def finish(self) -> Deferred[IBody]:
        """The whole body, once every write has ended: in memory if it never
        grew past the threshold, else in its file."""
        if self._failure is not None:
            return fail(self._failure)
        if not self._spilled:
            return succeed(MemoryBody(b"".join(self._pending)))
        if not self._writing:  # so nothing is pending either
            return succeed(self._whole())
        self._done = Deferred()
        return self._done

    def _whole(self) -> SpooledBody:
        assert self._file is not None  # a write has ended
        return self.body or SpooledBody(self.length, self._serial, self._file, self.length)

    def discard(self) -> None:
        """The body will never be used (its client went away, or it was
        refused): its file is closed once a write in progress has ended."""
        if self._discarded:
            return
        self._discarded = True
        self._pending = []
        # So that the connection reads (and drops) what its client sends.
        self._holds.release_all()
        if not self._writing and self._file is not None:
            self._serial(self._file.close)


def serial(in_thread: InThread) -> InThread:
    """
    C{in_thread}, each call of it started once the one before has ended,
    failed or not (Twisted's C{DeferredLock}; a runner that raises, its pool
    stopped, fails that call alone): the writes and reads of one spooled
    body keep their order, whichever thread runs each. Measured against a
    hand-made chain of Deferreds, uncontended, it costs about 1 us more a
    call (8.5 against 7.5): nothing beside the thread hop each call makes.
    """
    return partial(DeferredLock().run, in_thread)
