"""Memory: batch caps learned from out of memory, kept across worker restarts, and a budget per worker.

A cap learned when a batch ran out of memory (at warmup or while serving) is written next to the
latency profile in the model's directory, which every worker of the model shares and a restarted
worker finds again: it warms and serves within the cap instead of failing batches to rediscover
it. Caps only shrink. Workers of one model on devices of different sizes share the smallest cap
(safe, possibly conservative).

The budget (`handler.memory_budget`) is a fraction of the device or a size in bytes. On CUDA it
is enforced by the caching allocator's per-process limit, so an allocation past it raises out of
memory like a full card would, and warmup learns caps under it; two models can share one card.
On the CPU nothing enforces it: torch has no per-process limit for host memory.
Pure: no torch; the CUDA module is passed in.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from tsbatch.handlers.core.buckets import bucket_label, bucket_order, parse_bucket

logger = logging.getLogger(__name__)

OOM_CAPS_FILE = "oom_caps.json"


def load_caps(path: str) -> dict[int, int]:
    """bucket -> largest batch that fits (0: not even one request); {} when none were learned."""
    try:
        with open(path) as f:
            data = json.load(f)
        return {parse_bucket(bucket): int(cap) for bucket, cap in data.get("caps", {}).items() if int(cap) >= 0}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def keep_caps(path: str, learned: dict[int, int], reason: str) -> dict[int, int]:
    """Merge `learned` into the file (the smaller cap wins) and replace it atomically; returns all caps."""
    caps = load_caps(path)
    for bucket, cap in learned.items():
        caps[bucket] = min(cap, caps.get(bucket, cap))
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"caps": {bucket_label(b): c for b, c in sorted(caps.items(), key=lambda kv: bucket_order(kv[0]))},
                       "why": f"out of memory ({reason}); 0 means not even one request of the bucket fits"}, f)
        os.replace(tmp, path)
    except OSError as error:  # a read-only model directory: the caps still hold in this worker
        logger.warning("tsbatch: could not keep learned batch caps in %s: %s", path, error)
    return caps


def budget_bytes(budget: float | int, total_bytes: int) -> int:
    """A fraction of the device (0 < f <= 1) or a size in bytes, as bytes."""
    return int(budget * total_bytes) if isinstance(budget, float) else int(budget)


def apply_budget(budget: float | int, cuda: Any, device_index: int) -> str:
    """Cap this process's CUDA allocations at the budget; returns what was set, for the log."""
    total = cuda.get_device_properties(device_index).total_memory
    limit = budget_bytes(budget, total)
    if limit > total:
        raise ValueError(f"handler.memory_budget of {limit} bytes is more than the device's {total}")
    cuda.set_per_process_memory_fraction(limit / total, device_index)
    return f"{limit / 2**30:.1f} GiB of {total / 2**30:.1f} GiB on cuda:{device_index}"
