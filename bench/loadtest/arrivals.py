"""When requests leave: open-loop schedules, and the loop that follows one.

Open loop means a request leaves at its scheduled time whether or not earlier ones were answered,
so a slow server meets the load a real one would instead of slowing its own clients down (a
closed loop hides saturation). Every sender in bench/ follows a schedule through at_arrivals().
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Awaitable, Callable, Iterable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def poisson_arrivals(rate: float, duration: float, seed: int = 0) -> list[float]:
    """Open-loop send times (seconds from start): exponential gaps at `rate` per second."""
    rng = random.Random(seed + 1)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return times
        times.append(t)


async def at_arrivals(items: Iterable[T], arrivals: Sequence[float], send: Callable[[T, float], Awaitable[R]],
                      one_in_flight: bool = False, lags: list[float] | None = None) -> list[R]:
    """Start `send(item, at)` at each arrival time (seconds from now); results in item order.

    With `one_in_flight`, each send is awaited before the next may start (late, if the last one ran
    past its time): the server never holds two requests, so latency is free of queueing.
    `lags`, if given, gets each item's client lag in item order: seconds from its scheduled time to
    when its send began (a client that falls behind delays requests the server never saw, which a
    latency timed from the send would hide)."""
    start = time.perf_counter()
    results, tasks = [], []

    async def timed(item: T, at: float) -> tuple[R, float]:
        lag = time.perf_counter() - start - at
        return await send(item, at), lag

    for item, at in zip(items, arrivals):
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        if one_in_flight:
            results.append(await timed(item, at))
        else:
            tasks.append(asyncio.create_task(timed(item, at)))
    done = results + list(await asyncio.gather(*tasks))
    if lags is not None:
        lags.extend(lag for _, lag in done)
    return [result for result, _ in done]
