"""Lane threads: they execute the policy's plans and answer each ticket on its own Reply.

Each lane loops: ask the policy (handlers/core/policy.py) for its Plan under one lock, run it outside
the lock (the 504s, then the batch through the worker's isolator), answer every ticket as soon as
its batch ends, and tell the policy the pass finished. While every lane is inside a pass, a
watcher thread answers 504 what the policy expires meanwhile. Nothing here decides what runs. A
result that is ready only after its ticket's deadline is answered 504 instead, so no accepted
request is ever answered late.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from tsbatch.handlers.core.errors import DeadlineExceeded, ModelFailed, ServingError
from tsbatch.handlers.core.policy import Plan, Policy, Ticket
from tsbatch.handlers.core.reply import Answer

logger = logging.getLogger(__name__)


def missed_deadline() -> DeadlineExceeded:
    """What a request that could not finish before its deadline is answered (504)."""
    return DeadlineExceeded("this request could not finish before its deadline (the worker is saturated): "
                            "raise X-Deadline-Ms or retry")


def late() -> DeadlineExceeded:
    return DeadlineExceeded("the answer was ready only after this request's deadline (the worker is saturated): "
                            "raise X-Deadline-Ms or retry")


def answer_ticket(ticket: Ticket, answer: Answer) -> None:
    """Settle one ticket's text on its request's Reply (tickets without one: tests, the simulator)."""
    if ticket.reply is not None:
        ticket.reply.settle(ticket.item.part, answer)


class Lanes:
    """One thread per lane of the policy, running its plans through `isolator.execute(batch)`."""

    def __init__(self, policy: Policy, isolator, clock: Callable[[], float] = time.monotonic,
                 on_answer: Callable[[Ticket, Answer], None] | None = None,
                 on_batch: Callable[..., None] | None = None,
                 on_lane_start: Callable[[int], None] | None = None,
                 use_threads: Callable[[int, int], None] | None = None):
        self.policy = policy
        self.isolator = isolator
        self.clock = clock
        self.on_answer = on_answer or (lambda ticket, answer: None)  # metrics, tests: after the reply
        self.on_batch = on_batch or (lambda *args: None)
        self.on_lane_start = on_lane_start or (lambda lane: None)
        # (lane, threads): before a pass whose plan asks for other intra-op threads than the lane's last
        self.use_threads = use_threads or (lambda lane, threads: None)
        self.lane_threads = [state.threads for state in policy.lanes]  # each lane thread's own: only it touches its entry
        self.cond = threading.Condition()  # guards the policy
        self.stopping = False  # guarded by cond
        self.threads = [threading.Thread(target=self._lane, args=(i,), name=f"tsbatch-lane-{i}", daemon=True)
                        for i in range(len(policy.lanes))]
        self._started = [threading.Event() for _ in self.threads]
        self.watcher = threading.Thread(target=self._watch, name="tsbatch-deadlines", daemon=True)

    @property
    def buckets(self) -> list[tuple]:
        """The buckets each lane owns."""
        return [state.buckets for state in self.policy.lanes]

    def start(self) -> "Lanes":
        """Start every lane and return once each has run `on_lane_start` (its threads, its warm
        passes), so a worker is READY only with its lanes ready."""
        for thread in self.threads:
            thread.start()
        for started in self._started:
            started.wait()
        self.watcher.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """End every lane once its pass (if any) is done; what is still queued is not run."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for thread in self.threads + [self.watcher]:
            if thread.is_alive():
                thread.join(timeout)

    def submit(self, tickets: Sequence[Ticket]) -> None:
        """Admit one request's tickets, all or none (Overloaded propagates), and wake the lanes."""
        with self.cond:
            self.policy.admit(tickets, self.clock())
            self.cond.notify_all()

    def free_in(self) -> float:
        with self.cond:
            return self.policy.free_in(self.clock())

    @property
    def busy(self) -> list[bool]:
        with self.cond:
            return self.policy.busy

    def _lane(self, index: int) -> None:
        try:
            self.on_lane_start(index)
        except Exception:  # noqa: BLE001 - a lane that could not warm still serves
            logger.exception("tsbatch lane %s: start failed", index)
        finally:
            self._started[index].set()
        self._until_stopped(lambda: self._step(index), f"lane {index}: step")

    def _watch(self) -> None:
        """Expire what can no longer finish in time while every lane is inside a pass. Only a lane
        that steps expires tickets, so behind long passes a short deadline's 504 waited for the
        first pass to end (1.28 s for 300 ms behind huge inputs, 12-07); an idle lane's own wait
        already covers every deadline, so this one waits only while all lanes are busy."""
        self._until_stopped(self._expire_due, "deadline watcher: round")

    def _until_stopped(self, round_: Callable[[], None], what: str) -> None:
        """Run `round_` again and again until stop(): a lane or the watcher outlives any bug in one round."""
        while not self.stopping:
            try:
                round_()
            except Exception:  # noqa: BLE001
                logger.exception("tsbatch %s failed", what)
                time.sleep(0.01)

    def _expire_due(self) -> None:
        """One round: wait until a ticket falls due (or a submit or pass end), answer what did."""
        with self.cond:
            if self.stopping:
                return
            now = self.clock()
            due = self.policy.until_expiry(now) if all(self.policy.busy) else None
            expired = self.policy.expire(now) if due is not None and due <= 0 else []
            if not expired:
                self.cond.wait(timeout=None if due is None else max(due, 0.001))  # a submit or pass end wakes it
                return
        for ticket in expired:
            self._answer(ticket, Answer(missed_deadline(), 0))

    def _step(self, index: int) -> None:
        with self.cond:
            if self.stopping:
                return
            plan = self.policy.schedule(index, self.clock())
            if plan.idle:
                self.cond.wait(timeout=plan.wait)
                return
            if plan.batch is not None:
                self.cond.notify_all()  # a later lane may now help with what this one leaves queued
        try:
            self._run(plan)
        finally:
            with self.cond:
                self.policy.finished(plan, self.clock())
                self.cond.notify_all()  # a lane waiting to help re-checks who is busy

    def _run(self, plan: Plan) -> None:
        for ticket in plan.expired:
            self._answer(ticket, Answer(missed_deadline(), 0))
        if plan.batch is None:
            return
        if plan.threads != self.lane_threads[plan.lane]:  # the policy lent it idle lanes' cores, or took them back
            self.use_threads(plan.lane, plan.threads)
            self.lane_threads[plan.lane] = plan.threads
        batch, tickets = plan.batch, plan.tickets
        started = self.clock()
        try:
            outcomes, report = self.isolator.execute(batch)
        except Exception as error:  # noqa: BLE001 - isolation itself never raises; belt and braces
            outcomes, report = [ModelFailed(f"internal error: {error}")] * len(tickets), None
        finished = self.clock()
        for ticket, outcome in zip(tickets, outcomes):
            if ticket.deadline is not None and finished > ticket.deadline and not isinstance(outcome, ServingError):
                outcome = late()
            self._answer(ticket, Answer(outcome, len(tickets), batch.bucket, ticket.arrived, started, finished,
                                        plan.threads))
        self.on_batch(batch, tickets, report, started, finished)  # after answering: metrics never delay them

    def _answer(self, ticket: Ticket, answer: Answer) -> None:
        answer_ticket(ticket, answer)
        try:  # a bug in metrics must not cost the answers of the batch's other tickets
            self.on_answer(ticket, answer)
        except Exception:  # noqa: BLE001
            logger.exception("tsbatch: on_answer failed after the request was answered")
