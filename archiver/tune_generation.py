"""Serving settings for the built-in generation handler (`tsbatch archive --task generation`),
each with its reason, as archiver/tune.py chooses the encoder's: the same Tuning, so the archive's
model-config.yaml comments, config.properties' tuned block and the CLI's report come from one path.

What applies is taken from tune.py (async mode's frontend keys, workers for the machine, the
frontend queue's floor). What does not is skipped, and `SKIPPED` says why: bucket tuning (batch
caps per length bucket, max_wait_ms, the simulator) is the encoder's, since the generation engine
schedules token by token under token_budget and kv_bound; and no generation profile exists yet
(`tsbatch profile` does not time prefill and decode steps), so the engine's settings are its
defaults, or what --handler-config set.

Pure: no torch, no clock, no files.
"""
from __future__ import annotations

import math
from dataclasses import fields
from typing import Iterable

from tsbatch.archiver.tune import MIN_JOB_QUEUE, Choice, Machine, TuneError, Tuning, _mode
from tsbatch.handlers.edge.config import SETTING, FrontendConfig
from tsbatch.handlers.edge.generation_api import GenerationConfig

SKIPPED = ("not tuned from a profile: bucket tuning (batch caps per length bucket, max_wait_ms, the simulator) is the "
           "encoder's and does not apply, since the generation engine schedules token by token under token_budget "
           "and kv_bound; and no generation profile exists yet (tsbatch profile does not time prefill and decode "
           "steps), so the engine's settings are its defaults or the handler configuration's")
MODE = "async"  # the only mode the generation handler serves in


def plan_generation(machine: Machine, config: GenerationConfig, fixed: Iterable[str] = (),
                    target_ms: float = 0.0) -> Tuning:
    """Every model-config.yaml and config.properties value of a generation archive, with its reason.
    `fixed` names the handler keys the user's configuration set: those keep the user's value."""
    if machine.cores < 1:
        raise TuneError(f"need at least one CPU core to serve, got {machine.cores}")
    fixed = set(fixed)
    use_gpu = config.device == "auto" and machine.gpus > 0
    frontend = _mode(MODE, config.queue_cap)
    frontend["asyncCommunication"] = Choice(True, "the generation handler serves in async mode only: each request "
                                                  "is a coroutine awaiting its tokens from the worker's one decode "
                                                  "loop, and a stream's lines go out as TorchServe's intermediate "
                                                  "replies as they are made")
    frontend["continuousBatching"] = Choice(False, "async mode instead: the engine, not the frontend, decides which "
                                                   "sequences step together")
    if use_gpu:
        workers = Choice(machine.gpus, f"one worker per GPU ({machine.gpus}): each runs one decode loop on its own")
        threads = max(1, machine.cores // machine.gpus)
    else:
        workers = Choice(1, "one decode loop batches every sequence of a worker in each step: a second worker on the "
                            "same cores would split the batch and the cores")
        threads = machine.cores
    frontend["minWorkers"] = workers
    frontend["maxWorkers"] = Choice(workers.value, "as many as minWorkers (scale explicitly with PUT /models/NAME)")
    frontend["responseTimeout"] = Choice(
        math.ceil(config.deadline_ms / 1000), f"handler.deadline_ms ({config.deadline_ms} ms), the longest a "
        "generation may take: the engine answers 504 past it itself (TorchServe 0.12 does not enforce this in async "
        "mode)")
    startup = _default(FrontendConfig, "startupTimeout")
    frontend["startupTimeout"] = Choice(startup, "the template's: loading measures nothing here (no profile), and the "
                                                 "worker warms no shapes before READY, only one prefill and one "
                                                 "decode step that check the model can be driven")
    frontend["jobQueueSize"] = Choice(MIN_JOB_QUEUE, "async mode hands every request to the worker at once, where "
                                                     f"handler.queue_cap ({config.queue_cap}) bounds what waits (503 "
                                                     "past it); the frontend's queue holds only what arrives while the "
                                                     f"worker loads: TorchServe's default {MIN_JOB_QUEUE}")
    frontend["deviceType"] = Choice("gpu" if use_gpu else "cpu",
                                    ("the machine has GPU(s) and handler.device is auto" if use_gpu else
                                     "no GPU on the machine, or handler.device is cpu")
                                    + ": TorchServe hands out GPU ids only for deviceType gpu")
    handler = {}
    for f in fields(GenerationConfig):
        value = getattr(config, f.name)
        if f.name == "task":
            handler[f.name] = Choice(value, "--task generation: " + f.metadata[SETTING].doc)
        elif f.name == "torch_threads" and "torch_threads" not in fixed:
            handler[f.name] = Choice(threads, f"{machine.cores} cores shared by {workers.value} worker(s)")
        elif f.name in fixed:
            handler[f.name] = Choice(value, "set in the handler configuration")
        else:  # every key written out, a null one too (the fault injection: off)
            handler[f.name] = Choice(value, f"default: {f.metadata[SETTING].doc}")
    properties = {
        "default_workers_per_model": Choice(workers.value, "the same as model-config.yaml's minWorkers, which wins for "
                                                           "this model; " + workers.reason),
        "job_queue_size": Choice(MIN_JOB_QUEUE, "the same as model-config.yaml's jobQueueSize, which wins for this "
                                                "model"),
        "number_of_gpu": Choice(workers.value if use_gpu else 0,
                                "GPUs TorchServe may hand to workers: " + ("one per worker" if use_gpu
                                                                           else "none, the model serves on CPU")),
    }
    return Tuning(target_ms, machine, MODE, frontend, handler, properties, skipped=SKIPPED)


def _default(cls, name: str):
    return next(f.default for f in fields(cls) if f.name == name)
