"""Default mode: TorchServe's own batching. The frontend's batch is split by bucket, shortest
bucket first, each planned batch run with isolation; every request is answered in the call."""
from __future__ import annotations

import time

from tsbatch.handlers.core.buckets import plan_batches
from tsbatch.handlers.core.reply import Answer, Reply
from tsbatch.handlers.edge.stages import Call, answer, by_request, prepare


class DefaultMode:
    name = "default"

    def __init__(self, worker):
        self.worker = worker

    def handle(self, data: list, context) -> list:
        """Never raises: a raise would fail every request of the frontend's batch."""
        w = self.worker
        call = Call.of(len(data), batch_size=len(data))
        arrived = time.monotonic()
        try:
            items = prepare(w.model, w.edges, w.unfit, data, context, call, limits=w.config)
            replies = {request[0].index: Reply.of(request) for request in by_request(items)}
            for batch in plan_batches(items, w.cap_for):
                started = time.monotonic()
                results, report = w.isolator.execute(batch)
                finished = time.monotonic()
                w.after_batch(batch, report)
                for item, outcome in zip(batch.items, results):
                    replies[item.index].settle(item.part, Answer(outcome, len(data), batch.bucket, arrived, started, finished))
            for index, reply in replies.items():
                call.settle(index, reply.answer())
        except Exception as error:  # noqa: BLE001 - a bug here must not fail the worker
            call.fail_unanswered(error)
        return answer(call, context)

    def close(self) -> None:
        """Nothing runs outside a call."""
