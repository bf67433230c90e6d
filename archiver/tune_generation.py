"""Serving settings for the built-in generation handler (`tsbatch archive --task generation`),
each with its reason, as archiver/tune.py chooses the encoder's: the same Tuning, so the archive's
model-config.yaml comments, config.properties' tuned block and the CLI's report come from one path.

From a generation profile (warmup/generation_profile.py) and two targets:
  max_running: the largest measured decode batch whose step p90, at the longer measured context,
    is within the time-per-output-token target (`tpot_ms`): every running sequence gets one token
    a step, so a decode step is each sequence's time per output token, and more seats make more
    tokens/s;
  token_budget: the largest budget whose costliest step that prefills a joining request is within
    the time-to-first-token target (`ttft_ms`): the request's first token comes when that step
    ends, and every running sequence waits for it too. A step is d decodes (d < max_running: the
    joining request needs a seat) plus one prefill per length edge, rows x edge tokens each, all
    within the budget and the seats left; its cost is the p90 of d decodes plus the p90s of its
    prefills, each a measured shape (made monotone in work first, as the encoder's tuner does). A
    step's first prefill joins whatever the budget, so the shortest prompt beside max_running - 1
    decodes must meet the TTFT target too (max_running is lowered until it does). With prefill_apart
    (the default) the prefills run in a step of their own and the running sequences decode in the
    next: a joining request then waits at most the decode step in flight and its own prefills, a
    running sequence both, so the same sum bounds either. Budgets past what the profile measured
    are never chosen: no timing is invented;
  startupTimeout: twice the profile's load + warmup, at least the template's.
What applies is taken from tune.py (async mode's frontend keys, workers for the machine, the
frontend queue's floor); bucket tuning (batch caps per length bucket, max_wait_ms, the
simulator) is the encoder's and is skipped. Keys the handler configuration set keep their value.
Without a profile (--no-tune) every engine setting is its default, and `SKIPPED` says why.

Pure: no torch, no clock, no files.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterable

from tsbatch.archiver.tune import (ASSUMED_LOAD_SECONDS, MIN_JOB_QUEUE, STARTUP_MARGIN, Choice, Machine, TuneError,
                                   Tuning, _mode, monotone)
from tsbatch.handlers.edge.config import SETTING, FrontendConfig
from tsbatch.handlers.edge.generation_api import GenerationConfig
from tsbatch.warmup.generation_profile import GenerationProfile
from tsbatch.warmup.profile import ShapeTiming

BUCKET_TUNING = ("bucket tuning (batch caps per length bucket, max_wait_ms, the simulator) is the encoder's and does "
                 "not apply: the generation engine schedules token by token under token_budget and kv_bound")
SKIPPED = ("not tuned from a profile (--no-tune): the engine's settings are its defaults or the handler "
           "configuration's; without --no-tune, tsbatch archive --task generation measures a generation profile "
           "(or takes one with --profile) and sets token_budget and max_running for --ttft-ms and --tpot-ms; "
           + BUCKET_TUNING)
MODE = "async"  # the only mode the generation handler serves in
# CPU chat: an answer that starts within a second keeps a reader with it, and 10 tokens/s streams
# faster than people read (about 4-5 words, 6-8 tokens, a second)
DEFAULT_TTFT_MS = 1000.0
DEFAULT_TPOT_MS = 100.0


@dataclass(frozen=True)
class GenerationTuning(Tuning):
    """A generation archive's Tuning: the two targets it was tuned for (0: not tuned)."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0


@dataclass(frozen=True)
class Step:
    """One engine step a budget admits: `decodes` running sequences and one prefill per edge."""

    decodes: int
    decode_ms: float
    prefills: tuple[ShapeTiming, ...]

    @property
    def prefill_ms(self) -> float:
        return sum(p.p90_ms for p in self.prefills)

    @property
    def total_ms(self) -> float:
        return self.decode_ms + self.prefill_ms

    def describe(self) -> str:
        shapes = " + ".join(f"{p.batch}x{p.bucket}" for p in sorted(self.prefills, key=lambda p: p.bucket))
        return (f"{self.decodes} decodes (p90 {self.decode_ms:.1f} ms) + prefill {shapes} (p90 {self.prefill_ms:.1f} "
                f"ms) = {self.total_ms:.1f} ms")


class Costs:
    """The profile's timings, monotone in work, as the tuner reads them."""

    def __init__(self, profile: GenerationProfile):
        if not profile.prefill or not profile.decode:
            raise TuneError("the generation profile has no prefill or no decode timings: profile again "
                            "(tsbatch profile --task generation)")
        self.context = max(t.bucket for t in profile.decode)  # the longer measured context
        self.decode = {t.batch: t for t in monotone(profile.decode) if t.bucket == self.context}
        self.prefill = monotone(profile.prefill)
        self.edges = sorted({t.bucket for t in self.prefill})
        limits = {**profile.environment, **(profile.environment.get("serving") or {})}  # lowered by out of memory
        self.max_running = _int(limits.get("max_running")) or max(self.decode)
        self.token_budget = _int(limits.get("token_budget")) or max(t.batch * t.bucket for t in self.prefill)

    def decode_ms(self, rows: int) -> float:
        return self.decode[rows].p90_ms if rows else 0.0

    def alone(self, edge: int) -> ShapeTiming | None:
        return next((t for t in self.prefill if t.batch == 1 and t.bucket == edge), None)

    def prefill_table(self, max_running: int, budget: int) -> list[list[tuple[float, tuple[ShapeTiming, ...]]]]:
        """table[rows][tokens]: the costliest prefills, one per edge, of at most `rows` rows and
        `tokens` tokens together (their p90s summed, and the shapes); a knapsack over the edges."""
        empty = (0.0, ())
        table = [[empty] * (budget + 1) for _ in range(max_running + 1)]
        for edge in self.edges:
            group = [t for t in self.prefill if t.bucket == edge and t.batch <= max_running
                     and t.batch * edge <= budget]
            if not group:
                continue
            new = [list(row) for row in table]
            for shape in group:
                cost, p90 = shape.batch * edge, shape.p90_ms
                for rows in range(shape.batch, max_running + 1):
                    before, after = table[rows - shape.batch], new[rows]
                    for tokens in range(cost, budget + 1):
                        held = before[tokens - cost]
                        if held[0] + p90 > after[tokens][0]:
                            after[tokens] = (held[0] + p90, held[1] + (shape,))
            table = new
        return table

    def worst_step(self, table, max_running: int, budget: int) -> Step | None:
        """The costliest step that prefills within `budget` tokens: d decodes, and prefills of at
        most budget - d tokens in the max_running - d seats left."""
        steps = [Step(d, self.decode_ms(d), table[max_running - d][budget - d][1])
                 for d in range(min(max_running, budget + 1)) if table[max_running - d][budget - d][1]]
        return max(steps, key=lambda s: s.total_ms, default=None)


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def threads_per_worker(machine: Machine, use_gpu: bool) -> int:
    """One decode loop per worker: on CPU it takes every core, on GPUs each worker a share."""
    return max(1, machine.cores // machine.gpus) if use_gpu else machine.cores


def plan_generation(machine: Machine, config: GenerationConfig, fixed: Iterable[str] = (),
                    ttft_ms: float = DEFAULT_TTFT_MS, tpot_ms: float = DEFAULT_TPOT_MS,
                    profile: GenerationProfile | None = None) -> GenerationTuning:
    """Every model-config.yaml and config.properties value of a generation archive, with its reason.
    `fixed` names the handler keys the user's configuration set: those keep the user's value."""
    if machine.cores < 1:
        raise TuneError(f"need at least one CPU core to serve, got {machine.cores}")
    for name, value in (("--ttft-ms", ttft_ms), ("--tpot-ms", tpot_ms)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise TuneError(f"{name} must be a positive number of milliseconds, got {value!r}")
    fixed = set(fixed)
    if profile is None:
        use_gpu = config.device == "auto" and machine.gpus > 0
    else:
        use_gpu = config.device == "auto" and str(profile.environment.get("device", "cpu")).startswith("cuda")
        if use_gpu and machine.gpus < 1:
            raise TuneError("the generation profile ran on CUDA but the target machine has no GPU: profile on the "
                            "target machine, or pass --gpus")
    frontend = _mode(MODE, config.queue_cap)
    frontend["asyncCommunication"] = Choice(True, "the generation handler serves in async mode only: each request "
                                                  "is a coroutine awaiting its tokens from the worker's one decode "
                                                  "loop, and a stream's lines go out as TorchServe's intermediate "
                                                  "replies as they are made")
    frontend["continuousBatching"] = Choice(False, "async mode instead: the engine, not the frontend, decides which "
                                                   "sequences step together")
    if use_gpu:
        workers = Choice(machine.gpus, f"one worker per GPU ({machine.gpus}): each runs one decode loop on its own")
    else:
        workers = Choice(1, "one decode loop batches every sequence of a worker in each step: a second worker on the "
                            "same cores would split the batch and the cores")
    threads = threads_per_worker(machine, use_gpu)
    frontend["minWorkers"] = workers
    frontend["maxWorkers"] = Choice(workers.value, "as many as minWorkers (scale explicitly with PUT /models/NAME)")
    frontend["responseTimeout"] = Choice(
        math.ceil(config.deadline_ms / 1000), f"handler.deadline_ms ({config.deadline_ms} ms), the longest a "
        "generation may take: the engine answers 504 past it itself (TorchServe 0.12 does not enforce this in async "
        "mode)")
    template = _default(FrontendConfig, "startupTimeout")
    frontend["startupTimeout"] = (
        _startup_timeout(profile, template) if profile is not None else
        Choice(template, "the template's: nothing was measured (--no-tune), and the worker warms every prefill "
                         "shape and decode batch size the engine forms before READY"))
    frontend["jobQueueSize"] = Choice(MIN_JOB_QUEUE, "async mode hands every request to the worker at once, where "
                                                     f"handler.queue_cap ({config.queue_cap}) bounds what waits (503 "
                                                     "past it); the frontend's queue holds only what arrives while the "
                                                     f"worker loads: TorchServe's default {MIN_JOB_QUEUE}")
    frontend["deviceType"] = Choice("gpu" if use_gpu else "cpu",
                                    ((("the profile ran on CUDA" if profile is not None else
                                       "the machine has GPU(s)") + " and handler.device is auto") if use_gpu else
                                     ("the profile ran on the CPU, or handler.device is cpu" if profile is not None
                                      else "no GPU on the machine, or handler.device is cpu"))
                                    + ": TorchServe hands out GPU ids only for deviceType gpu")
    tuned = _budgets(profile, config, fixed, ttft_ms, tpot_ms) if profile is not None else {}
    handler = {}
    for f in fields(GenerationConfig):
        value = getattr(config, f.name)
        if f.name == "task":
            handler[f.name] = Choice(value, "--task generation: " + f.metadata[SETTING].doc)
        elif f.name == "torch_threads" and "torch_threads" not in fixed:
            handler[f.name] = Choice(threads, f"{machine.cores} cores shared by {workers.value} worker(s)")
        elif f.name in tuned:
            handler[f.name] = tuned[f.name]
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
    if profile is None:
        return GenerationTuning(0.0, machine, MODE, frontend, handler, properties, skipped=SKIPPED)
    return GenerationTuning(ttft_ms, machine, MODE, frontend, handler, properties, ttft_ms=ttft_ms, tpot_ms=tpot_ms)


def _budgets(profile: GenerationProfile, config: GenerationConfig, fixed: set[str], ttft_ms: float,
             tpot_ms: float) -> dict[str, Choice]:
    """max_running for the TPOT target, then token_budget for the TTFT target (module docstring)."""
    costs = Costs(profile)
    one = costs.decode.get(1)
    if one is None:
        raise TuneError("the generation profile has no decode timing of one sequence: profile again")
    if one.p90_ms > tpot_ms:
        raise TuneError(f"a time-per-token target of {tpot_ms:g} ms is below what this model can do here: decoding "
                        f"one sequence at {costs.context} tokens of context takes p90 {one.p90_ms:.1f} ms; it needs "
                        f"--tpot-ms {math.ceil(one.p90_ms)} or more, or faster hardware")
    first = costs.alone(costs.edges[0])
    if first is None:
        raise TuneError(f"the generation profile has no prefill of one {costs.edges[0]}-token context: profile again")
    if first.p90_ms + one.p90_ms > ttft_ms:
        need = first.p90_ms + one.p90_ms
        raise TuneError(f"a time-to-first-token target of {ttft_ms:g} ms is below what this model can do here: the "
                        f"smallest prefill (1x{first.bucket}, p90 {first.p90_ms:.1f} ms) beside one decode (p90 "
                        f"{one.p90_ms:.1f} ms) takes {need:.1f} ms; it needs --ttft-ms {math.ceil(need)} or more, or "
                        "faster hardware")
    running = _max_running(costs, config, fixed, tpot_ms, ttft_ms)
    budget = _token_budget(costs, config, fixed, ttft_ms, running.value)
    if budget.value < running.value:  # a fixed budget: every running sequence feeds one token a step
        running = Choice(budget.value, f"handler.token_budget ({budget.value}), since every running sequence feeds a "
                                       f"token a step; {running.reason}")
    return {"max_running": running, "token_budget": budget}


def _max_running(costs: Costs, config: GenerationConfig, fixed: set[str], tpot_ms: float, ttft_ms: float) -> Choice:
    measured = max(costs.decode)
    if "max_running" in fixed:
        if config.max_running > measured:
            raise TuneError(f"handler.max_running is {config.max_running} but the generation profile measured decode "
                            f"batches up to {measured}: profile with this handler configuration")
        at = costs.decode[config.max_running]
        return Choice(config.max_running, f"set in the handler configuration (decode of {config.max_running} at "
                                          f"{costs.context} tokens: p90 {at.p90_ms:.1f} ms)")
    fits = [rows for rows, t in costs.decode.items() if t.p90_ms <= tpot_ms and rows <= costs.max_running]
    rows = max(fits)
    step = costs.decode[rows].p90_ms
    reason = (f"decode of {rows} sequences at {costs.context} tokens of context each: p90 {step:.1f} ms <= "
              f"{tpot_ms:g} ms TPOT target (every running sequence gets one token a step, so a decode step is its time "
              "per output token; more seats, more tokens/s); ")
    if rows + 1 in costs.decode:
        reason += f"{rows + 1} takes {costs.decode[rows + 1].p90_ms:.1f} ms"
    else:
        reason += (f"{rows} is the most the profile measured (its max_running): profile with a larger "
                   "handler.max_running to try more")
    # a step's first prefill joins whatever the budget: the shortest prompt beside rows - 1 decodes
    # is a step no token_budget bounds, so it must meet the TTFT target itself
    first = costs.alone(costs.edges[0])
    tpot_rows = rows
    while rows > 1 and costs.decode_ms(rows - 1) + first.p90_ms > ttft_ms:
        rows -= 1
    if rows < tpot_rows:
        over = Step(tpot_rows - 1, costs.decode_ms(tpot_rows - 1), (first,))
        fit = Step(rows - 1, costs.decode_ms(rows - 1), (first,))
        reason = (f"{rows}, not the {tpot_rows} the TPOT target allows: a step's first prefill joins whatever the "
                  f"token budget, and the shortest prompt's step {over.describe()} is over the {ttft_ms:g} ms TTFT "
                  f"target, {fit.describe()} within it; " + reason)
    return Choice(rows, reason)


def _token_budget(costs: Costs, config: GenerationConfig, fixed: set[str], ttft_ms: float, running: int) -> Choice:
    limit = max(costs.token_budget, running)
    table = costs.prefill_table(running, limit)
    long = next((t for t in sorted(costs.prefill, key=lambda t: -t.bucket) if t.batch == 1), None)
    alone = Step(running - 1, costs.decode_ms(running - 1), (long,))
    note = (f"; a prompt past the budget is prefilled alone whatever the budget: {alone.describe()}"
            + ("" if alone.total_ms <= ttft_ms else ", over the target: the longest prompts' own first token and "
               "their step's delay to the running sequences are not the budget's to bound"))
    if "token_budget" in fixed:
        worst = costs.worst_step(table, running, min(config.token_budget, limit))
        figure = f" (its costliest prefilling step: {worst.describe()})" if worst and config.token_budget <= limit else ""
        return Choice(config.token_budget, f"set in the handler configuration{figure}")
    chosen = None
    for budget in range(limit, running - 1, -1):
        worst = costs.worst_step(table, running, budget)
        if worst is None or worst.total_ms <= ttft_ms:
            chosen = budget, worst
            break
    if chosen is None:
        worst = costs.worst_step(table, running, running)
        need = math.ceil(worst.total_ms)
        raise TuneError(f"a time-to-first-token target of {ttft_ms:g} ms is below what {running} running sequences "
                        f"allow here: even a token_budget of {running} admits {worst.describe()}; it needs --ttft-ms "
                        f"{need} or more, or a lower --tpot-ms (fewer running sequences)")
    budget, worst = chosen
    what = (f"the costliest step that prefills a joining request within {budget} tokens: {worst.describe()} <= "
            f"{ttft_ms:g} ms TTFT target (its first token comes when that step ends, and every running sequence "
            "waits for it)" if worst else f"no prefill fits within {budget} tokens beside the decodes")
    if budget < limit:
        over = costs.worst_step(table, running, budget + 1)
        what += f"; {budget + 1} would admit {over.describe()}"
    else:
        what += f"; {limit} is the most the profile measured (its token_budget): profile with a larger one to try more"
    return Choice(budget, what + note)


def _startup_timeout(profile: GenerationProfile, template: int) -> Choice:
    """tune.py's rule (twice load + warmup), at least the template's."""
    load = profile.environment.get("load_seconds")
    note = ""
    if isinstance(load, bool) or not isinstance(load, (int, float)) or load < 0:
        load, note = ASSUMED_LOAD_SECONDS, f" (the profile does not say how long loading took: assumed {ASSUMED_LOAD_SECONDS:g} s)"
    measured = load + profile.warmup_seconds
    value = max(template, math.ceil(STARTUP_MARGIN * measured))
    return Choice(value, f"model load {load:.1f} s + warmup of every profiled prefill shape and decode batch size "
                         f"{profile.warmup_seconds:.1f} s = {measured:.1f} s, x{STARTUP_MARGIN:g}, at least the "
                         f"template's {template}; serving warms only the shapes its token_budget and max_running form, "
                         f"so this is an upper bound{note}")


def _default(cls, name: str):
    return next(f.default for f in fields(cls) if f.name == name)
