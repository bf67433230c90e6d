"""How long a bucket's waiting requests hold for company: only when the worker needs batches.

Asked when a lane is free to run a bucket's batch now. Holding costs every waiting request the
hold; it pays only by filling batches, and filling batches matters only when passes of one
request could not keep up. So: while the worker's recent arrivals (all buckets together, the
median gap of the last 8) come less often than one per two single-request passes of the bucket
(T(1), from the latency profile), a request runs at once: the lane is idle more than half the
time, and a newcomer rarely finds it busy. Once they come faster, a bucket's oldest request holds
up to `max_wait_ms` for company, as before, so batches fill and capacity holds.

Measured side by side (bench/compare.py, bench/results/light-load.md): at 14 req/s of the make
bench mix a short request no longer waits `max_wait_ms` (11 ms tuned here) for company that does
not come (short p50 46.4 -> 35.4 ms); a first version that also skipped the hold under load (holding only while a bucket's own
gaps were below T(1)/(n + 1)) lost capacity on short texts alone at 90 req/s (p99 206 vs 150 ms).
Without a profile (warmup off) the hold is always `max_wait_ms`.

Pure: no clock of its own (times come from the caller), no torch, no threads.
"""
from __future__ import annotations

import math
from collections import deque

RECENT = 8  # arrivals whose gaps tell the worker's traffic
BUSY = 0.5  # single-request passes per arrival gap from which batches must fill


class Arrivals:
    """The worker's recent arrivals: the median gap between the last RECENT of them (one lull
    before a burst does not hide the burst)."""

    def __init__(self):
        self.times: deque = deque(maxlen=RECENT)

    def arrived(self, now: float) -> None:
        self.times.append(now)

    def median_gap(self) -> float:
        """Infinite before two arrivals: nothing says the worker is busy."""
        times = list(self.times)
        if len(times) < 2:
            return math.inf
        gaps = sorted(max(0.0, b - a) for a, b in zip(times, times[1:]))
        return gaps[len(gaps) // 2]


def release_at(oldest: float, alone: float, arrivals: Arrivals, max_wait: float) -> float:
    """When a bucket's batch stops holding for company (a time on the caller's clock), from when
    its oldest request arrived and `alone`, the seconds of a pass of one request (0: unknown)."""
    if alone <= 0 or alone >= BUSY * arrivals.median_gap():
        return oldest + max_wait  # no profile, or too busy for passes of one: fill batches
    return oldest  # passes of one keep up: run at once
