"""bench/generate.py's client: generation asks through bench/loadtest/client.py's one client, timed
to the first piece of body (a stream's first token) and to the whole answer, and open-loop
windows of them.

Times are seconds from the request's scheduled arrival, so a client that sends late adds its lag
to what it measures (no coordinated omission). Never raises: a lost answer is data.
"""
from __future__ import annotations

import asyncio
import time

from bench.generate_mix import Answer, Ask
from bench.loadtest.arrivals import at_arrivals
from bench.loadtest.client import shoot


async def ask(url: str, item: Ask, stream: bool, scheduled: float, timeout: float = 120.0) -> Answer:
    """POST one ask; `scheduled` is its arrival time on time.perf_counter()'s clock."""
    answer = Answer(item, stream)

    def first_piece() -> None:
        answer.first_chunk = time.perf_counter() - scheduled

    left = time.perf_counter()
    shot = await shoot(url, item.body(stream), "application/json", timeout=timeout, first_piece=first_piece)
    answer.status, answer.body, answer.error = shot.status, shot.body, shot.error
    answer.done = None if shot.latency is None else left - scheduled + shot.latency
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
