"""tsbatch.handlers.core.policy: per-bucket queues, readiness, ordering, priority, deadlines, queue cap,
and a lane's plan (schedule / finished).

Time is a fake clock: plain floats passed as `now` (and as each ticket's `arrived`); nothing sleeps.
Unless a test says otherwise the policy has priority aging off (classes are exact) and a huge
age bound, so each test exercises one rule at a time.
"""
from __future__ import annotations

import itertools
import math

import pytest

from tsbatch.handlers.core.buckets import batch_cap, Batch, Item
from tsbatch.handlers.core.cost import CostModel
from tsbatch.handlers.core.errors import BadInput, Overloaded
from tsbatch.handlers.core.policy import (BORROW_RECENT, RECENT, Plan, Policy, PolicySettings, Priority, Ticket, borrowing_lane,
                                          within_budget)

pytestmark = pytest.mark.unit

EDGES = (16, 32, 64, 128, 256)
TOKENS = 256  # caps: 16 -> 16, 32 -> 8, 64 -> 4, 128 -> 2, 256 -> 1
CAP = {edge: TOKENS // edge for edge in EDGES}
HIGH, NORMAL, LOW = Priority.HIGH, Priority.NORMAL, Priority.LOW

_counter = itertools.count()


def make_scheduler(policy: PolicySettings, cap_for=None, tokens: int = TOKENS, cost: CostModel | None = None) -> Policy:
    """A Policy whose caps are the token budget alone, unless a test gives its own; no cost model
    unless a test gives one."""
    return Policy(policy, cap_for or (lambda bucket: batch_cap(bucket, tokens)), cost)


def policy(**overrides) -> PolicySettings:
    values = dict(edges=EDGES, max_wait=0.5, queue_cap=10_000,
                  age_bound=1_000.0, priority_aging=0.0)
    values.update(overrides)
    return PolicySettings(**values)


def ticket(bucket: int, arrived: float = 0.0, priority: Priority = NORMAL,
           deadline: float | None = None, text: str | None = None) -> Ticket:
    n = next(_counter)
    item = Item(index=n, text=text or f"b{bucket}-{n}", length=bucket - 1, bucket=bucket)
    return Ticket(item, arrived, priority, deadline)


def submit(scheduler: Policy, bucket: int, count: int, arrived: float = 0.0,
           priority: Priority = NORMAL) -> list[Ticket]:
    tickets = [ticket(bucket, arrived, priority) for _ in range(count)]
    for t in tickets:
        scheduler.submit_all([t])
    return tickets


def take(scheduler: Policy, now: float, buckets=None) -> tuple[Batch, list[Ticket]]:
    picked = scheduler.pick(now, buckets)
    assert picked is not None, f"no batch ready at {now}"
    batch, tickets = picked
    assert batch.items == tuple(t.item for t in tickets), "the batch and its tickets disagree"
    assert all(t.item.bucket == batch.bucket for t in tickets)
    return batch, tickets


def ids(tickets) -> list[int]:
    return [id(t) for t in tickets]


def all_queued(scheduler: Policy) -> list[Ticket]:
    return [t for queue in scheduler.queues.values() for t in queue]


# -- bucket formation ----------------------------------------------------------------------------

def test_tickets_go_to_their_bucket_queue():
    s = make_scheduler(policy())
    a, b, c, d = ticket(16), ticket(64), ticket(16), ticket(256)
    for t in (a, b, c, d):
        s.submit_all([t])
    assert set(s.queues) == set(EDGES)
    assert ids(s.queues[16]) == ids([a, c])
    assert ids(s.queues[64]) == ids([b])
    assert ids(s.queues[256]) == ids([d])
    assert s.queues[32] == [] and s.queues[128] == []
    assert len(s) == 4


def test_empty_scheduler_has_nothing_to_do():
    s = make_scheduler(policy())
    assert len(s) == 0
    assert s.pick(1e6) is None
    assert s.time_until_ready(0.0) is None
    assert s.expire(1e6) == []


# -- a batch leaves when its token budget is full ----------------------------------------------

@pytest.mark.parametrize("edge", EDGES)
def test_full_bucket_leaves_at_once_and_not_one_ticket_earlier(edge):
    s = make_scheduler(policy(max_wait=100.0))
    first = submit(s, edge, CAP[edge] - 1)
    assert s.pick(0.0) is None  # one short of the budget: waits
    last = submit(s, edge, 1)
    batch, tickets = take(s, 0.0)  # no time has passed: the budget alone makes it ready
    assert batch.bucket == edge
    assert batch.size == CAP[edge]
    assert ids(tickets) == ids(first + last)
    assert len(s) == 0


def test_a_full_bucket_gives_exactly_cap_tickets_and_keeps_the_rest():
    s = make_scheduler(policy(max_wait=100.0))
    tickets = [ticket(64, arrived=i) for i in range(6)]  # cap 4
    for t in tickets:
        s.submit_all([t])
    batch, taken = take(s, 6.0)
    assert batch.size == 4
    assert ids(taken) == ids(tickets[:4])  # the oldest go first
    assert ids(s.queues[64]) == ids(tickets[4:])
    assert s.pick(6.0) is None  # two left: not full, and not old enough


def test_custom_cap_for_decides_when_a_bucket_is_full():
    caps = {16: 2, 32: 3, 64: 1, 128: 1, 256: 1}
    asked = []

    def cap_for(bucket):
        asked.append(bucket)
        return caps[bucket]

    s = make_scheduler(policy(max_wait=100.0), cap_for=cap_for)
    submit(s, 32, 2)
    assert s.pick(0.0) is None  # 2 < 3
    submit(s, 32, 2)
    batch, _ = take(s, 0.0)
    assert (batch.bucket, batch.size) == (32, 2)  # full at cap_for's 3 (not 256 // 32 = 8); a power of two leaves
    assert 32 in asked
    assert len(s.queues[32]) == 2


def test_budget_smaller_than_the_edge_still_allows_one():
    s = make_scheduler(policy(max_wait=100.0), tokens=100)
    submit(s, 256, 2)
    batch, _ = take(s, 0.0)
    assert batch.size == 1


# -- ... or when its oldest ticket has waited max_wait --------------------------------------------

def test_partial_batch_leaves_after_max_wait_and_not_before():
    s = make_scheduler(policy(max_wait=0.5))
    first = ticket(64, arrived=10.0)
    s.submit_all([first])
    assert s.pick(10.0) is None
    assert s.time_until_ready(10.0) == pytest.approx(0.5)
    assert s.time_until_ready(10.2) == pytest.approx(0.3)
    second = ticket(64, arrived=10.4)
    s.submit_all([second])
    assert s.pick(10.49) is None
    assert s.time_until_ready(10.45) == pytest.approx(0.05)  # counted from the oldest, not the newest
    batch, taken = take(s, 10.5)
    assert batch.size == 2
    assert ids(taken) == ids([first, second])  # company that arrived meanwhile rides along
    assert len(s) == 0
    assert s.time_until_ready(10.5) is None


def test_time_until_ready_is_never_negative():
    s = make_scheduler(policy(max_wait=0.5))
    s.submit_all([ticket(64, arrived=0.0)])
    assert s.time_until_ready(0.7) == 0.0


def test_time_until_ready_takes_the_soonest_bucket():
    s = make_scheduler(policy(max_wait=0.5))
    s.submit_all([ticket(128, arrived=0.0)])
    s.submit_all([ticket(32, arrived=0.3)])
    s.submit_all([ticket(64, arrived=0.1)])
    assert s.time_until_ready(0.3) == pytest.approx(0.2)  # 128's ticket, due at 0.5


def test_a_bucket_holds_for_company_only_while_the_worker_needs_batches():
    """With a latency profile the hold is Policy.release's: while arrivals come less often
    than one per two single-request passes a request runs at once; faster, it holds max_wait."""
    s = make_scheduler(policy(max_wait=0.5), cost=CostModel(median=lambda *, bucket, size: 0.010 + 0.0001 * size))
    first = ticket(16, arrived=0.0)
    s.submit_all([first])
    assert s.time_until_ready(0.0, [16]) == 0.0  # nothing known of the traffic: run now
    assert ids(take(s, 0.0)[1]) == ids([first])
    for at in (0.1, 0.2, 0.3):  # one every 100 ms: a pass of one (10 ms) keeps up
        s.submit_all([ticket(16, arrived=at)])
        assert len(take(s, at)[1]) == 1
    for at in (0.301, 0.302, 0.303, 0.304):  # now most gaps are a millisecond: fill batches
        s.submit_all([ticket(16, arrived=at)])
    assert s.pick(0.304) is None
    assert s.time_until_ready(0.304, [16]) == pytest.approx(0.301 + 0.5 - 0.304)
    assert len(take(s, 0.801)[1]) == 4  # the oldest's max_wait is up: one pass for all four


def test_shortest_ready_bucket_goes_first_even_when_the_longer_one_is_older():
    s = make_scheduler(policy(max_wait=0.5))
    s.submit_all([ticket(256, arrived=0.0)])  # cap 1: ready at once
    s.submit_all([ticket(32, arrived=0.1)])  # ready by age at 0.6
    assert take(s, 0.0)[0].bucket == 256  # the only ready one
    s.submit_all([ticket(256, arrived=0.2)])
    assert take(s, 0.6)[0].bucket == 32
    assert take(s, 0.6)[0].bucket == 256


def test_an_unready_shorter_bucket_does_not_hold_back_a_ready_longer_one():
    s = make_scheduler(policy(max_wait=0.5))
    s.submit_all([ticket(16, arrived=0.0)])
    submit(s, 64, CAP[64], arrived=0.0)
    assert take(s, 0.1)[0].bucket == 64
    assert s.pick(0.1) is None


def test_shortest_first_holds_with_default_aging_for_tickets_of_the_same_class():
    s = make_scheduler(policy(max_wait=0.005, priority_aging=1.0, age_bound=0.25))
    submit(s, 64, 1, arrived=0.000)  # ready by age at 0.005
    submit(s, 16, CAP[16], arrived=0.001)  # full: ready at once
    assert take(s, 0.006)[0].bucket == 16


def test_starving_bucket_goes_first_even_if_a_shorter_one_is_ready():
    s = make_scheduler(policy(max_wait=0.5, age_bound=2.0))
    long = ticket(128, arrived=0.0)
    s.submit_all([long])
    submit(s, 16, CAP[16], arrived=1.9)
    assert take(s, 1.99)[0].bucket == 16  # the long ticket is ready but not yet starving
    submit(s, 16, CAP[16], arrived=1.99)
    batch, taken = take(s, 2.0)  # waited age_bound: jumps the shortest-first order
    assert ids(taken) == ids([long])
    assert take(s, 2.0)[0].bucket == 16


def test_starving_buckets_go_oldest_first():
    s = make_scheduler(policy(max_wait=0.5, age_bound=2.0))
    s.submit_all([ticket(256, arrived=0.0)])
    s.submit_all([ticket(128, arrived=0.5)])
    submit(s, 16, CAP[16], arrived=3.0)
    assert [take(s, 3.0)[0].bucket for _ in range(3)] == [256, 128, 16]


@pytest.mark.parametrize("short_priority", [NORMAL, HIGH])
def test_a_stream_of_ready_short_batches_cannot_starve_a_long_ticket(short_priority):
    """Every step a full batch of short tickets is waiting; batches take `step` seconds each."""
    age_bound, step = 2.0, 0.35
    s = make_scheduler(policy(max_wait=0.1, age_bound=age_bound))
    long = ticket(128, arrived=0.0)
    s.submit_all([long])
    served_at = None
    order = []
    for n in range(100):
        now = n * step
        submit(s, 16, CAP[16], arrived=now, priority=short_priority)
        batch, taken = take(s, now)
        order.append(batch.bucket)
        if any(t is long for t in taken):
            served_at = now
            break
    assert served_at is not None, "the long ticket was never served"
    assert served_at <= age_bound + step  # within the bound plus the batch that was running
    # the shorts really did hold it back until the bound: it was ready from 0.1 on
    assert served_at >= age_bound
    assert order[:-1] == [16] * (len(order) - 1) and order[-1] == 128


# -- priority ------------------------------------------------------------------------------------

def test_priority_beats_bucket_length_across_buckets():
    s = make_scheduler(policy(max_wait=100.0))
    submit(s, 16, CAP[16], priority=LOW)
    submit(s, 64, CAP[64], priority=NORMAL)
    submit(s, 256, CAP[256], priority=HIGH)
    assert [take(s, 0.0)[0].bucket for _ in range(3)] == [256, 64, 16]


def test_a_bucket_counts_at_its_best_ticket():
    s = make_scheduler(policy(max_wait=100.0))
    submit(s, 16, CAP[16], priority=NORMAL)
    submit(s, 64, CAP[64] - 1, priority=LOW)
    submit(s, 64, 1, priority=HIGH)
    assert take(s, 0.0)[0].bucket == 64


def test_inside_a_bucket_the_best_tickets_go_first_in_arrival_order():
    s = make_scheduler(policy(max_wait=1.0))
    plan = [LOW, NORMAL, HIGH, LOW, HIGH, NORMAL]  # bucket 64: cap 4
    tickets = [ticket(64, arrived=i * 0.1, priority=p) for i, p in enumerate(plan)]
    for t in tickets:
        s.submit_all([t])
    _, first = take(s, 0.6)
    assert ids(first) == ids([tickets[2], tickets[4], tickets[1], tickets[5]])
    assert ids(s.queues[64]) == ids([tickets[0], tickets[3]])  # the low ones wait
    assert s.pick(0.6) is None
    _, second = take(s, 1.0)  # the oldest (a low one) has waited max_wait
    assert ids(second) == ids([tickets[0], tickets[3]])


# -- aging ---------------------------------------------------------------------------------------

def test_effective_priority():
    low = ticket(16, arrived=10.0, priority=LOW)
    assert low.effective_priority(10.0, 1.0) == LOW
    assert low.effective_priority(11.0, 1.0) == NORMAL
    assert low.effective_priority(12.0, 1.0) == HIGH
    assert low.effective_priority(50.0, 1.0) == HIGH  # never better than high
    assert low.effective_priority(50.0, 0.0) == LOW  # aging off


def test_a_low_ticket_that_waited_two_aging_periods_counts_as_high_inside_a_bucket():
    def first_served(now: float) -> tuple[Ticket, Ticket, Ticket]:
        s = make_scheduler(policy(max_wait=0.0, priority_aging=1.0), cap_for=lambda b: 1)
        low = ticket(64, arrived=0.0, priority=LOW)
        high = ticket(64, arrived=1.5, priority=HIGH)
        s.submit_all([low])
        s.submit_all([high])
        return take(s, now)[1][0], low, high

    served, low, high = first_served(1.9)  # not yet aged enough: high goes first
    assert served is high
    served, low, high = first_served(2.0)  # counts as high now, and it arrived first
    assert served is low


def test_a_low_ticket_that_waited_two_aging_periods_counts_as_high_across_buckets():
    def first_bucket(now: float) -> int:
        s = make_scheduler(policy(max_wait=0.0, priority_aging=1.0))
        s.submit_all([ticket(16, arrived=0.0, priority=LOW)])
        s.submit_all([ticket(256, arrived=now, priority=HIGH)])
        return take(s, now)[0].bucket

    assert first_bucket(1.9) == 256
    assert first_bucket(2.0) == 16  # both high now: the shorter one goes first


def test_a_ticket_that_gained_a_class_keeps_its_arrival_order_in_that_class():
    s = make_scheduler(policy(max_wait=0.0, priority_aging=1.0), cap_for=lambda b: 1)
    low = ticket(64, arrived=0.0, priority=LOW)
    normal = ticket(64, arrived=0.7, priority=NORMAL)
    s.submit_all([low])
    s.submit_all([normal])
    assert take(s, 1.2)[1][0] is low


# -- deadlines -----------------------------------------------------------------------------------

def test_expire_removes_and_returns_exactly_the_tickets_past_their_deadline():
    s = make_scheduler(policy())
    past = ticket(16, deadline=1.0)
    due = ticket(64, deadline=2.0)
    due_too = ticket(16, deadline=2.0)
    later = ticket(64, deadline=3.0)
    never = ticket(256, deadline=None)
    for t in (past, later, due, never, due_too):
        s.submit_all([t])

    expired = s.expire(2.0)
    assert sorted(ids(expired)) == sorted(ids([past, due, due_too]))  # deadline <= now
    assert sorted(ids(all_queued(s))) == sorted(ids([later, never]))
    assert len(s) == 2
    assert s.expire(2.0) == []  # removed, not returned twice
    assert ids(s.expire(1e9)) == ids([later])  # no deadline: never expires
    assert ids(all_queued(s)) == ids([never])


def test_expire_with_a_lead_removes_tickets_that_could_not_finish_in_time():
    lead = {16: 0.1, 256: 0.5}.get  # the lead: the cost model's p90 of the bucket's pass
    s = make_scheduler(policy(), cost=CostModel(p90=lambda *, bucket, size: lead(bucket, 0.0)))
    tight_short = ticket(16, deadline=1.05)  # a 16-token pass takes 0.1 s: 1.0 + 0.1 > 1.05
    fine_short = ticket(16, deadline=1.2)
    tight_long = ticket(256, deadline=1.4)  # a 256-token pass takes 0.5 s: 1.0 + 0.5 > 1.4
    fine_long = ticket(256, deadline=1.6)
    for t in (tight_short, fine_short, tight_long, fine_long):
        s.submit_all([t])

    expired = s.expire(1.0)
    assert sorted(ids(expired)) == sorted(ids([tight_short, tight_long]))
    assert sorted(ids(all_queued(s))) == sorted(ids([fine_short, fine_long]))


def test_until_expiry_is_when_expire_would_take_the_first_ticket():
    lead = {16: 0.1, 256: 0.5}.get
    s = make_scheduler(policy(), cost=CostModel(p90=lambda *, bucket, size: lead(bucket, 0.0)))
    s.submit_all([ticket(256, deadline=None)])
    assert s.until_expiry(0.0) is None  # nothing with a deadline: nothing to watch for
    s.submit_all([ticket(16, deadline=1.3), ticket(256, deadline=1.7)])  # due at 1.3 - 0.1 and 1.7 - 0.5
    s.submit_all([ticket(16, deadline=1.25)])
    assert s.until_expiry(1.0) == pytest.approx(0.15)  # 1.25 - 0.1 - 1.0
    assert s.expire(1.14) == []
    assert len(s.expire(1.15)) == 1 and s.until_expiry(1.15) == pytest.approx(0.05)  # then 1.3 - 0.1 and 1.7 - 0.5


def test_expire_charges_the_pass_the_queue_would_form_not_the_cap():
    """A lone long request under a deadline shorter than a full pass at cap runs alone in time: it
    must not be expired (it was, when the lead was always the p90 at cap: 16 x 256 tokens)."""
    p90 = lambda *, bucket, size: 0.1 * size  # noqa: E731 - a pass of n requests takes 0.1 s each
    s = make_scheduler(policy(max_wait=5.0), cap_for=lambda bucket: 16, cost=CostModel(p90=p90))
    alone = ticket(256, deadline=1.0)
    s.submit_all([alone])
    assert s.expire(0.0) == []  # one request: 0.1 s, well within 1.0
    assert s.time_until_ready(0.0) == pytest.approx(0.9)  # a lane wakes when it must expire it, not before
    crowd = [ticket(256, deadline=1.0) for _ in range(11)]  # 12 queued: a pass of 12 takes 1.2 s
    s.submit_all(crowd)
    assert sorted(ids(s.expire(0.0))) == sorted(ids([alone, *crowd]))


@pytest.mark.parametrize("now, lead, deadline", [
    (14.342575945131959, 0.266775, None),  # where tsbatch export spun forever on a CI machine's profile
    (1.3968866394505475, 0.1906488652291506, 1.5875355046796982),
    (8.332131564958335, 0.42076526274605275, 8.752896827704388),
])
def test_a_ticket_is_expired_at_the_instant_a_lane_is_woken_for_it(now, lead, deadline):
    """In floats `now + lead < deadline` can hold while `deadline - lead - now` is 0.0: expire kept
    the ticket and time_until_ready answered 0, so a lane (and the simulator, whose clock then never
    moves) asked again at once, forever. Both now read one instant, deadline - lead."""
    if deadline is None:  # the first float past now + lead whose difference rounds to 0
        deadline = now + lead
        while not (now + lead < deadline and deadline - lead - now <= 0):
            deadline = math.nextafter(deadline, math.inf)
            assert deadline - now - lead < 1e-9, "no such deadline near now + lead"
    assert now + lead < deadline and deadline - lead - now <= 0  # the case, as floats have it
    s = make_scheduler(policy(max_wait=5.0), cost=CostModel(p90=lambda *, bucket, size: lead))
    t = ticket(256, deadline=deadline)
    s.submit_all([t])
    expired = s.expire(now)
    wait = s.time_until_ready(now)
    assert ids(expired) == ids([t]) or (wait is not None and now + wait > now)


def test_time_until_ready_wakes_a_lane_when_a_ticket_must_expire_not_at_its_deadline():
    s = make_scheduler(policy(max_wait=5.0))
    s.submit_all([ticket(64, arrived=0.0, deadline=1.0)])
    assert s.time_until_ready(0.0) == pytest.approx(1.0)
    led = make_scheduler(policy(max_wait=5.0), cost=CostModel(p90=lambda *, bucket, size: 0.3))  # a 0.3 s lead
    led.submit_all([ticket(64, arrived=0.0, deadline=1.0)])
    assert led.time_until_ready(0.0) == pytest.approx(0.7)


def test_expired_tickets_never_reach_a_batch():
    s = make_scheduler(policy(max_wait=0.0))
    gone = ticket(64, deadline=1.0)
    kept = ticket(64, deadline=5.0)
    s.submit_all([gone])
    s.submit_all([kept])
    s.expire(1.0)
    _, taken = take(s, 1.0)
    assert ids(taken) == ids([kept])


def test_time_until_ready_accounts_for_deadlines():
    s = make_scheduler(policy(max_wait=0.5))
    s.submit_all([ticket(64, arrived=0.0, deadline=0.2)])
    assert s.time_until_ready(0.0) == pytest.approx(0.2)  # the deadline comes before max_wait
    assert s.time_until_ready(0.15) == pytest.approx(0.05)
    assert s.time_until_ready(0.3) == 0.0  # already past: wake now
    s.submit_all([ticket(128, arrived=0.0, deadline=0.1)])
    # another bucket's deadline wakes this lane too: an idle lane expires what a busy one cannot
    assert s.time_until_ready(0.0, [64]) == pytest.approx(0.1)
    assert s.time_until_ready(0.0, [128]) == pytest.approx(0.1)
    assert s.time_until_ready(0.0) == pytest.approx(0.1)


def test_a_deadline_after_max_wait_does_not_shorten_the_wait():
    s = make_scheduler(policy(max_wait=0.5))
    s.submit_all([ticket(64, arrived=0.0, deadline=9.0)])
    assert s.time_until_ready(0.0) == pytest.approx(0.5)


# -- queue cap -----------------------------------------------------------------------------------

def test_queue_cap_raises_overloaded_and_accepts_again_after_a_batch():
    s = make_scheduler(policy(queue_cap=5, max_wait=0.5))
    accepted = [ticket(edge) for edge in (16, 16, 64, 128, 256)]
    for t in accepted:
        s.submit_all([t])  # exactly queue_cap fit
    assert len(s) == 5

    refused = ticket(32)
    with pytest.raises(Overloaded) as caught:
        s.submit_all([refused])
    assert caught.value.status == 503
    assert "5" in caught.value.message
    assert len(s) == 5
    assert all(t is not refused for t in all_queued(s))

    take(s, 0.0)  # 256 is full at one ticket
    assert len(s) == 4
    s.submit_all([refused])
    assert len(s) == 5
    with pytest.raises(Overloaded):
        s.submit_all([ticket(32)])


def test_queue_cap_counts_each_lane_alone_so_a_long_backlog_never_refuses_short_requests():
    lanes = [(16, 32, 64), (128, 256)]
    s = Policy(policy(queue_cap=3), lambda bucket: batch_cap(bucket, TOKENS), lanes=lanes)
    for _ in range(3):
        s.submit_all([ticket(256)])
    with pytest.raises(Overloaded) as caught:
        s.submit_all([ticket(128)])  # the long lane's cap is reached
    assert "3 texts of this length waiting (cap 3)" in caught.value.message
    for edge in (16, 32, 64):
        s.submit_all([ticket(edge)])  # the short lane has its own
    with pytest.raises(Overloaded):
        s.submit_all([ticket(16)])
    assert len(s) == 6


def test_a_request_of_several_texts_is_refused_whole_when_one_of_its_lanes_is_full():
    s = Policy(policy(queue_cap=2), lambda bucket: batch_cap(bucket, TOKENS), lanes=[(16, 32, 64), (128, 256)])
    s.submit_all([ticket(256), ticket(256)])
    with pytest.raises(Overloaded) as caught:
        s.submit_all([ticket(16), ticket(128)])
    assert "this request has" not in caught.value.message  # one of its texts is over the long lane's cap
    assert len(s) == 2
    s.submit_all([ticket(16), ticket(32)])
    with pytest.raises(Overloaded) as caught:
        s.submit_all([ticket(16), ticket(64)])
    assert "this request has 2" in caught.value.message
    assert len(s) == 4


# -- Priority.parse ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "value, expected",
    [
        (None, NORMAL),
        ("", NORMAL),
        ("   ", NORMAL),
        ("high", HIGH),
        ("HIGH", HIGH),
        ("High", HIGH),
        ("normal", NORMAL),
        (" low ", LOW),
        ("LOW", LOW),
    ],
)
def test_priority_parse(value, expected):
    assert Priority.parse(value) is expected


@pytest.mark.parametrize("value", ["urgent", "0", "2", "hi", "high!", "low normal"])
def test_priority_parse_rejects_unknown_values(value):
    with pytest.raises(BadInput) as caught:
        Priority.parse(value)
    assert caught.value.status == 400
    assert "X-Priority" in caught.value.message
    assert repr(value) in caught.value.message


def test_priority_order():
    assert HIGH < NORMAL < LOW


# -- lanes: pick and time_until_ready restricted to some buckets -----------------------------

SHORT_LANE, LONG_LANE = (16, 32, 64), (128, 256)


def test_pick_only_takes_from_the_given_buckets():
    s = make_scheduler(policy(max_wait=100.0, age_bound=1.0))
    long = submit(s, 256, 1, arrived=0.0, priority=HIGH)  # ready, high and starving
    assert s.pick(5.0, SHORT_LANE) is None
    short = submit(s, 16, CAP[16], arrived=5.0, priority=LOW)
    batch, taken = take(s, 5.0, SHORT_LANE)
    assert batch.bucket == 16 and ids(taken) == ids(short)
    assert ids(s.queues[256]) == ids(long)  # untouched
    submit(s, 32, CAP[32], arrived=5.0)
    batch, taken = take(s, 5.0, LONG_LANE)
    assert ids(taken) == ids(long)
    assert take(s, 5.0, iter(SHORT_LANE))[0].bucket == 32  # any iterable of buckets


def test_time_until_ready_only_looks_at_the_given_buckets():
    s = make_scheduler(policy(max_wait=0.5))
    s.submit_all([ticket(256, arrived=0.0)])
    assert s.time_until_ready(0.0, SHORT_LANE) is None
    assert s.time_until_ready(0.0, LONG_LANE) == pytest.approx(0.5)
    s.submit_all([ticket(32, arrived=0.0)])
    assert s.time_until_ready(0.0, SHORT_LANE) == pytest.approx(0.5)


def test_a_ticket_that_may_not_wait_makes_its_bucket_ready_at_once():
    """Continuous mode with siblings: no request can join before the call is answered, so
    waiting for company would only add latency."""
    scheduler = make_scheduler(policy(max_wait=0.5))
    waiting = ticket(16, arrived=0.0)
    scheduler.submit_all([waiting])
    assert scheduler.pick(0.1) is None
    assert scheduler.time_until_ready(0.1) == pytest.approx(0.4)
    closed = ticket(16, arrived=0.1)
    closed.may_wait = False
    scheduler.submit_all([closed])
    assert scheduler.time_until_ready(0.1) == 0.0
    batch, tickets = scheduler.pick(0.1)
    assert tickets == [waiting, closed] and batch.bucket == 16


def test_within_budget_fills_each_lane_up_to_its_seconds_and_always_takes_a_lanes_first():
    costs = [(0, 0.1), (0, 0.1), (1, 0.9), (0, 0.25), (1, 0.2), (0, 0.05), (1, 0.05)]
    assert within_budget(costs, [0.3, 0.3]) == [True, True, True, False, False, True, False]
    assert within_budget(costs, [0.3, 1.2]) == [True, True, True, False, True, True, True]
    assert within_budget([(0, 5.0), (0, 0.1)], [0.3]) == [True, False]  # the first always fits
    assert within_budget([], [1.0]) == []


# -- a lane's plan: schedule and finished, on a fake clock --------------------------------------------

def two_lanes(cost: CostModel | None = None, **overrides) -> Policy:
    """The short lane (16, 32, 64) on 2 intra-op threads, the long lane (128, 256) on 1."""
    return Policy(policy(**overrides), lambda bucket: batch_cap(bucket, TOKENS), cost,
                  lanes=[SHORT_LANE, LONG_LANE], threads=[2, 1])


def flat(seconds: float) -> CostModel:
    """Every pass takes `seconds`, median and p90 alike."""
    return CostModel(median=lambda *, bucket, size: seconds, p90=lambda *, bucket, size: seconds)


def test_a_plan_names_its_lane_batch_tickets_threads_and_the_pass_it_expects():
    p = two_lanes(CostModel(median=lambda *, bucket, size: 0.001 * bucket * size), max_wait=100.0)
    tickets = submit(p, 64, CAP[64], arrived=1.0)  # full: ready at once
    submit(p, 256, 1, arrived=1.0)
    plan = p.schedule(0, 2.0)
    assert isinstance(plan, Plan) and plan.lane == 0 and not plan.idle
    assert (plan.batch.bucket, plan.batch.size) == (64, 4)
    assert ids(plan.tickets) == ids(tickets) and plan.batch.items == tuple(t.item for t in tickets)
    assert plan.threads == 2 and plan.expired == () and plan.wait is None
    assert plan.started == 2.0 and plan.typical == pytest.approx(0.256)  # the cost model's median of 4 x 64
    assert p.busy == [True, False] and p.lanes[0].running == 64
    assert len(p.queues[256]) == 1 and len(p.queues[64]) == 0  # the long lane's ticket is left to it
    long_plan = p.schedule(1, 2.0)
    assert (long_plan.lane, long_plan.batch.bucket, long_plan.threads) == (1, 256, 1)
    assert p.busy == [True, True]


def test_tickets_that_can_no_longer_finish_come_back_in_the_plan_to_be_answered():
    p = two_lanes(flat(0.5), max_wait=100.0)
    doomed = ticket(256, arrived=0.0, deadline=1.2)  # 1.0 + a 0.5 s pass ends past 1.2
    fine = ticket(256, arrived=0.0, deadline=9.0)
    other_lane = ticket(16, arrived=0.0, deadline=1.1)  # a short lane's ticket expires from any lane
    p.submit_all([doomed, fine])
    p.submit_all([other_lane])
    plan = p.schedule(1, 1.0)
    assert sorted(ids(plan.expired)) == sorted(ids([doomed, other_lane]))
    assert ids(plan.tickets) == ids([fine]) and plan.batch.bucket == 256  # and what can still finish runs
    assert len(p) == 0
    p.finished(plan, 1.5)
    assert p.schedule(1, 1.5).idle


def test_a_plan_of_expired_tickets_alone_runs_no_batch_and_says_no_wait():
    p = two_lanes(flat(0.5), max_wait=100.0)
    doomed = ticket(16, arrived=0.0, deadline=1.2)
    p.submit_all([doomed])
    plan = p.schedule(0, 1.0)
    assert ids(plan.expired) == ids([doomed]) and plan.batch is None and plan.tickets == ()
    assert not plan.idle and plan.wait is None and p.busy == [False, False]  # answering 504s is no pass


def test_with_nothing_ready_the_plan_is_to_wait_until_the_first_bucket_is_due():
    p = two_lanes(max_wait=0.5)
    submit(p, 32, 1, arrived=1.0)
    plan = p.schedule(0, 1.2)
    assert plan.idle and plan.batch is None and plan.wait == pytest.approx(0.3)
    assert p.schedule(1, 1.2).wait is None  # the long lane has nothing of its own, and 32's lane is idle
    assert p.busy == [False, False]
    assert p.schedule(0, 1.5).batch.bucket == 32


def test_finished_frees_the_lane_and_its_pace_learns_how_long_the_pass_took():
    p = two_lanes(flat(0.1), max_wait=100.0)
    submit(p, 64, CAP[64], arrived=0.0)
    plan = p.schedule(0, 1.0)
    assert p.busy == [True, False] and p.free_in(1.0) == 0.0  # the long lane is idle
    p.finished(plan, 1.2)  # twice the typical 0.1 s
    assert p.busy == [False, False] and p.lanes[0].running is None
    assert p.lanes[0].load.pace == pytest.approx(1.2)  # a fifth of the way from 1 to 2
    assert p.lanes[0].load.idle_share(1.2) == pytest.approx(0.9)  # 0.2 s of its own work over a 2 s horizon
    p.finished(p.schedule(0, 1.2), 5.0)  # an idle plan: nothing learnt
    assert p.lanes[0].load.pace == pytest.approx(1.2)


def test_free_in_is_until_the_first_busy_lanes_typical_end():
    p = two_lanes(CostModel(median=lambda *, bucket, size: {64: 0.4, 256: 2.0}[bucket]), max_wait=100.0)
    submit(p, 64, CAP[64], arrived=0.0)
    submit(p, 256, 1, arrived=0.0)
    short, long = p.schedule(0, 1.0), p.schedule(1, 1.0)
    assert p.free_in(1.1) == pytest.approx(0.3)
    assert p.free_in(1.6) == pytest.approx(0.04)  # overran: a tenth of its typical time
    p.finished(short, 1.6)
    assert p.free_in(1.6) == 0.0


def test_a_later_lane_helps_a_busy_earlier_one_on_time_it_had_to_spare():
    p = two_lanes(flat(0.1), max_wait=100.0)
    first = submit(p, 64, CAP[64], arrived=0.0)
    second = submit(p, 64, CAP[64], arrived=0.0)
    assert ids(p.schedule(0, 1.0).tickets) == ids(first)
    helping = p.schedule(1, 1.0)  # nothing of its own: the short lane is busy, so it runs short work
    assert ids(helping.tickets) == ids(second) and helping.threads == 1
    assert p.lanes[1].running == 64
    p.finished(helping, 1.1)
    assert p.lanes[1].load.idle_share(1.1) == 1.0  # an earlier lane's work is not its own


def test_an_earlier_lane_takes_over_from_a_later_one_that_fell_behind_on_time_it_had_to_spare():
    p = two_lanes(flat(0.1), max_wait=100.0)
    submit(p, 256, 1, arrived=0.0)
    running = p.schedule(1, 1.0)
    queued = submit(p, 256, 2, arrived=0.0)  # two passes queued: not behind
    assert p.schedule(0, 1.0).idle
    queued += submit(p, 256, 1, arrived=0.0)  # three: behind
    plan = p.schedule(0, 1.0)
    assert plan.lane == 0 and plan.batch.bucket == 256 and ids(plan.tickets) == ids(queued[:1])
    p.finished(plan, 1.1)
    p.finished(running, 1.1)
    assert p.lanes[0].load.idle_share(1.1) == 1.0  # a later lane's work is not its own
    assert p.lanes[1].load.idle_share(1.1) < 1.0


# -- borrowing idle lanes' cores (borrow_cores) -----------------------------------------------------------

def wide_cost(own: float, wide: float) -> CostModel:
    """Lanes of 1 thread each: every pass takes `own` on 1 thread and `wide` on 2."""
    at = lambda seconds: (lambda *, bucket, size: seconds)  # noqa: E731
    return CostModel(at(own), at(own), threads=1, wider={2: CostModel(at(wide), at(wide), threads=2)})


def one_thread_lanes(cost: CostModel, **overrides) -> Policy:
    return Policy(policy(max_wait=100.0, **overrides), lambda bucket: batch_cap(bucket, TOKENS), cost,
                  lanes=[SHORT_LANE, LONG_LANE], threads=[1, 1])


def test_a_long_pass_borrows_the_idle_short_lanes_thread_only_when_asked_and_it_saves_enough():
    for borrow, cost, expected in [(False, wide_cost(0.088, 0.045), 1),  # off: the lane's own share
                                   (True, wide_cost(0.088, 0.045), 2),
                                   (True, wide_cost(0.015, 0.008), 1),  # 7 ms saved: under BORROW_SAVING
                                   (True, wide_cost(0.088, 0.0), 1),  # never timed on 2 threads
                                   (True, flat(0.088), 1)]:  # a cost model without thread counts
        p = one_thread_lanes(cost, borrow_cores=borrow)
        submit(p, 256, 1, arrived=0.0)
        plan = p.schedule(1, 1.0)
        assert plan.batch.bucket == 256 and plan.threads == expected, (borrow, expected)
        assert plan.typical == pytest.approx(cost.median(bucket=256, size=1, threads=expected))


def test_no_borrowing_while_another_lane_runs_or_has_work_queued():
    p = one_thread_lanes(wide_cost(0.088, 0.045), borrow_cores=True)
    submit(p, 16, CAP[16], arrived=0.0)
    submit(p, 256, 1, arrived=0.0)
    assert p.schedule(1, 1.0).threads == 1  # the short lane has a full batch waiting
    short = p.schedule(0, 1.0)
    assert short.batch.bucket == 16 and short.threads == 1  # the long lane is running
    p.finished(short, 1.1)
    submit(p, 256, 1, arrived=1.1)
    assert p.schedule(0, 1.1).idle  # nothing of its own; the long lane is not behind


def test_only_the_long_lane_borrows_and_only_beside_lanes_of_one_thread():
    """One lane borrowing keeps the worker to one OpenMP team (bench/results/omp-pools.md)."""
    p = one_thread_lanes(wide_cost(0.088, 0.045), borrow_cores=True)
    submit(p, 16, 1, arrived=0.0)
    assert p.schedule(0, 200.0).threads == 1  # a short pass never borrows the idle long lane's thread
    submit(p, 256, 1, arrived=0.0)
    assert p.schedule(1, 200.0).threads == 1  # the short lane runs: nothing to borrow
    at = lambda seconds: (lambda *, bucket, size: seconds)  # noqa: E731
    four = CostModel(at(0.088), at(0.088), threads=2, wider={4: CostModel(at(0.030), at(0.030), threads=4)})
    q = Policy(policy(max_wait=100.0, borrow_cores=True), lambda bucket: batch_cap(bucket, TOKENS), four,
               lanes=[SHORT_LANE, LONG_LANE], threads=[2, 2])
    submit(q, 256, 1, arrived=0.0)
    assert q.schedule(1, 200.0).threads == 2  # the short lane's own team: borrowing would make a second
    assert [borrowing_lane(t) for t in ([1, 1], [1, 2], [2, 1], [1, 1, 1], [4], [])] == [1, 1, None, 2, None, None]


def test_no_borrowing_while_requests_arrive_more_often_than_every_two_borrowed_passes():
    p = one_thread_lanes(wide_cost(0.088, 0.045), borrow_cores=True)
    for i in range(8):  # one every 60 ms: a 45 ms pass would likely have company arrive mid-pass
        submit(p, 256, 1, arrived=i * 0.060)
    assert p.schedule(1, 1.0).threads == 1
    q = one_thread_lanes(wide_cost(0.088, 0.045), borrow_cores=True)
    for i in range(8):  # one every 100 ms: over before the next
        submit(q, 256, 1, arrived=i * 0.100)
    assert q.schedule(1, 1.0).threads == 2


def test_a_lull_in_the_last_few_arrivals_does_not_make_a_busy_worker_borrow():
    """Quiet, for borrowing, is judged over BORROW_RECENT arrival gaps: at 14 req/s the median of 8
    gaps said quiet for about one long pass in ten, and a short pass beside a borrowed one could take
    it to 4x its time (docs/experiments.md 12-06 18:10)."""
    p = one_thread_lanes(wide_cost(0.088, 0.045), borrow_cores=True)
    times = [i * 0.050 for i in range(BORROW_RECENT - RECENT)]  # busy: one every 50 ms ...
    times += [times[-1] + (i + 1) * 0.150 for i in range(RECENT)]  # ... then a lull of 8 gaps of 150 ms
    for t in times:
        submit(p, 256, 1, arrived=t)
    assert p.quiet(0.045)  # holding for company reads the last 8 gaps: quiet
    assert p.schedule(1, times[-1]).threads == 1  # borrowing reads 32: not quiet
    q = one_thread_lanes(wide_cost(0.088, 0.045), borrow_cores=True)
    for i in range(BORROW_RECENT):  # one every 150 ms throughout: borrows
        submit(q, 256, 1, arrived=i * 0.150)
    assert q.schedule(1, BORROW_RECENT * 0.150).threads == 2
