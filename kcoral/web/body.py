"""
A request body as it is forwarded: bytes in memory, or an anonymous
temporary file that a large body is spooled to (L{kcoral.web.spool}), read
back in a thread so that no disk I/O happens on the reactor thread, or
handed on chunk by chunk as it arrives to a reader that has caught up.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import IO

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.web.iweb import IBodyProducer
from zope.interface import Attribute, Interface, implementer

#: Runs a call in a thread: the result of C{f(*args)}, as a Deferred.
InThread = Callable[..., Deferred]


#: Bytes read from a spooled body at a time: large enough that a thread hop
#: per chunk costs little, small enough to be all the memory a forward holds.
READ_BYTES = 1 << 20
#: While a forward waits on its client (a reader has caught up with a body
#: still arriving, and holds a member's slot meanwhile), the body must arrive
#: at this rate or better over each window of L{PACE_WINDOW_SECONDS}: a
#: client that stalls, or trickles, does not hold a member for long.
PACE_BYTES_PER_SECOND = 1 << 20
PACE_WINDOW_SECONDS = 10.0


class IBody(Interface):
    """A whole request body, which may be sent any number of times."""

    length = Attribute("Its size in bytes.")

    def send() -> bytes | IBodyProducer:
        """What treq sends as this body, once: bytes, or a new producer for
        each attempt (a producer cannot be started twice)."""

    def read() -> Deferred[memoryview]:
        """All of it, once it has all arrived: a view of it in memory, or
        what was read from its file in a thread (never the reactor's)."""

    def close() -> Deferred[None]:
        """Let go of what holds it; it is not sent again."""

    def behind() -> bool:
        """Whether a forward of it that ends now was let down by its client:
        it has not all arrived, and while a forward last waited on it, it
        arrived under L{PACE_BYTES_PER_SECOND}."""


class RequestBody(io.BytesIO):
    """A request body as it arrives, in memory, which handlers view without
    copying (L{MemoryBody}): closing it would fail while such views exist,
    and the GC frees it."""

    def close(self):
        pass


def _bytes_of(data: bytes | io.BytesIO) -> bytes:
    return data if isinstance(data, bytes) else data.getvalue()


@implementer(IBody)
@attrs.frozen
class MemoryBody:
    """
    A body held in memory: bytes, or a request's content, which neither way
    of taking it copies while the other is not in use: a view of it to read
    (C{getbuffer}), or its bytes to send (C{getvalue}: a BytesIO gives up
    its own buffer while no view of it is held). A Router only sends the
    body, on each try; a server only reads it.
    """

    data: bytes | io.BytesIO = attrs.field(eq=_bytes_of)

    @property
    def length(self) -> int:
        if isinstance(self.data, bytes):
            return len(self.data)
        with self.data.getbuffer() as view:
            return view.nbytes

    def send(self) -> bytes:
        return _bytes_of(self.data)

    def read(self) -> Deferred[memoryview]:
        data = self.data
        return succeed(memoryview(data) if isinstance(data, bytes) else data.getbuffer())

    def close(self) -> Deferred[None]:
        return succeed(None)

    def behind(self) -> bool:
        return False


def held(body: IBody, most: int) -> bytes | None:
    """The bytes of C{body} if it is in memory and at most C{most} bytes
    long, else None: a body its handler reads at once must be small, and a
    site spools only bodies larger than its threshold."""
    if body.length > most or not isinstance(body, MemoryBody):
        return None
    return body.send()


@implementer(IBody)
class SpooledBody:
    """
    A body of C{length} bytes in an anonymous temporary file that C{serial}
    writes, reads and closes in a thread, one call after another (so it is
    closed only once a read in progress has ended); or, with C{chunks}, kept
    in memory as the chunks it arrived in (L{kcoral.web.spool.Spool.kept}),
    C{kept} called once it is closed. It may still be arriving: C{received}
    bytes of it have arrived, of which C{written} are in C{file} so far
    (None until the first write). A reader that has read all that arrived is
    handed each chunk as it arrives (L{follow}); one behind what arrived
    reads the chunks, or the file, and waits when it has read all that is
    written (L{when_grown}).

    While a reader follows it, a forward waits on its client: C{clock}
    times that against L{PACE_BYTES_PER_SECOND} (L{behind}), window by
    window, and C{stalled} is told when a window ends behind.
    """

    def __init__(self, length: int, serial: InThread, file: IO[bytes] | None = None,
                 written: int = 0, chunks: list[bytes] | None = None,
                 kept: Callable[[], object] = lambda: None, clock=None):
        self.length = length
        self.serial = serial
        self.file = file
        self.written = self.received = written
        self.chunks = chunks
        self._kept = kept
        self._waiting: list[Callable[[], object]] = []
        self._following: dict[FileReader, None] = {}
        #: Told whether a reader follows it, each time that changes: its
        #: client is read at the pace of the reader (None: at its own).
        self.paced: Callable[[bool], object] | None = None
        #: Told when a window of a forward waiting on its client ends behind.
        self.stalled: Callable[[], object] | None = None
        self._clock = clock
        self._window_end = None  # a named timer: the current window's end
        # The last stretch of time readers followed it: its start, the bytes
        # arrived then, and its end (None: still following).
        self._since = 0.0
        self._mark = 0
        self._until: float | None = 0.0

    def arrived(self, data: bytes) -> None:
        """C{data} arrived, next after what did: readers following get it."""
        self.received += len(data)
        if self.received >= self.length:
            self._cancel_window()
        if self.chunks is not None:
            self.chunks.append(data)
        for reader in list(self._following):
            reader.arrived(data)

    def grew(self, file: IO[bytes], written: int) -> None:
        """C{written} bytes of it are now in C{file}: readers waiting go on."""
        self.file, self.written = file, written
        waiting, self._waiting = self._waiting, []
        for go_on in waiting:
            go_on()

    def when_grown(self, go_on: Callable[[], object]) -> None:
        """Call C{go_on} once more of it is in its file."""
        self._waiting.append(go_on)

    def follow(self, reader: FileReader) -> None:
        """Hand C{reader} each chunk as it arrives, until L{unfollow}."""
        if not self._following:
            self._start_window()
            if self.paced is not None:
                self.paced(True)
        self._following[reader] = None

    def unfollow(self, reader: FileReader) -> None:
        if self._following.pop(reader, False) is None and not self._following:
            self._end_window()
            if self.paced is not None:
                self.paced(False)

    def _start_window(self) -> None:
        if self._clock is None or self.received >= self.length:
            return
        self._since, self._mark, self._until = self._clock.seconds(), self.received, None
        self._window_end = self._clock.callLater(PACE_WINDOW_SECONDS, self._window_ended)

    def _end_window(self) -> None:
        if self._clock is not None and self._until is None:
            self._until = self._clock.seconds()
        self._cancel_window()

    def _cancel_window(self) -> None:
        if self._window_end is not None and self._window_end.active():
            self._window_end.cancel()
        self._window_end = None

    def _window_ended(self) -> None:
        self._window_end = None
        if not self.behind():
            self._start_window()
        elif self.stalled is not None:
            self.stalled()

    def behind(self) -> bool:
        if self._clock is None or self.received >= self.length:
            return False
        until = self._clock.seconds() if self._until is None else self._until
        return self.received - self._mark < PACE_BYTES_PER_SECOND * (until - self._since)

    def send(self) -> IBodyProducer:
        return FileReader(self)

    def read(self) -> Deferred[memoryview]:
        """All of it, once it has all arrived: joined from its chunks, or
        read from its file in its serial's thread (never on the reactor's)."""
        if self.chunks is not None:
            return succeed(memoryview(b"".join(self.chunks)))
        return self.serial(_read_whole, self.file, self.length).addCallback(memoryview)

    def close(self) -> Deferred[None]:
        self._waiting = []
        self._following = {}
        self.paced = self.stalled = None
        self._cancel_window()
        if self.chunks is not None:
            self.chunks = None
            self._kept()
        file = self.file
        return succeed(None) if file is None else self.serial(file.close)


def _pread(file: IO[bytes], size: int, offset: int) -> bytes:
    # The descriptor asked for at each read: a file closed meanwhile fails
    # the read, where its number might already name another file.
    return os.pread(file.fileno(), size, offset)


def _read_whole(file: IO[bytes], length: int) -> bytes:
    chunks, offset = [], 0
    while offset < length:
        chunk = _pread(file, length - offset, offset)
        if not chunk:
            raise EOFError(f"spooled body ends at {offset} of {length} bytes")
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


@implementer(IBodyProducer)
class FileReader:
    """
    Produces the bytes of C{body} from its start: each chunk read in a
    thread by its serial (C{os.pread}: no shared file position, so each
    attempt of a forward reads with a reader of its own) as far as it has
    been written; once all that arrived has been produced, each chunk as it
    arrives, for as long as the consumer is not paused (the first attempt of
    a forward that starts with the body: nothing read back). It reads the
    next chunk only once the consumer has taken the last one and is not
    paused: what a forward holds in memory is one chunk and the transport's
    buffer.
    """

    def __init__(self, body: SpooledBody):
        self.length = body.length
        self._body = body
        self._offset = 0
        self._index = 0  # of the next chunk, where they are in memory
        self._paused = self._reading = self._stopped = False
        self._consumer = None
        self._done: Deferred[None] = Deferred(lambda d: self.stopProducing())

    def startProducing(self, consumer) -> Deferred[None]:
        self._consumer = consumer
        self._read()
        return self._done

    def _read(self) -> None:
        body = self._body
        while not (self._paused or self._reading or self._stopped):
            if self._offset >= self.length:
                self._finish()
                return
            if body.chunks is not None and self._index < len(body.chunks):
                data = body.chunks[self._index]
                self._index += 1
                self._produce(data)
                continue
            if self._offset >= body.written:
                if self._offset == body.received:
                    body.follow(self)
                else:  # arrived, not yet written
                    body.when_grown(self._read)
                return
            assert body.file is not None  # written to
            self._reading = True
            d = body.serial(_pread, body.file, min(READ_BYTES, body.written - self._offset),
                                 self._offset)
            d.addCallbacks(self._got, self._failed)
            return

    def _finish(self) -> None:
        self._body.unfollow(self)
        if not self._done.called:
            self._done.callback(None)

    def _got(self, data: bytes) -> None:
        self._reading = False
        if self._stopped:
            return
        if not data:
            self._failed(EOFError(f"spooled body ends at {self._offset} of {self.length} bytes"))
            return
        self._produce(data)
        self._read()

    def _produce(self, data: bytes) -> None:
        self._offset += len(data)
        assert self._consumer is not None  # produced from startProducing on
        self._consumer.write(data)  # which may pause or stop this producer

    def arrived(self, data: bytes) -> None:
        """The next chunk of a body this reader follows."""
        self._index += 1
        self._produce(data)
        if self._offset >= self.length and not self._stopped:
            self._finish()

    def _failed(self, reason) -> None:
        self._reading = False
        if not self._stopped:
            self._stopped = True
            self._done.errback(reason)

    def pauseProducing(self) -> None:
        # What arrives meanwhile is read back from the file once resumed.
        self._paused = True
        self._body.unfollow(self)

    def resumeProducing(self) -> None:
        self._paused = False
        self._read()

    def stopProducing(self) -> None:
        # The Deferred of startProducing must then never fire.
        self._stopped = True
        self._body.unfollow(self)
