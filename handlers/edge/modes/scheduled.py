"""What the scheduler modes (continuous and async) share: the worker's Policy decides, its Lanes
run the plans (handlers/core/policy.py, handlers/runtime/lanes.py), and each request is answered on its own
Reply when its last text's batch ends. Admission reads the request's X-Priority, X-Deadline-Ms and X-Deadline-At;
a full queue, or a deadline the lane cannot meet, answers 503 at once.
"""
from __future__ import annotations

import logging

from tsbatch.handlers.core.buckets import Item
from tsbatch.handlers.core.errors import DeadlineExceeded, Overloaded, ServingError
from tsbatch.handlers.core.policy import Policy, PolicySettings, Priority, Ticket, borrowing_lane, deadline_at
from tsbatch.handlers.core.reply import Answer, Reply
from tsbatch.handlers.edge import backend_socket
from tsbatch.handlers.edge.stages import PRIORITY_HEADER, Call, client_deadline, request_headers
from tsbatch.handlers.runtime.lanes import Lanes
from tsbatch.handlers.runtime.warming import borrowed_threads, example_batch, warm_lane

logger = logging.getLogger(__name__)


def policy_for(worker, lanes: list[tuple[tuple, int]]) -> Policy:
    """The worker's Policy: its configuration, its caps, its cost model and its lanes."""
    return Policy(PolicySettings.of(worker.config, worker.edges), worker.cap_for, worker.cost,
                  [lane for lane, _ in lanes], [t for _, t in lanes])


class ScheduledMode:
    name = "scheduled"

    def __init__(self, worker, lanes: list[tuple[tuple[int, ...], int]]):
        """`lanes`: the buckets each lane serves and the intra-op threads it gets."""
        self.worker = worker
        self.lanes = lanes
        self.warm_batches = [self._warm_batches(buckets) for buckets, _ in lanes]  # here, before the lanes start
        policy = policy_for(worker, lanes)
        logger.info("tsbatch scheduler (%s mode): lanes (buckets, threads) %s, %s", self.name, lanes, policy.settings)
        backend_socket.lock_writes()
        self.engine = Lanes(policy, worker.isolator, on_answer=self._on_answer, on_batch=self._on_batch,
                            on_lane_start=self._on_lane_start, use_threads=self._use_threads).start()

    def close(self) -> None:
        self.engine.stop()

    def admit(self, items: list[Item], context, arrived: float, call: Call, may_wait: bool = True) -> Reply | None:
        """Queue a request's items (one per text) whole, each ticket carrying the request's Reply,
        or answer in `call` why it cannot be (bad headers, full queue, past its deadline): None."""
        index = items[0].index
        try:
            priority, deadline = self._terms(context, index, arrived)
            reply = Reply.of(items, deadline)
            self.engine.submit([Ticket(item, arrived, priority, deadline, reply, may_wait) for item in items])
            return reply
        except ServingError as error:
            if isinstance(error, Overloaded):
                self.worker.metrics.rejected(error.reason)
            elif isinstance(error, DeadlineExceeded):
                self.worker.metrics.deadline_missed(items[0].bucket)
            call.fail(index, error)
            return None

    def _terms(self, context, index: int, now: float) -> tuple[Priority, float]:
        """The request's priority and deadline (monotonic seconds), from its headers and the config."""
        cfg = self.worker.config
        headers = request_headers(context, index)
        priority = Priority.parse(headers.get(PRIORITY_HEADER))
        # the handler's own deadline ends deadline_margin_ms early, so the answer reaches the client in time
        deadline = deadline_at(now, cfg.deadline_ms, cfg.deadline_margin_ms)
        asked = client_deadline(headers, now)
        if asked is not None:  # a client may shorten the deadline, not extend it
            deadline = min(deadline, asked - cfg.deadline_margin_ms / 1000)
        if deadline <= now:  # late already (in TorchServe's queue, say): computing it would help nobody
            raise DeadlineExceeded("the request's deadline had passed when it reached the worker (X-Deadline-At / "
                                   "X-Deadline-Ms, less deadline_margin_ms)")
        return priority, deadline

    def _on_answer(self, ticket: Ticket, answer: Answer) -> None:
        if isinstance(answer.outcome, DeadlineExceeded):
            self.worker.metrics.deadline_missed(ticket.item.bucket)

    def _on_batch(self, batch, tickets, report, started: float, finished: float) -> None:
        for ticket in tickets:
            self.worker.metrics.queue_wait(batch.bucket, ticket.priority.name.lower(), started - ticket.arrived)
        self.worker.after_batch(batch, report)

    def _warm_batches(self, buckets) -> list:
        """A lane's warm batches (each bucket it can run, at batch 1), made on the handler's thread."""
        w = self.worker
        if not w.config.warmup:
            return []
        return [example_batch(w.model, 1, b) for b in buckets if b in w.edges and b not in w.unfit]

    def _on_lane_start(self, index: int) -> None:
        """On the lane's own thread, before READY: its warm passes, on every thread count the policy
        may give it (all the lanes' for the borrowing lane with borrow_cores), ending on its own."""
        threads = self.lanes[index][1]
        wide = borrowed_threads(self.worker.config, self.lanes)
        borrows = wide and index == borrowing_lane([t for _, t in self.lanes])
        for count in ([wide] if borrows else []) + [threads]:
            self._use_threads(index, count)
            warm_lane(self.worker.forward, self.warm_batches[index])

    def _use_threads(self, index: int, threads: int) -> None:
        self.worker.model.use_threads(threads, background=index > 0)
