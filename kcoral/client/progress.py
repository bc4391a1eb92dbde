"""
Progress bars for large request bodies, shown by clients made with
C{progress=True}: tqdm's C{tqdm.auto}, so that a notebook gets its widget and
a terminal a text bar. Bodies are counted as they are written to the
connection, not as they are prepared: hashing and framing run before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IConsumer
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

#: Bodies from this size on get a bar; smaller ones leave in a moment on any network.
PROGRESS_BYTES = 64 << 20


def upload_bar(length: int, url: str) -> Any:
    """A bar for a body of C{length} bytes to C{url}, or None for a smaller body."""
    if length < PROGRESS_BYTES:
        return None
    # Imported here: the Router and the nodes import the client package but
    # never show a bar, and tqdm comes with the client's extra.
    from tqdm.auto import tqdm

    return tqdm(total=length, desc=f"upload to {url}", unit="B", unit_scale=True, unit_divisor=1024)


@implementer(IConsumer)
class _CountingConsumer:
    def __init__(self, consumer: IConsumer, advance: Callable[[int], object]):
        self._consumer = consumer
        self._advance = advance

    def registerProducer(self, producer, streaming):
        self._consumer.registerProducer(producer, streaming)

    def unregisterProducer(self):
        self._consumer.unregisterProducer()

    def write(self, data):
        self._consumer.write(data)
        self._advance(len(data))


@implementer(IBodyProducer)
class CountingProducer:
    """
    C{producer}'s body, calling C{advance} with the size of each piece it
    writes. The connection pauses the producer while its buffer is full, so
    the count follows what the connection has taken.
    """

    def __init__(self, producer: IBodyProducer, advance: Callable[[int], object]):
        self._producer = producer
        self._advance = advance
        self.length = producer.length

    def startProducing(self, consumer):
        return self._producer.startProducing(_CountingConsumer(consumer, self._advance))

    def pauseProducing(self):
        self._producer.pauseProducing()

    def resumeProducing(self):
        self._producer.resumeProducing()

    def stopProducing(self):
        self._producer.stopProducing()
