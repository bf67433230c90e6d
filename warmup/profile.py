"""The latency profile: what warmup measured per (batch size, bucket), kept as JSON.

The tuner reads it to choose batch sizes under a latency target; operators read it in the model
directory and in the worker's log.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from tsbatch.warmup.plan import Bucket, bucket_label, parse_bucket

PROFILE_FILE = "latency_profile.json"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The sample at rank round(q/100 * (n-1)) of the sorted values (numpy's "nearest"), None if
    there are none: always a measured value, never an interpolation. The one percentile of the
    project: warmup's p90 and every bench report's figures."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))]


@dataclass
class ShapeTiming:
    batch: int
    bucket: Bucket
    median_ms: float
    p90_ms: float
    runs: int
    first_ms: float  # the untimed first pass: what a cold request would have paid
    total_ms: float = 0.0  # everything warmup spent on this shape
    threads: int | None = None  # intra-op threads it ran on, where not the profile's own (a pass on idle lanes' cores too)

    @classmethod
    def measured(cls, batch: int, bucket: Bucket, first_ms: float, timings_ms: list[float],
                 threads: int | None = None) -> "ShapeTiming":
        """One warmed shape's record from its untimed first pass and its timed ones (ms): the one
        place the encoder's and generation's profiles round and summarise timings."""
        return cls(batch, bucket, round(statistics.median(timings_ms), 3), round(percentile(timings_ms, 90), 3),
                   len(timings_ms), round(first_ms, 3), round(first_ms + sum(timings_ms), 3), threads)


def find_timing(timings: Sequence[ShapeTiming], *, batch: int, bucket: Bucket,
                threads: int | None = None) -> ShapeTiming | None:
    """The timing of one shape among `timings` (None: not measured); keywords only, so the pair cannot be swapped.
    `threads`: one timed on that many threads (None: on the profile's own)."""
    return next((t for t in timings if t.batch == batch and t.bucket == bucket and t.threads == threads), None)


@dataclass
class LatencyProfile:
    model: str
    environment: dict[str, Any]
    shapes: list[ShapeTiming] = field(default_factory=list)
    warmup_seconds: float = 0.0
    # bucket -> largest batch that fit when warmup ran out of memory there (0: not even one request)
    oom_caps: dict[Bucket, int] = field(default_factory=dict)

    def add(self, batch: int, bucket: Bucket, first_ms: float, timings_ms: list[float],
            threads: int | None = None) -> ShapeTiming:
        timing = ShapeTiming.measured(batch, bucket, first_ms, timings_ms, threads)
        self.shapes.append(timing)
        return timing

    def lookup(self, *, batch: int, bucket: Bucket, threads: int | None = None) -> ShapeTiming | None:
        """The timing of one shape (None: not measured); keywords only, so the pair cannot be swapped."""
        return find_timing(self.shapes, batch=batch, bucket=bucket, threads=threads)

    def own_shapes(self) -> list[ShapeTiming]:
        """The timings on the profile's own threads (what the tuner sizes caps from)."""
        return [t for t in self.shapes if t.threads is None]

    def to_json(self) -> str:
        data = asdict(self)
        for shape in data["shapes"]:  # a profile without wider timings reads as it always did
            if shape["threads"] is None:
                del shape["threads"]
        data["oom_caps"] = {bucket_label(bucket): cap for bucket, cap in self.oom_caps.items()}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "LatencyProfile":
        data = json.loads(text)
        shapes = [ShapeTiming(**{**s, "bucket": parse_bucket(s["bucket"])}) for s in data.pop("shapes", [])]
        oom_caps = {parse_bucket(bucket): int(cap) for bucket, cap in (data.pop("oom_caps", None) or {}).items()}
        return cls(shapes=shapes, oom_caps=oom_caps, **data)

    @classmethod
    def load(cls, path: str) -> "LatencyProfile":
        with open(path) as f:
            return cls.from_json(f.read())

    def save(self, path: str) -> None:
        """The one writer of a profile: whole or not at all (workers of one model share a
        directory, and a reader never sees half a file)."""
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)
