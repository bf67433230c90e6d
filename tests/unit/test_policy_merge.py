"""Policy's merged passes (merge_edge, split_cost) and its use of them: one pass of a longer bucket takes
shorter buckets' requests only where the latency profile says it saves lane time and costs the
requests nothing on average. Profiles here are made up: a fixed cost per pass plus a cost per
padded token, in seconds."""
from __future__ import annotations

import pytest

from tsbatch.handlers.core.buckets import Item
from tsbatch.handlers.core.cost import CostModel
from tsbatch.handlers.core.policy import Policy, PolicySettings, Ticket, merge_edge, split_cost

pytestmark = pytest.mark.unit

EDGES = (8, 16, 24, 32, 128)


def cpu_like(fixed: float = 0.010, per_token: float = 0.00005):
    """A pass costs `fixed` plus `per_token` per padded token (on a CPU the fixed part dominates
    small batches of short texts)."""
    return lambda size, bucket: fixed + per_token * size * bucket


def cap16(bucket: int) -> int:
    return 16


def cost(pass_time) -> CostModel:
    """The cost model whose median is `pass_time(size, bucket)`."""
    return CostModel(median=lambda *, bucket, size: pass_time(size, bucket))


def test_small_batches_of_neighbouring_buckets_run_as_one_pass_when_the_fixed_cost_dominates():
    # 2 of 8 tokens then 2 of 16: apart 10.8 ms + 11.6 ms, merged 4 x 16 tokens 13.2 ms
    assert merge_edge((8, 2), [(8, 0), (16, 2)], cap16, cost(cpu_like())) == (16, 4)


def test_without_a_fixed_cost_padding_only_adds_and_nothing_merges():
    assert merge_edge((8, 2), [(8, 0), (16, 2)], cap16, cost(cpu_like(fixed=0.0))) is None


def test_a_long_request_does_not_set_the_padding_of_a_short_one_when_that_slows_them():
    # merged (2 x 128 tokens, 22.8 ms) saves lane time over 10.4 + 16.4 ms apart, but the short
    # request would finish at 22.8 instead of 10.4 ms: summed completion 45.6 > 10.4 + 26.8
    time = cpu_like()
    assert time(2, 128) < time(1, 8) + time(1, 128)
    assert merge_edge((8, 1), [(8, 0), (128, 1)], cap16, cost(time)) is None


def test_the_picked_buckets_leftovers_come_before_a_longer_buckets_requests():
    # 3 waiting in bucket 8 run as 2 + 1 apart; with one of 16 they fill one pass of 4 at 16 tokens
    assert merge_edge((8, 2), [(8, 1), (16, 1)], cap16, cost(cpu_like())) == (16, 4)
    # when the leftovers alone fill the batch, no longer edge is needed: none merges
    assert merge_edge((8, 2), [(8, 2), (16, 3)], lambda b: 4, cost(cpu_like())) is None


def test_shapes_the_profile_does_not_know_never_merge():
    known = cpu_like()
    unknown_merged = lambda size, bucket: 0.0 if (size, bucket) == (4, 16) else known(size, bucket)  # noqa: E731
    assert merge_edge((8, 2), [(8, 0), (16, 2)], cap16, cost(unknown_merged)) is None
    assert split_cost(16, 3, 16, cost(unknown_merged)) == [(known(2, 16), 2), (known(1, 16), 1)]
    assert split_cost(16, 4, 16, cost(unknown_merged)) == []


def test_the_edge_that_saves_the_most_wins():
    # one waiting in each of 16, 24 and 32: merging all four into 32 saves more than into 16 or 24
    assert merge_edge((8, 1), [(8, 0), (16, 1), (24, 1), (32, 1)], cap16, cost(cpu_like())) == (32, 4)


# -- in the policy --------------------------------------------------------------------------------

def scheduler(pass_time=cpu_like()) -> Policy:
    policy = PolicySettings(edges=EDGES, max_wait=0.0, queue_cap=100, age_bound=1000.0, priority_aging=0.0)
    return Policy(policy, cap16, cost(pass_time))


def queue(s: Policy, bucket: int, count: int, arrived: float = 0.0, deadline: float | None = None) -> list[Ticket]:
    tickets = [Ticket(Item(index=bucket * 100 + i, text="t", length=bucket - 1, bucket=bucket), arrived,
                      deadline=deadline) for i in range(count)]
    s.submit_all(tickets)
    return tickets


def test_the_policy_runs_a_merged_pass_padded_to_the_longest_bucket_in_it():
    s = scheduler()
    short, longer = queue(s, 8, 2), queue(s, 16, 2)
    batch, tickets = s.pick(1.0, (8, 16, 24, 32))
    assert batch.bucket == 16 and tickets == short + longer  # the picked bucket's requests first
    assert len(s) == 0


def test_the_policy_merges_only_within_the_buckets_it_was_asked_for():
    s = scheduler()
    short, _ = queue(s, 8, 2), queue(s, 16, 2)
    batch, tickets = s.pick(1.0, (8,))  # a lane of bucket 8 alone
    assert batch.bucket == 8 and tickets == short and len(s) == 2


def test_a_merged_pass_that_would_end_past_a_deadline_is_not_run():
    s = scheduler()
    short = queue(s, 8, 2, deadline=1.0 + 0.012)  # its own pass (10.8 ms) fits, the merged 13.2 ms not
    queue(s, 16, 2)
    batch, tickets = s.pick(1.0, (8, 16))
    assert batch.bucket == 8 and tickets == short


def test_without_a_profile_the_policy_never_merges():
    s = Policy(PolicySettings(edges=EDGES, max_wait=0.0, queue_cap=100, age_bound=1000.0, priority_aging=0.0),
               cap16)
    short, _ = queue(s, 8, 2), queue(s, 16, 2)
    batch, tickets = s.pick(1.0, (8, 16))
    assert batch.bucket == 8 and tickets == short
