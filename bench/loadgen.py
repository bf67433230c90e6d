"""Open-loop HTTP load on loopback: every request leaves at its scheduled time, answered or not.

asyncio with raw HTTP/1.1 (one connection per request, Connection: close) keeps the client light,
since it shares the machine's cores with the server it measures.
"""
from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

from bench.workload import Request

TOKENS = re.compile(rb'"tokens":\s*(\d+)')


@dataclass
class Result:
    kind: str
    sent: float
    latency: float | None  # seconds; None if no answer
    status: int | None
    tokens: int = 0
    padded_to: int = 0
    batch_size: int = 0
    error: str = ""


@dataclass
class RunResult:
    rate: float
    duration: float
    results: list[Result] = field(default_factory=list)
    wall: float = 0.0


async def _one(host: str, port: int, path: str, request: Request, sent: float, timeout: float) -> Result:
    body = request.text.encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        try:
            writer.write(head + body)
            await writer.drain()
            status, headers, payload = await asyncio.wait_for(_read_response(reader), timeout)
        finally:
            writer.close()
    except Exception as error:  # noqa: BLE001 - recorded as a lost response
        return Result(request.kind, sent, None, None, error=type(error).__name__)
    latency = time.perf_counter() - start
    if status == 200 and not payload.strip():
        return Result(request.kind, sent, None, status, error="empty body")
    match = TOKENS.search(payload[-200:]) or TOKENS.search(payload)
    return Result(
        request.kind, sent, latency, status,
        tokens=int(match.group(1)) if match else 0,
        padded_to=int(headers.get(b"x-tsbatch-padded-to", b"0") or 0),
        batch_size=int(headers.get(b"x-tsbatch-batch-size", b"0") or 0),
    )


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response: TorchServe keeps connections open, so read by length or chunks."""
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
            await reader.readexactly(2)
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    return status, headers, await reader.read(-1)


async def _run(url: str, requests: list[Request], arrivals: list[float], timeout: float,
               one_in_flight: bool = False) -> list[Result]:
    hostport, _, path = url.removeprefix("http://").partition("/")
    host, _, port = hostport.partition(":")
    start = time.perf_counter()
    results, tasks = [], []
    for request, at in zip(requests, arrivals):
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        send = _one(host, int(port), "/" + path, request, at, timeout)
        if one_in_flight:
            results.append(await send)
        else:
            tasks.append(asyncio.create_task(send))
    return results + list(await asyncio.gather(*tasks))


def run_open_loop(url: str, requests: list[Request], arrivals: list[float], rate: float,
                  duration: float, timeout: float = 60.0, one_in_flight: bool = False) -> RunResult:
    started = time.perf_counter()
    results = asyncio.run(_run(url, requests, arrivals, timeout, one_in_flight))
    return RunResult(rate, duration, results, time.perf_counter() - started)


def run_one_in_flight(url: str, requests: list[Request], arrivals: list[float], rate: float,
                      duration: float, timeout: float = 60.0) -> RunResult:
    """The same arrivals, but a request leaves only once the one before it is answered: the server
    never holds two, so latency is what one request costs after the idle gap it found (no queueing)."""
    return run_open_loop(url, requests, arrivals, rate, duration, timeout, one_in_flight=True)
