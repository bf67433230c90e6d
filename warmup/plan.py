"""Plan warmup from the serving configuration: every (batch size, bucket) shape the handler forms.

The handler forms batch sizes that are powers of two only (5 waiting requests run as 4 + 1), so
the set of shapes is small — len(buckets) × log2(max batch) — and every one of them is warmed.
No padding rows are ever added: a batch of 5 is two passes, not one padded to 8.
Pure: no torch, no clock, and nothing from handlers/: the handler passes its batch sizes in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence


@dataclass(frozen=True)
class Shape:
    batch: int
    bucket: int

    @property
    def tokens(self) -> int:
        return self.batch * self.bucket


def plan_shapes(edges: Sequence[int], sizes_for: Callable[[int], Iterable[int]]) -> list[Shape]:
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
