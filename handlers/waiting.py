"""How long a bucket's waiting requests hold for company: only when the worker needs batches.

Asked when a lane is free to run a bucket's batch now. Holding costs every waiting request the
hold; it pays only by filling batches, and filling batches matters only when passes of one
request could not keep up. So: while the worker's recent arrivals (all buckets together, the
median gap of the last 8) come less often than one per two single-request passes of the bucket
(T(1), from the latency profile), a request runs at once: the lane is idle more than half the
time, and a newcomer rarely finds it busy. Once a single-request pass takes longer than the mean
arrival gap (the median gap over ln 2 for Poisson arrivals: one lane can no longer keep up with
passes of one), a bucket's oldest request holds up to `max_wait_ms` for company, so batches fill
and capacity holds. In the band between, a bucket holds only when its own arrivals (the median
gap of its last 8) come at least once per `max_wait_ms`: a bucket that would gain no company
within the hold runs at once, because the hold would cost its requests the wait and save no pass.
On short texts alone at 60 req/s over a few buckets, every request had held the full 13 ms
(bench/results/short-only-now.md); with the company rule alone short p50 fell 41.5 -> 33.1 ms at
60 req/s, but at 90 req/s short p99 rose 116 -> 156 ms (bench/results/hold-company-short-only.md),
hence the upper bound of the band.

Measured side by side (bench/compare.py, bench/results/light-load.md): at 14 req/s of the make
bench mix a short request no longer waits `max_wait_ms` (11 ms tuned here) for company that does
not come (short p50 46.4 -> 35.4 ms); a first version that also skipped the hold under load (holding only while a bucket's own
gaps were below T(1)/(n + 1)) lost capacity on short texts alone at 90 req/s (p99 206 vs 150 ms).
Without a profile (warmup off) the hold is always `max_wait_ms`.

Passes of one are counted per lane that can run the bucket now (`lanes`: its own lane and each
idle lane that helps it, handlers/engine.py): on short texts alone the long lane runs short
passes too, so two lanes keep up with single-request passes where one could not, and holding
would only add the wait. Side by side on short texts alone (bench/results/lanes-that-help.md):
at 90 req/s the median hold fell from 13.2 to 1-2 ms and short p50 from 32.9 to 26.2 ms (the
first-come control 27.5), short p99 59 -> 69 ms (control 61; rounds ranged 59-100); at 60 req/s
p50/p99 22.6/47.9 -> 19.0/41.8 ms. The mix at 14, 70 and 130 req/s was unchanged within noise
(bench/results/lanes-that-help-mix.md): there the long lane is busy with its own.

Pure: no clock of its own (times come from the caller), no torch, no threads.
"""
from __future__ import annotations

import math
from collections import deque

RECENT = 8  # arrivals whose gaps tell the worker's traffic
BUSY = 0.5  # single-request passes per median arrival gap from which holding may pay
FULL = 1 / math.log(2)  # ... from which one lane cannot keep up with passes of one: always hold


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


def release_at(oldest: float, alone: float, arrivals: Arrivals, max_wait: float,
               company: Arrivals | None = None, lanes: int = 1) -> float:
    """When a bucket's batch stops holding for company (a time on the caller's clock), from when
    its oldest request arrived, `alone` (the seconds of a pass of one request, 0: unknown), the
    worker's `arrivals`, the bucket's own (`company`) and how many `lanes` can run its passes now."""
    if alone <= 0:
        return oldest + max_wait  # no profile: the configured wait
    alone /= max(1, lanes)
    gap = arrivals.median_gap()
    if alone < BUSY * gap:
        return oldest  # passes of one keep up easily: run at once
    if alone < FULL * gap and company is not None and company.median_gap() > max_wait:
        return oldest  # busy, but no company would come within the hold
    return oldest + max_wait  # fill batches
