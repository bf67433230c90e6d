"""tsbatch.handlers.core.buckets: edges, bucket choice, batch caps and the batch plan."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tsbatch.handlers.core.buckets import Batch, Item, batch_cap, bucket_for, check_edges, default_edges, next_batch_size, plan_batches

pytestmark = pytest.mark.unit


def item(index: int, bucket: int, tokens: int | None = None) -> Item:
    return Item(index=index, text=f"t{index}", length=bucket if tokens is None else tokens, bucket=bucket)


# -- default_edges / check_edges ---------------------------------------------------------------

@pytest.mark.parametrize(
    "max_length, expected",
    [
        (512, (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)),
        (256, (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)),
        (300, (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 300)),
        (70, (8, 16, 24, 32, 40, 48, 56, 64, 70)),
        (1024, (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                640, 768, 896, 1024)),
        (17, (8, 16, 17)),
        (16, (8, 16)),
        (8, (8,)),
        (5, (5,)),  # a model shorter than the smallest edge: its maximum is the only edge
    ],
)
def test_default_edges(max_length, expected):
    assert default_edges(max_length) == expected


@pytest.mark.parametrize("max_length", [1, 10, 16, 100, 384, 512, 4097])
def test_default_edges_are_strictly_increasing_and_end_at_the_maximum(max_length):
    edges = default_edges(max_length)
    assert edges[-1] == max_length
    assert all(a < b for a, b in zip(edges, edges[1:]))


@pytest.mark.parametrize(
    "edges, max_length, expected",
    [
        ((16, 64, 256), 512, (16, 64, 256, 512)),  # the maximum is always an edge
        ((16, 64, 512), 512, (16, 64, 512)),  # ... once
        ((16, 64, 1024, 2048), 512, (16, 64, 512)),  # edges above the maximum are dropped
        ((600,), 512, (512,)),
        ((), 128, (128,)),
        ([32, 128], 384, (32, 128, 384)),  # a list works too, a tuple comes back
    ],
)
def test_check_edges(edges, max_length, expected):
    assert check_edges(edges, max_length) == expected


# -- bucket_for --------------------------------------------------------------------------------

EDGES = (16, 32, 64, 128, 256, 512)


@pytest.mark.parametrize(
    "tokens, expected",
    [
        (0, 16),
        (1, 16),
        (16, 16),  # an edge holds exactly its own length
        (17, 32),
        (32, 32),
        (33, 64),
        (200, 256),
        (257, 512),
        (512, 512),
    ],
)
def test_bucket_for(tokens, expected):
    assert bucket_for(tokens, EDGES) == expected


def test_bucket_for_uneven_edges():
    edges = default_edges(300)
    assert bucket_for(257, edges) == 300
    assert bucket_for(300, edges) == 300
    assert bucket_for(65, edges) == 80


@pytest.mark.parametrize("tokens", [513, 10_000])
def test_bucket_for_too_many_tokens(tokens):
    with pytest.raises(ValueError, match=f"{tokens} tokens exceed the largest bucket edge 512"):
        bucket_for(tokens, EDGES)


# -- batch_cap ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "bucket, max_batch_tokens, expected",
    [
        (16, 16384, 1024),
        (512, 16384, 32),
        (384, 16384, 42),
        (384, 1000, 2),
        (512, 512, 1),
        (1024, 512, 1),  # at least one, even over the budget
        (512, 1, 1),
    ],
)
def test_batch_cap(bucket, max_batch_tokens, expected):
    assert batch_cap(bucket, max_batch_tokens) == expected


# -- Batch -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "bucket, tokens, real, padded",
    [
        (32, [17, 20, 32], 69, 96),
        (16, [1], 1, 16),
        (64, [], 0, 0),
        (512, [300, 512], 812, 1024),
    ],
)
def test_batch_real_and_padded_tokens(bucket, tokens, real, padded):
    batch = Batch(bucket, tuple(item(i, bucket, t) for i, t in enumerate(tokens)))
    assert batch.size == len(tokens)
    assert batch.real_tokens == real
    assert batch.padded_tokens == padded
    assert batch.padded_tokens >= batch.real_tokens


# -- plan_batches ------------------------------------------------------------------------------

def shape(batches):
    """A plan as [(bucket, [indexes...]), ...] for readable comparisons."""
    return [(b.bucket, [i.index for i in b.items]) for b in batches]


@pytest.mark.parametrize(
    "buckets, cap, expected",
    [
        # shortest bucket first, arrival order inside a bucket
        ([64, 16, 64, 16, 32], 10, [(16, [1, 3]), (32, [4]), (64, [0, 2])]),
        # caps split a bucket in arrival order
        ([16] * 5, 2, [(16, [0, 1]), (16, [2, 3]), (16, [4])]),
        ([16] * 4, 4, [(16, [0, 1, 2, 3])]),
        ([16] * 4, 1, [(16, [0]), (16, [1]), (16, [2]), (16, [3])]),
        # a cap below one still makes progress
        ([16, 16], 0, [(16, [0]), (16, [1])]),
        ([16, 16], -3, [(16, [0]), (16, [1])]),
        ([], 8, []),
    ],
)
def test_plan_batches(buckets, cap, expected):
    items = [item(i, b) for i, b in enumerate(buckets)]
    assert shape(plan_batches(items, lambda bucket: cap)) == expected


def test_plan_batches_uses_each_buckets_own_cap():
    items = [item(i, b) for i, b in enumerate([512, 16, 512, 16, 512, 16, 512])]
    caps = {16: 3, 512: 2}
    asked = []

    def cap_for(bucket):
        asked.append(bucket)
        return caps[bucket]

    assert shape(plan_batches(items, cap_for)) == [
        (16, [1, 3]),  # batch sizes are powers of two: a cap of 3 forms 2 + 1
        (16, [5]),
        (512, [0, 2]),
        (512, [4, 6]),
    ]
    assert sorted(asked) == [16, 512]


def test_plan_batches_accepts_any_iterable():
    items = (item(i, b) for i, b in enumerate([32, 16]))
    assert shape(plan_batches(items, lambda b: 8)) == [(16, [1]), (32, [0])]


@given(
    buckets=st.lists(st.sampled_from(EDGES), max_size=60),
    caps=st.fixed_dictionaries({edge: st.integers(min_value=-1, max_value=9) for edge in EDGES}),
)
def test_plan_batches_invariants(buckets, caps):
    items = [item(i, b) for i, b in enumerate(buckets)]
    batches = plan_batches(items, caps.__getitem__)

    # every item exactly once
    planned = [i.index for b in batches for i in b.items]
    assert sorted(planned) == list(range(len(items)))
    # shortest bucket first
    assert [b.bucket for b in batches] == sorted(b.bucket for b in batches)
    for batch in batches:
        # one bucket per batch, never empty, cap respected
        assert all(i.bucket == batch.bucket for i in batch.items)
        assert 1 <= batch.size <= max(1, caps[batch.bucket])
    # arrival order inside a bucket
    for edge in EDGES:
        order = [i.index for b in batches if b.bucket == edge for i in b.items]
        assert order == sorted(order)
        # only the last batch of a bucket may be short
        sizes = [b.size for b in batches if b.bucket == edge]
        # every size is a power of two, the largest that fits the cap and what is left
        left = len([i for i in items if i.bucket == edge])
        for size in sizes:
            assert size & (size - 1) == 0
            assert size == next_batch_size(left, max(1, caps[edge]))
            left -= size
