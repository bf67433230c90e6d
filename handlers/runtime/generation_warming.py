"""The generation handler's warmup: run every prefill shape and decode batch size the engine can
form on the runner before READY, and keep what each cost as the generation profile.

The plan is warmup/generation_profile.py's (prefill_shapes over the settings' prefill_edges,
decode_shapes at its contexts) and the timing rule warmup/run.py's (time_runs: once untimed, then
until two agree), so the encoder's warmup and this one time shapes alike. A decode shape is timed
on KV caches of its context, built by one untimed prefill of `rows` contexts of that length; each
timed decode runs on the same caches (a decode step leaves its input cache as it was).

Out of memory at a shape never fails the load. What ran out is logged, kept in the profile's
environment (`out_of_memory`), and the settings the engine serves with are lowered so that it
never forms that shape again; the plan's shapes those settings cannot form are skipped:
  prefill of rows > 1 at an edge: token_budget becomes what fitted, (rows - 1) x edge (and
    max_running no more than it: every running sequence feeds a token a step);
  prefill of one row at an edge: no context of that edge can run, so kv_bound drops to the edge
    below (longer asks are refused 507 at submit, as any that cannot fit);
  decode of rows at a context: kv_bound is learned down as a step out of memory teaches the
    policy at run time (generation_policy.learned_bound).
No torch and no TorchServe here: the runner does the passes.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from tsbatch.handlers.core.errors import OutOfMemory
from tsbatch.handlers.core.generation_policy import GenerationSettings, learned_bound
from tsbatch.warmup.generation_profile import GENERATION_PROFILE_FILE, GenerationProfile, decode_shapes, prefill_shapes
from tsbatch.warmup.plan import Shape, WarmupPlan
from tsbatch.warmup.run import time_runs

logger = logging.getLogger(__name__)

OVERHEAD_S = 0.002  # a pass's fixed cost in the estimate, as WarmupPlan.estimate_seconds counts it


def warm_up_generation(runner, settings: GenerationSettings, repeats: int, max_repeats: int, model_name: str,
                       model_dir: str, startup_timeout: Any, torch_threads: int | None = None,
                       clock=time.perf_counter) -> tuple[GenerationProfile, GenerationSettings]:
    """Warm every planned shape; returns the profile (also saved in model_dir) and the settings
    to serve with (as given, or lowered by out of memory: see the module docstring)."""
    began = clock()
    prefill = prefill_shapes(settings.prefill_edges, settings.max_running, settings.token_budget)
    decode = decode_shapes(settings.max_running, runner.max_positions)
    _log_estimate(runner, prefill, decode, repeats, startup_timeout, clock)
    profile = GenerationProfile(model=model_name, environment={
        "task": "generation", "model_class": type(runner.lm).__name__, "device": str(runner.device),
        "torch_threads": torch_threads, "token_budget": settings.token_budget, "max_running": settings.max_running,
        "kv_bound": settings.kv_bound, "max_positions": runner.max_positions,
        "kv_bytes_per_token": runner.kv_bytes_per_token, "prefill_edges": list(settings.prefill_edges),
        "decode_contexts": sorted({s.bucket for s in decode}), "warmup_repeats": repeats,
        "warmup_max_repeats": max_repeats, "out_of_memory": []})
    serving = settings
    plan = [("prefill", shape) for shape in prefill] + [("decode", shape) for shape in decode]
    for number, (kind, shape) in enumerate(plan, 1):
        if not formable(kind, shape, serving):
            continue  # lowered by an out-of-memory shape before it: the engine will not form it
        try:
            first_ms, timings = _time(runner, kind, shape, repeats, max_repeats, clock)
        except OutOfMemory as error:
            serving = lowered(kind, shape, serving)
            profile.environment["out_of_memory"].append({"kind": kind, "batch": shape.batch, "bucket": shape.bucket})
            logger.warning("tsbatch warmup: out of memory at %s of %d x %d tokens (%s): serving with token_budget=%d "
                           "max_running=%d kv_bound=%d", kind, shape.batch, shape.bucket, error, serving.token_budget,
                           serving.max_running, serving.kv_bound,
                           extra={"tsbatch_warmup": {"event": "out_of_memory", "kind": kind, "batch": shape.batch,
                                                     "bucket": str(shape.bucket)}})
            continue
        timing = profile.add(kind, shape, first_ms, timings)
        logger.info("tsbatch warmup shape %d of %d: %s %d x %d tokens: first %.1f ms, median %.1f ms (%d runs)",
                    number, len(plan), kind, shape.batch, shape.bucket, first_ms, timing.median_ms, timing.runs,
                    extra={"tsbatch_warmup": {"event": "shape", "kind": kind, "number": number, "of": len(plan),
                                              "batch": shape.batch, "bucket": str(shape.bucket),
                                              "first_ms": round(first_ms, 1), "median_ms": timing.median_ms,
                                              "runs": timing.runs}})
    if profile.prefill:  # warmup ends on its largest shapes; the likeliest first request is the smallest
        smallest = profile.prefill[0]
        try:
            _time(runner, "prefill", Shape(smallest.batch, smallest.bucket), 0, 0, clock)
        except OutOfMemory:
            logger.warning("tsbatch warmup: the smallest prefill ran out of memory on its second visit")
    if serving != settings:
        profile.environment["serving"] = {"token_budget": serving.token_budget, "max_running": serving.max_running,
                                          "kv_bound": serving.kv_bound}
    profile.warmup_seconds = round(clock() - began, 3)
    path = os.path.join(model_dir, GENERATION_PROFILE_FILE)
    profile.save(path)  # atomically: workers of one model share the directory
    logger.info("tsbatch warmup done in %.1fs by worker pid %d; generation profile %s: %s",
                profile.warmup_seconds, os.getpid(), path, profile.to_json().replace("\n", ""),
                extra={"tsbatch_warmup": {"event": "done", "seconds": profile.warmup_seconds, "path": path}})
    return profile, serving


def formable(kind: str, shape: Shape, settings: GenerationSettings) -> bool:
    """Whether the engine can form this shape under `settings` (a prefill of rows at an edge holds
    at least rows x (the edge below + 1) KV-cache tokens; a decode rows x its context)."""
    if shape.batch > settings.max_running:
        return False
    if kind == "decode":
        return shape.batch * shape.bucket <= settings.kv_bound
    below = max((e for e in settings.prefill_edges if e < shape.bucket), default=0)
    fits_budget = shape.batch == 1 or shape.tokens <= settings.token_budget
    return fits_budget and shape.batch * (below + 1) <= settings.kv_bound


def lowered(kind: str, shape: Shape, settings: GenerationSettings) -> GenerationSettings:
    """The settings after this shape ran out of memory (the module docstring's three rules)."""
    if kind == "decode":
        kv_tokens = shape.batch * (shape.bucket + 1)
        return dataclasses.replace(settings, kv_bound=learned_bound(settings.kv_bound, kv_tokens, settings.oom_backoff))
    if shape.batch > 1:
        budget = min(settings.token_budget, (shape.batch - 1) * shape.bucket)
        return dataclasses.replace(settings, token_budget=budget, max_running=min(settings.max_running, budget))
    below = max((e for e in settings.prefill_edges if e < shape.bucket), default=1)
    return dataclasses.replace(settings, kv_bound=max(1, min(settings.kv_bound, below)))


def _time(runner, kind: str, shape: Shape, repeats: int, max_repeats: int, clock) -> tuple[float, list[float]]:
    if kind == "prefill":
        contexts = [runner.example(shape.bucket)] * shape.batch
        return time_runs(lambda: runner.prefill(contexts, pad_to=shape.bucket), repeats, max_repeats, clock)
    tokens = runner.example(shape.bucket + 1)
    built = runner.prefill([tokens[:-1]] * shape.batch)  # untimed: the caches a decode at this context runs on
    rows = [(tokens[-1], result.cache) for result in built]
    return time_runs(lambda: runner.decode(rows), repeats, max_repeats, clock)


def _log_estimate(runner, prefill: list[Shape], decode: list[Shape], repeats: int, startup_timeout: Any,
                  clock) -> None:
    """How long the plan will take, from the warm cost per token of the longest single prefill,
    against TorchServe's startupTimeout (a worker not READY by then is killed)."""
    probe = max((s for s in prefill if s.batch == 1), key=lambda s: s.bucket, default=None)
    seconds = 0.0
    if probe is not None:
        contexts = [runner.example(probe.bucket)]
        try:
            runner.prefill(contexts, pad_to=probe.bucket)
            started = clock()
            runner.prefill(contexts, pad_to=probe.bucket)
            per_token = (clock() - started) / probe.tokens
        except OutOfMemory:
            per_token = 0.0  # the plan meets it shape by shape
        seconds = (WarmupPlan(tuple(prefill), repeats, repeats).estimate_seconds(per_token, OVERHEAD_S)
                   + WarmupPlan(tuple(Shape(s.batch, 1) for s in decode), repeats, repeats).estimate_seconds(
                       per_token, OVERHEAD_S)
                   + sum(s.tokens for s in decode) * per_token)  # each decode shape's untimed prefill
    shapes = len(prefill) + len(decode)
    event = {"event": "estimate", "shapes": shapes, "seconds": round(seconds, 1), "startup_timeout": startup_timeout}
    if isinstance(startup_timeout, int) and seconds > startup_timeout:
        logger.warning("tsbatch warmup: %d generation shapes are estimated to take %.0fs, more than "
                       "startupTimeout=%ss: the worker may be killed before READY; raise startupTimeout in "
                       "model-config.yaml or lower token_budget or max_running", shapes, seconds, startup_timeout,
                       extra={"tsbatch_warmup": event})
    else:
        logger.info("tsbatch warmup: %d generation shapes (%d prefill, %d decode at contexts %s), estimated %.1fs "
                    "(startupTimeout %ss)", shapes, len(prefill), len(decode), sorted({s.bucket for s in decode}),
                    seconds, startup_timeout, extra={"tsbatch_warmup": event})

