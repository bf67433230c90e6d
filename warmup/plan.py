"""Plan warmup from the serving configuration: every (batch size, bucket) shape the handler forms.

The handler forms batch sizes that are powers of two only (5 waiting requests run as 4 + 1), so
the set of shapes is small — len(buckets) × log2(max batch) — and every one of them is warmed.
No padding rows are ever added: a batch of 5 is two passes, not one padded to 8.
Pure: no torch, no clock, and nothing from handlers/: the handler passes its batch sizes in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, Union

Bucket = Union[int, tuple[int, ...]]  # an edge, or one edge per size (handlers/core/buckets.py)


def bucket_tokens(bucket: Bucket) -> int:
    """What one row of a bucket (or one length) costs in the token budget: its edge, or the sum
    of its edges (a prompt padded to P that grows by N new tokens holds P + N)."""
    return sum(bucket) if isinstance(bucket, tuple) else bucket


def bucket_label(bucket: Bucket) -> str:
    """How a bucket is written in metrics, headers, model-config.yaml and the profile: "32", "32x16"."""
    return "x".join(str(edge) for edge in bucket) if isinstance(bucket, tuple) else str(bucket)


def parse_bucket(label: Any) -> Bucket:
    """The bucket a label (or a profile's JSON list) names; inverse of bucket_label."""
    if isinstance(label, (list, tuple)):
        return tuple(int(edge) for edge in label)
    if isinstance(label, str) and "x" in label:
        return tuple(int(edge) for edge in label.split("x"))
    return int(label)


SMALLEST_EDGE = 8  # the shortest length edge: shorter inputs pad to it


def default_edges(max_length: int) -> tuple[int, ...]:
    """Edges 8 tokens apart up to 64, 16 apart up to 128, 32 up to 256, 64 up to 512, 128 beyond;
    the model's maximum is always the last edge. Fine steps where inputs are short keep padding
    waste low (a request pads at most one step), while the number of shapes stays small."""
    edges = []
    edge = SMALLEST_EDGE
    while edge < max_length:
        edges.append(edge)
        step = 8 if edge < 64 else 16 if edge < 128 else 32 if edge < 256 else 64 if edge < 512 else 128
        edge += step
    edges.append(max_length)
    return tuple(edges)


@dataclass(frozen=True)
class Shape:
    batch: int
    bucket: Bucket

    @property
    def tokens(self) -> int:
        return self.batch * bucket_tokens(self.bucket)


def plan_shapes(edges: Sequence[Bucket], sizes_for: Callable[[Bucket], Iterable[int]]) -> list[Shape]:
    """Every shape the handler can form (`sizes_for(bucket)`: its batch sizes there), shortest
    bucket first, small batches first."""
    return [Shape(size, edge) for edge in edges for size in sorted(sizes_for(edge))]


@dataclass(frozen=True)
class WarmupPlan:
    shapes: tuple[Shape, ...]
    repeats: int  # passes per shape at least; more until two timings agree, up to max_repeats
    max_repeats: int

    def estimate_seconds(self, seconds_per_token: float, overhead_s: float = 0.002) -> float:
        """Predicted duration from a measured cost per token and a fixed cost per pass."""
        passes = self.repeats + 1  # the first, untimed pass of each shape
        return sum(passes * (shape.tokens * seconds_per_token + overhead_s) for shape in self.shapes)


def stable(timings: Iterable[float], tolerance: float = 0.1) -> bool:
    """The last two timings agree within `tolerance` (relative): the shape is warm."""
    last = list(timings)[-2:]
    if len(last) < 2:
        return False
    low, high = min(last), max(last)
    return high <= low * (1 + tolerance)
