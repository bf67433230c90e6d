"""tsbatch's TorchServe handler for Hugging Face encoders (embedding, sequence and token classification).

TorchServe imports this file by its basename from the archive root, next to the `handlers/` and
`warmup/` packages, and instantiates its one class. `handle` is a short shell over the stages
parse -> tokenize -> bucket -> plan batches -> execute (with isolation) -> answer.
It never raises on input: every request gets a result or its own JSON error and status.

Three modes, chosen by model-config.yaml:
- default TorchServe batching: the frontend's batch is split by bucket, shortest bucket first;
- scheduler modes: tsbatch's scheduler and lane threads in each worker (handlers/scheduler.py,
  handlers/engine.py) form the batches, and each request is answered when its own batch ends.
  They differ in how requests reach the worker:
  - continuous (`continuousBatching: true`, the shipped default): the frontend calls `handle` again
    and again with every request the worker holds plus new arrivals; each call returns as soon as
    some request is done (or after `poll_ms`) and answers only the finished ones: the others stay
    with the frontend and come back in the next call. A worker that dies fails its requests with
    TorchServe's "Worker died." and is restarted and warmed like in default mode.
  - async (`asyncCommunication: true`): one coroutine per request. TorchServe 0.12 cannot
    restart an async worker that died (see the README), so it is opt-in.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import replace
from http import HTTPStatus
from typing import Any

from handlers.buckets import Item, batch_cap, bucket_for, check_edges, default_edges, plan_batches
from handlers.config import HandlerConfig
from handlers.errors import (BadInput, ConfigError, DeadlineExceeded, ModelFailed, OutOfMemory, Overloaded,
                             ServingError)
from handlers.isolate import Isolator, OomCaps, is_out_of_memory
from handlers.memory import OOM_CAPS_FILE, apply_budget, keep_caps, load_caps
from handlers.metrics import Metrics
from handlers.parse import parse_text, row_value
from handlers.scheduler import Priority, Scheduler, SchedulerPolicy, Ticket, within_budget
from handlers.siblings import Siblings, fit_threads, usable_cores

logger = logging.getLogger(__name__)

JSON = "application/json"
BATCH_SIZE_HEADER = "x-tsbatch-batch-size"  # requests in the batch (frontend batch, or tsbatch's in async mode)
WORKER_HEADER = "x-tsbatch-worker"  # pid of the worker process that answered
PADDED_HEADER = "x-tsbatch-padded-to"  # tokens the request was padded to (its bucket's edge)
PRIORITY_HEADER = "x-priority"
DEADLINE_HEADER = "x-deadline-ms"
RETRY_AFTER_SECONDS = "1"


class EncoderHandler:
    """Serves one encoder model; configured by the `handler:` section of model-config.yaml."""

    def __init__(self):
        self.initialized = False
        self.config: HandlerConfig | None = None
        self.runner = None
        self.edges: tuple[int, ...] = ()
        self.isolator: Isolator | None = None
        self.engine = None
        self.mode = "default"
        # continuous mode: request id -> Ticket still running, request id -> (outcome, batch size) done
        self.running: dict[str, Ticket] = {}
        self.finished: dict[str, tuple[Any, int]] = {}
        self.finished_cond = threading.Condition()

    def initialize(self, context) -> None:
        from handlers.runner import ModelRunner  # torch stays at the edge, loaded only here

        started = time.monotonic()
        yaml_config = context.model_yaml_config or {}
        model_dir = context.system_properties.get("model_dir")
        self.config = HandlerConfig.from_yaml(yaml_config.get("handler"))
        # joined first: siblings see this worker long before it polls (continuous mode), and
        # workers of one model share the cores
        self.siblings = Siblings(model_dir).join()
        self._fit_threads(yaml_config)
        gpu_id = context.system_properties.get("gpu_id")
        self.runner = ModelRunner(self.config, os.path.join(model_dir, self.config.model_dir),
                                  int(gpu_id) if isinstance(gpu_id, (int, str)) and str(gpu_id).isdigit() else None)
        max_length = self.runner.max_length
        self.edges = check_edges(self.config.buckets or default_edges(max_length), max_length)
        if self.config.max_batch_tokens < self.edges[-1]:
            raise ConfigError(
                f"handler.max_batch_tokens ({self.config.max_batch_tokens}) must hold one request of the "
                f"largest bucket ({self.edges[-1]} tokens): raise it or lower max_length"
            )
        self.metrics = Metrics(getattr(context, "metrics", None), context.model_name, self._gpu_sampler())
        self._apply_memory_budget()
        # caps learned from out of memory by this model's workers so far (handlers/memory.py)
        self.caps_file = os.path.join(model_dir, OOM_CAPS_FILE)
        known = load_caps(self.caps_file)
        self.unfit = {bucket for bucket, cap in known.items() if cap == 0}  # not one request fits: 507
        self.isolator = Isolator(self._timed_run, self.config.isolation_budget,
                                 OomCaps({b: c for b, c in known.items() if c > 0}, on_learn=self._learned))
        self.mode = serving_mode(yaml_config)
        self.batch_size = int(context.system_properties.get("batch_size") or 1)  # the frontend's batchSize
        timeout = yaml_config.get("responseTimeout")
        self.response_timeout = timeout if isinstance(timeout, int) and timeout > 1 else 120
        lanes = self._lanes() if self.mode != "default" else None
        self.profile = None
        if self.config.warmup:
            self.profile = self._warm_up(context.model_name, model_dir, yaml_config, lanes)
            self.metrics.warmup(self.profile)
        for bucket in self.edges:  # every bucket's cap, learned from out of memory or not
            self.metrics.cap(bucket, 0 if bucket in self.unfit else self.cap_for(bucket))
        self.runner.mark_ready()
        if lanes is not None:
            self.engine = self._start_engine(lanes)
        if self.config.fault_injection.enabled:
            logger.warning("fault injection is ON: %s", self.config.fault_injection)
        logger.info(
            "tsbatch loaded task=%s mode=%s buckets=%s max_batch_tokens=%d %s in %.1fs",
            self.config.task.value, self.mode, list(self.edges),
            self.config.max_batch_tokens, self.runner.describe(), time.monotonic() - started,
        )
        self.initialized = True

    def _fit_threads(self, yaml_config: dict) -> None:
        """Never more intra-op threads than this worker's share of the cores (handlers/siblings.py)."""
        planned = yaml_config.get("minWorkers")
        workers = max(1 + self.siblings.others(), planned if isinstance(planned, int) else 1)
        threads, why = fit_threads(self.config.torch_threads, usable_cores(), workers)
        if why:
            logger.warning("tsbatch threads: %s", why)
        self.config = replace(self.config, torch_threads=threads)

    def _apply_memory_budget(self) -> None:
        budget = self.config.memory_budget
        if budget is None:
            return
        device = self.runner.device
        if device.type != "cuda":
            logger.warning("tsbatch: handler.memory_budget=%s is not enforced on %s: torch has no per-process "
                           "limit for host memory (out of memory still lowers caps, never fails the load)",
                           budget, device.type)
            return
        import torch

        logger.info("tsbatch memory budget: %s", apply_budget(budget, torch.cuda, device.index or 0))

    def _learned(self, bucket: int, cap: int) -> None:
        """A cap learned while serving: keep it for this model's workers (a restarted one too)."""
        keep_caps(self.caps_file, {bucket: cap}, "learned while serving")
        self.metrics.cap(bucket, cap)

    def _free_memory(self, shape, error) -> None:
        """After out of memory: give cached device memory back so the next shapes start clean."""
        if self.runner.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def _gpu_sampler(self):
        device = self.runner.device
        if device.type != "cuda":
            return None
        from handlers.metrics import nvml_sampler

        return nvml_sampler([device.index or 0])

    def _timed_run(self, batch):
        """One forward pass, timed for tsbatch_forward_seconds (failed passes count too)."""
        started = time.perf_counter()
        try:
            return self.runner.run(batch)
        finally:
            self.metrics.forward(batch.bucket, time.perf_counter() - started)

    def _after_batch(self, batch, report) -> None:
        real = sum(item.tokens for item in batch.items)
        self.metrics.batch(batch.bucket, batch.size, real, report)
        if report is not None and report.oom_splits:
            self.metrics.cap(batch.bucket, self.cap_for(batch.bucket))

    def _on_scheduled_batch(self, batch, tickets, report, started: float, finished: float) -> None:
        for ticket in tickets:
            self.metrics.queue_wait(batch.bucket, ticket.priority.name.lower(), started - ticket.arrived)
        self._after_batch(batch, report)

    def _deliver(self, ticket: Ticket, outcome: Any, batch_size: int) -> None:
        if isinstance(outcome, DeadlineExceeded):
            self.metrics.deadline_missed(ticket.item.bucket)
        _resolve(ticket, outcome, batch_size)

    def _lanes(self) -> list[tuple[tuple[int, ...], int]]:
        """The scheduler modes' lanes (buckets each serves) and the intra-op threads each one gets:
        a share of the worker's, so two lanes busy at once never oversubscribe the cores (OpenMP
        teams that outnumber the cores spin against each other: warmup of 3 workers x 2 lanes x
        2 threads on 2 cores ran 5x slower than with 1 thread a lane)."""
        from handlers.engine import split_lanes

        lanes = split_lanes(self.edges, self.config.long_lane_from)
        threads = max(1, self.runner.describe()["torch_threads"] // len(lanes))
        return [(lane, threads) for lane in lanes]

    def _warm_up(self, model_name: str, model_dir: str, yaml_config: dict, lanes) -> Any:
        """Run every shape the handler can form before READY and keep the timings as the profile."""
        from warmup.plan import Shape as WarmupShape
        from warmup.plan import WarmupPlan, plan_shapes
        from warmup.profile import PROFILE_FILE, LatencyProfile
        from warmup.run import estimate, run_plan

        cfg = self.config
        edges = [edge for edge in self.edges if edge not in self.unfit]
        plan = WarmupPlan(tuple(plan_shapes(edges, self.cap_for)), cfg.warmup_repeats, cfg.warmup_max_repeats)
        default_threads = self.runner.describe()["torch_threads"]
        threads_for = {b: t for lane, t in (lanes or []) for b in lane}

        def run_shape(shape) -> None:
            self.runner.use_threads(threads_for.get(shape.bucket, default_threads))
            self.runner.run(self.runner.synthetic_batch(shape.batch, shape.bucket))

        try:
            seconds = estimate(plan, run_shape)
        except Exception as error:  # noqa: BLE001 - out of memory is for the plan to meet, shape by shape
            if not is_out_of_memory(error):
                raise
            self._free_memory(None, error)
            seconds = 0.0
        startup_timeout = yaml_config.get("startupTimeout", 120)
        if isinstance(startup_timeout, int) and seconds > startup_timeout:
            logger.warning(
                "tsbatch warmup: %d shapes are estimated to take %.0fs, more than startupTimeout=%ss: "
                "the worker may be killed before READY; raise startupTimeout in model-config.yaml "
                "(tsbatch archive sets it from this estimate) or lower max_batch_size",
                len(plan.shapes), seconds, startup_timeout)
        else:
            logger.info("tsbatch warmup: %d shapes, estimated %.1fs (startupTimeout %ss)",
                        len(plan.shapes), seconds, startup_timeout)
        environment = {**self.runner.describe(), "lanes": [list(l) for l, _ in (lanes or [])],
                       "threads_per_bucket": threads_for or default_threads}
        profile = LatencyProfile(model=model_name, environment=environment)
        run_plan(plan, run_shape, profile, on_oom=self._free_memory)
        self._learn_from_warmup(profile)
        if profile.shapes:  # warmup ends on its largest shapes; the likeliest first request is the smallest
            run_shape(WarmupShape(profile.shapes[0].batch, profile.shapes[0].bucket))
        self.runner.use_threads(default_threads)
        path = os.path.join(model_dir, PROFILE_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        profile.save(tmp)
        os.replace(tmp, path)  # workers of one model share the directory: replace atomically
        logger.info("tsbatch warmup done in %.1fs by worker pid %d; latency profile %s: %s",
                    profile.warmup_seconds, os.getpid(), path, profile.to_json().replace("\n", ""))
        return profile

    def _learn_from_warmup(self, profile) -> None:
        """Caps warmup learned from out of memory hold from now on, for this model's workers."""
        if not profile.oom_caps:
            return
        for bucket, cap in profile.oom_caps.items():
            if cap == 0:
                self.unfit.add(bucket)
            else:
                self.isolator.caps.caps[bucket] = min(cap, self.isolator.caps.caps.get(bucket, cap))
        keep_caps(self.caps_file, profile.oom_caps, "learned at warmup")
        logger.warning("tsbatch warmup: batch caps learned from out of memory (bucket: largest batch that fits; "
                       "0: none, those requests get 507): %s", profile.oom_caps)

    def _start_engine(self, lanes):
        from handlers import socket_guard
        from handlers.engine import Engine

        socket_guard.install()
        cfg = self.config
        policy = SchedulerPolicy(
            edges=self.edges, max_batch_tokens=cfg.max_batch_tokens, max_wait=cfg.max_wait_ms / 1000,
            queue_cap=cfg.queue_cap, age_bound=cfg.age_bound_ms / 1000,
            priority_aging=cfg.priority_aging_ms / 1000,
        )
        logger.info("tsbatch scheduler (%s mode): lanes (buckets, threads) %s, policy %s", self.mode, lanes, policy)
        return Engine(Scheduler(policy, self.cap_for), self.isolator, [lane for lane, _ in lanes],
                      deliver=self._deliver, on_batch=self._on_scheduled_batch,
                      on_lane_start=lambda i: self.runner.use_threads(lanes[i][1], background=i > 0),
                      pass_seconds=self._pass_seconds, typical_pass=self._typical_pass)

    def _pass_seconds(self, bucket: int) -> float:
        """How long a pass of this bucket takes at its cap (p90 from warmup's latency profile; 0
        without one): a request that cannot finish by its deadline gets 504 before it runs."""
        timing = self.profile.lookup(self.cap_for(bucket), bucket) if self.profile else None
        return timing.p90_ms / 1000 if timing else 0.0

    def _typical_pass(self, size: int, bucket: int) -> float:
        """The median time of a pass of this shape in warmup (0 without a profile or the shape)."""
        timing = self.profile.lookup(size, bucket) if self.profile else None
        return timing.median_ms / 1000 if timing else 0.0

    def cap_for(self, bucket: int) -> int:
        """Largest batch of this bucket: the token budget, max_batch_size and the tuned
        batch_caps, lowered by any out-of-memory cap learned since."""
        cap = min(batch_cap(bucket, self.config.max_batch_tokens), self.config.max_batch_size,
                  self.config.batch_caps.get(bucket, self.config.max_batch_size))
        return self.isolator.caps.cap(bucket, cap)

    def handle(self, data: list, context):
        self.metrics.handler_call()
        if self.mode == "async":
            return self._handle_async(data, context)  # TorchServe awaits the coroutine
        if self.mode == "continuous":
            return self._handle_continuous(data, context)
        outcomes: list[Any] = [None] * len(data)
        padded = [0] * len(data)
        try:
            items = self.tokenize(self.parse(data, context, outcomes), outcomes)
            for batch in plan_batches(items, self.cap_for):
                results, report = self.isolator.execute(batch)
                self._after_batch(batch, report)
                for item, outcome in zip(batch.items, results):
                    outcomes[item.index], padded[item.index] = outcome, batch.bucket
        except Exception as error:  # noqa: BLE001 - a bug here must not fail the worker
            outcomes = _fail_unanswered(outcomes, error)
        return self.answer(outcomes, context, [len(data)] * len(data), padded)

    async def _handle_async(self, data: list, context) -> list:
        """Async mode: never raises (one raise fails every request in flight on the worker)."""
        arrived = time.monotonic()  # the deadline counts from here: parsing and tokenizing are inside it
        outcomes: list[Any] = [None] * len(data)
        sizes = [1] * len(data)
        padded = [0] * len(data)
        try:
            loop = asyncio.get_running_loop()
            items = self.tokenize(self.parse(data, context, outcomes), outcomes)
            waiting = []
            for item in items:
                future = loop.create_future()
                if self._admit(item, context, arrived, _settle_on(loop, future), outcomes):
                    waiting.append((item, future))
            for item, future in waiting:
                outcomes[item.index], sizes[item.index] = await future
                padded[item.index] = item.bucket
        except Exception as error:  # noqa: BLE001
            outcomes = _fail_unanswered(outcomes, error)
        bodies = self.answer(outcomes, context, sizes, padded)
        _reply_async(bodies, outcomes, context)
        return [""] * len(data)

    def _handle_continuous(self, data: list, context) -> list:
        """Continuous mode: take in new requests, wait until one of this call's requests is done
        (at most poll_ms), answer the finished ones and leave the rest to come back next call.

        TorchServe replies for the indexes left in `context.request_ids`; an index taken out of it
        gets no reply, so the frontend keeps that request and sends it again with the next call.
        Never raises: a raise would fail every request the worker holds."""
        arrived = time.monotonic()
        ids = context.request_ids
        outcomes: list[Any] = [None] * len(data)
        sizes = [1] * len(data)
        padded = [0] * len(data)
        try:
            alone = self.siblings.alone()
            new = [i for i in range(len(data)) if ids.get(i) not in self.running]
            items = self.tokenize(self.parse(data, context, outcomes, new), outcomes)
            mine = [ids.get(i) for i in range(len(data))]
            if not alone and len(data) >= max(2, self.batch_size // 4):  # a backlog in TorchServe's queue
                items = self._fit_call(items, outcomes)
            with self.finished_cond:  # held while admitting, so no lane can finish a ticket not yet in `running`
                for item in items:
                    rid = ids[item.index]
                    ticket = self._admit(item, context, arrived, lambda o, n, rid=rid: self._finish(rid, o, n),
                                         outcomes, may_wait=alone)
                    if ticket is not None:
                        self.running[rid] = ticket
                if alone and all(outcome is None for outcome in outcomes):
                    self._wait_for_one(mine)
                if not (alone and self.siblings.alone()):
                    self._wait_for_all(mine)
                for index, rid in enumerate(mine):
                    if rid in self.finished:
                        outcomes[index], sizes[index] = self.finished.pop(rid)
                        padded[index] = self.running.pop(rid).item.bucket
        except Exception as error:  # noqa: BLE001
            outcomes = _fail_unanswered(outcomes, error)
            with self.finished_cond:
                for rid in ids.values():
                    self.running.pop(rid, None)
                    self.finished.pop(rid, None)
        for index, outcome in enumerate(outcomes):
            if outcome is None:
                del ids[index]  # still running: no reply now, the frontend sends it again
        return self.answer(outcomes, context, sizes, padded)

    def _fit_call(self, items: list[Item], outcomes: list) -> list[Item]:
        """Continuous mode with siblings, a call that found a backlog (a quarter of batchSize or more:
        the frontend gathers a call for 1 ms, so these had queued): take in only the work that can
        end within max_call_ms per lane (a request's share of its bucket's pass at cap, from the
        latency profile; a lane always takes its first request) and answer the rest 503 at once. A
        call is answered whole, and while every worker is inside a call new requests wait in
        TorchServe's queue, where the handler cannot see or shed them: short calls keep that wait
        short and drain that queue faster than it fills."""
        lanes = self.engine.lanes
        lane_of = {bucket: i for i, lane in enumerate(lanes) for bucket in lane}
        costs = [(lane_of[item.bucket], self._pass_seconds(item.bucket) / self.cap_for(item.bucket))
                 for item in items]
        budgets = [self.config.max_call_ms / 1000] * len(lanes)
        taken = []
        for item, fits in zip(items, within_budget(costs, budgets)):
            if fits:
                taken.append(item)
                continue
            self.metrics.rejected("call_full")
            outcomes[item.index] = Overloaded(
                f"this worker took in {self.config.max_call_ms} ms of work with this call: retry shortly")
        return taken

    def _wait_for_one(self, mine: list) -> None:
        """Continuous mode, the model's only worker: wait until one of this call's requests is
        done, then answer it. With nothing done, the call goes back to the frontend for new
        arrivals only when they could start: after `poll_ms` while a lane is idle, else `poll_ms`
        before the first busy lane's pass should end (by the latency profile), so what arrived
        during that pass is taken in, or shed, in time for the lane's next batch. TorchServe calls
        a worker that holds requests back to back, so this wait is its only pacing. Called under
        finished_cond."""
        poll = self.config.poll_ms / 1000
        hold = max(poll, self.engine.free_in() - poll)
        self.finished_cond.wait_for(lambda: any(rid in self.finished for rid in mine), timeout=hold)

    def _wait_for_all(self, mine: list) -> None:
        """Continuous mode with siblings: answer every request of the call in this one reply.
        TorchServe re-polls a worker holding requests under the model lock that an idle sibling
        keeps while it waits for the next arrival, so a request left with the frontend could
        wait for that arrival (handlers/siblings.py). Bounded by the requests' deadlines: what is
        still running a second past the last one is answered 504 here. Called under finished_cond."""
        running = [self.running[rid] for rid in mine if rid in self.running]
        deadlines = [t.deadline for t in running if t.deadline is not None]
        # and inside TorchServe's responseTimeout, past which it would kill the worker
        timeout = self.response_timeout - 1.0
        if deadlines and len(deadlines) == len(running):
            timeout = min(timeout, max(deadlines) - time.monotonic() + 1.0)
        done = self.finished_cond.wait_for(
            lambda: all(rid in self.finished for rid in mine if rid in self.running), timeout=timeout)
        if not done:
            late = DeadlineExceeded("this request could not finish before its deadline (the worker is saturated): "
                                    "raise X-Deadline-Ms or retry")
            for rid in mine:
                if rid in self.running and rid not in self.finished:
                    self.finished[rid] = (late, 0)

    def _finish(self, rid: str, outcome: Any, batch_size: int) -> None:
        """From a lane thread: a continuous-mode request is done; wake the call waiting for it."""
        with self.finished_cond:
            if rid in self.running:
                self.finished[rid] = (outcome, batch_size)
                self.finished_cond.notify_all()

    def _admit(self, item: Item, context, arrived: float, settle, outcomes: list, may_wait: bool = True) -> Ticket | None:
        """Queue the item in the scheduler, or record why it cannot be (bad headers, full queue)."""
        try:
            ticket = self._ticket(item, context, arrived, settle)
            ticket.may_wait = may_wait
            self.engine.submit([ticket])
            return ticket
        except ServingError as error:
            if isinstance(error, Overloaded):
                self.metrics.rejected("queue_full")
            outcomes[item.index] = error
            return None

    def _ticket(self, item: Item, context, now: float, settle) -> Ticket:
        headers = _headers(context, item.index)
        priority = Priority.parse(headers.get(PRIORITY_HEADER))
        deadline_ms = self.config.deadline_ms
        if headers.get(DEADLINE_HEADER) is not None:
            try:
                asked = int(headers[DEADLINE_HEADER])
            except ValueError:
                raise BadInput(f"X-Deadline-Ms must be a whole number of milliseconds, got {headers[DEADLINE_HEADER]!r}") from None
            if asked < 1:
                raise BadInput(f"X-Deadline-Ms must be positive, got {asked}")
            deadline_ms = min(deadline_ms, asked)  # a client may shorten the deadline, not extend it
        # the handler's own deadline ends deadline_margin_ms early, so the answer reaches the client in time
        return Ticket(item, now, priority, now + max(0, deadline_ms - self.config.deadline_margin_ms) / 1000,
                      payload=settle)

    # -- stages
    def parse(self, data: list, context, outcomes: list, rows=None) -> list[tuple[int, str]]:
        texts = []
        for index in range(len(data)) if rows is None else rows:
            row = data[index]
            try:
                texts.append((index, parse_text(row_value(row), _content_type(context, index))))
            except ServingError as error:
                outcomes[index] = error
        return texts

    def tokenize(self, texts: list[tuple[int, str]], outcomes: list) -> list[Item]:
        items = []
        for index, text in texts:
            try:
                tokens, encoding = self.runner.tokenize(text)
            except ServingError as error:
                outcomes[index] = error
                continue
            except Exception as error:  # noqa: BLE001 - e.g. lone surrogates the tokenizer rejects
                outcomes[index] = BadInput(f"text cannot be tokenized ({type(error).__name__}: {error})")
                continue
            bucket = bucket_for(tokens, self.edges)
            if bucket in self.unfit:
                outcomes[index] = OutOfMemory(
                    f"inputs of up to {bucket} tokens (this request has {tokens}) do not fit in this worker's "
                    f"memory even one at a time (learned from out of memory): send a shorter text")
                continue
            items.append(Item(index, text, tokens, bucket, encoding))
        return items

    def answer(self, outcomes: list, context, batch_sizes: list[int], padded: list[int]) -> list:
        """Write each request's status once, here, and return one body per request.

        Rows beyond the context's requests (KServe's envelope hands one request's instances as
        several rows) get their bodies but no per-request headers: there is no request to set."""
        bodies = []
        requests = len(getattr(context, "request_processor", None) or outcomes)
        for index, outcome in enumerate(outcomes):
            if outcome is None:  # continuous mode: still running, not answered in this call
                bodies.append("")
                continue
            if index >= requests:
                bodies.append(json.dumps(outcome.to_body() if isinstance(outcome, ServingError) else outcome))
                continue
            context.set_response_content_type(index, JSON)
            context.set_response_header(index, BATCH_SIZE_HEADER, str(batch_sizes[index]))
            if padded[index]:
                context.set_response_header(index, PADDED_HEADER, str(padded[index]))
            context.set_response_header(index, WORKER_HEADER, str(os.getpid()))
            if isinstance(outcome, ServingError):
                context.set_response_status(outcome.status, HTTPStatus(outcome.status).phrase, idx=index)
                if isinstance(outcome, Overloaded):
                    context.set_response_header(index, "Retry-After", RETRY_AFTER_SECONDS)
                bodies.append(json.dumps(outcome.to_body()))
            else:
                bodies.append(json.dumps(outcome))
        return bodies


def _reply_async(bodies: list, outcomes: list, context) -> None:
    """Send the answers of an async-mode call so that TorchServe 0.12's frontend forgets each job.

    Its async frontend drops a job only on a reply marked ts_stream_next=false, and a streamed
    reply with a status >= 400 loses its body. So: results go out as one streamed chunk (200)
    whose final reply is the empty list `handle` returns; errors go out as plain full responses
    (status and JSON body; the frontend closes that connection), and their final reply carries
    ts_stream_next=false explicitly so the frontend forgets them too.
    """
    from ts.handler_utils.utils import send_intermediate_predict_response
    from ts.protocol.otf_message_handler import create_predict_response

    ids = context.request_ids
    ok = {i: rid for i, rid in ids.items() if not isinstance(outcomes[i], ServingError)}
    failed = {i: rid for i, rid in ids.items() if i not in ok}
    if ok:
        send_intermediate_predict_response(bodies, ok, "tsbatch", 200, context)
    if failed:
        context.cl_socket.sendall(create_predict_response(bodies, failed, "tsbatch", 200, context))
        for index in failed:
            context.set_response_header(index, "ts_stream_next", "false")


def serving_mode(yaml_config: dict) -> str:
    """"async", "continuous" or "default", from the frontend keys of model-config.yaml."""
    if yaml_config.get("asyncCommunication") is True and yaml_config.get("continuousBatching") is True:
        raise ConfigError("model-config.yaml sets both asyncCommunication and continuousBatching: TorchServe "
                          "cannot do both; keep continuousBatching (tsbatch's default) or asyncCommunication")
    if yaml_config.get("asyncCommunication") is True:
        return "async"
    if yaml_config.get("continuousBatching") is True:
        return "continuous"
    return "default"


def _resolve(ticket: Ticket, outcome: Any, batch_size: int = 1) -> None:
    """Hand a ticket's outcome, from a lane thread, to whoever waits for it."""
    ticket.payload(outcome, batch_size)


def _settle_on(loop, future):
    """Async mode: resolve `future` on its event loop."""
    def settle(outcome: Any, batch_size: int) -> None:
        def set_result():
            if not future.done():
                future.set_result((outcome, batch_size))

        loop.call_soon_threadsafe(set_result)

    return settle


def _fail_unanswered(outcomes: list, error: Exception) -> list:
    logger.exception("tsbatch pipeline failed")
    failure = ModelFailed(f"internal error in tsbatch: {type(error).__name__}: {error}")
    return [o if o is not None else failure for o in outcomes]


def _headers(context, index: int) -> dict:
    """The request's headers with lower-cased names (clients and proxies differ in case)."""
    try:
        headers = context.get_all_request_header(index) or {}
    except Exception:  # noqa: BLE001 - a context without headers means "none"
        return {}
    return {str(k).lower(): v for k, v in headers.items()}


def _content_type(context, index: int) -> str | None:
    """The content type TorchServe recorded for the request's payload parameter."""
    headers = _headers(context, index)
    for name in ("body", "data"):
        if isinstance(headers.get(name), dict):
            return headers[name].get("content-type")
    value = headers.get("content-type")
    return value if isinstance(value, str) else None
