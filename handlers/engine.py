"""The scheduler modes' execution side: lane threads that take batches from the Scheduler and run them.

Each request becomes a Ticket whose Answer is handed back (`deliver`) as soon as its own batch
finishes: to the coroutine awaiting it in async mode, to the call waiting for it in continuous mode. Model
passes run on lane threads, never on TorchServe's thread. With two lanes, short buckets and long
buckets run on separate threads that share the cores (the long one at a lower OS priority), so a
short request never waits for a long pass to end. The long lane also helps: with no long batch
ready and the short lane busy, it runs the next short batch, so a short request that arrives
during a short pass does not wait for that pass either. The short lane runs long batches only when
the long lane falls behind (more than BEHIND of its passes queued): on this mix the long lane is
what bounds a worker's throughput, and under sustained load the short lane's core would otherwise
idle between short batches while long requests queue.

Deadlines are kept three times: a request whose lane has more work queued than its deadline
allows is refused at once (503, `_admissible`, timed as handlers/admission.py says), a ticket
whose pass could not end before its deadline (`pass_seconds`, from the latency profile) gets 504
instead of running, and a result that is ready only after the deadline is replaced by 504 as
well, so no accepted request is ever answered late.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from tsbatch.handlers.admission import LaneLoad, finish_in
from tsbatch.handlers.buckets import Bucket, bucket_tokens
from tsbatch.handlers.errors import DeadlineExceeded, ModelFailed, Overloaded, ServingError
from tsbatch.handlers.isolate import Isolator
from tsbatch.handlers.scheduler import Answer, Scheduler, Ticket

logger = logging.getLogger(__name__)


# a later lane is behind when more than this many of its passes are queued behind the one it runs:
# at light load a long request waits for at most one long pass and short requests keep their lane
# to themselves; under sustained load the short lane's idle core takes long passes too
BEHIND = 2


def missed_deadline() -> DeadlineExceeded:
    """What a request that could not finish before its deadline is answered (504)."""
    return DeadlineExceeded("this request could not finish before its deadline (the worker is saturated): "
                            "raise X-Deadline-Ms or retry")


def split_lanes(edges: Sequence[Bucket], long_lane_from: int | None) -> list[tuple[Bucket, ...]]:
    """One lane for all buckets, or two: buckets whose row costs fewer than `long_lane_from`
    tokens (handlers/buckets.bucket_tokens) and the rest."""
    if long_lane_from is None:
        return [tuple(edges)]
    short = tuple(e for e in edges if bucket_tokens(e) < long_lane_from)
    long = tuple(e for e in edges if bucket_tokens(e) >= long_lane_from)
    return [lane for lane in (short, long) if lane]


class Engine:
    """Runs scheduled batches on lane threads; `deliver(ticket, answer)` answers each."""

    def __init__(self, scheduler: Scheduler, isolator: Isolator, lanes: Sequence[tuple[int, ...]],
                 deliver: Callable[[Ticket, Answer], None], clock: Callable[[], float] = time.monotonic,
                 on_batch: Callable[..., None] | None = None,
                 on_lane_start: Callable[[int], None] | None = None,
                 pass_seconds: Callable[..., float] | None = None,
                 typical_pass: Callable[[int, int], float] | None = None):
        self.scheduler = scheduler
        # (bucket, size=its cap) -> p90 seconds of that pass by the latency profile (0: unknown)
        self.pass_seconds = pass_seconds or (lambda bucket, size=None: 0.0)
        # (batch size, bucket) -> typical seconds of that pass (0: unknown), for `free_in`
        self.typical_pass = typical_pass or (lambda size, bucket: 0.0)
        self.isolator = isolator
        self.deliver = deliver
        self.clock = clock
        self.on_batch = on_batch or (lambda *args: None)
        self.on_lane_start = on_lane_start or (lambda lane: None)
        self.cond = threading.Condition()
        self.lanes = [tuple(lane) for lane in lanes]
        # guarded by cond: when lane i's pass started and how long such a pass typically takes
        self.passes = [(0.0, 0.0)] * len(self.lanes)
        self.running: list[Bucket | None] = [None] * len(self.lanes)  # guarded by cond: the bucket of lane i's pass, if any
        self.load = [LaneLoad() for _ in self.lanes]  # guarded by cond: lane i's pace and idle share, for admission
        self.owner = {bucket: i for i, lane in enumerate(self.lanes) for bucket in lane}
        self.stopping = False  # guarded by cond
        self.threads = [
            threading.Thread(target=self._lane, args=(i, lane), name=f"tsbatch-lane-{i}", daemon=True)
            for i, lane in enumerate(self.lanes)
        ]

    def start(self) -> "Engine":
        for thread in self.threads:
            thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """End every lane once its pass (if any) is done; what is still queued is not run."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for thread in self.threads:
            if thread.is_alive():
                thread.join(timeout)

    def submit(self, tickets: Sequence[Ticket]) -> None:
        """Queue one request's tickets (one per text), all or none, and wake the lanes. Overloaded
        propagates when they do not fit: the queue is full, or what a ticket's lane has running
        and queued, then its own pass (the latency profile's times), would end past its deadline,
        so the request is refused at once instead of answered 504 later."""
        with self.cond:
            for ticket in tickets:
                self._admissible(ticket)
            self.scheduler.submit_all(tickets)
            self.cond.notify_all()

    def _admissible(self, ticket: Ticket) -> None:
        """Refuse a ticket whose lane would run it past its deadline: the rest of the pass running
        now, then every queued pass of the lane's buckets with this ticket among them, at the
        sizes the lane will form them (Scheduler.work), each the profile's median at the lane's
        recent pace, less what earlier lanes would take over once it falls behind
        (handlers/admission.py). An idle lane with nothing queued never refuses. Called under cond."""
        if ticket.deadline is None:
            return
        bucket = ticket.item.bucket
        lane = self.owner.get(bucket, 0)
        if self.running[lane] is None and not any(self.scheduler.queues[b] for b in self.lanes[lane]):
            return
        now = self.clock()
        own = self._ahead(lane, now, joining=bucket)
        helpers = [(self._ahead(h, now), self.load[h].idle_share(now)) for h in range(lane)]
        behind = BEHIND * self.load[lane].pace * (self.passes[lane][1] or self._median(bucket, 1))
        done = finish_in(own, behind, helpers)
        if now + done > ticket.deadline:
            raise Overloaded(f"this worker has {done * 1000:.0f} ms of work ahead of this request with its own pass, "
                             f"more than its deadline allows: retry shortly", reason="deadline")

    def _ahead(self, lane: int, now: float, joining: Bucket | None = None) -> float:
        """Seconds of work lane `lane` has: the rest of its running pass and its queued passes
        (with one more request `joining` a bucket), at the lane's pace. Called under cond."""
        pace = self.load[lane].pace
        running = 0.0
        if self.running[lane] is not None:
            started, typical = self.passes[lane]
            running = max(0.0, started + typical * pace - now)
        return running + pace * self.scheduler.work(self.lanes[lane], self._median, joining=joining)

    def _median(self, bucket: Bucket, size: int) -> float:
        """A pass's typical seconds by the profile (its p90 where only that is known, 0: unknown)."""
        return self.typical_pass(size, bucket) or self.pass_seconds(bucket, size)

    def _lane(self, index: int, buckets: tuple[int, ...]) -> None:
        self.on_lane_start(index)
        while not self.stopping:
            try:
                self._step(index, buckets)
            except Exception:  # noqa: BLE001 - a lane must outlive any bug in one step
                logger.exception("tsbatch lane %s: step failed", buckets)
                time.sleep(0.01)

    def _step(self, index: int, buckets: tuple[int, ...]) -> None:
        with self.cond:
            now = self.clock()
            expired = self.scheduler.expire(now, self.pass_seconds)
            merge = self._others_busy(index)
            picked = self.scheduler.next_batch(now, buckets, self._serving, merge)
            helped = self._helped(index)
            if picked is None and helped:
                picked = self.scheduler.next_batch(now, helped, self._serving, merge)
            if picked is None:
                behind = self._behind(index)
                picked = self.scheduler.next_batch(now, behind, merge=merge) if behind else None
            if picked is None and not expired:
                if self.stopping:
                    return
                self.cond.wait(timeout=self.scheduler.time_until_ready(now, buckets + helped, self.pass_seconds,
                                                                       self._serving))
                return
            if picked is not None:
                self.running[index] = picked[0].bucket
                self.passes[index] = (now, self.typical_pass(picked[0].size, picked[0].bucket))
                self.cond.notify_all()  # a later lane may now help with what this one leaves queued
        try:
            self._run(expired, picked)
        finally:
            with self.cond:
                if picked is not None:
                    started, typical = self.passes[index]
                    ended = self.clock()
                    own = self.owner.get(self.running[index], 0) <= index  # not helping a later lane
                    self.load[index].ran(ended - started, typical, ended, own=own)
                self.running[index] = None
                self.cond.notify_all()  # a lane waiting to help re-checks who is busy

    @property
    def busy(self) -> list[bool]:
        """Whether each lane is running a pass, for readers outside (read under cond)."""
        return [bucket is not None for bucket in self.running]

    def free_in(self) -> float:
        """Seconds until some lane can start new work: 0 while one is idle (or the profile does not
        know a running shape), else until the first busy lane's pass should end by its typical
        time. A pass that overran it (a noisy machine, isolation) may end any moment, but is not
        checked on more often than a tenth of its typical time."""
        with self.cond:
            if None in self.running:
                return 0.0
            now = self.clock()
            return min(max(started + typical - now, typical / 10) for started, typical in self.passes)

    def _behind(self, index: int) -> tuple[int, ...]:
        """Buckets of later (longer) lanes that are busy with more than BEHIND passes queued (by
        the latency profile): lane `index`, with nothing of its own or of earlier lanes to run,
        takes their batches rather than idle its share of the cores while they queue. Called under cond."""
        out = ()
        for i in range(index + 1, len(self.lanes)):
            typical = self.passes[i][1]
            if self.running[i] is not None and typical > 0 and \
                    self.scheduler.backlog(self.lanes[i], self.pass_seconds) > BEHIND * typical:  # passes at cap
                out += self.lanes[i]
        return out

    def _serving(self, bucket: Bucket) -> int:
        """How many lanes can run `bucket`'s passes now: its own lane and each later lane that is
        idle or already running one of that lane's buckets (later lanes help earlier ones). A
        bucket holds for company only while that many lanes could not keep up with passes of one
        (handlers/waiting.py). Called under cond."""
        owner = self.owner.get(bucket, 0)
        mine = self.lanes[owner]
        return 1 + sum(1 for j in range(owner + 1, len(self.lanes)) if self.running[j] is None or self.running[j] in mine)

    def _others_busy(self, index: int) -> bool:
        """Whether every other lane is running a pass: only then may lane `index` merge buckets
        into one pass (handlers/merging.py), which saves lane time but makes the shortest requests
        wait for the longer ones; with a lane idle their passes would run side by side instead.
        Called under cond."""
        return all(bucket is not None for j, bucket in enumerate(self.running) if j != index)

    def _helped(self, index: int) -> tuple[int, ...]:
        """Buckets of earlier (shorter) lanes that are busy now: lane `index` may run their batches
        when it has none of its own. Called under cond."""
        return tuple(b for i in range(index) if self.running[i] is not None for b in self.lanes[i])

    def _run(self, expired: list[Ticket], picked) -> None:
        for ticket in expired:
            self.deliver(ticket, Answer(missed_deadline(), 0))
        if picked is None:
            return
        batch, tickets = picked
        started = self.clock()
        try:
            outcomes, report = self.isolator.execute(batch)
        except Exception as error:  # noqa: BLE001 - isolation itself never raises; belt and braces
            outcomes, report = [ModelFailed(f"internal error: {error}")] * len(tickets), None
        finished = self.clock()
        for ticket, outcome in zip(tickets, outcomes):
            if ticket.deadline is not None and finished > ticket.deadline and not isinstance(outcome, ServingError):
                outcome = DeadlineExceeded(
                    "the answer was ready only after this request's deadline (the worker is saturated): "
                    "raise X-Deadline-Ms or retry")
            self.deliver(ticket, Answer(outcome, len(tickets), batch.bucket, ticket.arrived, started, finished))
        self.on_batch(batch, tickets, report, started, finished)  # after answering: metrics never delay them
