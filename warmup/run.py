"""Run a warmup plan: each shape once untimed, then until two timings agree (or max repeats).

Warmup goes through the same path as traffic: `run_shape` runs a planned Batch of synthetic
requests (real tokenizer output of the bucket's length) on the runner. The clock is injected.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from warmup.plan import Shape, WarmupPlan, stable
from warmup.profile import LatencyProfile

logger = logging.getLogger(__name__)


def estimate(plan: WarmupPlan, run_shape: Callable[[Shape], None], clock=time.perf_counter) -> float:
    """Seconds the plan will take, from the warm cost per token of its largest single-request shape."""
    probe = max((s for s in plan.shapes if s.batch == 1), key=lambda s: s.bucket, default=plan.shapes[-1])
    run_shape(probe)
    started = clock()
    run_shape(probe)
    seconds_per_token = (clock() - started) / probe.tokens
    return plan.estimate_seconds(seconds_per_token)


def run_plan(plan: WarmupPlan, run_shape: Callable[[Shape], None], profile: LatencyProfile,
             clock=time.perf_counter, log: Callable[..., None] = logger.info) -> LatencyProfile:
    began = clock()
    total = len(plan.shapes)
    for number, shape in enumerate(plan.shapes, 1):
        started = clock()
        run_shape(shape)
        first_ms = (clock() - started) * 1000
        timings: list[float] = []
        while len(timings) < plan.repeats or (not stable(timings) and len(timings) < plan.max_repeats):
            started = clock()
            run_shape(shape)
            timings.append((clock() - started) * 1000)
        timing = profile.add(shape.batch, shape.bucket, first_ms, timings)
        log("tsbatch warmup shape %d of %d: batch %d x %d tokens: first %.1f ms, median %.1f ms (%d runs)",
            number, total, shape.batch, shape.bucket, first_ms, timing.median_ms, timing.runs)
    profile.warmup_seconds = round(clock() - began, 3)
    return profile
