"""Policy.release: a bucket holds for company only while waiting pays, checked with a fake clock on
light, bursty and heavy arrival patterns through the real Policy, one lane served the way the lanes
serve it (a free lane takes the next ready batch, else sleeps until the policy's next due time or
the next arrival)."""
from __future__ import annotations

import math
import random

import pytest

from tsbatch.handlers.core.buckets import Item
from tsbatch.handlers.core.cost import CostModel
from tsbatch.handlers.core.policy import Arrivals, Policy, PolicySettings, Ticket

pytestmark = pytest.mark.unit

EDGE = 16
MAX_WAIT = 0.011  # what tune chooses here: the time one short request takes alone


def pass_time(size: int, bucket=EDGE) -> float:
    """A CPU encoder's shape: a fixed cost per pass and a smaller one per row."""
    return 0.008 + 0.003 * size


def cost(pass_time=pass_time) -> CostModel:
    return CostModel(median=lambda *, bucket, size: pass_time(size, bucket))


def release_at(oldest: float, alone: float, arrivals: Arrivals, max_wait: float, company: Arrivals | None = None,
               lanes: int = 1, helping: bool = True) -> float:
    """Policy.release for a bucket whose oldest request arrived at `oldest`, a pass of one taking
    `alone` (0: unknown), the worker's `arrivals`, the bucket's own (`company`; default the
    worker's: a worker of one bucket) and `lanes` lanes able to run it now (a policy of that many
    lanes, every later one idle)."""
    edges = tuple(range(16, 16 * (lanes + 1), 16))  # bucket 16 on lane 0, one bucket on each later lane
    policy = Policy(PolicySettings(edges=edges, max_wait=max_wait, queue_cap=100, age_bound=10.0, priority_aging=0.0),
                    lambda bucket: 16, cost(lambda size, bucket: alone), lanes=[(edge,) for edge in edges])
    policy.arrivals = arrivals
    policy.company[16] = company if company is not None else arrivals
    policy.queues[16].append(Ticket(Item(0, "", 10, 16), oldest))
    assert policy._serving(16) == lanes
    return policy.release(16, helping)


def serve(arrivals: list[float], profile: bool = True, buckets: list[int] | None = None) -> tuple[list[float], list[int]]:
    """Latency of each request and the size of each pass, one lane, cap 16; `buckets`: each
    request's bucket (default all EDGE)."""
    buckets = buckets or [EDGE] * len(arrivals)
    policy = PolicySettings(edges=tuple(sorted(set(buckets))), max_wait=MAX_WAIT, queue_cap=10_000, age_bound=10.0,
                            priority_aging=0.0)
    scheduler = Policy(policy, lambda bucket: 16, cost() if profile else None)
    done: dict[int, float] = {}
    sizes: list[int] = []
    now, i = 0.0, 0
    while len(done) < len(arrivals):
        while i < len(arrivals) and arrivals[i] <= now + 1e-12:
            scheduler.submit_all([Ticket(Item(i, "", 10, buckets[i]), arrivals[i])])
            i += 1
        picked = scheduler.pick(now)
        if picked is not None:
            batch, tickets = picked
            now += pass_time(batch.size)
            sizes.append(batch.size)
            for t in tickets:
                done[t.item.index] = now - t.arrived
            continue
        due = scheduler.time_until_ready(now)
        nxt = arrivals[i] if i < len(arrivals) else math.inf
        now = min(nxt, now + due if due is not None else math.inf)
    return [done[k] for k in range(len(arrivals))], sizes


def poisson(rate: float, count: int, seed: int = 0) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def test_light_traffic_runs_every_request_at_once():
    latencies, sizes = serve(poisson(5, 200))
    assert max(latencies) <= 2 * pass_time(1) + 1e-9  # no hold: at most one pass already running ahead
    assert sum(latencies) / len(latencies) == pytest.approx(pass_time(1), abs=0.001)
    fixed, _ = serve(poisson(5, 200), profile=False)  # the fixed max_wait it replaces
    assert sum(fixed) / len(fixed) == pytest.approx(pass_time(1) + MAX_WAIT, abs=0.001)


def test_heavy_traffic_still_fills_batches_and_keeps_up():
    arrivals = poisson(200, 3000)  # alone a pass serves 91 requests/s; at 16 per pass, 285
    latencies, sizes = serve(arrivals)
    assert sum(sizes) / len(sizes) >= 3  # what arrives during a pass rides the next one
    assert max(latencies) < 0.2  # the queue does not grow: capacity holds


def test_a_busy_worker_does_not_hold_a_bucket_that_gains_no_company_within_the_hold():
    """60 req/s over six buckets: the worker is too busy for passes of one by the worker-wide
    rule (a gap of 17 ms is under two 11 ms passes), but each bucket sees a request every 100 ms,
    so a hold of MAX_WAIT would almost never find company: requests run at once."""
    rng = random.Random(4)
    arrivals = poisson(60, 1500, seed=4)
    buckets = [rng.choice((8, 16, 24, 32, 40, 48)) for _ in arrivals]
    latencies, sizes = serve(arrivals, buckets=buckets)
    waits = sorted(lat - pass_time(1) for lat in latencies)
    assert waits[len(waits) // 2] < MAX_WAIT / 2  # the median request did not hold
    one_bucket, _ = serve(arrivals)  # the same traffic in one bucket does find company: it holds
    assert sorted(one_bucket)[len(one_bucket) // 2] > sorted(latencies)[len(latencies) // 2]


def test_a_burst_after_a_lull_is_served_in_few_passes():
    arrivals = []
    for burst in range(20):  # 8 requests 0.5 ms apart, every 300 ms
        arrivals += [burst * 0.3 + k * 0.0005 for k in range(8)]
    latencies, sizes = serve(arrivals)
    assert len(sizes) <= 2 * 20 + 2  # once the bursts are known, each is one pass (not 8)
    assert max(latencies) < 0.06


def test_the_hold_is_max_wait_only_while_arrivals_outpace_half_a_single_pass():
    arrivals = Arrivals()
    assert release_at(1.0, 0.010, arrivals, 0.5) == 1.0  # nothing known: run at once
    for t in (0.0, 0.1, 0.2, 0.3):
        arrivals.arrived(t)
    assert release_at(1.0, 0.010, arrivals, 0.5) == 1.0  # 100 ms gaps: 10 ms passes keep up
    assert release_at(1.0, 0.060, arrivals, 0.5) == 1.5  # 60 ms passes do not: hold max_wait
    assert release_at(1.0, 0.0, arrivals, 0.5) == 1.5  # no profile: the configured wait
    lull = Arrivals()
    for t in (0.0, 5.0, 5.001, 5.002):  # a lull, then a burst: the median gap is the burst's
        lull.arrived(t)
    assert lull.median_gap() == pytest.approx(0.001)


def test_the_company_rule_applies_only_while_one_lane_keeps_up_with_passes_of_one():
    worker, sparse, dense = Arrivals(), Arrivals(), Arrivals()
    for k in range(9):
        worker.arrived(k * 0.010)  # the worker: a request every 10 ms
        sparse.arrived(k * 0.100)  # this bucket: one every 100 ms, no company within an 11 ms hold
        dense.arrived(k * 0.005)  # this bucket: one every 5 ms
    assert release_at(1.0, 0.004, worker, 0.011, sparse) == 1.0  # 4 ms passes keep up easily
    assert release_at(1.0, 0.008, worker, 0.011, sparse) == 1.0  # busy, but nothing to wait for
    assert release_at(1.0, 0.008, worker, 0.011, dense) == pytest.approx(1.011)  # company is coming
    assert release_at(1.0, 0.016, worker, 0.011, sparse) == pytest.approx(1.011)  # 16 ms > 10/ln 2: fill batches


def test_passes_of_one_are_counted_per_lane_that_can_run_the_bucket():
    """16 ms passes against a request every 10 ms: one lane cannot keep up with passes of one and
    holds; with a second lane idle or helping (short texts alone), 8 ms a pass per lane is in the
    band where a bucket holds only if company comes within the hold."""
    worker, sparse, dense = Arrivals(), Arrivals(), Arrivals()
    for k in range(9):
        worker.arrived(k * 0.010)
        sparse.arrived(k * 0.100)
        dense.arrived(k * 0.005)
    assert release_at(1.0, 0.016, worker, 0.011, sparse, lanes=1) == pytest.approx(1.011)
    assert release_at(1.0, 0.016, worker, 0.011, sparse, lanes=2) == 1.0
    assert release_at(1.0, 0.016, worker, 0.011, dense, lanes=2) == pytest.approx(1.011)
    # counting its own lane alone (a lane taking over from one behind): one lane, never fewer
    assert release_at(1.0, 0.016, worker, 0.011, sparse, lanes=2, helping=False) == pytest.approx(1.011)


def test_the_policy_asks_how_many_lanes_can_run_a_bucket():
    policy = PolicySettings(edges=(8, 16, 24, 32, 40, 48), max_wait=MAX_WAIT, queue_cap=100, age_bound=10.0,
                            priority_aging=0.0)
    scheduler = Policy(policy, lambda bucket: 16, cost(lambda size, bucket: 0.016),
                       lanes=[(8, 16, 24, 32, 40), (48,)])
    for k in range(9):  # the worker: a request every 10 ms over six buckets; bucket 24 gets the last one
        scheduler.submit_all([Ticket(Item(k, "", 10, 24 if k == 8 else (8, 16, 32, 40, 48)[k % 5]), k * 0.010)])
    asked = []
    serving = scheduler._serving
    scheduler._serving = lambda bucket: asked.append(bucket) or serving(bucket)
    now = 0.081
    scheduler.lanes[1].running = 48  # the other lane runs its own: one lane can run 24
    assert scheduler.pick(now, (24,)) is None  # one lane: 16 ms passes hold
    assert scheduler.time_until_ready(now, (24,)) == pytest.approx(0.080 + MAX_WAIT - now)
    scheduler.lanes[1].running = None  # idle, it can help: two lanes
    assert scheduler.time_until_ready(now, (24,)) == 0.0
    picked = scheduler.pick(now, (24,))  # two: the bucket gains no company, run it
    assert picked is not None and picked[0].bucket == 24 and set(asked) == {24}
