"""How long a lane takes to get through its queue: what admission by deadline holds a new
request's deadline against (handlers/engine.py `_admissible`).

Warmup times every pass alone on the machine; served, a pass runs beside the other lane,
TorchServe's threads and, on a small box, the clients, and takes longer. So each lane keeps its
`pace` (the recent ratio of its passes' times to the profile's medians) and charges its queue at
the medians times that pace: a queue of many passes takes about the sum of their typical times,
where the profile's p90 for every one of them (the estimate before) charged each as a slow one.
Once a lane falls behind, an earlier lane helps with its queue (engine.BEHIND) as far as its own
work leaves it idle (`idle_share`), and the estimate counts that help. The old estimate counted
neither, and refused long requests far below the knee with p99 well inside the target
(bench/results/bench-long.md: 1 of 625 at 32 req/s, p99 304 ms; bench.md: 3 of 2,129 at 104).

Pure: times come from the caller, no torch, no threads.
"""
from __future__ import annotations

import math
from typing import Sequence

PACE_WEIGHT = 0.2  # each pass moves its lane's pace this far toward its own ratio
PACE_BOUNDS = (0.5, 4.0)  # one odd pass (isolation after a failure, a stall) moves it only so far
BUSY_HORIZON = 2.0  # seconds over which a lane's record of its busy time fades


class LaneLoad:
    """One lane's recent passes: how long they took against the profile (`pace`) and how much of
    the lane's time its own work took (`idle_share`, the rest is what it can give a lane behind)."""

    def __init__(self):
        self.pace = 1.0
        self.busy = 0.0  # seconds of own work, fading with BUSY_HORIZON
        self.seen = 0.0  # when `busy` was last faded

    def ran(self, seconds: float, typical: float, now: float, own: bool = True) -> None:
        """A pass ended at `now` after `seconds`; `typical`: its median in the profile (0:
        unknown, the pace stays); `own`: of this lane's buckets or an earlier lane's (helping a
        later lane is time it had to spare)."""
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


def finish_in(own: float, behind: float, helpers: Sequence[tuple[float, float]] = ()) -> float:
    """Seconds until a lane has run `own` seconds of work (the rest of its pass, its queue, the new
    request's pass), when earlier lanes help with its queue while more than `behind` seconds of it
    wait. `helpers`: (seconds until the helper is through its own work, its idle share). Helped, the
    queue drains at 1 + the helpers' idle shares from when the first helper is free until `behind`
    is left, then at the lane's own pace."""
    if not helpers:
        return own
    free = min(ready for ready, _ in helpers)
    share = sum(idle for _, idle in helpers)
    if share <= 0 or own - free <= behind:
        return own
    return free + (own - free - behind) / (1 + share) + behind
