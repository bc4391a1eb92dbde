"""
A request body as it is forwarded: bytes in memory, or an anonymous
temporary file that a large body was spooled to (L{kcoral.web.spool}), read
back in a thread so that no disk I/O happens on the reactor thread.
"""

from __future__ import annotations

import os
from typing import IO

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.web.iweb import IBodyProducer
from zope.interface import Attribute, Interface, implementer

from kcoral.web.serial import Serial

#: Bytes read from a spooled body at a time: large enough that a thread hop
#: per chunk costs little, small enough to be all the memory a forward holds.
READ_BYTES = 1 << 20


class IBody(Interface):
    """A whole request body, which may be sent any number of times."""

    length = Attribute("Its size in bytes.")

    def send() -> bytes | IBodyProducer:
        """What treq sends as this body, once: bytes, or a new producer for
        each attempt (a producer cannot be started twice)."""

    def close() -> Deferred[None]:
        """Let go of what holds it; it is not sent again."""


@implementer(IBody)
@attrs.frozen
class MemoryBody:
    """A body held in memory."""

    data: bytes

    @property
    def length(self) -> int:
        return len(self.data)

    def send(self) -> bytes:
        return self.data

    def close(self) -> Deferred[None]:
        return succeed(None)


def body_of(request) -> IBody:
    """The whole body of C{request}, under any C{Site}: a KCoral request's
    own (L{kcoral.web.request.KCoralRequest.body}), else its content read
    into memory (under C{treq.testing.StubTreq}, for one)."""
    body = getattr(request, "body", None)
    if body is not None:
        return body
    request.content.seek(0)
    return MemoryBody(request.content.read())


@implementer(IBody)
@attrs.frozen
class SpooledBody:
    """A body of C{length} bytes in C{file}, an anonymous temporary file that
    C{serial} reads and closes in a thread, one call after another (so it is
    closed only once a read in progress has ended)."""

    file: IO[bytes]
    length: int
    serial: Serial

    def send(self) -> IBodyProducer:
        return FileReader(self.file, self.length, self.serial)

    def close(self) -> Deferred[None]:
        return self.serial.call(self.file.close)


def _pread(file: IO[bytes], size: int, offset: int) -> bytes:
    # The descriptor asked for at each read: a file closed meanwhile fails
    # the read, where its number might already name another file.
    return os.pread(file.fileno(), size, offset)


@implementer(IBodyProducer)
class FileReader:
    """
    Produces C{length} bytes of C{file} from its start, each chunk read in a
    thread by C{serial} (C{os.pread}: no shared file position, so each attempt
    of a forward reads with a reader of its own). It reads the
    next chunk only once the consumer has taken the last one and is not
    paused: what a forward holds in memory is one chunk and the transport's
    buffer.
    """

    def __init__(self, file: IO[bytes], length: int, serial: Serial):
        self.length = length
        self._file = file
        self._serial = serial
        self._offset = 0
        self._paused = self._reading = self._stopped = False
        self._consumer = None
        self._done: Deferred[None] = Deferred(lambda d: self.stopProducing())

    def startProducing(self, consumer) -> Deferred[None]:
        self._consumer = consumer
        self._read()
        return self._done

    def _read(self) -> None:
        if self._paused or self._reading or self._stopped:
            return
        if self._offset >= self.length:
            self._done.callback(None)
            return
        self._reading = True
        d = self._serial.call(_pread, self._file, min(READ_BYTES, self.length - self._offset),
                              self._offset)
        d.addCallbacks(self._got, self._failed)

    def _got(self, data: bytes) -> None:
        self._reading = False
        if self._stopped:
            return
        if not data:
            self._failed(EOFError(f"spooled body ends at {self._offset} of {self.length} bytes"))
            return
        self._offset += len(data)
        assert self._consumer is not None  # reads start with startProducing
        self._consumer.write(data)  # which may pause this producer
        self._read()

    def _failed(self, reason) -> None:
        self._reading = False
        if not self._stopped:
            self._stopped = True
            self._done.errback(reason)

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._read()

    def stopProducing(self) -> None:
        # The Deferred of startProducing must then never fire.
        self._stopped = True
