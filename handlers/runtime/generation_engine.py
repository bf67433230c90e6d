"""The generation engine's loop: one thread that plans a step (GenerationPolicy), runs it on
the model (GenerationRunner) and settles it, over and over while anything is live.

Joining sequences prefill in one call per length edge (GenerationSettings.prefill_edges), each
padded to its edge, so every prefill is a shape warmup ran before READY.
A step that raises is run again in halves until each failing sequence is alone: it gets its own
500, every other sequence keeps the token it would have got alone (NaN from one sequence fails
it the same way, without a re-run). A step that runs out of memory advances nobody: the scheduler
learns a lower KV-cache bound and the next plan preempts down to it, so the step is retried
without the youngest or lowest-priority sequences. Tokens reach the waiter as they are made
(`waiter.token(seq, token)`), the end once (`waiter.settle(seq)`: `seq.tokens`, or `seq.error`).

Fault injection (chaos testing, off unless `handler.fault_oom_substring` is set): a sequence
submitted with `fault_oom=True` makes the first step that holds it run out of memory, once, as a
step too big for the device would (raised where the runner would raise it, so the same recovery runs).
Metrics: `metrics` (handlers/edge/metrics.py's Metrics, or None) hears each settled step and each
sequence that ends.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any, Callable, Protocol

from tsbatch.handlers.core.errors import ModelFailed, ModelUnavailable, OutOfMemory, ServingError
from tsbatch.handlers.core.generation_policy import (GenerationRequest, GenerationPolicy, Seq, Status, StepOutcome,
                                                     StepPlan, model_failed, produced_nan)
from tsbatch.handlers.models.generation_runner import GenerationRunner, RowResult, SequenceCache

logger = logging.getLogger(__name__)

IDLE_WAIT = 1.0  # seconds an idle loop sleeps before looking again (a submit wakes it at once)
BLOCKED_WAIT = 0.01  # seconds a loop with sequences live but none to run waits before planning again


class Waiter(Protocol):
    """Whoever waits for a sequence: told each new token, then its end once."""

    def token(self, seq: Seq, token: int) -> None: ...

    def settle(self, seq: Seq) -> None: ...


class AsyncWaiter:
    """A sequence's tokens and end, handed from the engine's thread to a coroutine on `loop`:
    `await next_event()` gives ("token", id) for each token, then ("end", seq) once; with a
    `timeout`, None when nothing came in that long (nothing is lost: the event stays queued)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.events: collections.deque = collections.deque()
        self.arrived = asyncio.Event()

    def token(self, seq: Seq, token: int) -> None:
        self.loop.call_soon_threadsafe(self._put, ("token", token))

    def settle(self, seq: Seq) -> None:
        self.loop.call_soon_threadsafe(self._put, ("end", seq))

    def _put(self, event: tuple[str, Any]) -> None:
        self.events.append(event)
        self.arrived.set()

    async def next_event(self, timeout: float | None = None) -> tuple[str, Any] | None:
        while not self.events:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        return self.events.popleft()


class GenerationEngine:
    """Runs the policy's plans on the runner; `step()` is one iteration, `start()` a thread of them."""

    def __init__(self, policy: GenerationPolicy, runner: GenerationRunner,
                 clock: Callable[[], float] = time.monotonic, name: str = "tsbatch-generation", metrics: Any = None):
        self.policy = policy
        self.runner = runner
        self.clock = clock
        self.metrics = metrics
        self.fault_oom: set[Seq] = set()  # fault injection: each makes its first step run out of memory
        self.cancelled = 0  # sequences whose client went away while they were live
        self.cond = threading.Condition()  # guards the policy; the model runs outside it
        self.caches: dict[Seq, SequenceCache] = {}  # the loop's own: running sequences' KV caches
        self.splits = 0  # parts of steps that raised and were re-run in halves
        self.steps = 0  # steps that ran the model
        self.tokens = 0  # tokens made, all sequences together
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def submit(self, request: GenerationRequest, waiter: Any = None, fault_oom: bool = False) -> Seq:
        """Queue a request; Overloaded or OutOfMemory propagate at once (the policy's refusals).
        `fault_oom`: fault injection, its first step runs out of memory."""
        with self.cond:
            seq = self.policy.submit(request, waiter)
            if fault_oom:
                self.fault_oom.add(seq)
            self.cond.notify_all()
        return seq

    def cancel(self, seq: Seq) -> bool:
        """The client went away: its seat is freed now, its cache at the next step boundary."""
        with self.cond:
            live = self.policy.cancel(seq, self.clock())
            if live:
                self.cancelled += 1
                self.fault_oom.discard(seq)
        return live

    def start(self) -> "GenerationEngine":
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop after its step; every sequence still live is answered 503."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout)
        with self.cond:
            left = self.policy.waiting + self.policy.running
            for seq in left:
                self.policy.cancel(seq, self.clock())
                seq.status, seq.error = Status.FAILED, ModelUnavailable("the worker is stopping: retry")
        self.caches.clear()
        for seq in left:
            _tell(seq, "settle")

    def step(self) -> StepPlan | None:
        """Plan, run and settle one step; None when nothing was live."""
        with self.cond:
            plan = self.policy.schedule(self.clock())
        self._drop_caches()  # preempted, expired, refused, or cancelled since the last step
        for seq in plan.ended:
            _tell(seq, "settle")
        if not plan.runs:
            if plan.ended or plan.preempted:
                self._report(plan.ended)
                return plan
            return None
        outcome, caches = self._run(plan)
        self.steps += 1
        self.tokens += len(outcome.tokens) - len(outcome.eos)  # an end-of-sequence token is no part of an answer
        with self.cond:
            ended = self.policy.finished(plan, outcome, self.clock())
        for seq in plan.runs:
            if seq.status is Status.RUNNING and seq in caches:
                self.caches[seq] = caches[seq]
            if seq in outcome.tokens and seq not in outcome.eos and seq.status in (Status.RUNNING, Status.FINISHED):
                _tell(seq, "token", outcome.tokens[seq])
        self._drop_caches()
        for seq in ended:
            _tell(seq, "settle")
        self._report(list(plan.ended) + list(ended))
        return plan

    def stats(self) -> dict[str, int]:
        """What the metrics report: sequences running and waiting, KV-cache tokens in use against the
        bound, and counts since start (steps, tokens made, preemptions, out-of-memory steps, isolation splits)."""
        with self.cond:
            s = self.policy
            return {"running": len(s.running), "waiting": len(s.waiting), "kv_tokens": s.kv_in_use,
                    "kv_bound": s.kv_bound, "steps": self.steps, "tokens": self.tokens, "preemptions": s.preemptions,
                    "out_of_memory_steps": s.out_of_memory_steps, "splits": self.splits, "cancelled": self.cancelled}

    def _report(self, ended: list[Seq]) -> None:
        """Tell the metrics what this step changed; a metrics error is logged, never the loop's end."""
        if self.metrics is None:
            return
        try:
            self.metrics.generation_step(self.stats(), ended)
        except Exception:  # noqa: BLE001
            logger.exception("tsbatch generation: metrics failed")

    def _drop_caches(self) -> None:
        """Keep the caches of running sequences only (the loop's thread alone touches them)."""
        for seq in [s for s in self.caches if s.status is not Status.RUNNING]:
            del self.caches[seq]

    def _run(self, plan: StepPlan) -> tuple[StepOutcome, dict[Seq, SequenceCache]]:
        """The step's outcome (tokens for the sequences that ran, failures found alone, or out of
        memory) and the grown caches of those that ran."""
        results: dict[Seq, RowResult] = {}
        failed: dict[Seq, ServingError] = {}
        try:
            self._isolate(list(plan.runs), set(plan.prefill), results, failed)
        except OutOfMemory:
            return StepOutcome(out_of_memory=True), {}
        tokens, eos = {}, set()
        for seq, result in results.items():
            if result.token is None:
                failed[seq] = produced_nan()
                continue
            tokens[seq] = result.token
            if result.token in self.runner.eos_ids:
                eos.add(seq)
        caches = {seq: result.cache for seq, result in results.items() if seq in tokens}
        return StepOutcome(tokens=tokens, eos=frozenset(eos), failed=failed), caches

    def _isolate(self, seqs: list[Seq], prefill: set[Seq], results: dict[Seq, RowResult],
                 failed: dict[Seq, ServingError]) -> None:
        """Run these sequences' step into `results`; where it raises, run each half apart until the
        failing ones are alone. OutOfMemory propagates: the whole step is then out of memory."""
        try:
            results.update(self._run_part(seqs, prefill))
        except OutOfMemory:
            raise
        except Exception as error:  # one of these sequences makes the model raise
            if len(seqs) == 1:
                logger.info("tsbatch generation: request %s failed alone: %r", seqs[0].rid, error)
                failed[seqs[0]] = model_failed(error)
                return
            self.splits += 1
            half = len(seqs) // 2
            self._isolate(seqs[:half], prefill, results, failed)
            self._isolate(seqs[half:], prefill, results, failed)

    def _run_part(self, seqs: list[Seq], prefill: set[Seq]) -> dict[Seq, RowResult]:
        injected = [seq for seq in seqs if seq in self.fault_oom]
        if injected:
            self.fault_oom.difference_update(injected)
            raise OutOfMemory(f"fault injection: a generation step of {len(seqs)} sequences ran out of memory "
                              f"(request {injected[0].rid})")
        joining = [seq for seq in seqs if seq in prefill]
        decoding = [seq for seq in seqs if seq not in prefill]
        missing = [seq.rid for seq in decoding if seq not in self.caches]
        if missing:
            raise RuntimeError(f"the plan decodes {len(missing)} sequences with no KV cache (first: {missing[0]})")
        rows = self.runner.decode([(seq.tokens[-1], self.caches[seq]) for seq in decoding])
        joined = []
        for edge, group in self._by_edge(joining).items():  # one prefill per edge: rows x edge, a warmed shape
            rows += self.runner.prefill([tuple(seq.request.prompt) + tuple(seq.tokens) for seq in group], pad_to=edge)
            joined += group
        if len(rows) != len(seqs):
            raise RuntimeError(f"the runner returned {len(rows)} results for {len(seqs)} sequences")
        return dict(zip(decoding + joined, rows))

    def _by_edge(self, joining: list[Seq]) -> dict[int, list[Seq]]:
        """Joining sequences by the length edge their contexts pad to, shortest first (no edges: one
        group, padded to its longest)."""
        settings = self.policy.settings
        groups: dict[int, list[Seq]] = {}
        for seq in joining:
            groups.setdefault(settings.padded(seq.context) if settings.prefill_edges else 0, []).append(seq)
        return dict(sorted(groups.items()))

    def _loop(self) -> None:
        while True:
            with self.cond:
                if self.stopping:
                    return
            try:
                plan = self.step()
            except Exception:  # a bug here must not end the loop: every live sequence is failed instead
                logger.exception("tsbatch generation: step failed")
                self._fail_all(ModelFailed("the generation engine failed on this step; see the worker log"))
                plan = None
            if plan is None or not plan.runs:
                with self.cond:
                    if not self.stopping:  # a submit wakes it at once
                        self.cond.wait(IDLE_WAIT if not len(self.policy) else BLOCKED_WAIT)

    def _fail_all(self, error: ServingError) -> None:
        with self.cond:
            left = self.policy.waiting + self.policy.running
            for seq in left:
                self.policy.cancel(seq, self.clock())
                seq.status, seq.error = Status.FAILED, error
        self.caches.clear()
        for seq in left:
            _tell(seq, "settle")


def _tell(seq: Seq, what: str, *args) -> None:
    """Call the waiter's `what` if it has one; a waiter that raises is logged, never the loop's end."""
    method = getattr(seq.waiter, what, None)
    if method is None:
        return
    try:
        method(seq, *args)
    except Exception:
        logger.exception("tsbatch generation: the waiter of %s failed on %s", seq.rid, what)
