"""The one scheduling policy: everything a worker decides about what runs next, in one place.

A worker serves from per-bucket queues with one or more lanes (threads that run passes; with two,
short buckets and long buckets run side by side, so a short request never waits for a long pass).
Three calls, made under the lanes' lock (handlers/runtime/lanes.py), the simulator
(archiver/simulate.py) or a test, with the time passed in:

- `admit(tickets, now)` queues one request's tickets whole, or refuses them (Overloaded, 503):
  its lane's queue is full, or its lane would run it past its deadline.
- `schedule(lane, now)` returns that lane's Plan: the tickets to answer 504 now (they can no longer
  finish in time) and the batch to run, or how long to wait. Read top to bottom it says: expire,
  then the lane's own buckets, then help a busy earlier lane, then take over from a later lane that
  fell behind; a batch leaves its bucket when full or when holding for company stops paying;
  several short buckets may merge into one pass while every other lane is busy.
- `finished(plan, now)` records how the pass went (the lane's pace, for admission).

Every time the policy needs is asked of one CostModel (handlers/core/cost.py) with keyword arguments.
Pure: no torch, no threads, no clock.
"""
from __future__ import annotations

import enum
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from tsbatch.handlers.core.buckets import Batch, Bucket, Item, batch_sizes, bucket_order, bucket_tokens, next_batch_size
from tsbatch.handlers.core.cost import CostModel, Helper, LaneLoad, finish_in
from tsbatch.handlers.core.errors import BadInput, Overloaded

# a later lane is behind when its queue holds more than this many of its running pass's time
# (`_backlog` charges each queued bucket a slow pass at its cap): under sustained load the short
# lane's idle core takes long passes too. A queue charged at cap outweighs a running pass of one,
# so with caps above 2 a single queued long request already counts (BEHIND 0, 1 and 2 simulate
# alike on the mix); the live runs measured this value
BEHIND = 2
RECENT = 8  # arrivals whose gaps tell the worker's traffic
BUSY = 0.5  # single-request passes per median arrival gap from which holding for company may pay
FULL = 1 / math.log(2)  # ... from which one lane cannot keep up with passes of one: always hold
# a pass borrows idle lanes' cores only when that saves at least this much of its time: below it the
# frontend and the worker's I/O, which then find no core free, lose more than the pass gains (short
# passes on both threads at light load lost live, docs/experiments.md 12-01 11:22)
BORROW_SAVING = 0.010
# ... and only when the median of this many arrival gaps says the pass is likely over before the next
# arrival: over RECENT's 8, one long pass in ten borrowed at 14 req/s, and a short pass that ran
# beside one could take it to 4x its time (docs/experiments.md 12-06 18:10)
BORROW_RECENT = 32


class Priority(enum.IntEnum):
    HIGH = 0
    NORMAL = 1
    LOW = 2

    @classmethod
    def parse(cls, value: str | None) -> "Priority":
        """From the X-Priority header; absent means normal, anything unknown is the client's error."""
        if value is None or not value.strip():
            return cls.NORMAL
        try:
            return cls[value.strip().upper()]
        except KeyError:
            raise BadInput(f"X-Priority must be high, normal or low, got {value!r}") from None


@dataclass(eq=False)
class Ticket:
    """One text of a request, waiting in the policy's queues, and the Reply it is answered on
    (handlers/core/reply.py; None in tests and the simulator). `may_wait` is False when no other request
    can reach the worker before this one is answered: holding for company would only add latency."""

    item: Item
    arrived: float
    priority: Priority = Priority.NORMAL
    deadline: float | None = None
    reply: Any = None
    may_wait: bool = True

    def effective_priority(self, now: float, aging: float) -> float:
        """The class this ticket counts as now: one whole class better per `aging` seconds waited,
        so tickets of one class tie and the shortest bucket still goes first among them."""
        if aging <= 0:
            return float(self.priority)
        return float(max(0, int(self.priority) - math.floor((now - self.arrived) / aging)))


@dataclass(frozen=True)
class PolicySettings:
    edges: tuple[Bucket, ...]
    max_wait: float  # seconds the oldest request of a bucket may hold for company, at most
    queue_cap: int  # texts waiting for one lane, all its buckets together
    age_bound: float  # seconds after which a bucket's oldest request jumps the shortest-first order
    priority_aging: float  # seconds of waiting that raise a request by one priority class
    borrow_cores: bool = False  # a pass may run on every lane's threads while the other lanes idle

    @classmethod
    def of(cls, config, edges: Sequence[Bucket]) -> "PolicySettings":
        """From the handler configuration (handlers/edge/config.HandlerConfig: its keys in ms)."""
        return cls(edges=tuple(edges), max_wait=config.max_wait_ms / 1000, queue_cap=config.queue_cap,
                   age_bound=config.age_bound_ms / 1000, priority_aging=config.priority_aging_ms / 1000,
                   borrow_cores=config.borrow_cores)


@dataclass(frozen=True)
class Plan:
    """What one lane does next: answer `expired` 504, run `batch` (its `tickets`, in the batch's
    order) on `threads` intra-op threads, or, with nothing to run, wait `wait` seconds (None: until
    woken)."""

    lane: int
    expired: tuple[Ticket, ...] = ()
    batch: Batch | None = None
    tickets: tuple[Ticket, ...] = ()
    threads: int = 1
    wait: float | None = None
    started: float = 0.0
    typical: float = 0.0  # the pass's median by the cost model (0: unknown)

    @property
    def idle(self) -> bool:
        return self.batch is None and not self.expired


@dataclass
class LaneState:
    buckets: tuple[Bucket, ...]
    threads: int = 1
    running: Bucket | None = None  # the bucket of the pass it runs, if any
    started: float = 0.0
    typical: float = 0.0
    load: LaneLoad = field(default_factory=LaneLoad)


def split_lanes(edges: Sequence[Bucket], long_lane_from: int | None) -> list[tuple[Bucket, ...]]:
    """One lane for all buckets, or two: buckets whose row costs fewer than `long_lane_from`
    tokens (handlers/core/buckets.bucket_tokens) and the rest."""
    if long_lane_from is None:
        return [tuple(edges)]
    short = tuple(e for e in edges if bucket_tokens(e) < long_lane_from)
    long = tuple(e for e in edges if bucket_tokens(e) >= long_lane_from)
    return [lane for lane in (short, long) if lane]


def lane_threads(threads: int, lanes: int) -> int:
    """The intra-op threads each lane gets: a share of the worker's, so lanes busy at once never
    oversubscribe the cores (OpenMP teams that outnumber the cores spin against each other)."""
    return max(1, threads // max(1, lanes))


def borrowing_lane(threads: Sequence[int]) -> int | None:
    """The one lane whose passes may run on every lane's threads (`borrow_cores`), given each
    lane's own: the last (long) lane, and only beside lanes of one thread. GNU OpenMP (PyTorch's
    CPU wheels) gives each thread that runs a multi-threaded pass a team that outlives the pass;
    once a process's teams hold more threads than it has cores, their workers sleep between
    parallel regions, and a borrowed two-thread pass ran at its one-thread speed
    (bench/results/omp-pools.md). One lane borrowing, beside lanes of one thread (no team),
    keeps the worker to one team."""
    if len(threads) < 2 or any(t > 1 for t in threads[:-1]):
        return None
    return len(threads) - 1


def deadline_at(now: float, deadline_ms: int, margin_ms: int) -> float:
    """The worker's own deadline for a request taken in at `now`: `margin_ms` early, kept for
    what the worker cannot see (the reply's way back through the frontend)."""
    return now + max(0, deadline_ms - margin_ms) / 1000


def call_hold(poll: float, free_in: float) -> float:
    """How long a continuous-mode call with nothing done waits before it goes back to the
    frontend for new arrivals: `poll` while a lane is idle, else until `poll` before the first
    busy lane should be free (`free_in`), so what arrived meanwhile is in for its next batch."""
    return max(poll, free_in - poll)


class Arrivals:
    """Recent arrivals: the median gap between the last RECENT of them (one lull before a burst
    does not hide the burst), or of the last `keep` for a decision that a lull must not mislead."""

    def __init__(self, keep: int = RECENT):
        self.times: deque = deque(maxlen=keep)

    def arrived(self, now: float) -> None:
        self.times.append(now)

    def median_gap(self, last: int = RECENT) -> float:
        """Infinite before two arrivals: nothing says the worker is busy."""
        times = list(self.times)[-last:]
        if len(times) < 2:
            return math.inf
        gaps = sorted(max(0.0, b - a) for a, b in zip(times, times[1:]))
        return gaps[len(gaps) // 2]


class Policy:
    """The queues of one worker, its lanes' state, and every rule about what runs next."""

    def __init__(self, settings: PolicySettings, cap_for: Callable[[Bucket], int], cost: CostModel | None = None,
                 lanes: Sequence[tuple[Bucket, ...]] | None = None, threads: Sequence[int] | None = None):
        self.settings = settings
        self.cost = cost or CostModel()
        self.cap_for = cap_for  # the worker's one rule for a bucket's largest batch
        self.queues: dict[Bucket, list[Ticket]] = {edge: [] for edge in settings.edges}
        lanes = [tuple(lane) for lane in (lanes or [settings.edges])]
        self.lanes = [LaneState(lane, (threads or [1] * len(lanes))[i]) for i, lane in enumerate(lanes)]
        self.owner = {bucket: i for i, lane in enumerate(self.lanes) for bucket in lane.buckets}
        self.arrivals = Arrivals(keep=BORROW_RECENT)  # the worker's
        self.company: dict[Bucket, Arrivals] = {edge: Arrivals() for edge in settings.edges}  # each bucket's

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    # -- admission ---------------------------------------------------------------------------------

    def admit(self, tickets: Sequence[Ticket], now: float) -> None:
        """Queue one request's tickets (one per text), all or none; Overloaded when they do not
        fit: the queue is full, or a ticket's lane would run it past its deadline."""
        for ticket in tickets:
            self._check_deadline(ticket, now)
        self.submit_all(tickets)

    def submit_all(self, tickets: Sequence[Ticket]) -> None:
        """Queue tickets, or none of them when they would pass a lane's queue cap (which counts
        texts): raise Overloaded. The cap is each lane's, so a backlog of long requests never
        refuses short ones their own lane would serve at once."""
        joining = Counter(self.owner.get(ticket.item.bucket, 0) for ticket in tickets)
        for lane, n in sorted(joining.items()):
            waiting = sum(len(self.queues[b]) for b in self.lanes[lane].buckets)
            if waiting + n > self.settings.queue_cap:
                raise Overloaded(
                    f"this worker has {waiting} texts of this length waiting (cap {self.settings.queue_cap}"
                    + (f", this request has {n}" if n > 1 else "") + "): retry shortly"
                )
        for ticket in tickets:
            self.queues[ticket.item.bucket].append(ticket)
        for bucket in {ticket.item.bucket for ticket in tickets}:
            self.company[bucket].arrived(tickets[0].arrived)
        if tickets:
            self.arrivals.arrived(tickets[0].arrived)

    def _check_deadline(self, ticket: Ticket, now: float) -> None:
        """Refuse a ticket whose lane would run it past its deadline: the rest of the pass running
        now, then every queued pass of the lane's buckets with this ticket among them, at the sizes
        the lane will form them, each the cost model's typical time at the lane's recent pace, less
        what the other lanes would take over (`Helper`): an earlier lane once this one falls behind,
        a later lane whenever it has none of its own work. An idle lane with nothing queued never
        refuses."""
        if ticket.deadline is None:
            return
        bucket = ticket.item.bucket
        lane = self.owner.get(bucket, 0)
        state = self.lanes[lane]
        if state.running is None and not any(self.queues[b] for b in state.buckets):
            return
        own = self._ahead(lane, now, joining=bucket)
        behind = BEHIND * state.load.pace * (state.typical or self.cost.typical(bucket=bucket, size=1))
        helpers = [Helper(self._ahead(h, now), self.lanes[h].load.idle_share(now), below=behind if h < lane else 0.0)
                   for h in range(len(self.lanes)) if h != lane]
        done = finish_in(own, helpers)
        if now + done > ticket.deadline:
            raise Overloaded(f"this worker has {done * 1000:.0f} ms of work ahead of this request with its own pass, "
                             f"more than its deadline allows: retry shortly", reason="deadline")

    def _ahead(self, lane: int, now: float, joining: Bucket | None = None) -> float:
        """Seconds of work a lane has: the rest of its running pass and its queued passes (with one
        more request `joining` a bucket), at the lane's pace."""
        state = self.lanes[lane]
        running = max(0.0, state.started + state.typical * state.load.pace - now) if state.running is not None else 0.0
        return running + state.load.pace * self.work(state.buckets, joining=joining)

    def work(self, buckets: Iterable[Bucket], joining: Bucket | None = None) -> float:
        """Seconds until these buckets' queues (and one more request `joining` one of them) have run:
        each bucket's requests in the passes a lane forms (batch_sizes), each its typical time."""
        return sum(self.cost.typical(bucket=bucket, size=size) for bucket in buckets
                   for size in batch_sizes(len(self.queues[bucket]) + (bucket == joining), self.cap_for(bucket)))

    # -- scheduling --------------------------------------------------------------------------------

    def schedule(self, lane: int, now: float) -> Plan:
        """Lane `lane`'s next step: expire what cannot finish in time, then its own buckets, then
        help a busy earlier lane, then a later lane that fell behind; else wait."""
        state = self.lanes[lane]
        expired = tuple(self.expire(now))
        merge = self._others_busy(lane)
        picked = self.pick(now, state.buckets, merge=merge)
        helped = self._helped(lane)
        if picked is None and helped:
            picked = self.pick(now, helped, merge=merge)
        if picked is None:
            behind = self._behind(lane)
            picked = self.pick(now, behind, merge=merge, helping=False) if behind else None
        if picked is None:  # a behind lane's batch still holding is not waited on: the next arrival
            # or pass end brings it (waking for it cost short p99 live, docs/experiments.md 12-06 09:17)
            wait = None if expired else self.time_until_ready(now, state.buckets + helped)
            return Plan(lane, expired, threads=state.threads, wait=wait)
        batch, tickets = picked
        threads = self.pass_threads(lane, batch)
        typical = self.cost.median(bucket=batch.bucket, size=batch.size, threads=threads)
        state.running, state.started, state.typical = batch.bucket, now, typical
        return Plan(lane, expired, batch, tuple(tickets), threads, started=now, typical=typical)

    def pass_threads(self, lane: int, batch: Batch) -> int:
        """The intra-op threads of a pass: its lane's share, or every lane's threads when
        `borrow_cores` is on, this is the `borrowing_lane`, every other lane is idle with nothing
        queued, and the cost model (a profile timed on that many threads) says the pass ends at
        least BORROW_SAVING sooner and is likely over before the next arrival (`quiet`): the cores
        would otherwise idle. A lane that wakes meanwhile runs beside it on its own share, three
        threads on two cores, which costs its pass and the borrowed one more than borrowing saved
        (the simulator, 12-03)."""
        own = self.lanes[lane].threads
        others = [s for j, s in enumerate(self.lanes) if j != lane]
        if not self.settings.borrow_cores or lane != borrowing_lane([s.threads for s in self.lanes]):
            return own
        if any(s.running is not None or any(self.queues[b] for b in s.buckets) for s in others):
            return own
        wide = own + sum(s.threads for s in others)
        at_wide = self.cost.median(bucket=batch.bucket, size=batch.size, threads=wide)
        at_own = self.cost.median(bucket=batch.bucket, size=batch.size, threads=own)
        return wide if 0 < at_wide <= at_own - BORROW_SAVING and self.quiet(at_wide, last=BORROW_RECENT) else own

    def finished(self, plan: Plan, now: float) -> None:
        """The lane's pass (if any) ended at `now`: it is free, and its pace learns how long it took."""
        state = self.lanes[plan.lane]
        if plan.batch is not None:
            own = self.owner.get(state.running, 0) == plan.lane  # not another lane's pass
            state.load.ran(now - plan.started, plan.typical, now, own=own)
        state.running = None

    def free_in(self, now: float) -> float:
        """Seconds until some lane can start new work: 0 while one is idle (or the cost model does
        not know a running shape), else until the first busy lane's pass should end by its typical
        time. A pass that overran it may end any moment, but is not checked on more often than a
        tenth of its typical time."""
        if any(state.running is None for state in self.lanes):
            return 0.0
        return min(max(s.started + s.typical - now, s.typical / 10) for s in self.lanes)

    @property
    def busy(self) -> list[bool]:
        return [state.running is not None for state in self.lanes]

    def expire(self, now: float) -> list[Ticket]:
        """Remove and return every ticket that cannot finish by its deadline: now plus a slow pass
        of the size its bucket's queue would form now (the cost model's p90; 0 when unknown: only
        deadlines already past)."""
        expired = []
        for bucket, queue in self.queues.items():
            if not any(t.deadline is not None for t in queue):
                continue
            lead = self._lead(bucket, len(queue))
            keep = []
            for ticket in queue:  # the instant time_until_ready waits for, computed alike: in floats now + lead
                # could fall short of a deadline that deadline - lead - now reaches, a wait of 0 forever
                (expired if ticket.deadline is not None and now >= ticket.deadline - lead else keep).append(ticket)
            self.queues[bucket] = keep
        return expired

    def _lead(self, bucket: Bucket, queued: int | None = None) -> float:
        """A slow pass of `bucket`: of `queued` requests (at most its cap), or at its cap. Charging the
        cap to a queue that would form a smaller pass expired a lone long request under a deadline
        shorter than a full pass, though it would have run alone in time."""
        cap = self.cap_for(bucket)
        return self.cost.p90(bucket=bucket, size=cap if queued is None else max(1, min(queued, cap)))

    def pick(self, now: float, buckets: Iterable[Bucket] | None = None, merge: bool = True,
             helping: bool = True) -> tuple[Batch, list[Ticket]] | None:
        """The batch to run now among `buckets` (default all), with its tickets; None if none is
        ready. Among ready buckets: a starving one (its oldest waited `age_bound`) first, then the
        best priority class, then the shortest bucket. `merge`: whether one pass may take several
        buckets' requests where that pays; `helping=False`: a bucket holds for company as if its own
        lane alone served it (a lane taking over from one that fell behind)."""
        allowed = self.settings.edges if buckets is None else tuple(buckets)
        ready = [b for b in allowed if self.ready(b, now, helping)]
        if not ready:
            return None
        bucket = min(ready, key=lambda b: self._rank(b, now))
        queue = self._in_turn(bucket, now)
        chosen = queue[: next_batch_size(len(queue), self.cap_for(bucket))]
        edge = bucket
        if merge:
            edge, chosen = self._merged(bucket, chosen, queue[len(chosen):], allowed, now)
        for ticket in chosen:
            self.queues[ticket.item.bucket].remove(ticket)
        return Batch(edge, tuple(t.item for t in chosen)), chosen

    def ready(self, bucket: Bucket, now: float, helping: bool = True) -> bool:
        queue = self.queues[bucket]
        if not queue:
            return False
        if len(queue) >= self.cap_for(bucket) or not all(t.may_wait for t in queue):
            return True
        return now >= self.release(bucket, helping)

    def time_until_ready(self, now: float, buckets: Sequence[Bucket] | None = None) -> float | None:
        """Seconds until some bucket in `buckets` stops holding, or any ticket must expire (in any
        bucket: an idle lane expires tickets a busy lane cannot get to); None: nothing to wait for."""
        allowed = self.settings.edges if buckets is None else tuple(buckets)
        waits = [(self.release(bucket) if all(t.may_wait for t in queue) else now) - now
                 for bucket, queue in self.queues.items() if queue and bucket in allowed]
        expiry = self.until_expiry(now)
        waits += [] if expiry is None else [expiry]
        return max(0.0, min(waits)) if waits else None

    def until_expiry(self, now: float) -> float | None:
        """Seconds until `expire` would take some waiting ticket (0 or less: it would now); None: no
        waiting ticket has a deadline."""
        waits = []
        for bucket, queue in self.queues.items():
            deadlines = [t.deadline for t in queue if t.deadline is not None]
            if deadlines:
                waits.append(min(deadlines) - self._lead(bucket, len(queue)) - now)
        return min(waits) if waits else None

    # -- holding for company -----------------------------------------------------------------------

    def release(self, bucket: Bucket, helping: bool = True) -> float:
        """When a bucket's waiting requests stop holding for company. Holding costs every waiting
        request the hold and pays only by filling batches, which matters only when passes of one
        could not keep up: while arrivals (the worker's median gap) come less often than one per
        two single-request passes (T(1), per lane that can run the bucket now), run at once; once
        T(1) exceeds the mean gap (median over ln 2), hold up to max_wait; in between, hold only
        while the bucket's own arrivals would bring company within max_wait. No cost model: always
        max_wait."""
        oldest = min(t.arrived for t in self.queues[bucket])
        max_wait = self.settings.max_wait
        alone = self.cost.median(bucket=bucket, size=1)
        if alone <= 0:
            return oldest + max_wait
        alone /= self._serving(bucket) if helping else 1
        gap = self.arrivals.median_gap()
        if self.quiet(alone):
            return oldest  # passes of one keep up easily
        if alone < FULL * gap and self.company[bucket].median_gap() > max_wait:
            return oldest  # busy, but no company would come within the hold
        return oldest + max_wait  # fill batches

    def quiet(self, seconds: float, last: int = RECENT) -> bool:
        """Whether a pass of `seconds` is likely over before the next request arrives: it takes
        under BUSY of the worker's median arrival gap (over its `last` arrivals)."""
        return seconds < BUSY * self.arrivals.median_gap(last)

    def _serving(self, bucket: Bucket) -> int:
        """How many lanes can run `bucket`'s passes now: its own and each later lane that is idle
        or already running one of that lane's buckets (later lanes help earlier ones)."""
        owner = self.owner.get(bucket, 0)
        mine = self.lanes[owner].buckets
        return 1 + sum(1 for s in self.lanes[owner + 1:] if s.running is None or s.running in mine)

    # -- lanes helping each other ------------------------------------------------------------------

    def _helped(self, lane: int) -> tuple[Bucket, ...]:
        """Buckets of earlier (shorter) lanes that are busy now: this lane may run their batches
        when it has none of its own."""
        return tuple(b for s in self.lanes[:lane] if s.running is not None for b in s.buckets)

    def _behind(self, lane: int) -> tuple[Bucket, ...]:
        """Buckets of later (longer) lanes that are busy with more than BEHIND passes queued at
        cap: this lane, with nothing of its own or of earlier lanes to run, takes their batches
        rather than idle its share of the cores while they queue."""
        out = ()
        for s in self.lanes[lane + 1:]:
            if s.running is not None and s.typical > 0 and self._backlog(s.buckets) > BEHIND * s.typical:
                out += s.buckets
        return out

    def _backlog(self, buckets: Iterable[Bucket]) -> float:
        """Seconds of passes queued in these buckets, each bucket's requests in batches of its cap,
        each pass a slow one at cap."""
        return sum(math.ceil(len(self.queues[b]) / max(1, self.cap_for(b))) * self._lead(b)
                   for b in buckets if self.queues[b])

    def _others_busy(self, lane: int) -> bool:
        """Whether every other lane is running a pass: only then may this lane merge buckets into
        one pass; with a lane idle their passes would run side by side instead."""
        return all(s.running is not None for j, s in enumerate(self.lanes) if j != lane)

    # -- order and merging -------------------------------------------------------------------------

    def _in_turn(self, bucket: Bucket, now: float) -> list[Ticket]:
        aging = self.settings.priority_aging
        return sorted(self.queues[bucket], key=lambda t: (t.effective_priority(now, aging), t.arrived))

    def _rank(self, bucket: Bucket, now: float) -> tuple:
        queue = self.queues[bucket]
        oldest = min(t.arrived for t in queue)
        starving = now - oldest >= self.settings.age_bound
        best = min(t.effective_priority(now, self.settings.priority_aging) for t in queue)
        # starving buckets first (oldest first), then by priority class, then shortest bucket
        return (0, oldest, 0.0, ()) if starving else (1, 0.0, best, bucket_order(bucket))

    def _merged(self, bucket: Bucket, chosen: list[Ticket], leftover: list[Ticket], allowed: Sequence[Bucket],
                now: float) -> tuple[Bucket, list[Ticket]]:
        """The picked batch, or one pass of a longer bucket among `allowed` that also takes their
        waiting requests, where the cost model says it pays (`merge_edge`) and every ticket in it
        can still meet its deadline."""
        if not self.cost.known or not isinstance(bucket, int):
            return bucket, chosen
        longer = sorted(b for b in allowed if isinstance(b, int) and b > bucket and self.queues[b])
        if not longer:
            return bucket, chosen
        after = [(bucket, len(leftover))] + [(b, len(self.queues[b])) for b in longer]
        merge = merge_edge((bucket, len(chosen)), after, self.cap_for, self.cost)
        if merge is None:
            return bucket, chosen
        edge, size = merge
        merged = (chosen + leftover + [t for b in longer if b <= edge for t in self._in_turn(b, now)])[:size]
        end = now + self.cost.median(bucket=edge, size=size)
        if any(t.deadline is not None and t.deadline < end for t in merged):
            return bucket, chosen
        return edge, merged


# -- when one pass of a longer bucket serves several buckets for less -------------------------------

def split_cost(bucket: Bucket, count: int, cap: int, cost: CostModel) -> list[tuple[float, int]]:
    """The passes `count` requests of a bucket take on their own (batch_sizes), in order, as
    (seconds, requests); an empty list when the cost model does not know one of them."""
    passes = [(cost.median(bucket=bucket, size=size), size) for size in batch_sizes(count, cap)]
    return passes if all(seconds > 0 for seconds, _ in passes) else []


def _apart(alone: float, size: int, groups: Sequence[tuple[Bucket, int]], cap_for: Callable[[Bucket], int],
           cost: CostModel) -> tuple[float, float] | None:
    """The picked pass (`size` requests, `alone` seconds), then each group's (bucket, requests)
    own passes one after another: when the last ends and the requests' summed completion times.
    None when the cost model does not know one of those passes."""
    clock, summed = alone, size * alone
    for group, count in groups:
        passes = split_cost(group, count, cap_for(group), cost)
        if count and not passes:
            return None
        for seconds, requests in passes:
            clock += seconds
            summed += requests * clock
    return clock, summed


def merge_edge(own: tuple[Bucket, int], after: Sequence[tuple[Bucket, int]], cap_for: Callable[[Bucket], int],
               cost: CostModel) -> tuple[Bucket, int] | None:
    """On a CPU a pass has a fixed cost a few more short rows hardly change, so several buckets'
    small batches can cost more than one pass padded to the longest of them. `own`: (bucket, size)
    of the batch the lane picked; `after`: (bucket, requests waiting) that would run after it, the
    picked bucket's leftovers first, then longer buckets, shortest first. Returns (edge, batch size)
    of the merged pass that saves the most summed completion time while also saving lane time, or
    None when none pays. Shapes stay ones warmup covers (edges, powers of two up to the cap)."""
    bucket, size = own
    alone = cost.median(bucket=bucket, size=size)
    if alone <= 0:
        return None
    best, best_saving = None, 0.0
    before = size + after[0][1]  # requests ahead of the first longer bucket
    for last in range(1, len(after)):
        edge, count = after[last]
        batch = next_batch_size(before + count, cap_for(edge))
        reaches = batch > before  # a power of two that fills before this bucket: a shorter edge holds it
        before += count
        merged = cost.median(bucket=edge, size=batch)
        if not reaches or merged <= 0:
            continue
        left, taken = batch - size, []
        for group, waiting in after[: last + 1]:  # the requests the merged pass takes, by group
            taken.append((group, min(waiting, left)))
            left -= taken[-1][1]
        apart = _apart(alone, size, taken, cap_for, cost)
        if apart is None:
            continue
        end, summed = apart
        saving = summed - batch * merged
        if merged < end and saving > best_saving:
            best, best_saving = (edge, batch), saving
    return best


def fits_call(buckets: Sequence[Bucket], policy: Policy, budget: float) -> list[bool]:
    """For each text of a call in order (its bucket), whether it fits in `budget` seconds of its
    lane's work: its share of a slow pass of its bucket at cap."""
    costs = [(policy.owner.get(b, 0), policy.cost.p90(bucket=b, size=policy.cap_for(b)) / policy.cap_for(b))
             for b in buckets]
    return within_budget(costs, [budget] * len(policy.lanes))


def within_budget(costs: Sequence[tuple[int, float]], budgets: Sequence[float]) -> list[bool]:
    """For each request in order, (its lane, the seconds of that lane's work it adds): whether it
    fits in `budgets[lane]` seconds of its lane's work. A lane always takes its first request, so
    a worker never refuses everything."""
    used: dict[int, float] = {}
    fits = []
    for lane, cost in costs:
        so_far = used.get(lane)
        ok = so_far is None or so_far + cost <= budgets[lane] + 1e-9
        if ok:
            used[lane] = (so_far or 0.0) + cost
        fits.append(ok)
    return fits
