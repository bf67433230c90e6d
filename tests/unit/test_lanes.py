"""tsbatch.handlers.runtime.lanes: split_lanes, and the lane threads (Lanes) running a real Policy's plans.

The isolator is a fake whose `execute` can block on an Event, so a test can hold a pass "running"
for as long as it likes; every blocked call is released when the test ends (lane threads are
daemons and simply go idle). Waits are bounded (WAIT seconds) and end as soon as the condition holds.
"""
from __future__ import annotations

import itertools
import threading
import time

import pytest

from tsbatch.handlers.core.buckets import batch_cap, Item
from tsbatch.handlers.core.cost import CostModel
from tsbatch.handlers.core.errors import DeadlineExceeded, ModelFailed, Overloaded
from tsbatch.handlers.core.policy import Policy, PolicySettings, Ticket, split_lanes
from tsbatch.handlers.core.reply import Reply
from tsbatch.handlers.edge.modes.continuous_mode import PACE_MAX_S, reply_pace
from tsbatch.handlers.runtime.lanes import Lanes

pytestmark = pytest.mark.unit

EDGES = (16, 32, 64, 128, 256)
TOKENS = 256  # caps: 16 -> 16, 32 -> 8, 64 -> 4, 128 -> 2, 256 -> 1
WAIT = 5.0  # the longest any test waits for something that should happen
_counter = itertools.count()


# -- split_lanes ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "long_lane_from, expected",
    [
        (None, [EDGES]),
        (128, [(16, 32, 64), (128, 256)]),
        (100, [(16, 32, 64), (128, 256)]),
        (256, [(16, 32, 64, 128), (256,)]),
        (17, [(16,), (32, 64, 128, 256)]),
        (1000, [EDGES]),  # above every edge: one lane
        (257, [EDGES]),
        (16, [EDGES]),  # at or below the smallest edge: every bucket is long, still one lane
        (1, [EDGES]),
    ],
)
def test_split_lanes(long_lane_from, expected):
    assert split_lanes(EDGES, long_lane_from) == expected


def test_split_lanes_accepts_a_list_and_returns_tuples():
    assert split_lanes([32, 512], 64) == [(32,), (512,)]
    assert split_lanes([32, 512], None) == [(32, 512)]


# -- fakes ---------------------------------------------------------------------------------------

class FakeIsolator:
    """Returns {"text": ...} per item; calls for a bucket in `block` wait until `release` is set."""

    def __init__(self, block=(), fail: bool = False):
        self.block = set(block)
        self.fail = fail
        self.release = threading.Event()
        self.entered = threading.Event()  # set once a blocking call has started
        self.lock = threading.Lock()
        self.calls = []  # batches, in the order their execution started
        self.threads = []  # the lane thread that ran each call, same order

    def execute(self, batch):
        with self.lock:
            self.calls.append(batch)
            self.threads.append(threading.current_thread().name)
        if batch.bucket in self.block:
            self.entered.set()
            self.release.wait(timeout=30)
        if self.fail:
            raise RuntimeError("isolator exploded")
        return [{"text": item.text} for item in batch.items], None

    def executed_items(self) -> list:
        with self.lock:
            return [item for batch in self.calls for item in batch.items]


class Deliveries:
    """The Lanes' `on_answer`: records (ticket, outcome, batch_size) and wakes waiting tests."""

    def __init__(self):
        self.cond = threading.Condition()
        self.got = []

    def __call__(self, ticket, answer):
        with self.cond:
            self.got.append((ticket, answer.outcome, answer.batch_size))
            self.cond.notify_all()

    def wait_for(self, predicate, timeout: float = WAIT) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self.got), timeout=timeout)

    def wait_count(self, n: int, timeout: float = WAIT) -> bool:
        return self.wait_for(lambda got: len(got) >= n, timeout)

    def wait_ticket(self, ticket, timeout: float = WAIT):
        self.wait_for(lambda got: any(t is ticket for t, _, _ in got), timeout)
        return self.of(ticket)

    def of(self, ticket):
        with self.cond:
            found = [(outcome, size) for t, outcome, size in self.got if t is ticket]
        assert len(found) <= 1, f"delivered {len(found)} times"
        return found[0] if found else None

    def snapshot(self):
        with self.cond:
            return list(self.got)


def make_scheduler(policy: PolicySettings, cap_for=None, tokens: int = TOKENS, cost: CostModel | None = None,
                   lanes=None) -> Policy:
    """A Policy whose caps are the token budget alone, unless a test gives its own."""
    return Policy(policy, cap_for or (lambda bucket: batch_cap(bucket, tokens)), cost, lanes=lanes)


def policy(**overrides) -> PolicySettings:
    values = dict(edges=EDGES, max_wait=0.01, queue_cap=10_000,
                  age_bound=1.0, priority_aging=1.0)
    values.update(overrides)
    return PolicySettings(**values)


def ticket(bucket: int, deadline_in: float | None = None) -> Ticket:
    """Index 0, as every item of an async-mode call (one request per call) has."""
    n = next(_counter)
    now = time.monotonic()
    item = Item(index=0, text=f"b{bucket}-{n}", length=bucket - 1, bucket=bucket)
    return Ticket(item, now, deadline=None if deadline_in is None else now + deadline_in)


@pytest.fixture
def make_engine():
    isolators = []

    def make(isolator=None, lanes=(EDGES,), on_batch=None, timing=None, **overrides):
        """`timing`: the Policy's CostModel (the latency profile; none by default)."""
        isolator = isolator or FakeIsolator()
        isolators.append(isolator)
        deliveries = Deliveries()
        engine = Lanes(make_scheduler(policy(**overrides), cost=timing, lanes=list(lanes)), isolator,
                       on_answer=deliveries, on_batch=on_batch).start()
        engines.append(engine)
        return engine, isolator, deliveries

    engines = []
    yield make
    for isolator in isolators:
        isolator.release.set()
    for engine in engines:
        engine.stop(WAIT)
        assert not any(thread.is_alive() for thread in engine.threads), "a lane outlived stop()"


# -- every ticket answered once, with its own outcome --------------------------------------------

@pytest.mark.parametrize("lanes", [[EDGES], split_lanes(EDGES, 128)], ids=["one-lane", "two-lanes"])
def test_every_ticket_is_delivered_exactly_once_with_its_own_outcome(make_engine, lanes):
    batches = []
    engine, isolator, deliveries = make_engine(
        lanes=lanes, on_batch=lambda batch, tickets, report, started, ended: batches.append(
            (batch, list(tickets), report, started, ended)))
    assert all(thread.daemon and thread.is_alive() for thread in engine.threads)
    assert len(engine.threads) == len(lanes)

    buckets = [EDGES[i % len(EDGES)] for i in range(23)]
    per_thread = [[ticket(b) for b in buckets] for _ in range(4)]
    submitters = [threading.Thread(target=lambda ts=ts: [engine.submit([t]) for t in ts])
                  for ts in per_thread[:3]]
    for thread in submitters:
        thread.start()
    engine.submit(per_thread[3])  # several tickets in one call too
    for thread in submitters:
        thread.join(WAIT)
    everything = [t for ts in per_thread for t in ts]

    assert deliveries.wait_count(len(everything)), f"only {len(deliveries.got)} of {len(everything)}"
    assert not deliveries.wait_count(len(everything) + 1, timeout=0.2), "a ticket was answered twice"

    got = deliveries.snapshot()
    assert sorted(id(t) for t, _, _ in got) == sorted(id(t) for t in everything)
    size_of = {}
    for batch in isolator.calls:
        for item in batch.items:
            assert id(item) not in size_of, "an item ran twice"
            size_of[id(item)] = batch.size
    for t, outcome, size in got:
        assert outcome == {"text": t.item.text}
        assert size == size_of[id(t.item)] >= 1
        assert size <= TOKENS // t.item.bucket
    assert len(engine.policy) == 0

    # on_batch saw every batch, with its tickets, and a sane time span
    assert sorted(id(b) for b, *_ in batches) == sorted(id(b) for b in isolator.calls)
    for batch, tickets, report, started, ended in batches:
        assert tuple(t.item for t in tickets) == batch.items
        assert report is None and started <= ended


def test_a_lone_ticket_runs_after_max_wait(make_engine):
    engine, isolator, deliveries = make_engine(max_wait=0.05)
    t = ticket(16)  # cap 16: only max_wait can release it
    engine.submit([t])
    assert deliveries.wait_ticket(t) == ({"text": t.item.text}, 1)


def test_an_isolator_that_raises_fails_each_ticket_of_its_batch(make_engine):
    engine, isolator, deliveries = make_engine(FakeIsolator(fail=True), max_wait=10.0)
    tickets = [ticket(64) for _ in range(4)]  # cap 4: full at once
    engine.submit(tickets)
    assert deliveries.wait_count(4)
    for t in tickets:
        outcome, size = deliveries.of(t)
        assert isinstance(outcome, ModelFailed) and outcome.status == 500
        assert "isolator exploded" in outcome.message
        assert size == 4
    # the lane survived: the next batch is served too
    isolator.fail = False
    more = [ticket(64) for _ in range(4)]
    engine.submit(more)
    assert deliveries.wait_count(8)
    assert all(deliveries.of(t)[0] == {"text": t.item.text} for t in more)


# -- deadlines -----------------------------------------------------------------------------------

def test_a_ticket_past_its_deadline_gets_504_and_never_runs(make_engine):
    engine, isolator, deliveries = make_engine(max_wait=10.0)
    late = ticket(256, deadline_in=-1.0)  # bucket 256 is full at one ticket: it would run at once
    on_time = ticket(256, deadline_in=60.0)
    engine.submit([late, on_time])

    outcome, size = deliveries.wait_ticket(late)
    assert isinstance(outcome, DeadlineExceeded)
    assert outcome.status == 504
    assert size == 0
    assert deliveries.wait_ticket(on_time) == ({"text": on_time.item.text}, 1)
    assert all(item is not late.item for item in isolator.executed_items())


def test_a_ticket_whose_deadline_passes_while_waiting_gets_504_on_time(make_engine):
    engine, isolator, deliveries = make_engine(max_wait=30.0)
    t = ticket(16, deadline_in=0.1)  # alone in a bucket of cap 16: it would wait 30 s
    engine.submit([t])
    assert deliveries.wait_count(1, timeout=WAIT), "the lane slept past the deadline"
    outcome, size = deliveries.of(t)
    assert isinstance(outcome, DeadlineExceeded) and size == 0
    assert isolator.calls == []


@pytest.mark.parametrize("lanes", [[EDGES], split_lanes(EDGES, 128)], ids=["one-lane", "two-lanes"])
def test_a_deadline_that_passes_while_every_lane_is_inside_a_pass_is_answered_before_the_passes_end(
        make_engine, lanes):
    isolator = FakeIsolator(block=(64, 256))
    engine, isolator, deliveries = make_engine(isolator, lanes=lanes, max_wait=30.0)
    engine.submit([ticket(256)])  # fills a pass at one ticket: runs at once, and blocks
    if len(lanes) > 1:
        engine.submit([ticket(64) for _ in range(4)])  # cap 4: the short lane's pass, blocked too
    assert _until(lambda: engine.busy == [True] * len(lanes)), "a lane never started its pass"
    waiting = ticket(16, deadline_in=0.2)  # would wait 30 s for company
    engine.submit([waiting])

    outcome, size = deliveries.wait_ticket(waiting)
    assert isinstance(outcome, DeadlineExceeded) and size == 0
    assert not isolator.release.is_set() and len(deliveries.snapshot()) == 1  # every pass still running
    isolator.release.set()
    assert deliveries.wait_count(1 + (5 if len(lanes) > 1 else 1))


def test_an_on_answer_that_raises_costs_no_request_its_answer():
    """on_answer is metrics: a bug there must not leave a batch's other requests unanswered, nor
    stop the deadline watcher."""
    def broken_metrics(ticket, answer):
        raise RuntimeError("metrics exploded")

    def replied(bucket: int, deadline_in: float | None = None) -> Ticket:
        t = ticket(bucket, deadline_in)
        return Ticket(t.item, t.arrived, deadline=t.deadline, reply=Reply())

    isolator = FakeIsolator(block=(256,))
    engine = Lanes(make_scheduler(policy(max_wait=30.0)), isolator, on_answer=broken_metrics).start()
    try:
        batch = [replied(64) for _ in range(4)]  # cap 4: one full pass
        engine.submit(batch)
        assert _until(lambda: all(t.reply.done() for t in batch)), "a ticket after the first lost its answer"
        assert [t.reply.answer().outcome for t in batch] == [{"text": t.item.text} for t in batch]

        engine.submit([replied(256)])  # the one lane enters a pass and stays there
        assert _until(lambda: engine.busy == [True])
        for _ in range(2):  # the watcher answers the second deadline too: the first raise did not end it
            waiting = replied(16, deadline_in=0.2)
            engine.submit([waiting])
            assert _until(lambda: waiting.reply.done()), "the watcher died with the metrics"
            assert isinstance(waiting.reply.answer().outcome, DeadlineExceeded)
        assert not isolator.release.is_set()
    finally:
        isolator.release.set()
        engine.stop(WAIT)


def test_the_deadline_watcher_outlives_a_round_that_raises(make_engine):
    engine, isolator, deliveries = make_engine(FakeIsolator(block=(256,)), max_wait=30.0)
    until_expiry, calls = engine.policy.until_expiry, []

    def fails_once(now):
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("policy bug")
        return until_expiry(now)

    engine.policy.until_expiry = fails_once
    engine.submit([ticket(256)])
    assert _until(lambda: engine.busy == [True] and calls), "the watcher never looked"
    waiting = ticket(16, deadline_in=0.2)
    engine.submit([waiting])
    outcome, _ = deliveries.wait_ticket(waiting)
    assert isinstance(outcome, DeadlineExceeded) and not isolator.release.is_set()


def test_a_ticket_whose_pass_would_end_after_its_deadline_gets_504_without_running(make_engine):
    engine, isolator, deliveries = make_engine(  # a 256-token pass: 0.5 s
        max_wait=0.0, timing=CostModel(p90=lambda *, bucket, size: {256: 0.5}.get(bucket, 0.0)))
    doomed = ticket(256, deadline_in=0.3)  # could not finish in time: answer now, spend nothing
    engine.submit([doomed])
    outcome, size = deliveries.wait_ticket(doomed)
    assert isinstance(outcome, DeadlineExceeded) and size == 0
    assert isolator.calls == []

    with engine.cond:
        engine.policy.cost = CostModel(p90=lambda *, bucket, size: 0.5)
    fits = ticket(256, deadline_in=5.0)
    engine.submit([fits])
    assert deliveries.wait_ticket(fits) == ({"text": fits.item.text}, 1)


def test_a_result_ready_after_the_deadline_is_answered_504_not_late(make_engine):
    isolator = FakeIsolator(block=(64,))
    engine, isolator, deliveries = make_engine(isolator, max_wait=0.0)
    slow = [ticket(64, deadline_in=0.2) for _ in range(4)]  # cap 4: one pass that outlives the deadline
    engine.submit(slow)
    assert isolator.entered.wait(WAIT)
    time.sleep(0.3)
    isolator.release.set()
    assert deliveries.wait_count(4)
    assert all(isinstance(deliveries.of(t)[0], DeadlineExceeded) for t in slow)
    assert [b.size for b in isolator.calls] == [4]  # it did run: the late guard, not the early one


def test_an_error_outcome_keeps_its_own_status_even_after_the_deadline(make_engine):
    class Failing(FakeIsolator):
        def execute(self, batch):
            time.sleep(0.2)
            return [ModelFailed("boom")] * batch.size, None

    engine, isolator, deliveries = make_engine(Failing(), max_wait=0.0)
    t = ticket(256, deadline_in=0.1)
    engine.submit([t])
    outcome, _ = deliveries.wait_ticket(t)
    assert isinstance(outcome, ModelFailed)


# -- queue cap -----------------------------------------------------------------------------------

def test_overloaded_propagates_from_submit_when_the_queue_is_full(make_engine):
    isolator = FakeIsolator(block=EDGES)
    engine, isolator, deliveries = make_engine(isolator, queue_cap=2, max_wait=10.0)
    running = ticket(256)
    engine.submit([running])
    assert isolator.entered.wait(WAIT), "the lane never started the first batch"
    queued = [ticket(256), ticket(256)]
    engine.submit(queued)  # the lane is busy: these two fill the queue
    refused = ticket(256)
    with pytest.raises(Overloaded) as caught:
        engine.submit([refused])
    assert caught.value.status == 503
    assert len(engine.policy) == 2

    isolator.release.set()
    assert deliveries.wait_count(3)
    assert sorted(id(t) for t, _, _ in deliveries.snapshot()) == sorted(map(id, [running, *queued]))
    assert deliveries.of(refused) is None
    engine.submit([refused])  # room again
    assert deliveries.wait_ticket(refused) == ({"text": refused.item.text}, 1)


def test_one_requests_tickets_are_queued_whole_or_refused_whole(make_engine):
    """A request of several texts is several tickets submitted together (issue #20): when they
    do not all fit, none stays queued, so no text of a refused request runs."""
    isolator = FakeIsolator(block=EDGES)
    engine, isolator, deliveries = make_engine(isolator, queue_cap=2, max_wait=10.0)
    engine.submit([ticket(256)])
    assert isolator.entered.wait(WAIT)
    refused = [ticket(256), ticket(256), ticket(256)]
    with pytest.raises(Overloaded, match="this request has 3"):
        engine.submit(refused)
    fits = [ticket(256), ticket(256)]
    engine.submit(fits)
    isolator.release.set()
    assert deliveries.wait_count(3)
    assert all(deliveries.of(t) is not None for t in fits)
    assert not deliveries.wait_count(4, timeout=0.2)
    assert all(deliveries.of(t) is None for t in refused)


# -- lanes: a short request does not wait for a long pass ------------------------------------------

def test_with_two_lanes_a_short_ticket_is_served_while_a_long_pass_runs(make_engine):
    isolator = FakeIsolator(block=(128, 256))
    engine, isolator, deliveries = make_engine(isolator, lanes=split_lanes(EDGES, 128), max_wait=10.0)
    long = ticket(256)
    engine.submit([long])
    assert isolator.entered.wait(WAIT), "the long lane never started its pass"
    next_long = ticket(128)
    engine.submit([next_long, ticket(128)])  # ready, but the short lane must leave it alone

    short = ticket(64)
    shorts = [short] + [ticket(64) for _ in range(3)]  # cap 4: ready at once
    engine.submit(shorts)
    assert deliveries.wait_for(lambda got: {id(t) for t, _, _ in got} >= set(map(id, shorts))), \
        "the short batch waited for the long pass"
    assert not isolator.release.is_set()  # the long pass is still running ...
    assert deliveries.of(long) is None  # ... and unanswered
    assert deliveries.of(short) == ({"text": short.item.text}, 4)
    assert [b.bucket for b in isolator.calls] == [256, 64]  # the short lane took only its own

    isolator.release.set()
    assert deliveries.wait_ticket(long) == ({"text": long.item.text}, 1)
    assert deliveries.wait_ticket(next_long) == ({"text": next_long.item.text}, 2)


def test_the_long_lane_runs_a_short_batch_while_the_short_lane_is_busy(make_engine):
    isolator = FakeIsolator(block=(16,))
    engine, isolator, deliveries = make_engine(isolator, lanes=split_lanes(EDGES, 128), max_wait=10.0)
    first = [ticket(16) for _ in range(16)]  # cap 16: ready at once, and its pass blocks the short lane
    engine.submit(first)
    assert isolator.entered.wait(WAIT), "the short lane never started its pass"
    second = [ticket(64) for _ in range(4)]  # cap 4: ready at once
    engine.submit(second)
    assert deliveries.wait_for(lambda got: {id(t) for t, _, _ in got} >= set(map(id, second))), \
        "the second short batch waited for the first short pass although the long lane was idle"
    assert not isolator.release.is_set() and deliveries.of(first[0]) is None
    assert isolator.threads == ["tsbatch-lane-0", "tsbatch-lane-1"]
    isolator.release.set()
    assert deliveries.wait_count(20)


def test_the_long_lane_leaves_short_batches_to_an_idle_short_lane(make_engine):
    engine, isolator, deliveries = make_engine(lanes=split_lanes(EDGES, 128), max_wait=10.0)
    for n in range(5):
        batch = [ticket(64) for _ in range(4)]
        engine.submit(batch)
        assert deliveries.wait_count(4 * (n + 1))
        with engine.cond:  # the lane marks itself idle just after delivering: wait for that
            assert engine.cond.wait_for(lambda: not any(engine.busy), timeout=WAIT)
    assert isolator.threads == ["tsbatch-lane-0"] * 5


def test_the_long_lane_runs_its_own_batch_before_helping(make_engine):
    isolator = FakeIsolator(block=(16,))
    engine, isolator, deliveries = make_engine(isolator, lanes=split_lanes(EDGES, 128), max_wait=10.0)
    with engine.cond:  # both batches queued before any lane looks: the long lane must pick its own first
        for t in [ticket(16) for _ in range(16)] + [ticket(64) for _ in range(4)] + [ticket(256)]:
            engine.policy.submit_all([t])
        engine.cond.notify_all()
    assert deliveries.wait_count(5), "the long lane did not run the long batch and then the 64 batch"
    by_lane = {lane: [b.bucket for b, t in zip(isolator.calls, isolator.threads) if t == lane]
               for lane in set(isolator.threads)}
    assert by_lane == {"tsbatch-lane-0": [16], "tsbatch-lane-1": [256, 64]}
    isolator.release.set()
    assert deliveries.wait_count(21)


PROFILE = CostModel(median=lambda *, bucket, size: 0.1, p90=lambda *, bucket, size: 0.1)


def _long_pass_running(make_engine, queued: int):
    """The long lane blocked in a 256 pass (cap 1) with `queued` more 256 tickets behind it."""
    isolator = FakeIsolator(block=(256,))
    engine, isolator, deliveries = make_engine(isolator, lanes=split_lanes(EDGES, 128), max_wait=10.0,
                                               timing=PROFILE)
    engine.submit([ticket(256)])
    assert isolator.entered.wait(WAIT), "the long lane never started its pass"
    engine.submit([ticket(256) for _ in range(queued)])
    return engine, isolator, deliveries


def test_the_short_lane_takes_long_batches_when_the_long_lane_falls_behind(make_engine):
    engine, isolator, deliveries = _long_pass_running(make_engine, queued=3)  # 3 passes queued > BEHIND
    assert _until(lambda: "tsbatch-lane-0" in isolator.threads), "the idle short lane left the long queue alone"
    with isolator.lock:
        assert [b.bucket for b in isolator.calls] == [256, 256]
    isolator.release.set()
    assert deliveries.wait_count(4)


def test_the_short_lane_leaves_one_queued_long_pass_alone_and_keeps_serving_shorts(make_engine):
    engine, isolator, deliveries = _long_pass_running(make_engine, queued=2)  # 2 passes: not behind
    shorts = [ticket(64) for _ in range(4)]  # cap 4: ready at once
    engine.submit(shorts)
    assert deliveries.wait_for(lambda got: {id(t) for t, _, _ in got} >= set(map(id, shorts)))
    time.sleep(0.2)  # time enough to (wrongly) take a long batch
    assert isolator.threads == ["tsbatch-lane-1", "tsbatch-lane-0"]
    assert [b.bucket for b in isolator.calls] == [256, 64]
    isolator.release.set()
    assert deliveries.wait_count(7)


def test_a_behind_long_lane_does_not_take_the_short_lane_from_its_own_batches(make_engine):
    isolator = FakeIsolator(block=(256, 16))
    engine, isolator, deliveries = make_engine(isolator, lanes=split_lanes(EDGES, 128), max_wait=10.0,
                                               timing=PROFILE)
    with engine.cond:  # all queued before any lane looks: the short lane must pick its own first
        for t in [ticket(256) for _ in range(5)] + [ticket(16) for _ in range(16)]:
            engine.policy.submit_all([t])
        engine.cond.notify_all()
    assert _until(lambda: len(isolator.threads) == 2)
    assert sorted(zip(isolator.threads, [b.bucket for b in isolator.calls])) == \
        [("tsbatch-lane-0", 16), ("tsbatch-lane-1", 256)]
    isolator.release.set()
    assert deliveries.wait_count(21)


def test_with_one_lane_a_short_ticket_waits_for_the_long_pass(make_engine):
    """The contrast that shows what lanes are for (and that the two-lane test can fail)."""
    isolator = FakeIsolator(block=(128, 256))
    engine, isolator, deliveries = make_engine(isolator, lanes=[EDGES], max_wait=10.0)
    long = ticket(256)
    engine.submit([long])
    assert isolator.entered.wait(WAIT)
    shorts = [ticket(64) for _ in range(4)]
    engine.submit(shorts)
    assert not deliveries.wait_count(1, timeout=0.3)
    isolator.release.set()
    assert deliveries.wait_count(5)
    order = [t for t, _, _ in deliveries.snapshot()]
    assert order[0] is long


# -- free_in: when a lane can take new work (continuous mode paces its calls by it) ----------------

def _until(predicate, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_free_in_is_zero_while_a_lane_is_idle_then_the_first_typical_end(make_engine):
    isolator = FakeIsolator(block=(64, 256))
    typical = CostModel(median=lambda *, bucket, size: {64: 2.0, 256: 60.0}[bucket])
    engine, isolator, deliveries = make_engine(isolator, lanes=split_lanes(EDGES, 128), max_wait=0.0, timing=typical)
    assert engine.free_in() == 0.0  # nothing runs
    engine.submit([ticket(256)])
    assert _until(lambda: len(isolator.calls) == 1)
    assert engine.free_in() == 0.0  # the short lane is idle: a new short request could start now
    engine.submit([ticket(64)])
    assert _until(lambda: len(isolator.calls) == 2)
    assert 1.0 < engine.free_in() <= 2.0  # both busy: the 64-token pass (2 s typical) ends first
    real = engine.clock
    engine.clock = lambda: real() + 3.0  # that pass has overrun its typical time
    assert engine.free_in() == pytest.approx(0.2)  # a tenth of it, not 0: no re-poll storm
    engine.clock = real
    isolator.release.set()
    assert deliveries.wait_count(2)
    assert _until(lambda: engine.free_in() == 0.0)


def test_lanes_serving_a_bucket_count_its_own_and_each_later_lane_idle_or_helping_with_it(make_engine):
    """What the hold for company divides a single-request pass by (Policy.release): a
    short bucket has two lanes while the long lane is idle or runs short passes too, one while
    the long lane runs its own; a long bucket always has its own lane only."""
    isolator = FakeIsolator(block=(16, 256))
    engine, isolator, deliveries = make_engine(isolator, lanes=split_lanes(EDGES, 128), max_wait=0.0)
    with engine.cond:
        assert (engine.policy._serving(16), engine.policy._serving(256)) == (2, 1)  # both idle
    engine.submit([ticket(256)])
    assert _until(lambda: len(isolator.calls) == 1)
    with engine.cond:
        assert (engine.policy._serving(16), engine.policy._serving(256)) == (1, 1)  # the long lane runs its own
    isolator.release.set()
    assert deliveries.wait_count(1)
    isolator.release.clear()
    engine.submit([ticket(16)])
    assert _until(lambda: len(isolator.calls) == 2)
    engine.submit([ticket(16)])  # the short lane is busy: the long lane helps with it
    assert _until(lambda: len(isolator.calls) == 3)
    assert isolator.threads[1:] == ["tsbatch-lane-0", "tsbatch-lane-1"]
    with engine.cond:
        assert (engine.policy._serving(16), engine.policy._serving(256)) == (2, 1)
    isolator.release.set()
    assert deliveries.wait_count(3)


def test_reply_pace_grows_with_the_requests_the_next_call_resends_up_to_its_bound():
    assert reply_pace(0) == 0.0 and reply_pace(-1) == 0.0
    assert reply_pace(2) == pytest.approx(0.002)  # light load: a reply or two a millisecond apart
    assert reply_pace(26) == pytest.approx(0.026)  # saturated: ~38 replies a second, not ~100
    assert reply_pace(500) == PACE_MAX_S


def test_free_in_is_zero_when_the_profile_does_not_know_the_running_shape(make_engine):
    isolator = FakeIsolator(block=(256,))
    engine, isolator, deliveries = make_engine(isolator, max_wait=0.0)  # one lane, no cost model
    engine.submit([ticket(256)])
    assert _until(lambda: len(isolator.calls) == 1)
    assert engine.free_in() == 0.0  # unknown: go back for arrivals after poll_ms, as without a profile


def _admitted_until_refused(engine, make_ticket) -> tuple[int, Overloaded]:
    """How many one-ticket requests `engine` admits before it refuses one, and that refusal."""
    for accepted in range(100):
        try:
            engine.submit([make_ticket()])
        except Overloaded as refused:
            return accepted, refused
    raise AssertionError("100 requests admitted, none refused")


@pytest.mark.parametrize("short_lane_busy, fits", [
    (5.0, 8),  # the short lane busy with its own work throughout: no help, 8 passes of 125 ms
    (1.0, 11),  # idle half the time: past 2 passes behind the queue drains at 1.5 lanes
    (0.0, 14),  # idle: at 2 lanes (1.75 s of passes end at 1.0 s)
])
def test_a_request_whose_lane_has_more_work_queued_than_its_deadline_allows_is_refused_at_once(short_lane_busy, fits):
    """Admission by deadline: what its lane has queued (the passes it will form, the profile's
    times) plus its own pass must end before the deadline; otherwise 503 now, not 504 after
    waiting. Past BEHIND passes queued the short lane helps as far as its own work leaves it idle,
    and the estimate counts that. The other lane's requests are not refused for it."""
    pass_s = {16: 0.010, 32: 0.010, 64: 0.010, 128: 0.125, 256: 0.125}
    scheduler = Policy(PolicySettings(edges=EDGES, max_wait=0.5, queue_cap=1000, age_bound=10.0,
                                      priority_aging=0.0), lambda b: batch_cap(b, TOKENS),
                       CostModel(p90=lambda *, bucket, size: pass_s[bucket]), lanes=split_lanes(EDGES, 128))
    clock = lambda: 0.0  # noqa: E731 - the engine's lanes are not started: time stands still
    engine = Lanes(scheduler, FakeIsolator(), clock=clock, on_answer=lambda t, a: None)
    scheduler.lanes[0].load.ran(short_lane_busy, 0.0, 0.0)  # the short lane's own passes, just ended

    def long_ticket():
        item = Item(index=0, text="long", length=250, bucket=256)
        return Ticket(item, 0.0, deadline=1.0)

    accepted, refused = _admitted_until_refused(engine, long_ticket)  # each adds a 125 ms pass (cap 1) to the long lane
    assert accepted == fits and refused.reason == "deadline" and "ms of work ahead" in str(refused)
    engine.submit([Ticket(Item(index=0, text="short", length=10, bucket=16), 0.0, deadline=0.05)])
    engine.submit([Ticket(Item(index=0, text="no deadline", length=250, bucket=256), 0.0)])
    assert len(scheduler) == fits + 2


@pytest.mark.parametrize("long_lane_busy, fits", [
    (5.0, 8),  # the long lane busy with its own work throughout: the short lane alone, 8 passes of 125 ms
    (1.0, 12),  # idle half the time: the queue drains at 1.5 lanes (1.5 s of passes end at 1.0 s)
    (0.0, 16),  # idle: it runs every other short pass (2 s of passes end at 1.0 s)
])
def test_admission_counts_the_later_lane_that_runs_short_passes_whenever_it_has_none_of_its_own(long_lane_busy,
                                                                                                 fits):
    """With no long requests the long lane runs the short lane's passes (Policy._helped), so a short
    request's deadline is checked against two lanes draining its queue, as far as the long lane's
    own work leaves it idle; counting the short lane alone refused requests both lanes would have
    served in time (short workload near its knee, docs/experiments.md 12-07 03:10)."""
    scheduler = Policy(PolicySettings(edges=EDGES, max_wait=0.5, queue_cap=1000, age_bound=10.0,
                                      priority_aging=0.0), lambda b: 1,
                       CostModel(p90=lambda *, bucket, size: 0.125), lanes=split_lanes(EDGES, 128))
    engine = Lanes(scheduler, FakeIsolator(), clock=lambda: 0.0, on_answer=lambda t, a: None)  # time stands still
    scheduler.lanes[1].load.ran(long_lane_busy, 0.0, 0.0)  # the long lane's own passes, just ended
    accepted, refused = _admitted_until_refused(
        engine, lambda: Ticket(Item(index=0, text="short", length=10, bucket=16), 0.0, deadline=1.0))
    assert accepted == fits and refused.reason == "deadline" and "ms of work ahead" in str(refused)


def test_admission_charges_the_queue_at_the_pace_the_lane_runs_now():
    """A queue is charged at the profile's medians (8 passes of 125 ms fit a 1 s deadline; at the
    400 ms p90, 2 would), times the lane's pace: after passes that took twice their median, 4 fit."""
    scheduler = Policy(PolicySettings(edges=(256,), max_wait=0.5, queue_cap=1000, age_bound=10.0,
                                      priority_aging=0.0), lambda b: 1,
                       CostModel(median=lambda *, bucket, size: 0.125, p90=lambda *, bucket, size: 0.4), lanes=[(256,)])
    engine = Lanes(scheduler, FakeIsolator(), clock=lambda: 0.0, on_answer=lambda t, a: None)
    for _ in range(8):  # at the profile's pace: none refused
        engine.submit([Ticket(Item(index=0, text="long", length=250, bucket=256), 0.0, deadline=1.0)])
    scheduler.queues[256].clear()
    for _ in range(20):
        scheduler.lanes[0].load.ran(0.25, 0.125, 0.0)  # the lane's passes now take twice their median
    assert scheduler.lanes[0].load.pace == pytest.approx(2.0, rel=0.05)
    accepted, _ = _admitted_until_refused(
        engine, lambda: Ticket(Item(index=0, text="long", length=250, bucket=256), 0.0, deadline=1.0))
    assert accepted == 4  # 4 x 0.125 x 1.99 = 0.99 s fits, a 5th would end at 1.24 s


def test_a_lane_keeps_the_pace_of_the_passes_it_runs():
    """After passes that took far less than the profile's median, the lane's pace falls (bounded):
    the engine records every pass it runs, with the lane thread that ran it."""
    isolator = FakeIsolator()
    scheduler = Policy(PolicySettings(edges=EDGES, max_wait=0.0, queue_cap=1000, age_bound=10.0,
                                      priority_aging=0.0), lambda b: batch_cap(b, TOKENS),
                       CostModel(median=lambda *, bucket, size: 5.0), lanes=[EDGES])
    engine = Lanes(scheduler, isolator, on_answer=lambda t, a: None).start()
    try:
        for _ in range(5):
            engine.submit([ticket(16)])
            assert _until(lambda: not len(scheduler) and not any(engine.busy))
        assert _until(lambda: scheduler.lanes[0].load.pace < 0.75)  # 1 -> 0.5 by 0.2 a pass, 5 passes
    finally:
        engine.stop()


def test_admission_counts_the_passes_the_lane_will_form_not_a_full_pass_per_bucket():
    """A lane with one request waiting in each of five buckets runs five passes of one, not five
    passes at the cap: a new request fits its 1 s deadline (0.06 s a pass of one). Passes at the
    cap of 4 (0.19 s): 20 requests of one bucket fit (5 passes, 0.95 s), the 21st would end at
    1.01 s and is refused."""
    edges = (128, 160, 192, 224, 256)
    pass_s = {1: 0.06, 2: 0.1, 4: 0.19}
    scheduler = Policy(PolicySettings(edges=edges, max_wait=0.5, queue_cap=1000, age_bound=10.0,
                                      priority_aging=0.0), lambda bucket: 4,
                       CostModel(p90=lambda *, bucket, size: pass_s[size]), lanes=[edges])
    engine = Lanes(scheduler, FakeIsolator(), clock=lambda: 0.0, on_answer=lambda t, a: None)

    def at(bucket):
        return Ticket(Item(index=0, text="long", length=bucket - 1, bucket=bucket), 0.0, deadline=1.0)

    for bucket in edges:
        engine.submit([at(bucket)])
    engine.submit([at(256)])  # the old rule charged 6 passes at the cap: 1.14 s, refused
    assert len(scheduler) == 6
    for bucket in edges[:-1]:
        scheduler.queues[bucket].clear()
    for _ in range(18):
        engine.submit([at(256)])
    assert len(scheduler.queues[256]) == 20
    with pytest.raises(Overloaded, match="ms of work ahead") as refused:
        engine.submit([at(256)])
    assert refused.value.reason == "deadline" and "1010 ms" in str(refused.value)


# -- merged passes (Policy.merge_edge) only while the other lanes are busy --------------------------

def _merging_engine(isolator):
    """Two lanes over a policy whose profile has a fixed cost per pass (10 ms plus 0.05 ms a
    padded token): one pass of two short buckets' requests costs less than their two passes."""
    profile = lambda *, bucket, size: 0.010 + 0.00005 * size * bucket  # noqa: E731
    scheduler = make_scheduler(policy(max_wait=0.0), cost=CostModel(median=profile, p90=profile),
                               lanes=split_lanes(EDGES, 128))
    deliveries = Deliveries()
    engine = Lanes(scheduler, isolator, on_answer=deliveries).start()
    return engine, deliveries


def test_with_the_long_lane_busy_the_short_lane_runs_two_buckets_as_one_pass():
    isolator = FakeIsolator(block=(256,))
    engine, deliveries = _merging_engine(isolator)
    try:
        engine.submit([ticket(256)])
        assert isolator.entered.wait(WAIT), "the long lane never started its pass"
        shorts = [ticket(16), ticket(32)]
        engine.submit(shorts)  # queued together, under the engine's lock
        assert deliveries.wait_count(2)
        merged = isolator.calls[1]
        assert (merged.bucket, merged.items) == (32, tuple(t.item for t in shorts))
        assert deliveries.of(shorts[0]) == ({"text": shorts[0].item.text}, 2)
    finally:
        isolator.release.set()
        engine.stop(WAIT)


def test_with_the_long_lane_idle_two_buckets_run_as_their_own_passes_side_by_side():
    isolator = FakeIsolator(block=(16,))
    engine, deliveries = _merging_engine(isolator)
    try:
        shorts = [ticket(16), ticket(32)]
        engine.submit(shorts)
        assert deliveries.wait_ticket(shorts[1]) is not None  # the long lane ran it while 16 blocks
        assert [(b.bucket, b.size) for b in isolator.calls] == [(16, 1), (32, 1)]
        assert isolator.threads == ["tsbatch-lane-0", "tsbatch-lane-1"]
    finally:
        isolator.release.set()
        engine.stop(WAIT)


# -- threads per pass -----------------------------------------------------------------------------

def test_a_lane_switches_its_threads_before_a_pass_the_policy_gave_more_and_back_after():
    """borrow_cores: a 256 pass saves 43 ms on both lanes' threads, a 128 pass 5 ms (not enough)."""
    own = {128: 0.020, 256: 0.088}
    wide = {128: 0.015, 256: 0.045}
    at = lambda table: (lambda *, bucket, size: table[bucket])  # noqa: E731
    cost = CostModel(at(own), at(own), threads=1, wider={2: CostModel(at(wide), at(wide), threads=2)})
    isolator = FakeIsolator()
    switched = []  # (lane, threads, passes started before the switch)
    policy_ = Policy(policy(borrow_cores=True), lambda bucket: batch_cap(bucket, TOKENS), cost,
                     lanes=split_lanes(EDGES, 128), threads=[1, 1])
    deliveries = Deliveries()
    engine = Lanes(policy_, isolator, on_answer=deliveries,
                   use_threads=lambda lane, threads: switched.append((lane, threads, len(isolator.calls)))).start()
    try:
        for n, bucket in enumerate((256, 256, 128)):
            t = ticket(bucket)
            t.arrived -= 10 - n  # arrivals a second apart: passes are over before the next (quiet)
            engine.submit([t])
            assert deliveries.wait_ticket(t) is not None
    finally:
        engine.stop(WAIT)
    assert [b.bucket for b in isolator.calls] == [256, 256, 128]
    assert switched == [(1, 2, 0), (1, 1, 2)]  # once to 2 before the first pass, back to 1 for the 128 pass


def test_start_returns_once_each_lane_has_run_its_start_on_its_own_thread_and_a_failed_start_still_serves():
    """A worker goes READY when initialize returns: its lanes' warm passes (on_lane_start) must be
    over by then, each on its own lane thread. A start that raised leaves a lane that serves."""
    ran = []

    def on_lane_start(index: int) -> None:
        time.sleep(0.05)  # a warm pass: longer than starting a thread
        ran.append((index, threading.current_thread().name))
        if index == 0:
            raise RuntimeError("a warm pass failed")

    isolator, deliveries = FakeIsolator(), Deliveries()
    engine = Lanes(make_scheduler(policy(), lanes=[(16, 32, 64), (128, 256)]), isolator, on_answer=deliveries,
                   on_lane_start=on_lane_start).start()
    try:
        assert sorted(ran) == [(0, "tsbatch-lane-0"), (1, "tsbatch-lane-1")]
        short, long = ticket(16), ticket(256)
        engine.submit([short])
        engine.submit([long])
        assert deliveries.wait_count(2)
        assert deliveries.of(short)[0] == {"text": short.item.text}
        assert deliveries.of(long)[0] == {"text": long.item.text}
    finally:
        engine.stop(WAIT)
