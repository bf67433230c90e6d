"""How long a bucket's waiting requests hold for company: only while waiting pays.

Asked when a lane is free to run the bucket's batch now. Holding n waiting requests for the next
arrival costs each of them the gap g until it comes (and the time one more row adds to the pass);
it saves the newcomer a pass of its own, which it could start only after this one. With T(k) the
pass time of k requests (the latency profile), the n + 1 requests' total latency is lower by
holding when

    g  <  T(1) / (n + 1)  -  (T(2m) - T(m)) / m        (m: the largest power of two <= n)

the bucket's *patience*. So a bucket holds only while its traffic is dense compared with one pass
(the median of its recent gaps is below its patience), and only until its next arrival is overdue
by that much (the last arrival plus the patience), never past `max_wait_ms` after its oldest
request arrived. At light load a request runs at once; under load the lane is busy, requests pile
up while it runs and batches fill without anyone holding. Without a profile (warmup off) the hold
is `max_wait_ms`, as before.

Pure: no clock of its own (`now` comes from the caller), no torch, no threads.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable

from tsbatch.handlers.buckets import Bucket, largest_power_of_two

RECENT = 8  # arrivals per bucket whose gaps tell its traffic


class Arrivals:
    """Recent arrivals per bucket: the median gap between the last RECENT of them (one lull
    before a burst does not hide the burst)."""

    def __init__(self):
        self.times: dict[Bucket, deque] = {}

    def arrived(self, bucket: Bucket, now: float) -> None:
        self.times.setdefault(bucket, deque(maxlen=RECENT)).append(now)

    def median_gap(self, bucket: Bucket) -> float:
        """Infinite before two arrivals: nothing says company is coming."""
        times = list(self.times.get(bucket) or ())
        if len(times) < 2:
            return math.inf
        gaps = sorted(max(0.0, b - a) for a, b in zip(times, times[1:]))
        return gaps[len(gaps) // 2]

    def last(self, bucket: Bucket) -> float:
        times = self.times.get(bucket)
        return times[-1] if times else -math.inf


def patience(waiting: int, pass_time: Callable[[int], float]) -> float | None:
    """The longest gap to the next arrival worth holding `waiting` requests for (seconds; 0 or
    less: none), from `pass_time(k)` (a pass of k requests, 0 where unknown); None without a profile."""
    alone = pass_time(1)
    if alone <= 0:
        return None
    size = largest_power_of_two(max(1, waiting))
    bigger = pass_time(2 * size)
    per_row = (bigger - pass_time(size)) / size if bigger > 0 else 0.0
    return alone / (waiting + 1) - per_row


def release_at(waiting: int, oldest: float, arrivals: Arrivals, bucket: Bucket,
               pass_time: Callable[[int], float], max_wait: float) -> float:
    """When the bucket's batch stops holding for company (a time on the caller's clock)."""
    longest = patience(waiting, pass_time)
    if longest is None:
        return oldest + max_wait
    if arrivals.median_gap(bucket) >= longest:
        return oldest  # traffic too thin for waiting to pay: run at once
    return min(oldest + max_wait, arrivals.last(bucket) + longest)
