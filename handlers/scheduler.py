"""tsbatch's own scheduler for the scheduler modes (continuous and async): one queue per length
bucket, batches chosen by policy.

A batch leaves a bucket when its token budget is full or its oldest request has held for company
as long as the worker needs batches (handlers/waiting.py: max_wait under load, not at all at
light load). Among ready buckets: higher priority first (a request gains one class per
`priority_aging` seconds waited, so low never starves), then the shortest bucket — unless some
bucket's oldest request has waited `age_bound`, which then goes first. Requests that could no
longer finish by their deadline (now plus the time their own pass takes) leave through `expire`
and are answered 504 at once instead of late.

Pure: no torch, no threads; time comes from the caller (`now`), so tests use a fake clock.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

from tsbatch.handlers.buckets import Batch, Bucket, Item, batch_sizes, bucket_order, next_batch_size
from tsbatch.handlers.errors import BadInput, Overloaded, ServingError
from tsbatch.handlers.merging import merge_edge
from tsbatch.handlers.waiting import Arrivals, release_at

# bucket -> how many lanes can run its passes now (handlers/engine.py); None: one
Lanes = Callable[[Bucket], int] | None


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


@dataclass(frozen=True)
class Answer:
    """What one request got: its result or its error, the size of the pass that computed it, the
    bucket it was padded to (0 when it never ran), and when (monotonic seconds) the handler first
    saw it, its pass started and ended (0 when unknown): x-tsbatch-timing. A request of several
    texts gets its texts' results as one list, or the first failed text's error (stages.Gather)."""

    outcome: Any  # a result (dict or list) or a ServingError
    batch_size: int = 1
    bucket: Bucket = 0
    arrived: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    parts: tuple["Answer", ...] = ()  # a request of several texts: each text's own answer
    envelope: str = ""  # and the shape its results go back in (handlers/envelopes.py)

    @property
    def failed(self) -> bool:
        return isinstance(self.outcome, ServingError)


class Waiter(Protocol):
    """Whoever waits for a ticket's answer (a continuous-mode call, an async-mode coroutine)."""

    def settle(self, ticket: "Ticket", answer: Answer) -> None: ...


@dataclass(eq=False)
class Ticket:
    """A request waiting in the scheduler, and who waits for its answer (`rid`: its request id).
    `may_wait` is False when no other request can reach the worker before this one is answered
    (continuous mode with sibling workers): waiting for company would only add latency."""

    item: Item
    arrived: float
    priority: Priority = Priority.NORMAL
    deadline: float | None = None
    waiter: Waiter | None = None
    rid: str = ""
    may_wait: bool = True

    def effective_priority(self, now: float, aging: float) -> float:
        """The class this ticket counts as now: one whole class better per `aging` seconds waited,
        so tickets of one class tie and the shortest bucket still goes first among them."""
        if aging <= 0:
            return float(self.priority)
        return float(max(0, int(self.priority) - math.floor((now - self.arrived) / aging)))


@dataclass(frozen=True)
class SchedulerPolicy:
    edges: tuple[int, ...]
    max_wait: float  # seconds the oldest request of a bucket may hold for company, at most
    queue_cap: int  # requests waiting in this worker, all buckets together
    age_bound: float  # seconds after which a bucket's oldest request jumps the shortest-first order
    priority_aging: float  # seconds of waiting that raise a request by one priority class


class Scheduler:
    """Holds waiting tickets per bucket and hands out the next batch to run. `pass_time(size,
    bucket)`: seconds of a pass by the latency profile (0 where unknown); without it a bucket's
    oldest request holds `max_wait` for company."""

    def __init__(self, policy: SchedulerPolicy, cap_for: Callable[[Bucket], int],
                 pass_time: Callable[[int, Bucket], float] | None = None):
        self.policy = policy
        self.queues: dict[Bucket, list[Ticket]] = {edge: [] for edge in policy.edges}
        self._cap_for = cap_for  # the worker's one rule for a bucket's largest batch
        self._pass_time = pass_time
        self.arrivals = Arrivals()  # the worker's
        self.company: dict[Bucket, Arrivals] = {edge: Arrivals() for edge in policy.edges}  # each bucket's

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def submit(self, ticket: Ticket) -> None:
        """Queue a ticket, or raise Overloaded when the worker's queue cap is reached."""
        self.submit_all([ticket])

    def submit_all(self, tickets: Sequence[Ticket]) -> None:
        """Queue one request's tickets (one per text), or none of them when they would pass the
        worker's queue cap, which counts texts: raise Overloaded."""
        if len(self) + len(tickets) > self.policy.queue_cap:
            raise Overloaded(
                f"this worker has {len(self)} texts waiting (cap {self.policy.queue_cap}"
                + (f", this request has {len(tickets)}" if len(tickets) > 1 else "") + "): retry shortly"
            )
        for ticket in tickets:
            self.queues[ticket.item.bucket].append(ticket)
        for bucket in {ticket.item.bucket for ticket in tickets}:
            self.company[bucket].arrived(tickets[0].arrived)
        if tickets:
            self.arrivals.arrived(tickets[0].arrived)

    def backlog(self, buckets: Iterable[Bucket], pass_seconds: Callable[[Bucket], float]) -> float:
        """Seconds of passes queued in these buckets: each bucket's waiting requests in batches of
        its cap, each pass `pass_seconds(bucket)` long."""
        return sum(math.ceil(len(self.queues[b]) / max(1, self._cap_for(b))) * pass_seconds(b)
                   for b in buckets if self.queues[b])

    def work(self, buckets: Iterable[Bucket], pass_seconds: Callable[[Bucket, int], float],
             joining: Bucket | None = None) -> float:
        """Seconds until these buckets' queues (and one more request `joining` one of them) have
        run: each bucket's requests in the passes a lane forms (next_batch_size: powers of two up
        to the cap), each as long as `pass_seconds(bucket, size)` says for its size. Unlike
        backlog, a bucket with one request waiting costs a pass of one, not a pass at its cap."""
        return sum(pass_seconds(bucket, size) for bucket in buckets
                   for size in batch_sizes(len(self.queues[bucket]) + (bucket == joining), self._cap_for(bucket)))

    def expire(self, now: float, lead: Callable[[int], float] | None = None) -> list[Ticket]:
        """Remove and return every ticket that cannot finish by its deadline: `lead(bucket)` is
        the time a pass of that bucket takes (0 by default: only deadlines already passed)."""
        expired = []
        for bucket, queue in self.queues.items():
            keep = []
            finish = now + (lead(bucket) if lead else 0.0)
            for ticket in queue:
                (expired if ticket.deadline is not None and finish >= ticket.deadline else keep).append(ticket)
            self.queues[bucket] = keep
        return expired

    def ready(self, bucket: Bucket, now: float, lanes: Lanes = None) -> bool:
        queue = self.queues[bucket]
        if not queue:
            return False
        if len(queue) >= self._cap_for(bucket) or not all(t.may_wait for t in queue):
            return True
        return now >= self.release(bucket, lanes)

    def release(self, bucket: Bucket, lanes: Lanes = None) -> float:
        """When the bucket's waiting requests stop holding for company (handlers/waiting.py);
        `lanes(bucket)`: how many lanes can run its passes now (default one)."""
        queue = self.queues[bucket]
        oldest = min(t.arrived for t in queue)
        if self._pass_time is None:
            return oldest + self.policy.max_wait
        return release_at(oldest, self._pass_time(1, bucket), self.arrivals, self.policy.max_wait,
                          self.company[bucket], lanes(bucket) if lanes else 1)

    def next_batch(self, now: float, buckets: Iterable[int] | None = None, lanes: Lanes = None,
                   merge: bool = True) -> tuple[Batch, list[Ticket]] | None:
        """The batch to run now among `buckets` (default all), with its tickets; None if none is ready.
        `merge`: whether one pass may take several of these buckets' requests where that pays
        (False while another lane is idle: apart, the passes would run side by side)."""
        allowed = self.policy.edges if buckets is None else tuple(buckets)
        ready = [b for b in allowed if self.ready(b, now, lanes)]
        if not ready:
            return None
        bucket = min(ready, key=lambda b: self._rank(b, now))
        queue = self._in_turn(bucket, now)
        chosen = queue[: next_batch_size(len(queue), self._cap_for(bucket))]
        edge = bucket
        if merge:
            edge, chosen = self._merged(bucket, chosen, queue[len(chosen):], allowed, now)
        for ticket in chosen:
            self.queues[ticket.item.bucket].remove(ticket)
        return Batch(edge, tuple(t.item for t in chosen)), chosen

    def _in_turn(self, bucket: Bucket, now: float) -> list[Ticket]:
        aging = self.policy.priority_aging
        return sorted(self.queues[bucket], key=lambda t: (t.effective_priority(now, aging), t.arrived))

    def _merged(self, bucket: Bucket, chosen: list[Ticket], leftover: list[Ticket], allowed: Sequence[Bucket],
                now: float) -> tuple[Bucket, list[Ticket]]:
        """The picked batch, or one pass of a longer bucket of the same call's buckets (a lane's)
        that also takes their waiting requests, where the profile says it pays (handlers/merging.py)
        and every ticket in it can still meet its deadline."""
        if self._pass_time is None or not isinstance(bucket, int):
            return bucket, chosen
        longer = sorted(b for b in allowed if isinstance(b, int) and b > bucket and self.queues[b])
        if not longer:
            return bucket, chosen
        after = [(bucket, len(leftover))] + [(b, len(self.queues[b])) for b in longer]
        merge = merge_edge((bucket, len(chosen)), after, self._cap_for, self._pass_time)
        if merge is None:
            return bucket, chosen
        edge, size = merge
        merged = (chosen + leftover + [t for b in longer if b <= edge for t in self._in_turn(b, now)])[:size]
        end = now + self._pass_time(size, edge)
        if any(t.deadline is not None and t.deadline < end for t in merged):
            return bucket, chosen
        return edge, merged

    def _rank(self, bucket: Bucket, now: float) -> tuple:
        queue = self.queues[bucket]
        oldest = min(t.arrived for t in queue)
        starving = now - oldest >= self.policy.age_bound
        best = min(t.effective_priority(now, self.policy.priority_aging) for t in queue)
        # starving buckets first (oldest first), then by priority class, then shortest bucket
        return (0, oldest, 0.0, ()) if starving else (1, 0.0, best, bucket_order(bucket))

    def time_until_ready(self, now: float, buckets: Sequence[int] | None = None,
                         lead: Callable[[int], float] | None = None, lanes: Lanes = None) -> float | None:
        """Seconds until some bucket in `buckets` becomes ready by age, or any ticket must expire
        (deadline minus `lead`, in any bucket: an idle lane expires tickets a busy lane cannot get to)."""
        allowed = self.policy.edges if buckets is None else tuple(buckets)
        waits = []
        for bucket, queue in self.queues.items():
            if not queue:
                continue
            if bucket in allowed:
                due = self.release(bucket, lanes) if all(t.may_wait for t in queue) else now
                waits.append(due - now)
            ahead = lead(bucket) if lead else 0.0
            waits.extend(t.deadline - ahead - now for t in queue if t.deadline is not None)
        return max(0.0, min(waits)) if waits else None


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
