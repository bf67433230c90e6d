"""What the scheduler modes (continuous and async) share: tsbatch's scheduler and lane threads in
the worker (handlers/scheduler.py, handlers/engine.py) form the batches, and each request is
answered when its own batch ends. Admission reads the request's X-Priority and X-Deadline-Ms;
a full queue answers 503 at once.
"""
from __future__ import annotations

import logging

from tsbatch.handlers import socket_guard
from tsbatch.handlers.buckets import Item
from tsbatch.handlers.engine import Engine
from tsbatch.handlers.errors import BadInput, DeadlineExceeded, Overloaded, ServingError
from tsbatch.handlers.scheduler import Answer, Priority, Scheduler, SchedulerPolicy, Ticket, Waiter
from tsbatch.handlers.stages import DEADLINE_HEADER, PRIORITY_HEADER, Call, request_headers

logger = logging.getLogger(__name__)


class ScheduledMode:
    name = "scheduled"

    def __init__(self, worker, lanes: list[tuple[tuple[int, ...], int]]):
        """`lanes`: the buckets each lane serves and the intra-op threads it gets."""
        self.worker = worker
        self.lanes = lanes
        cfg = worker.config
        policy = SchedulerPolicy(
            edges=worker.edges, max_wait=cfg.max_wait_ms / 1000, queue_cap=cfg.queue_cap,
            age_bound=cfg.age_bound_ms / 1000, priority_aging=cfg.priority_aging_ms / 1000,
        )
        logger.info("tsbatch scheduler (%s mode): lanes (buckets, threads) %s, policy %s", self.name, lanes, policy)
        socket_guard.install()
        self.engine = Engine(Scheduler(policy, worker.cap_for, worker.typical_pass), worker.isolator, [lane for lane, _ in lanes],
                             deliver=self.deliver, on_batch=self._on_batch, on_lane_start=self._on_lane_start,
                             pass_seconds=worker.pass_seconds, typical_pass=worker.typical_pass).start()

    def close(self) -> None:
        self.engine.stop()

    def deliver(self, ticket: Ticket, answer: Answer) -> None:
        """From a lane thread: hand the answer to whoever waits for the ticket."""
        if isinstance(answer.outcome, DeadlineExceeded):
            self.worker.metrics.deadline_missed(ticket.item.bucket)
        ticket.waiter.settle(ticket, answer)

    def admit(self, items: list[Item], context, arrived: float, waiter: Waiter, call: Call, rid: str = "",
              may_wait: bool = True) -> list[Ticket]:
        """Queue a request's items (one per text) in the scheduler, all or none, or answer in `call`
        why it cannot be (bad headers, full queue, past its deadline)."""
        index = items[0].index
        try:
            tickets = [self._ticket(item, context, arrived) for item in items]
            for ticket in tickets:
                ticket.waiter, ticket.rid, ticket.may_wait = waiter, rid, may_wait
            self.engine.submit(tickets)
            return tickets
        except ServingError as error:
            if isinstance(error, Overloaded):
                self.worker.metrics.rejected(error.reason)
            call.fail(index, error)
            return []

    def _ticket(self, item: Item, context, now: float) -> Ticket:
        cfg = self.worker.config
        headers = request_headers(context, item.index)
        priority = Priority.parse(headers.get(PRIORITY_HEADER))
        deadline_ms = cfg.deadline_ms
        if headers.get(DEADLINE_HEADER) is not None:
            try:
                asked = int(headers[DEADLINE_HEADER])
            except ValueError:
                raise BadInput(f"X-Deadline-Ms must be a whole number of milliseconds, got {headers[DEADLINE_HEADER]!r}") from None
            if asked < 1:
                raise BadInput(f"X-Deadline-Ms must be positive, got {asked}")
            deadline_ms = min(deadline_ms, asked)  # a client may shorten the deadline, not extend it
        # the handler's own deadline ends deadline_margin_ms early, so the answer reaches the client in time
        return Ticket(item, now, priority, now + max(0, deadline_ms - cfg.deadline_margin_ms) / 1000)

    def _on_batch(self, batch, tickets, report, started: float, finished: float) -> None:
        for ticket in tickets:
            self.worker.metrics.queue_wait(batch.bucket, ticket.priority.name.lower(), started - ticket.arrived)
        self.worker.after_batch(batch, report)

    def _on_lane_start(self, index: int) -> None:
        self.worker.model.use_threads(self.lanes[index][1], background=index > 0)

