"""Just enough HTTP/1.1 for `bench serve`, on the standard library's asyncio streams.

One request per connection (`Connection: close`), so a response body ends where the server says:

    Transfer-Encoding: chunked   "<hex size>\\r\\n<bytes>\\r\\n" ... "0\\r\\n\\r\\n"  (streams)
    Content-Length: N            N bytes
    neither                      until the server closes the connection

and server-sent events are blocks separated by a blank line, each `data: <payload>` line of a
block being one payload (the OpenAI stream's JSON chunks, then `[DONE]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class Response:
    def __init__(self, reader: asyncio.StreamReader, status: int, headers: dict[str, str]):
        self.reader = reader
        self.status = status
        self.headers = headers  # names lower-cased

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    return  # trailers, if any, are left unread: the connection closes
                yield await self.reader.readexactly(size)
                await self.reader.readexactly(2)  # the CRLF after each chunk
        elif "content-length" in self.headers:
            yield await self.reader.readexactly(int(self.headers["content-length"]))
        else:
            while data := await self.reader.read(65536):
                yield data

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])


@contextlib.asynccontextmanager
async def http_request(
    url: str, method: str, headers: dict[str, str], body: bytes = b""
) -> AsyncIterator[Response]:
    """Send one request; yield the response once its status line and headers are in."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"want an http:// or https:// URL, got {url!r}")
    tls = ssl.create_default_context() if parts.scheme == "https" else None
    port = parts.port or (443 if tls else 80)
    reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=tls)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close",
                 f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        await writer.drain()
        status_line = (await reader.readline()).decode("latin-1").split()
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/"):
            raise ValueError(f"{url}: not an HTTP response: {' '.join(status_line)!r}")
        response_headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            response_headers[name.strip().lower()] = value.strip()
        yield Response(reader, int(status_line[1]), response_headers)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream, one per event, as they complete."""
    pending = b""
    async for chunk in chunks:
        pending = (pending + chunk).replace(b"\r\n", b"\n")  # a lone \r waits for its \n
        *events, pending = pending.split(b"\n\n")
        for event in events:
            data = [line[5:].removeprefix(b" ") for line in event.split(b"\n")
                    if line.startswith(b"data:")]
            if data:
                yield b"\n".join(data).decode()
