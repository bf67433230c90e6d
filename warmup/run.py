"""Run a warmup plan: each shape once untimed, then until two timings agree (or max repeats).

Warmup goes through the same path as traffic: `run_shape` runs a planned Batch of synthetic
requests (real tokenizer output of the bucket's length) on the runner. The clock is injected.
Each step is logged with a `tsbatch_warmup` record attribute (a dict), so a caller in the same
process (`tsbatch profile`) follows progress without reading the prose.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from tsbatch.warmup.plan import Shape, WarmupPlan, bucket_label, bucket_tokens, stable
from tsbatch.warmup.profile import LatencyProfile, ShapeTiming

logger = logging.getLogger(__name__)


def estimate(plan: WarmupPlan, run_shape: Callable[[Shape], None], clock=time.perf_counter) -> float:
    """Seconds the plan will take, from the warm cost per token of its largest single-request shape."""
    probe = max((s for s in plan.shapes if s.batch == 1), key=lambda s: bucket_tokens(s.bucket), default=plan.shapes[-1])
    run_shape(probe)
    started = clock()
    run_shape(probe)
    seconds_per_token = (clock() - started) / probe.tokens
    return plan.estimate_seconds(seconds_per_token)


def run_plan(plan: WarmupPlan, run_shape: Callable[[Shape], None], profile: LatencyProfile,
             clock=time.perf_counter, is_oom: Callable[[BaseException], bool] = lambda error: False,
             describe: Callable[[BaseException], str] = repr,
             on_oom: Callable[[Shape, BaseException], None] = lambda shape, error: None,
             threads: int | None = None) -> LatencyProfile:
    """Warm and time every shape. A shape that runs out of memory (`is_oom`) caps its bucket at
    the largest batch that fit (profile.oom_caps; 0 when not even one request did), the bucket's
    larger shapes are skipped, `on_oom` frees what it can, and warmup goes on: out of memory never
    fails a load. `threads`: `run_shape` runs on that many intra-op threads rather than the
    profile's own, and the timings say so (ShapeTiming.threads); a second call adds to the profile."""
    began = clock()
    total = len(plan.shapes)
    for number, shape in enumerate(plan.shapes, 1):
        if shape.bucket in profile.oom_caps:
            continue  # a smaller batch of this bucket already ran out of memory
        try:
            timing, first_ms = _time_shape(plan, shape, run_shape, profile, clock, threads)
        except Exception as error:  # noqa: BLE001 - only out of memory is survivable here
            if not is_oom(error):
                raise
            fitted = max((t.batch for t in profile.shapes if t.bucket == shape.bucket), default=0)
            profile.oom_caps[shape.bucket] = fitted
            logger.warning("tsbatch warmup: out of memory at batch %d x %s tokens (%s): bucket %s is capped at "
                           "%d%s", shape.batch, bucket_label(shape.bucket), describe(error), bucket_label(shape.bucket), fitted,
                           "" if fitted else ": its requests will get 507")
            on_oom(shape, error)
            continue
        event = {"event": "shape", "number": number, "of": total, "batch": shape.batch, "bucket": bucket_label(shape.bucket),
                 "first_ms": round(first_ms, 1), "median_ms": timing.median_ms, "runs": timing.runs, "threads": threads}
        logger.info("tsbatch warmup shape %d of %d: batch %d x %s tokens: first %.1f ms, median %.1f ms (%d runs)",
                    number, total, shape.batch, bucket_label(shape.bucket), first_ms, timing.median_ms, timing.runs,
                    extra={"tsbatch_warmup": event})
    profile.warmup_seconds = round(profile.warmup_seconds + clock() - began, 3)
    return profile


def _time_shape(plan: WarmupPlan, shape: Shape, run_shape: Callable[[Shape], None], profile: LatencyProfile,
                clock, threads: int | None = None) -> tuple[ShapeTiming, float]:
    first_ms, timings = time_runs(lambda: run_shape(shape), plan.repeats, plan.max_repeats, clock)
    return profile.add(shape.batch, shape.bucket, first_ms, timings, threads), first_ms


def time_runs(run: Callable[[], None], repeats: int, max_repeats: int,
              clock=time.perf_counter) -> tuple[float, list[float]]:
    """Warmup's one timing rule: `run` once untimed, then timed until the last two agree within
    10% (at least `repeats`, at most `max_repeats`). Returns the first run's ms and the timings."""
    started = clock()
    run()
    first_ms = (clock() - started) * 1000
    timings: list[float] = []
    while len(timings) < repeats or (not stable(timings) and len(timings) < max_repeats):
        started = clock()
        run()
        timings.append((clock() - started) * 1000)
    return first_ms, timings
