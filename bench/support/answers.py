"""An HTTP/1.1 answer read off an asyncio stream: the closed-loop loads'
own client, with nothing of an HTTP library between them and the socket."""

from __future__ import annotations


class BadAnswer(Exception):
    pass


async def read_answer(reader) -> tuple[int, bytes]:
    status = await reader.readline()
    if not status:
        raise BadAnswer("the connection closed")
    code = int(status.split(None, 2)[1])
    length, chunked = None, False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    if chunked:
        chunks = []
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return code, b"".join(chunks)
            chunks.append(chunk[:-2])
    if length is None:
        raise BadAnswer("an answer without Content-Length or chunked framing")
    return code, await reader.readexactly(length)
