"""When one pass of a longer bucket serves several buckets' requests for less than their own passes.

On a CPU a pass has a fixed cost that a few more short rows hardly change (the latency profile
says how much), so several buckets' small batches can cost more than one pass that pads them all
to the longest of them. The lane about to run `own` requests of bucket b may therefore take
waiting requests of longer buckets of its own lane into one pass padded to a longer edge e, when
the latency profile says both of these hold:
- it saves lane time: T(e, m) < T(b, n) + what the taken requests' own passes would take, and
- it costs no one on average: the sum of the requests' completion times in the merged pass is at
  most what it is with b's pass first and each longer bucket's passes after it, shortest first.
So a long request never sets the padding of short ones where that would slow them overall, and a
bucket never joins one on another lane (long buckets stay on the long lane). The engine merges
only while every other lane is busy (handlers/engine.py): with a lane idle the separate passes
would run side by side, and the shortest requests would not wait for the longer ones. Shapes stay
the ones warmup covers: edges of the lane and powers of two up to e's cap. Without a profile: no
merging. Measured: bench/results/merged-passes-*.md.

Pure: no torch, no threads.
"""
from __future__ import annotations

from typing import Callable, Sequence

from tsbatch.handlers.buckets import batch_sizes, next_batch_size

PassTime = Callable[[int, int], float]  # (size, bucket) -> seconds by the profile, 0 where unknown


def split_cost(bucket: int, count: int, cap: int, pass_time: PassTime) -> list[tuple[float, int]]:
    """The passes `count` requests of a bucket take on their own (batch_sizes), in order, as
    (seconds, requests); an empty list when the profile does not know one of them."""
    passes = [(pass_time(size, bucket), size) for size in batch_sizes(count, cap)]
    return passes if all(seconds > 0 for seconds, _ in passes) else []


def _apart(alone: float, size: int, groups: Sequence[tuple[int, int]], cap_for: Callable[[int], int],
           pass_time: PassTime) -> tuple[float, float] | None:
    """The picked pass (`size` requests, `alone` seconds), then each group's (bucket, requests)
    own passes one after another: when the last ends and the requests' summed completion times.
    None when the profile does not know one of those passes."""
    clock, summed = alone, size * alone
    for group, count in groups:
        passes = split_cost(group, count, cap_for(group), pass_time)
        if count and not passes:
            return None
        for seconds, requests in passes:
            clock += seconds
            summed += requests * clock
    return clock, summed


def merge_edge(own: tuple[int, int], after: Sequence[tuple[int, int]], cap_for: Callable[[int], int],
               pass_time: PassTime) -> tuple[int, int] | None:
    """`own`: (bucket, size) of the batch the lane picked; `after`: (bucket, requests waiting)
    that would run after it, in order: the picked bucket's leftovers first, then the lane's longer
    buckets, shortest first. Returns (edge, batch size) of the merged pass that saves the most
    summed completion time, or None when none pays. The merged pass takes the picked requests,
    then the others in that order, and is padded to the longest bucket it holds."""
    bucket, size = own
    alone = pass_time(size, bucket)
    if alone <= 0:
        return None
    best, best_saving = None, 0.0
    before = size + after[0][1]  # requests ahead of the first longer bucket
    for last in range(1, len(after)):
        edge, count = after[last]
        batch = next_batch_size(before + count, cap_for(edge))
        reaches = batch > before  # a power of two that fills before this bucket: a shorter edge holds it
        before += count
        merged = pass_time(batch, edge)
        if not reaches or merged <= 0:
            continue
        left, taken = batch - size, []
        for group, waiting in after[: last + 1]:  # the requests the merged pass takes, by group
            taken.append((group, min(waiting, left)))
            left -= taken[-1][1]
        apart = _apart(alone, size, taken, cap_for, pass_time)
        if apart is None:
            continue
        end, summed = apart
        saving = summed - batch * merged
        if merged < end and saving > best_saving:
            best, best_saving = (edge, batch), saving
    return best
