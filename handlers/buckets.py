"""Length buckets and batch planning: which requests run together, padded to what length.

A request is padded only to its own bucket's edge, never to a longer request's length, and
batches run shortest bucket first so short requests are not held behind long ones. Pure: no torch,
no clock; the runner executes what `plan_batches` returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

SMALLEST_EDGE = 8


@dataclass(frozen=True)
class Item:
    """A parsed, tokenized request ready to batch. `encoding` is the tokenizer's output, opaque here."""

    index: int
    text: str
    tokens: int
    bucket: int
    encoding: Any = None


@dataclass(frozen=True)
class Batch:
    """Requests of one bucket that run as one forward pass, padded to `bucket` tokens."""

    bucket: int
    items: tuple[Item, ...]

    @property
    def size(self) -> int:
        return len(self.items)

    @property
    def real_tokens(self) -> int:
        return sum(item.tokens for item in self.items)

    @property
    def padded_tokens(self) -> int:
        return self.bucket * len(self.items)


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


def check_edges(edges: Sequence[int], max_length: int) -> tuple[int, ...]:
    """Edges above the model's maximum are dropped; the maximum is always an edge."""
    kept = [e for e in edges if e < max_length]
    return tuple(kept) + (max_length,)


def bucket_for(tokens: int, edges: Sequence[int]) -> int:
    """The smallest edge that holds `tokens`."""
    for edge in edges:
        if tokens <= edge:
            return edge
    raise ValueError(f"{tokens} tokens exceed the largest bucket edge {edges[-1]}")


def batch_cap(bucket: int, max_batch_tokens: int) -> int:
    """How many requests of this bucket fit the token budget of one pass (at least one)."""
    return max(1, max_batch_tokens // bucket)


def largest_power_of_two(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"need at least one request, got {n}")
    return 1 << (n.bit_length() - 1)


def power_of_two_sizes(cap: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the largest power of two not above cap: every batch size the handler forms."""
    return tuple(1 << i for i in range(largest_power_of_two(max(1, cap)).bit_length()))


def next_batch_size(waiting: int, cap: int) -> int:
    """How many of `waiting` requests the next pass takes: a power of two, at most cap.

    Batch sizes are powers of two so that warmup can cover every shape the handler forms
    (5 waiting run as 4 + 1, never padded with dummy rows)."""
    return largest_power_of_two(max(1, min(waiting, cap)))


def plan_batches(items: Iterable[Item], cap_for: Callable[[int], int]) -> list[Batch]:
    """Group items by bucket, shortest bucket first, arrival order inside; batch sizes are powers
    of two of at most cap_for(bucket)."""
    by_bucket: dict[int, list[Item]] = {}
    for item in items:
        by_bucket.setdefault(item.bucket, []).append(item)
    batches = []
    for bucket in sorted(by_bucket):
        group = by_bucket[bucket]
        cap = max(1, cap_for(bucket))
        start = 0
        while start < len(group):
            size = next_batch_size(len(group) - start, cap)
            batches.append(Batch(bucket, tuple(group[start : start + size])))
            start += size
    return batches
