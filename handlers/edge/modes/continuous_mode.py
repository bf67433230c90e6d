"""Continuous mode (`continuousBatching: true`, the shipped default).

TorchServe calls `handle` again and again with every request the worker holds plus new arrivals.
A request is answered when its index is still in `context.request_ids` after the call; an index
taken out gets no reply, so the frontend keeps that request and sends it again with the next call.
- The model's only worker answers what is done and goes back for new arrivals, paced by its lanes
  (`_wait_for_one`). So does a worker whose siblings are all still loading (a scale-up, a restart).
- A worker with serving siblings answers every request of a call in that one reply (`_wait_for_all`):
  TorchServe 0.12 re-polls a worker holding requests under the model-wide lock an idle sibling
  keeps while it waits for the next arrival (handlers/edge/siblings.py), and, when every worker is busy,
  sheds from full calls what cannot end within `max_call_ms` (`_fit_call`).
A worker that dies fails its requests with TorchServe's "Worker died." and is restarted and warmed.
"""
from __future__ import annotations

import threading
import time

from tsbatch.handlers.core.buckets import Item
from tsbatch.handlers.core.errors import Overloaded
from tsbatch.handlers.core.policy import call_hold, fits_call
from tsbatch.handlers.core.reply import Answer, Reply
from tsbatch.handlers.edge.modes.scheduled import ScheduledMode
from tsbatch.handlers.edge.stages import Call, answer, by_request, prepare
from tsbatch.handlers.runtime.lanes import missed_deadline


# TorchServe re-sends every request a worker holds with each call (its id and all its HTTP
# headers, encoded by the frontend and read back field by field by the worker), so a reply while
# holding N requests costs N re-sends: CPU taken from the passes on a saturated machine
# (measured: docs/experiments.md, "reply pace").
PACE_PER_HELD_S = 0.001  # a reply waits this long per request it leaves held ...
PACE_MAX_S = 0.03  # ... up to this long, after the previous one


def reply_pace(held: int) -> float:
    """Seconds the only worker's next reply waits after its previous one while it holds `held`
    requests: re-sends stay near a thousand a second at any load, and a worker holding a request or
    two (light load) replies within a millisecond or two."""
    return min(PACE_MAX_S, max(0, held) * PACE_PER_HELD_S)


class ContinuousMode(ScheduledMode):
    name = "continuous"

    def __init__(self, worker, lanes):
        super().__init__(worker, lanes)
        self.running: dict[str, Reply] = {}  # request id -> its Reply, not yet returned to the frontend
        self.cond = threading.Condition()  # a Reply that is done notifies it
        self.replied = float("-inf")  # time.monotonic() of the last return to the frontend

    def _wake(self) -> None:
        """A Reply is done (from a lane thread): wake the call waiting for it."""
        with self.cond:
            self.cond.notify_all()

    def _done(self, rid) -> bool:
        reply = self.running.get(rid)
        return reply is not None and reply.done()

    def handle(self, data: list, context) -> list:
        """Take in new requests, wait as `_wait_for_one`/`_wait_for_all` say, answer the finished
        ones. Never raises: a raise would fail every request the worker holds."""
        w = self.worker
        arrived = time.monotonic()
        ids = context.request_ids
        call = Call.of(len(data))
        mine = [ids.get(i) for i in range(len(data))]
        w.siblings.in_call(True)
        try:
            alone = w.siblings.alone()
            new = [i for i, rid in enumerate(mine) if rid not in self.running]
            items = prepare(w.model, w.edges, w.unfit, data, context, call, new, limits=w.config)
            if not alone and len(data) >= max(2, w.batch_size // 4) and not w.siblings.any_idle():
                items = self._fit_call(items, call)  # a backlog in TorchServe's queue, every worker busy
            with self.cond:
                for request in by_request(items):
                    reply = self.admit(request, context, arrived, call, may_wait=alone)
                    if reply is not None:
                        self.running[mine[request[0].index]] = reply
                        reply.on_done(self._wake)
                if alone and all(a is None for a in call.answers):
                    self._wait_for_one(mine)
                if not (alone and w.siblings.alone()):
                    self._wait_for_all(mine)
                for index, rid in enumerate(mine):
                    if self._done(rid):
                        call.settle(index, self.running.pop(rid).answer())
        except Exception as error:  # noqa: BLE001
            call.fail_unanswered(error)
            with self.cond:
                for rid in mine:
                    self.running.pop(rid, None)
        finally:
            w.siblings.in_call(False)
        for index, answered in enumerate(call.answers):
            if answered is None:
                del ids[index]  # still running: no reply now, the frontend sends it again
        bodies = answer(call, context)
        self.replied = time.monotonic()
        return bodies

    def _wait_for_one(self, mine: list) -> None:
        """The model's only worker: wait until one of this call's requests is done, then answer it.
        With nothing done, the call goes back to the frontend for new arrivals only when they could
        start: after `poll_ms` while a lane is idle, else `poll_ms` before the first busy lane's
        pass should end (by the latency profile), so what arrived during that pass is taken in, or
        shed, in time for the lane's next batch. TorchServe calls a worker that holds requests back
        to back, so this wait is its only pacing. Replies are also at least `reply_pace` apart, by
        how many requests the next call re-sends, but never past a finished request's own deadline
        (which already keeps `deadline_margin_ms` for the reply's way out). Called under cond."""
        poll = self.worker.config.poll_ms / 1000
        hold = call_hold(poll, self.engine.free_in())
        self.cond.wait_for(lambda: any(self._done(rid) for rid in mine), timeout=hold)
        while (left := self._reply_due(mine) - time.monotonic()) > 0:
            self.cond.wait(timeout=left)  # a lane that settles a request wakes it to look again

    def _reply_due(self, mine: list) -> float:
        """When the next reply may go: `reply_pace` after the previous one, or a finished request's
        deadline if that comes first. Called under cond."""
        deadlines = [self.running[rid].deadline for rid in mine if self._done(rid) and self.running[rid].deadline]
        held = sum(1 for reply in self.running.values() if not reply.done())
        return min([self.replied + reply_pace(held)] + deadlines)

    def _wait_for_all(self, mine: list) -> None:
        """A worker with siblings: answer every request of the call in this one reply, bounded by
        the requests' deadlines (what still runs a second past the last one is answered 504) and
        by TorchServe's responseTimeout, past which it would kill the worker. Called under cond."""
        running = [self.running[rid] for rid in mine if rid in self.running]
        deadlines = [g.deadline for g in running if g.deadline is not None]
        timeout = self.worker.response_timeout - 1.0
        if deadlines and len(deadlines) == len(running):
            timeout = min(timeout, max(deadlines) - time.monotonic() + 1.0)
        done = self.cond.wait_for(lambda: all(r.done() for r in running), timeout=timeout)
        if not done:
            for reply in running:
                reply.force(Answer(missed_deadline(), 0))

    def _fit_call(self, items: list[Item], call: Call) -> list[Item]:
        """A call with siblings that found a backlog (a quarter of batchSize or more: the frontend
        gathers a call for 1 ms, so these had queued) while every sibling is inside a call too (an
        idle sibling would be polling, so a big call then is a burst, not a queue that grows, and
        it is served whole): take in only the work that can end within
        max_call_ms per lane (a request's share of its bucket's pass at cap, from the latency
        profile; a lane always takes its first request) and answer the rest 503 at once. A call is
        answered whole, and while every worker is inside a call new requests wait in TorchServe's
        queue, where the handler cannot see or shed them: short calls keep that wait short."""
        w = self.worker
        fits = fits_call([item.bucket for item in items], self.engine.policy, w.config.max_call_ms / 1000)
        shed = {item.index for item, ok in zip(items, fits) if not ok}
        for index in sorted(shed):  # a request of several texts is taken in whole or not at all
            w.metrics.rejected("call_full")
            call.fail(index, Overloaded(
                f"this worker took in {w.config.max_call_ms} ms of work with this call: retry shortly"))
        return [item for item in items if item.index not in shed]
