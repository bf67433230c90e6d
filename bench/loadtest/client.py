"""One HTTP request on its own connection, recorded as a Shot: status, latency, headers, body.

Raw HTTP/1.1 over asyncio keeps the client light: it shares the machine's cores with the server it
measures, and a lost answer must be recorded, not raised. Header names are kept lower-cased.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

TEXT = "text/plain"


@dataclass
class Shot:
    """One request: when it left (monotonic), and its answer or why there was none."""

    sent: float
    status: int | None = None
    latency: float | None = None  # seconds from send to the whole answer
    headers: dict = field(default_factory=dict)
    body: bytes = b""
    error: str = ""
    tag: str = ""

    @property
    def answered(self) -> bool:
        return self.status is not None

    @property
    def done_at(self) -> float | None:
        return None if self.latency is None else self.sent + self.latency

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def split_url(url: str) -> tuple[str, int, str]:
    """http://host:port/path -> (host, port, /path)."""
    hostport, _, path = url.removeprefix("http://").partition("/")
    host, _, port = hostport.partition(":")
    return host, int(port or 80), "/" + path


def request_head(host: str, path: str, content_type: str, length: int, headers: dict | None = None,
                 close: bool = True) -> bytes:
    """A POST's request line and headers; `host` as the Host header wants it (host or host:port)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    connection = "Connection: close\r\n" if close else ""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n{extra}"
            f"Content-Length: {length}\r\n{connection}\r\n").encode()


async def read_response(reader: asyncio.StreamReader,
                        first_piece: Callable[[], None] | None = None) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response: TorchServe keeps connections open, so read by length or chunks.
    Returns (status, {lower-cased name: value} as bytes, body). `first_piece`, if given, is called
    once when the body's first non-empty chunk is in (a body sent by length: when it is all in),
    so a stream's time to its first token can be taken."""
    told = first_piece is None

    def tell(piece: bytes) -> None:
        nonlocal told
        if piece and not told:
            told = True
            first_piece()

    blob = await reader.readuntil(b"\r\n\r\n")
    lines = blob[:-4].split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        chunks = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                try:
                    await reader.readuntil(b"\r\n")
                except asyncio.IncompleteReadError:
                    pass
                return status, headers, b"".join(chunks)
            chunks.append(await reader.readexactly(size))
            tell(chunks[-1])
            await reader.readexactly(2)
    if b"content-length" in headers:
        body = await reader.readexactly(int(headers[b"content-length"]))
    else:
        body = await reader.read(-1)
    tell(body)
    return status, headers, body


async def shoot(url: str, body: bytes, content_type: str = TEXT, headers: dict | None = None,
                timeout: float = 60.0, tag: str = "", first_piece: Callable[[], None] | None = None) -> Shot:
    """POST `body` on a fresh connection (Connection: close); never raises: failures are recorded.
    `timeout` bounds the whole exchange, connect to last byte: past it the request is unanswered.
    `first_piece`: see read_response."""
    host, port, path = split_url(url)
    head = request_head(f"{host}:{port}", path, content_type, len(body), headers)
    shot = Shot(time.monotonic(), tag=tag)
    started = time.perf_counter()
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(head + body)
            await writer.drain()
            status, raw_headers, payload = await read_response(reader, first_piece)
    except Exception as error:  # noqa: BLE001 - a lost answer is data here, not a crash
        shot.error = type(error).__name__
        return shot
    finally:
        if writer is not None:
            writer.close()
    shot.latency = time.perf_counter() - started
    shot.status = status
    shot.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers.items()}
    shot.body = payload
    return shot
