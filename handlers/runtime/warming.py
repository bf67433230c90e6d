"""The handler's side of warmup: plan every shape this worker can form, run the plan on the model
before READY, learn caps from out of memory, and keep the latency profile in the model directory.

The plan and the timing rules live in warmup/ (which knows nothing of handlers); this module
wires them to the model (handlers/api.py). No torch here: the model does the passes.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

from tsbatch.handlers.core.buckets import Batch, Item, bucket_label
from tsbatch.handlers.core.isolate import describe, is_out_of_memory
from tsbatch.handlers.core.policy import borrowing_lane
from tsbatch.warmup.plan import Shape, WarmupPlan, plan_shapes
from tsbatch.warmup.profile import PROFILE_FILE, LatencyProfile
from tsbatch.warmup.run import estimate, run_plan

logger = logging.getLogger(__name__)


def warm_up(model, config, edges, sizes_for: Callable[[int], tuple[int, ...]], lanes, model_name: str, model_dir: str,
            startup_timeout, on_oom: Callable, forward: Callable | None = None) -> LatencyProfile:
    """Run every shape the handler can form and return the timings as the profile (kept in
    model_dir for operators and the tuner). `lanes`: [(buckets, threads)], or None in default mode;
    `forward`: how a pass runs (default: the model's own). With `borrow_cores`, every shape is timed
    again on all the lanes' threads (ShapeTiming.threads): twice the warmup."""
    forward = forward or model.forward
    plan = WarmupPlan(tuple(plan_shapes(edges, sizes_for)),
                      config.warmup_repeats, config.warmup_max_repeats)
    default_threads = model.describe().get("torch_threads")  # None: the model has no thread setting
    threads_for = {b: t for lane, t in (lanes or []) for b in lane}
    examples: dict[int, Batch] = {}

    def run_shape(shape: Shape, threads: int | None = None) -> None:
        if shape.bucket not in examples:
            examples[shape.bucket] = example_batch(model, 1, shape.bucket)
        threads = threads or threads_for.get(shape.bucket, default_threads)
        if threads:
            model.use_threads(threads)
        forward(Batch(shape.bucket, examples[shape.bucket].items * shape.batch))

    try:
        seconds = estimate(plan, run_shape)
    except Exception as error:  # noqa: BLE001 - out of memory is for the plan to meet, shape by shape
        if not is_out_of_memory(error):
            raise
        on_oom(None, error)
        seconds = 0.0
    wide = borrowed_threads(config, lanes)
    if wide:
        seconds *= 2  # every shape again on the wide threads: at most as long again
    event = {"event": "estimate", "shapes": len(plan.shapes), "seconds": round(seconds, 1),
             "startup_timeout": startup_timeout}
    if isinstance(startup_timeout, int) and seconds > startup_timeout:
        logger.warning(
            "tsbatch warmup: %d shapes are estimated to take %.0fs, more than startupTimeout=%ss: "
            "the worker may be killed before READY; raise startupTimeout in model-config.yaml "
            "(tsbatch archive sets it from this estimate) or lower max_batch_size",
            len(plan.shapes), seconds, startup_timeout, extra={"tsbatch_warmup": event})
    else:
        logger.info("tsbatch warmup: %d shapes, estimated %.1fs (startupTimeout %ss)",
                    len(plan.shapes), seconds, startup_timeout, extra={"tsbatch_warmup": event})
    environment = {**model.describe(), "lanes": [list(lane) for lane, _ in (lanes or [])],
                   "threads_per_bucket": {bucket_label(b): t for b, t in threads_for.items()} or default_threads}
    profile = LatencyProfile(model=model_name, environment=environment)
    run_plan(plan, run_shape, profile, is_oom=is_out_of_memory, describe=describe, on_oom=on_oom)
    if wide:  # what a pass costs on every lane's threads, for the policy to borrow idle lanes' cores
        run_plan(plan, lambda shape: run_shape(shape, wide), profile, is_oom=is_out_of_memory, describe=describe,
                 on_oom=on_oom, threads=wide)
    if profile.shapes:  # warmup ends on its largest shapes; the likeliest first request is the smallest
        run_shape(Shape(profile.shapes[0].batch, profile.shapes[0].bucket))
    if default_threads:
        model.use_threads(default_threads)
    path = os.path.join(model_dir, PROFILE_FILE)
    profile.save(path)  # atomically: workers of one model share the directory
    logger.info("tsbatch warmup done in %.1fs by worker pid %d; latency profile %s: %s",
                profile.warmup_seconds, os.getpid(), path, profile.to_json().replace("\n", ""),
                extra={"tsbatch_warmup": {"event": "done", "seconds": profile.warmup_seconds, "path": path}})
    return profile


def warm_lane(forward: Callable, batches: Sequence[Batch], repeats: int = 2) -> None:
    """Run a lane's warm batches (each of its buckets at batch 1) on the lane's own thread, before
    READY. warm_up ran every shape on the handler's thread; a lane thread's first passes still pay
    for what is its own (its OpenMP team, its allocator arena): the first request of each length
    after READY took 1.3-1.5x its steady pass here until lanes warmed themselves. The batches are
    made beforehand on the handler's thread: lanes start together, and a fast tokenizer called from
    two threads at once raises ("Already borrowed", transformers 4.57)."""
    for _ in range(repeats):
        for batch in batches:
            forward(batch)


def borrowed_threads(config, lanes) -> int | None:
    """All the worker's lanes' threads together, where `borrow_cores` lets the `borrowing_lane`'s
    passes use them (None: warmup times the lanes' own threads only)."""
    if not getattr(config, "borrow_cores", False) or borrowing_lane([t for _, t in lanes or []]) is None:
        return None
    return sum(threads for _, threads in lanes)


def example_batch(model, size: int, length: int) -> Batch:
    """`size` copies of the model's example input of exactly `length`, as one batch of that bucket."""
    example = model.example(length)
    return Batch(length, tuple(Item(i, "", length, length, example) for i in range(size)))
