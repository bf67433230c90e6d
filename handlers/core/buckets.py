"""Length buckets and batch planning: which requests run together, padded to what length.

A request is padded only to its own bucket's edge, never to a longer request's length, and
batches run shortest bucket first so short requests are not held behind long ones. Pure: no torch,
no clock; the runner executes what `plan_batches` returns.

A length is one size (tokens, samples) or, for a model with a second size such as a generation's
`max_new_tokens`, a tuple of sizes; a bucket is then the tuple of its edges, one per size, so a
request asking for 8 new tokens never shares a pass with one asking for 256.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from tsbatch.warmup.plan import (  # noqa: F401 - the one home of the words
    SMALLEST_EDGE, Bucket, bucket_label, bucket_tokens, default_edges, parse_bucket)


@dataclass(frozen=True)
class Item:
    """A prepared request ready to batch: its length, its bucket and the model's `input` for it
    (what Model.prepare returned, opaque here). A request of several texts is several items of
    one `index` (its row), text `part` of `parts`; `parts` is 0 for a request of one."""

    index: int
    text: str
    length: Bucket
    bucket: Bucket
    input: Any = None
    part: int = 0
    parts: int = 0
    envelope: str = ""  # the shape its request's answer takes (handlers/edge/envelopes.py)


@dataclass(frozen=True)
class Batch:
    """Requests that run as one forward pass, padded to `bucket`: its own requests and, where one
    pass pays (handlers/core/policy.py, merge_edge), shorter buckets' of the same lane."""

    bucket: Bucket
    items: tuple[Item, ...]

    @property
    def size(self) -> int:
        return len(self.items)

    @property
    def real_tokens(self) -> int:
        return sum(bucket_tokens(item.length) for item in self.items)

    @property
    def padded_tokens(self) -> int:
        return bucket_tokens(self.bucket) * len(self.items)


def sizes(length: Bucket) -> tuple[int, ...]:
    """A length or bucket as a tuple of sizes (one for most models)."""
    return length if isinstance(length, tuple) else (length,)


def longest(edges: Sequence[Bucket]) -> Bucket:
    """The most each size may be: the largest edge, or per size the largest of its edges."""
    if isinstance(edges[0], tuple):
        return tuple(max(column) for column in zip(*edges))
    return max(edges)


def is_length(length: Any, edges: Sequence[Bucket]) -> bool:
    """A length this model's buckets can hold the shape of: whole numbers >= 0, one per size."""
    whole = all(isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in sizes(length))
    return whole and isinstance(length, tuple) == isinstance(edges[0], tuple) and len(sizes(length)) == len(sizes(edges[0]))


def holds(bigger: Bucket, smaller: Bucket) -> bool:
    """`bigger` is at least `smaller` in every size."""
    return all(a >= b for a, b in zip(sizes(bigger), sizes(smaller)))


def config_key(bucket: Bucket) -> int | str:
    """A bucket as a key of model-config.yaml's batch_caps: the edge, or its label ("32x16")."""
    return bucket_label(bucket) if isinstance(bucket, tuple) else bucket


def edges_per_size(edges: Sequence[Bucket]) -> list:
    """The buckets as model-config.yaml's `buckets` writes them: the edges, or one list per size."""
    if edges and isinstance(edges[0], tuple):
        return [sorted(set(column)) for column in zip(*edges)]
    return list(edges)


def bucket_order(bucket: Bucket) -> tuple:
    """Shortest first: by what a row costs, then by the edges."""
    return (bucket_tokens(bucket), sizes(bucket))


def bucket_grid(edges_per_size: Sequence[Sequence[int]]) -> tuple[Bucket, ...]:
    """Every bucket of a model with several sizes, one edge of each, shortest first."""
    return tuple(sorted(itertools.product(*[tuple(e) for e in edges_per_size]), key=bucket_order))


def power_of_two_edges(max_length: int) -> tuple[int, ...]:
    """8, 16, 32, ... up to the maximum (always an edge): the default for each size of a model
    with several, whose buckets multiply."""
    edges = []
    edge = SMALLEST_EDGE
    while edge < max_length:
        edges.append(edge)
        edge *= 2
    return tuple(edges) + (max_length,)


def check_edges(edges: Sequence[int], max_length: int) -> tuple[int, ...]:
    """Edges above the model's maximum are dropped; the maximum is always an edge."""
    kept = [e for e in edges if e < max_length]
    return tuple(kept) + (max_length,)


def bucket_for(length: Bucket, edges: Sequence[Bucket]) -> Bucket:
    """The smallest bucket that holds `length` (in every size, for several)."""
    if isinstance(length, tuple):
        holding = [b for b in edges if isinstance(b, tuple) and len(b) == len(length) and holds(b, length)]
        if not holding:
            raise ValueError(f"length {bucket_label(length)} exceeds the largest bucket {bucket_label(max(edges, key=bucket_order))}")
        return min(holding, key=bucket_order)
    for edge in edges:
        if length <= edge:
            return edge
    raise ValueError(f"{length} tokens exceed the largest bucket edge {edges[-1]}")


def batch_cap(bucket: Bucket, max_batch_tokens: int) -> int:
    """How many requests of this bucket fit the token budget of one pass (at least one)."""
    return max(1, max_batch_tokens // bucket_tokens(bucket))


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


def batch_sizes(count: int, cap: int) -> list[int]:
    """The passes `count` waiting requests of one bucket run as, in order (next_batch_size each
    time): 7 with cap 4 run as 4 + 2 + 1."""
    sizes = []
    while count > 0:
        sizes.append(next_batch_size(count, cap))
        count -= sizes[-1]
    return sizes


def plan_batches(items: Iterable[Item], cap_for: Callable[[Bucket], int]) -> list[Batch]:
    """Group items by bucket, shortest bucket first, arrival order inside; batch sizes are powers
    of two of at most cap_for(bucket)."""
    by_bucket: dict[Bucket, list[Item]] = {}
    for item in items:
        by_bucket.setdefault(item.bucket, []).append(item)
    batches = []
    for bucket in sorted(by_bucket, key=bucket_order):
        group = by_bucket[bucket]
        start = 0
        for size in batch_sizes(len(group), cap_for(bucket)):
            batches.append(Batch(bucket, tuple(group[start : start + size])))
            start += size
    return batches
