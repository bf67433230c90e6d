"""bench/generate.py's client: one generation request on its own connection, timed to its first
piece of body and to its end, and open-loop windows of them.

bench/loadtest/client.py reads a whole answer at once; a stream's time to first token needs the
moment its first chunk arrives, so this reads the response piece by piece (HTTP/1.1, chunked or by
length). Times are seconds from the request's scheduled arrival, so a client that sends late adds
its lag to what it measures (no coordinated omission). Never raises: a lost answer is data.
"""
from __future__ import annotations

import asyncio
import time

from bench.generate_mix import Answer, Ask
from bench.loadtest.arrivals import at_arrivals
from bench.loadtest.client import request_head, split_url


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict]:
    blob = await reader.readuntil(b"\r\n\r\n")
    lines = blob[:-4].split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return int(lines[0].split()[1]), headers


async def _pieces(reader: asyncio.StreamReader, headers: dict):
    """The body's pieces as they arrive: each chunk (chunked), or reads up to the length."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            piece = await reader.readexactly(size)
            await reader.readexactly(2)
            yield piece
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            piece = await reader.read(min(left, 65536))
            if not piece:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(piece)
            yield piece
    else:
        while piece := await reader.read(65536):
            yield piece


async def ask(url: str, item: Ask, stream: bool, scheduled: float, timeout: float = 120.0) -> Answer:
    """POST one ask; `scheduled` is its arrival time on time.perf_counter()'s clock."""
    answer = Answer(item, stream)
    host, port, path = split_url(url)
    body = item.body(stream)
    head = request_head(f"{host}:{port}", path, "application/json", len(body))
    writer = None
    pieces = []
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(head + body)
            await writer.drain()
            status, headers = await _read_head(reader)
            answer.status = status
            async for piece in _pieces(reader, headers):
                if piece and answer.first_chunk is None:
                    answer.first_chunk = time.perf_counter() - scheduled
                pieces.append(piece)
            answer.done = time.perf_counter() - scheduled
    except Exception as error:  # noqa: BLE001 - recorded, never raised
        answer.error = type(error).__name__
        answer.done = None
    finally:
        if writer is not None:
            writer.close()
    answer.body = b"".join(pieces)
    return answer


def open_loop(url: str, asks: list[Ask], arrivals: list[float], stream: bool, timeout: float = 120.0) -> list[Answer]:
    """Each ask leaves at its arrival time (seconds from now), answered or not; results in order."""
    async def run() -> list[Answer]:
        start = time.perf_counter()

        async def send(item: Ask, at: float) -> Answer:
            return await ask(url, item, stream, start + at, timeout)

        return await at_arrivals(asks, arrivals, send)

    return asyncio.run(run())


def one_by_one(url: str, asks: list[Ask], stream: bool, timeout: float = 120.0) -> list[Answer]:
    """Each ask alone: sent when the one before it is answered."""
    async def run() -> list[Answer]:
        return [await ask(url, item, stream, time.perf_counter(), timeout) for item in asks]

    return asyncio.run(run())
