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

from tsbatch.handlers.buckets import next_batch_size

PassTime = Callable[[int, int], float]  # (size, bucket) -> seconds by the profile, 0 where unknown


def split_cost(bucket: int, count: int, cap: int, pass_time: PassTime) -> list[tuple[float, int]]:
    """The passes `count` requests of a bucket take on their own (powers of two up to its cap), in
    order, as (seconds, requests); an empty list when the profile does not know one of them."""
    passes = []
    while count > 0:
        size = next_batch_size(count, cap)
        seconds = pass_time(size, bucket)
        if seconds <= 0:
            return []
        passes.append((seconds, size))
        count -= size
    return passes


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
    for last in range(1, len(after)):
        edge = after[last][0]
        batch = next_batch_size(size + sum(count for _, count in after[: last + 1]), cap_for(edge))
        if size + sum(count for _, count in after[:last]) >= batch:
            continue  # the batch (a power of two) fills before this bucket: a shorter edge holds it
        merged = pass_time(batch, edge)
        clock, apart_sum, left = alone, size * alone, batch - size
        for group, count in after[: last + 1]:  # apart: each group's share in its own passes, in order
            passes = split_cost(group, min(count, left), cap_for(group), pass_time)
            if not passes and min(count, left) > 0:
                clock = 0.0
                break
            for seconds, requests in passes:
                clock += seconds
                apart_sum += requests * clock
            left -= min(count, left)
        saving = apart_sum - batch * merged
        if merged > 0 and merged < clock and saving > best_saving:
            best, best_saving = (edge, batch), saving
    return best
