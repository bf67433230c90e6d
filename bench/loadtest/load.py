"""Many requests: open-loop windows of the workload, bursts, and background clients.

- run_open_loop / run_one_in_flight: one window of workload Requests at their arrival times,
  recorded as Results (kind, latency, tokens, padding) for the benchmark's summaries;
- open_loop / burst: raw bodies at their arrival times, or all at once, recorded as Shots;
- Load: an event loop on a background thread that keeps closed-loop clients and probers going
  while the caller does something else (kills a worker, scales, samples memory).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from bench.loadtest.arrivals import at_arrivals
from bench.loadtest.client import TEXT, Shot, shoot
from bench.loadtest.workload import Request

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
    timing: dict = field(default_factory=dict)  # x-tsbatch-timing: wait, pass, handler (ms)
    lag: float = 0.0  # seconds the client sent it after its scheduled time (included in latency)


def timing_of(header: str) -> dict:
    """x-tsbatch-timing "wait=1.0; pass=11.2; handler=13.0" as {"wait": 1.0, ...}; {} if absent or odd."""
    try:
        return {k.strip(): float(v) for k, v in (part.split("=") for part in header.split(";") if part.strip())}
    except ValueError:
        return {}


@dataclass
class RunResult:
    rate: float
    duration: float
    results: list[Result] = field(default_factory=list)
    wall: float = 0.0


def as_result(request: Request, sent: float, shot: Shot) -> Result:
    """A Shot as the benchmark counts it: a 200 with an empty body is lost, and the answer's token
    count and padding (X-Tsbatch-Padded-To, X-Tsbatch-Batch-Size) are kept for the summaries; of any
    other status, its JSON error message (what a refusal says it saw)."""
    if not shot.answered:
        return Result(request.kind, sent, None, None, error=shot.error)
    if shot.status == 200 and not shot.body.strip():
        return Result(request.kind, sent, None, shot.status, error="empty body")
    if shot.status != 200:  # why: the report keeps a few of each status's messages
        body = shot.json()
        message = body.get("error") if isinstance(body, dict) else None
        return Result(request.kind, sent, shot.latency, shot.status,
                      error=str(message or shot.body[:200].decode(errors="replace"))[:200])
    match = TOKENS.search(shot.body[-200:]) or TOKENS.search(shot.body)
    return Result(
        request.kind, sent, shot.latency, shot.status,
        tokens=int(match.group(1)) if match else 0,
        padded_to=int(shot.headers.get("x-tsbatch-padded-to", "0") or 0),
        batch_size=int(shot.headers.get("x-tsbatch-batch-size", "0") or 0),
        timing=timing_of(shot.headers.get("x-tsbatch-timing", "")),
    )


def run_open_loop(url: str, requests: list[Request], arrivals: list[float], rate: float,
                  duration: float, timeout: float = 60.0, one_in_flight: bool = False) -> RunResult:
    """Each request leaves at its arrival time (seconds from start), answered or not; one that
    has no answer `timeout` seconds after it left is lost. Latency runs from the scheduled arrival
    (the client's own lag included: no coordinated omission), except with `one_in_flight`, whose
    requests wait for the one before by design and are timed from when they leave."""
    async def send(request: Request, at: float) -> Result:
        return as_result(request, at, await shoot(url, request.text.encode(), timeout=timeout))

    started, lags = time.perf_counter(), []
    results = asyncio.run(at_arrivals(requests, arrivals, send, one_in_flight, lags))
    for result, lag in zip(results, lags):
        result.lag = lag
        if result.latency is not None and not one_in_flight:
            result.latency += lag
    return RunResult(rate, duration, results, time.perf_counter() - started)


def run_one_in_flight(url: str, requests: list[Request], arrivals: list[float], rate: float,
                      duration: float, timeout: float = 60.0) -> RunResult:
    """The same arrivals, but a request leaves only once the one before it is answered: the server
    never holds two, so latency is what one request costs after the idle gap it found (no queueing)."""
    return run_open_loop(url, requests, arrivals, rate, duration, timeout, one_in_flight=True)


def open_loop(url: str, bodies: Sequence[bytes], arrivals: Sequence[float], headers: dict | None = None,
              timeout: float = 60.0) -> list[Shot]:
    """Each body leaves at its arrival time (seconds from start), answered or not."""
    async def send(body: bytes, _at: float) -> Shot:
        return await shoot(url, body, headers=headers, timeout=timeout)

    return list(asyncio.run(at_arrivals(bodies, arrivals, send)))


def burst(url: str, bodies: Sequence[bytes], headers: dict | None = None, timeout: float = 60.0) -> list[Shot]:
    """Every body at once, each on its own connection; shots in body order."""
    async def run():
        return await asyncio.gather(*(shoot(url, b, headers=headers, timeout=timeout) for b in bodies))

    return list(asyncio.run(run()))


class Load:
    """An event loop on a background thread: fire requests (send), or keep closed-loop clients
    running (clients) while the caller kills things; every shot lands in `shots`."""

    def __init__(self):
        self.shots: list[Shot] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-load", daemon=True)
        self._thread.start()
        self._stopping = threading.Event()
        self._futures: list[concurrent.futures.Future] = []

    def send(self, url: str, body: bytes, content_type: str = TEXT, headers: dict | None = None,
             timeout: float = 60.0, tag: str = "") -> concurrent.futures.Future:
        async def one():
            shot = await shoot(url, body, content_type, headers, timeout, tag)
            self.shots.append(shot)
            return shot

        future = asyncio.run_coroutine_threadsafe(one(), self.loop)
        self._futures.append(future)
        return future

    def clients(self, url: str, bodies: Sequence[bytes], count: int, timeout: float,
                pause_after_error: float = 1.0, tag: str = "client") -> None:
        """`count` closed-loop clients, each sending the next body when its last one is answered."""
        async def client(offset: int):
            i = offset
            while not self._stopping.is_set():
                shot = await shoot(url, bodies[i % len(bodies)], timeout=timeout, tag=tag)
                self.shots.append(shot)
                i += count
                if shot.status != 200:
                    await asyncio.sleep(pause_after_error)

        for k in range(count):
            self._futures.append(asyncio.run_coroutine_threadsafe(client(k), self.loop))

    def prober(self, url: str, every: float, timeout: float, tag: str = "probe") -> None:
        """One short request every `every` seconds, whatever happened to the last ones."""
        async def probe():
            pending = set()
            while not self._stopping.is_set():
                task = asyncio.ensure_future(shoot(url, b"probe: are you serving?", timeout=timeout, tag=tag))
                task.add_done_callback(lambda t: self.shots.append(t.result()))
                pending.add(task)
                await asyncio.sleep(every)
            if pending:
                await asyncio.wait(pending)

        self._futures.append(asyncio.run_coroutine_threadsafe(probe(), self.loop))

    def stop(self) -> None:
        """Clients and probers send nothing new; requests already out still finish."""
        self._stopping.set()

    def close(self, timeout: float) -> bool:
        """Wait up to `timeout` for everything sent to finish; True if it all did."""
        self.stop()
        done, pending = concurrent.futures.wait(self._futures, timeout=timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        return not pending
