"""The one cost model: how long a pass takes, by the latency profile warmup measured.

Every question the policy (handlers/core/policy.py), the simulator and the tuner ask about time goes
here, with keyword arguments only (`cost.median(bucket=b, size=n)`), so a bucket and a batch size
can never be swapped unnoticed. 0.0 means "the profile does not know this shape": callers treat
it as unknown, never as free.

Also here, because they are arithmetic over pass times: a lane's pace (how much slower its passes
run served than alone in warmup) and how long a lane takes to get through its queue when other
lanes help (`finish_in`).

Pure: no torch, no clock, no threads.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, NamedTuple, Sequence

from tsbatch.warmup.plan import Bucket

# f(*, bucket, size) -> seconds, 0.0 where unknown
Table = Callable[..., float]


def _unknown(*, bucket: Bucket, size: int) -> float:
    return 0.0


class CostModel:
    """Seconds of one pass of `size` texts padded to `bucket`: the profile's median and p90, on the
    intra-op threads the profile's passes ran with (`threads`) or, where warmup also timed them on
    more (`wider`: threads -> CostModel), on those."""

    def __init__(self, median: Table | None = None, p90: Table | None = None, threads: int | None = None,
                 wider: Mapping[int, "CostModel"] | None = None):
        self._median = median or _unknown
        self._p90 = p90 or _unknown
        self.known = median is not None or p90 is not None  # False: no profile (warmup off)
        self.threads = threads  # what a question without `threads` means (None: whatever the profile ran with)
        self.wider = dict(wider or {})

    @classmethod
    def from_profile(cls, profile) -> "CostModel":
        """From a warmup.profile.LatencyProfile (None: nothing known). Its shapes timed on other
        thread counts (ShapeTiming.threads) answer questions asked with those `threads`."""
        if profile is None:
            return cls()
        default = profile_threads(profile)
        by_threads: dict[int, dict] = {}
        for timing in profile.shapes:  # the first of a shape, as warmup wrote it
            threads = timing.threads or default
            by_threads.setdefault(threads, {}).setdefault((timing.bucket, timing.batch), timing)
        models = {threads: cls._of(shapes, threads) for threads, shapes in by_threads.items()}
        own = models.pop(default, None) or cls(threads=default)
        own.wider = models
        return own

    @classmethod
    def _of(cls, shapes: dict, threads: int) -> "CostModel":
        def median(*, bucket: Bucket, size: int) -> float:
            timing = shapes.get((bucket, size))
            return timing.median_ms / 1000 if timing else 0.0

        def p90(*, bucket: Bucket, size: int) -> float:
            timing = shapes.get((bucket, size))
            return timing.p90_ms / 1000 if timing else 0.0

        return cls(median, p90, threads)

    def _at(self, threads: int | None) -> "CostModel | None":
        if threads is None or threads == self.threads or (self.threads is None and not self.wider):
            return self
        return self.wider.get(threads)

    def median(self, *, bucket: Bucket, size: int, threads: int | None = None) -> float:
        """The typical time of the pass (`threads`: intra-op threads; the profile's own when None;
        0.0 when the profile has no timing on that many)."""
        at = self._at(threads)
        return at._median(bucket=bucket, size=size) if at else 0.0

    def p90(self, *, bucket: Bucket, size: int, threads: int | None = None) -> float:
        """A slow run of the pass: what deadlines are checked against."""
        at = self._at(threads)
        return at._p90(bucket=bucket, size=size) if at else 0.0

    def typical(self, *, bucket: Bucket, size: int, threads: int | None = None) -> float:
        """The median, or the p90 where only that is known."""
        return self.median(bucket=bucket, size=size, threads=threads) or self.p90(bucket=bucket, size=size, threads=threads)


def profile_threads(profile) -> int:
    """The intra-op threads a profile's passes ran with unless a timing says otherwise (its lanes'
    threads; torch's when it ran without lanes)."""
    per_bucket = profile.environment.get("threads_per_bucket")
    if isinstance(per_bucket, dict) and per_bucket:
        return max(1, min(int(v) for v in per_bucket.values()))
    if isinstance(per_bucket, int):
        return max(1, per_bucket)
    threads = profile.environment.get("torch_threads")
    return threads if isinstance(threads, int) and threads > 0 else 1


# -- a lane's pace --------------------------------------------------------------------------------

PACE_WEIGHT = 0.2  # each pass moves its lane's pace this far toward its own ratio
PACE_BOUNDS = (0.5, 4.0)  # one odd pass (isolation after a failure, a stall) moves it only so far
BUSY_HORIZON = 2.0  # seconds over which a lane's record of its busy time fades


class LaneLoad:
    """One lane's recent passes: how long they took against the profile (`pace`: warmup times
    every pass alone, served it runs beside the other lane and TorchServe's threads) and how much
    of the lane's time its own work took (`idle_share`, the rest is what it can give another lane)."""

    def __init__(self):
        self.pace = 1.0
        self.busy = 0.0  # seconds of own work, fading with BUSY_HORIZON
        self.seen = 0.0  # when `busy` was last faded

    def ran(self, seconds: float, typical: float, now: float, own: bool = True) -> None:
        """A pass ended at `now` after `seconds`; `typical`: its median in the profile (0:
        unknown, the pace stays); `own`: of this lane's buckets (running another lane's passes is
        time it had to spare)."""
        if typical > 0:
            ratio = min(PACE_BOUNDS[1], max(PACE_BOUNDS[0], seconds / typical))
            self.pace += PACE_WEIGHT * (ratio - self.pace)
        self._fade(now)
        if own:
            self.busy += seconds

    def idle_share(self, now: float) -> float:
        """The share of recent time this lane had nothing of its own to run: 1 when idle for a
        while, 0 when busy with its own work throughout."""
        self._fade(now)
        return max(0.0, 1.0 - self.busy / BUSY_HORIZON)

    def _fade(self, now: float) -> None:
        if now > self.seen:
            self.busy *= math.exp(-(now - self.seen) / BUSY_HORIZON)
            self.seen = now


class Helper(NamedTuple):
    """Another lane as `finish_in` counts it: through its own work in `ready` seconds, then giving
    `share` of its time (its idle share) while more than `below` seconds of the lane's work are
    left (an earlier lane takes over only from a lane that fell behind; a later lane runs an earlier
    lane's passes whenever it has none of its own)."""

    ready: float
    share: float
    below: float = 0.0


_EPS = 1e-12  # seconds: below this a float's rounding, not work left


def finish_in(own: float, helpers: Sequence[Helper] = ()) -> float:
    """Seconds until a lane has run `own` seconds of work (the rest of its pass, its queue, the new
    request's pass) when other lanes help with its queue: it drains at 1 plus the shares of the
    helpers that are through their own work and still helping, at its own pace otherwise."""
    clock, left = 0.0, own
    while left > _EPS:
        still = [h for h in helpers if h.share > 0 and left > h.below + _EPS]  # helping now or later
        helping = [h for h in still if h.ready <= clock]
        rate = 1 + sum(h.share for h in helping)
        step = min([left / rate]  # done, or the next helper joins, or a helper stops
                   + [h.ready - clock for h in still if h.ready > clock]
                   + [(left - h.below) / rate for h in helping])
        clock, left = clock + step, left - step * rate
    return clock
