"""Choose serving settings from a latency profile, each with a one-line reason.

Per length bucket: the batch cap (a power of two the profile measured) with the best requests/s
whose predicted p99 meets the target. For the machine: workers and torch threads, never more
threads than cores. From measured times: startupTimeout, responseTimeout, jobQueueSize. And the
batching mode. The reasons end up as comments next to each value in model-config.yaml and
config.properties, so an operator can see why a number is what it is.

The predicted p99 of a request in bucket b (the scheduler modes, continuous or async, with the
lanes of handlers/core/policy.split_lanes):

    max_wait_ms + max(p90(cap(b'), b') for b' in lane(b)) + p90(cap(b), b)

(plus poll_ms in continuous mode, the longest a new request waits to be taken in) it waits at most
max_wait_ms for company, then for at most one pass already running in its own
lane (the slowest shape that lane may form), then for its own pass at p90. The lanes run on their
own threads, so a short request never waits behind a long pass. Under this model every bucket
meets the target exactly when every allowed pass has p90 <= (target - max_wait_ms) / 2, so each
bucket takes, independently, its fastest size (requests/s) among those within that per-pass
budget. Timings are first made monotone in work (see `monotone`), so one noisy measurement does
not decide a cap. A queue longer than one pass (offered load past capacity) is outside the model: that is
what bench/tune_bench.py measures.

Pure: no torch, no clock, no files.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from tsbatch.handlers.core.buckets import bucket_label, bucket_order, config_key, edges_per_size, holds, longest
from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.core.policy import split_lanes
from tsbatch.handlers.edge.config import HandlerConfig
from tsbatch.warmup.profile import LatencyProfile, ShapeTiming

DEFAULT_TARGET_MS = 500.0
MAX_THREADS_PER_WORKER = 4  # assumed point where a small encoder's intra-op scaling flattens
MIN_STARTUP_TIMEOUT_S = 120  # TorchServe's own default; never lower
STARTUP_MARGIN = 2.0
RESPONSE_MARGIN = 2.0
ASSUMED_LOAD_SECONDS = 30.0  # when the profile does not say how long the model took to load
MIN_JOB_QUEUE = 100  # TorchServe's default job_queue_size
MAX_WAIT_SHARE = 0.1  # max_wait_ms never takes more than this share of the target
# batch sizes whose requests/s lie within this share of the best count as equal, and the largest
# of them is the cap: the profile times the forward alone, a live pass also carries its lane's own
# work (padding, outputs, replies), which a larger batch spreads over more requests; closer than
# this the profile cannot tell sizes apart (p90 over median: 2% in the median shape of fc-v1300's
# mix profile, up to 14%). Measured: docs/experiments.md, 12-07 00:14
NEAR_THROUGHPUT = 0.03
INTAKE_ROOM = 32  # continuous mode: requests a full worker still takes in (to answer 503 itself)
MODES = ("continuous", "async")


class TuneError(Exception):
    """The profile cannot meet what was asked; the message says what the model can do."""


@dataclass(frozen=True)
class Machine:
    """Where the model will serve: cores for torch threads, GPUs for workers."""

    cores: int
    gpus: int = 0


@dataclass(frozen=True)
class Choice:
    value: Any
    reason: str


@dataclass(frozen=True)
class BucketPlan:
    """The tuned cap of one bucket and what the profile says it costs."""

    bucket: int
    batch: int
    median_ms: float
    p90_ms: float
    lane: int
    predicted_p99_ms: float
    limited_by: str  # why not larger: "target", "throughput" or "largest measured"

    @property
    def requests_per_s(self) -> float:
        return requests_per_s(self.batch, self.median_ms)


def requests_per_s(batch: int, median_ms: float) -> float:
    """What back-to-back passes of `batch` requests, `median_ms` each, serve a second (inf: untimed)."""
    return 1000.0 * batch / median_ms if median_ms > 0 else math.inf


@dataclass(frozen=True)
class Tuning:
    """Everything tune chose: model-config.yaml keys, handler keys, config.properties keys."""

    target_ms: float
    machine: Machine
    mode: str  # one of MODES
    frontend: dict[str, Choice]
    handler: dict[str, Choice]
    properties: dict[str, Choice]
    buckets: tuple[BucketPlan, ...] = field(default_factory=tuple)
    # tuning by simulation (archiver/tune_sim.py): every candidate with its predicted figures
    simulated: tuple = ()
    workload: str | None = None
    chosen: str | None = None
    reference_rate: float | None = None  # req/s at which each candidate's short p99 was predicted
    skipped: str | None = None  # why nothing was tuned from a profile (the generation handler: tune_generation.py)

    def frontend_values(self) -> dict[str, Any]:
        return {key: choice.value for key, choice in self.frontend.items()}

    def handler_values(self) -> dict[str, Any]:
        return {key: choice.value for key, choice in self.handler.items()}

    def comments(self) -> dict[tuple, str]:
        """Reasons keyed by their path in model-config.yaml, for properties.render_yaml."""
        notes: dict[tuple, str] = {(key,): c.reason for key, c in self.frontend.items()}
        notes.update({("handler", key): c.reason for key, c in self.handler.items()})
        for plan in self.buckets:
            notes[("handler", "batch_caps", config_key(plan.bucket))] = bucket_reason(plan)
        return notes

    def property_entries(self) -> tuple[tuple[str, str, str], ...]:
        """(key, value, reason) for the tuned block of config.properties."""
        return tuple((key, _property_value(c.value), c.reason) for key, c in self.properties.items())


def bucket_reason(plan: BucketPlan) -> str:
    why = {"target": "a larger batch would break the per-pass budget",
           "throughput": f"larger measured batches serve over {NEAR_THROUGHPUT:.0%} fewer requests/s",
           "largest measured": "the largest batch the profile measured",
           "out of memory": "a larger batch ran out of memory while profiling"}[plan.limited_by]
    return (f"bucket {bucket_label(plan.bucket)} tokens, lane {plan.lane}: batch {plan.batch} serves "
            f"{plan.requests_per_s:.0f} req/s (median {plan.median_ms:.1f} ms, p90 {plan.p90_ms:.1f} ms "
            f"per pass), predicted p99 {plan.predicted_p99_ms:.0f} ms; {why}")


def _property_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# -- workers and threads ---------------------------------------------------------------------

def plan_workers(machine: Machine, use_gpu: bool = False, threads: int | None = None) -> tuple[Choice, Choice]:
    """(workers, torch threads per worker): workers x threads never exceeds the cores.
    `threads` is a torch_threads the handler configuration fixed; workers then follow from it."""
    if machine.cores < 1:
        raise TuneError(f"need at least one CPU core to serve, got {machine.cores}")
    if machine.gpus < 0:
        raise TuneError(f"the number of GPUs cannot be negative, got {machine.gpus}")
    if threads is not None:
        return _workers_for_threads(machine, use_gpu, threads)
    if use_gpu:
        if machine.gpus < 1:
            raise TuneError("the profile ran on CUDA but the target machine has no GPU: "
                            "profile on the target machine, or pass --gpus")
        workers = min(machine.gpus, machine.cores)
        threads = max(1, min(MAX_THREADS_PER_WORKER, machine.cores // workers))
        spare = (f"; {machine.gpus - workers} GPU(s) stay idle: each worker needs a core of its own"
                 if workers < machine.gpus else "")
        return (Choice(workers, f"one worker per GPU ({machine.gpus} GPU(s), {machine.cores} cores){spare}"),
                Choice(threads, f"{machine.cores} cores shared by {workers} worker(s), at most "
                                f"{MAX_THREADS_PER_WORKER} each: tokenising and collating are all the CPU does"))
    workers = math.ceil(machine.cores / MAX_THREADS_PER_WORKER)
    threads = machine.cores // workers
    return (
        Choice(workers, f"{machine.cores} cores, no GPU: {workers} worker(s) x {threads} threads = "
                        f"{workers * threads} <= {machine.cores} cores (no oversubscription)"),
        Choice(threads, f"all of this worker's share of the {machine.cores} cores (at most "
                        f"{MAX_THREADS_PER_WORKER}, an assumption, not measured: that beyond it a small "
                        "encoder gains little from more intra-op threads, so extra cores go to more workers); "
                        "the scheduler's two lanes split them, the long lane at lower OS priority"),
    )


def _workers_for_threads(machine: Machine, use_gpu: bool, threads: int) -> tuple[Choice, Choice]:
    if threads > machine.cores:
        raise TuneError(f"handler.torch_threads is {threads} but the machine has {machine.cores} cores: "
                        "lower it or leave it out and let tune choose")
    workers = machine.cores // threads
    if use_gpu:
        if machine.gpus < 1:
            raise TuneError("the profile ran on CUDA but the target machine has no GPU: "
                            "profile on the target machine, or pass --gpus")
        workers = min(workers, machine.gpus)
    return (Choice(workers, f"{workers} worker(s) x {threads} threads (torch_threads set in the handler "
                            f"configuration) <= {machine.cores} cores" + (" and one per GPU at most" if use_gpu else "")),
            Choice(threads, "set in the handler configuration"))


# -- the p99 model ----------------------------------------------------------------------------

def predicted_p99(caps: Mapping[int, ShapeTiming], lanes: Iterable[Iterable[int]], wait_ms: float) -> dict[int, float]:
    """Predicted p99 per bucket: max_wait, one pass of its lane's slowest allowed shape ahead of it,
    then its own pass at p90 (see the module docstring)."""
    predicted = {}
    for lane in lanes:
        lane = [b for b in lane if b in caps]
        if not lane:
            continue
        ahead = max(caps[b].p90_ms for b in lane)
        for bucket in lane:
            predicted[bucket] = wait_ms + ahead + caps[bucket].p90_ms
    return predicted


def monotone(shapes: Iterable[ShapeTiming]) -> list[ShapeTiming]:
    """Timings made monotone in work: a shape is taken to cost no more than any measured shape with
    at least its batch size and bucket (min over those, for median and p90 apart). A one-off
    hiccup on a busy machine then cannot cap a bucket below what larger shapes showed it can do."""
    shapes = list(shapes)
    out = []
    for shape in shapes:
        bigger = [s for s in shapes if s.batch >= shape.batch and holds(s.bucket, shape.bucket)]
        out.append(replace(shape, median_ms=min(s.median_ms for s in bigger), p90_ms=min(s.p90_ms for s in bigger)))
    return out


def _sizes(shapes: list[ShapeTiming], bucket: int, config: HandlerConfig) -> list[ShapeTiming]:
    """The shapes of a bucket the handler may form with this config, smallest first."""
    limit = config.batch_limit(bucket)  # tune refuses a configuration with batch_caps: they are its output
    shapes = sorted((s for s in shapes if s.bucket == bucket and s.batch <= limit), key=lambda s: s.batch)
    if not shapes or shapes[0].batch != 1:
        raise TuneError(f"the profile has no batch-1 timing for bucket {bucket_label(bucket)}: profile again "
                        "(`tsbatch profile`) with this handler configuration")
    return shapes


def choose_cap(shapes: list[ShapeTiming], budget_ms: float) -> tuple[ShapeTiming, str]:
    """The largest size within NEAR_THROUGHPUT of the most requests/s among those whose p90 (and
    every smaller size's) fits the budget: the handler forms every power of two below its cap too."""
    allowed = []
    for shape in shapes:
        if shape.p90_ms > budget_ms:
            break
        allowed.append(shape)
    if not allowed:
        raise ValueError("no allowed size")  # callers check batch 1 first
    top = max(requests_per_s(s.batch, s.median_ms) for s in allowed)
    best = max((s for s in allowed if requests_per_s(s.batch, s.median_ms) >= (1 - NEAR_THROUGHPUT) * top),
               key=lambda s: s.batch)
    if best is not allowed[-1]:
        limited = "throughput"
    elif len(allowed) < len(shapes):
        limited = "target"
    else:
        limited = "largest measured"
    return best, limited


def choose_max_wait(profile: LatencyProfile, edges: tuple[int, ...], target_ms: float) -> Choice:
    """Wait for company at most as long as running alone takes: longer costs more than it saves."""
    alone = profile.lookup(batch=1, bucket=edges[0])
    ceiling = max(1, math.floor(MAX_WAIT_SHARE * target_ms))
    if alone is None:
        raise TuneError(f"the profile has no batch-1 timing for the smallest bucket {bucket_label(edges[0])}")
    wait = min(ceiling, max(1, math.ceil(alone.median_ms)))
    return Choice(wait, f"a request waits for company at most as long as running alone takes (batch 1 x "
                        f"{bucket_label(edges[0])} tokens: median {alone.median_ms:.1f} ms), capped at "
                        f"{MAX_WAIT_SHARE:.0%} of the target: waiting longer costs more than it can save")


def _edges(profile: LatencyProfile, config: HandlerConfig) -> tuple[int, ...]:
    """The profile's buckets; refuse a handler configuration that would serve other ones."""
    edges = tuple(sorted({s.bucket for s in profile.shapes} | set(profile.oom_caps), key=bucket_order))
    if not profile.shapes:
        raise TuneError("the profile has no timings: profile the model first (`tsbatch profile`)")
    if config.buckets is not None:
        try:
            served = config.edges_for(longest(edges))  # as the handler does, with the model's maximum
        except ConfigError as error:
            raise TuneError(str(error)) from None
        if served != edges:
            raise TuneError(f"the handler configuration serves buckets {list(served)} but the profile "
                            f"measured {list(edges)}: profile again with the same handler configuration")
    return edges


def _infeasible(target_ms: float, wait_ms: float, timing: ShapeTiming, budget_ms: float) -> TuneError:
    need = wait_ms + 2 * timing.p90_ms
    return TuneError(
        f"a p99 target of {target_ms:g} ms is below what this model can do here: bucket {bucket_label(timing.bucket)} "
        f"tokens at batch 1 takes p90 {timing.p90_ms:.1f} ms, more than the per-pass budget of "
        f"{budget_ms:.1f} ms; a request may wait {wait_ms:g} ms for company, one such pass ahead of it "
        f"and its own = {need:.1f} ms. Ask for --target-ms {math.ceil(need)} or more, or lower "
        "handler.max_length / buckets, or use faster hardware")


# -- everything together ----------------------------------------------------------------------

def tune(profile: LatencyProfile, target_ms: float, machine: Machine, config: HandlerConfig,
         mode: str = "continuous", fixed: Iterable[str] = ()) -> Tuning:
    """All tuned values for this profile, target and machine; TuneError when the target is out of reach.
    `fixed` names the handler keys the user's configuration set: those keep the user's value."""
    fixed = set(fixed)
    frontend = _mode(mode, config.held)  # first: refuses an unknown mode
    _refuse(profile, target_ms, config, fixed)
    edges = _edges(profile, config)
    use_gpu = str(profile.environment.get("device", "cpu")).startswith("cuda")
    workers, threads = plan_workers(machine, use_gpu, config.torch_threads if "torch_threads" in fixed else None)
    lanes = split_lanes(edges, config.long_lane_from)
    wait = (Choice(config.max_wait_ms, "set in the handler configuration") if "max_wait_ms" in fixed
            else choose_max_wait(profile, edges, target_ms))
    intake_ms = config.poll_ms if mode == "continuous" else 0  # a new request is taken in within poll_ms
    wait_ms = wait.value + intake_ms
    budget = (target_ms - wait_ms) / 2
    plans = _plan_buckets(profile, edges, lanes, config, target_ms, wait_ms, budget)
    memory = ""
    if profile.oom_caps:
        memory = ("; out of memory while profiling capped " + ", ".join(
            f"bucket {bucket_label(b)} at {c}" if c else f"bucket {bucket_label(b)} entirely (not one request fits: 507)"
            for b, c in sorted(profile.oom_caps.items(), key=lambda kv: bucket_order(kv[0]))))
    handler = {
        "buckets": Choice(edges_per_size(edges), "the buckets the profile measured: caps are per bucket, so serving "
                                       "uses the same edges"),
        "batch_caps": Choice({config_key(p.bucket): p.batch for p in plans},
                             f"per bucket, the largest measured batch size within {NEAR_THROUGHPUT:.0%} of the most "
                             f"requests/s whose p90 fits the per-pass budget (target {target_ms:g} - max_wait "
                             f"{wait_ms - intake_ms:g}"
                             + (f" - poll {intake_ms:g}" if intake_ms else "") + f") / 2 = {budget:.1f} ms: then "
                             "p99 <= " + ("poll + " if intake_ms else "") + "max_wait + one pass ahead + its own pass"
                             + memory),
        "torch_threads": threads,
    }
    handler["max_wait_ms"] = wait
    handler["deadline_ms"] = (
        Choice(config.deadline_ms, "set in the handler configuration") if "deadline_ms" in fixed
        else Choice(int(math.ceil(2 * target_ms)), f"twice the p99 target ({target_ms:g} ms): a request whose "
                    "lane has more work queued than this allows is refused at once (503, Retry-After), one "
                    "still waiting at it is answered 504, never late; clients may ask for less with X-Deadline-Ms"))
    properties = _serving(frontend, plans, workers, use_gpu, profile, config, target_ms)
    return Tuning(target_ms, machine, mode, frontend, handler, properties, plans)


def _refuse(profile: LatencyProfile, target_ms: float, config: HandlerConfig, fixed: set[str]) -> None:
    """TuneError for what no tuning can serve: a fixed batch_caps, a bad target, another task."""
    if "batch_caps" in fixed:
        raise TuneError("handler.batch_caps is what tune chooses: remove it from the handler configuration, "
                        "or build with --no-tune to keep your own")
    if not (isinstance(target_ms, (int, float)) and target_ms > 0 and math.isfinite(target_ms)):
        raise TuneError(f"the latency target must be a positive number of milliseconds, got {target_ms!r}")
    task = profile.environment.get("task")
    if task is not None and config.task is not None and task != config.task.value:
        raise TuneError(f"the profile was taken for task {task!r} but this configuration serves "
                        f"{config.task.value!r}: pass --task {task} or profile again")


def _plan_buckets(profile: LatencyProfile, edges, lanes, config: HandlerConfig, target_ms: float,
                  wait_ms: float, budget: float) -> tuple[BucketPlan, ...]:
    """Each bucket's cap: the largest measured batch near the most requests/s whose p90 fits `budget`
    (choose_cap)."""
    smooth = monotone(profile.own_shapes())
    # out of memory while profiling: a bucket not even one request fit in gets no cap (its requests get 507)
    unfit = tuple(b for b in edges if profile.oom_caps.get(b) == 0)
    fit = tuple(b for b in edges if b not in unfit)
    if not fit:
        raise TuneError(f"out of memory while profiling: not one request of any bucket fits ({list(unfit)}); "
                        "lower handler.max_length or handler.memory_budget's neighbours, or use a larger device")
    sizes = {bucket: _sizes(smooth, bucket, config) for bucket in fit}
    too_slow = [sizes[b][0] for b in fit if sizes[b][0].p90_ms > budget]
    if too_slow:
        raise _infeasible(target_ms, wait_ms, max(too_slow, key=lambda s: s.p90_ms), budget)
    chosen = {bucket: choose_cap(sizes[bucket], budget) for bucket in fit}
    for bucket, (shape, limited) in chosen.items():
        if limited == "largest measured" and profile.oom_caps.get(bucket) == shape.batch:
            chosen[bucket] = (shape, "out of memory")
    caps = {bucket: shape for bucket, (shape, _) in chosen.items()}
    predicted = predicted_p99(caps, lanes, wait_ms)
    lane_of = {bucket: i for i, lane in enumerate(lanes) for bucket in lane}
    return tuple(BucketPlan(b, caps[b].batch, caps[b].median_ms, caps[b].p90_ms, lane_of[b],
                            round(predicted[b], 1), chosen[b][1]) for b in fit)


def _serving(frontend: dict, plans, workers: Choice, use_gpu: bool, profile: LatencyProfile,
             config: HandlerConfig, target_ms: float) -> dict[str, Choice]:
    """Fill the frontend keys that follow from the plans (workers, timeouts, queue, device) and
    return config.properties' tuned block, which repeats them for TorchServe's defaults."""
    worst = max(plans, key=lambda p: p.p90_ms)
    frontend["minWorkers"] = workers
    frontend["maxWorkers"] = Choice(workers.value, "as many as minWorkers: more would oversubscribe the cores "
                                                   "(scale explicitly with PUT /models/NAME if you add hardware)")
    frontend["responseTimeout"] = _response_timeout(worst, config)
    frontend["startupTimeout"] = _startup_timeout(profile)
    best = max(plans, key=lambda p: p.requests_per_s)
    queue = _job_queue(best, workers.value, target_ms)
    frontend["jobQueueSize"] = queue
    frontend["deviceType"] = Choice("gpu" if use_gpu else "cpu",
                                    "the profile ran on " + ("CUDA" if use_gpu else "the CPU")
                                    + ": TorchServe hands out GPU ids only for deviceType gpu")
    return {
        "default_workers_per_model": Choice(workers.value, "the same as model-config.yaml's minWorkers, which "
                                                           "wins for this model; " + workers.reason),
        "job_queue_size": Choice(queue.value, "the same as model-config.yaml's jobQueueSize, which wins for "
                                              "this model; " + queue.reason),
        "number_of_gpu": Choice(workers.value if use_gpu else 0,
                                "GPUs TorchServe may hand to workers: " + ("one per worker" if use_gpu
                                                                           else "none, the model serves on CPU")),
    }


def frontend_keys(mode: str, held: int = HandlerConfig().held) -> dict[str, Any]:
    """model-config.yaml's batching keys for a mode, the one place every builder takes them from.
    `default` is TorchServe's own batching: both tsbatch modes off, batchSize and maxBatchDelay the
    caller's. `held`: the texts a worker may hold waiting (HandlerConfig.held)."""
    if mode == "default":
        return {"continuousBatching": False, "asyncCommunication": False}
    return {key: choice.value for key, choice in _mode(mode, held).items()}


def continuous_batch_size(config: HandlerConfig) -> int:
    """Continuous mode's batchSize for this handler (every lane's queue_cap plus INTAKE_ROOM), as
    an archive built with it ships: what the simulator's arms take as the frontend's call size."""
    return frontend_keys("continuous", config.held)["batchSize"]


def _mode(mode: str, held: int) -> dict[str, Choice]:
    if mode not in MODES:
        raise TuneError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "continuous":
        return {
            "continuousBatching": Choice(True, "tsbatch's scheduler batches by length bucket in the worker and answers "
                                               "each request when its own pass ends; unlike async mode, TorchServe 0.12 "
                                               "restarts a worker that dies in this mode (see the README)"),
            "asyncCommunication": Choice(False, "continuous mode instead: an async worker that dies is never replaced"),
            "batchSize": Choice(held + INTAKE_ROOM,
                                f"the requests one worker holds: handler.queue_cap per lane ({held} texts) waiting "
                                f"plus {INTAKE_ROOM} new ones per call, so a lane past its queue_cap never keeps "
                                "another lane's requests in the frontend's queue, and tsbatch still sees new "
                                "requests and answers them 503 with Retry-After"),
            "maxBatchDelay": Choice(1, "how long the frontend waits for company for an idle worker's first request: "
                                       "tsbatch batches, so 1 ms (0 would be replaced by 100)"),
        }
    return {  # async
        "asyncCommunication": Choice(True, "tsbatch's scheduler batches by length bucket in the worker; asked for "
                                           "with --mode async (TorchServe 0.12 does not replace an async worker "
                                           "that dies)"),
        "continuousBatching": Choice(False, "async mode instead"),
        "batchSize": Choice(1, "async mode: the frontend hands each request over at once and tsbatch batches"),
        "maxBatchDelay": Choice(1, "unused with batchSize 1 (0 would be replaced by 100)"),
    }


def _response_timeout(worst: BucketPlan, config: HandlerConfig) -> Choice:
    passes = 1 + config.isolation_budget
    reply_s = passes * worst.p90_ms / 1000
    deadline_s = math.ceil(config.deadline_ms / 1000)
    value = max(math.ceil(RESPONSE_MARGIN * reply_s), deadline_s)
    return Choice(value, f"a reply is at most {passes} passes (one, plus isolation_budget reruns) of the slowest "
                         f"allowed shape (batch {worst.batch} x {bucket_label(worst.bucket)} tokens, p90 {worst.p90_ms:.1f} ms) "
                         f"= {reply_s:.1f} s, x{RESPONSE_MARGIN:g}; not below the handler's deadline_ms "
                         f"({deadline_s} s) so tsbatch answers late requests itself (async mode does not "
                         "enforce it in TorchServe 0.12)")


def _startup_timeout(profile: LatencyProfile) -> Choice:
    load = profile.environment.get("load_seconds")
    note = ""
    if not isinstance(load, (int, float)) or load < 0:
        load, note = ASSUMED_LOAD_SECONDS, f" (the profile does not say how long loading took: assumed {ASSUMED_LOAD_SECONDS:g} s)"
    measured = profile.warmup_seconds + load
    value = max(MIN_STARTUP_TIMEOUT_S, math.ceil(STARTUP_MARGIN * measured))
    return Choice(value, f"model load {load:.1f} s + warmup of every profiled shape {profile.warmup_seconds:.1f} s "
                         f"= {measured:.1f} s, x{STARTUP_MARGIN:g}, at least {MIN_STARTUP_TIMEOUT_S}; serving "
                         f"warms only shapes up to the caps, so this is an upper bound{note}")


def _job_queue(best: BucketPlan, workers: int, target_ms: float) -> Choice:
    served = best.requests_per_s * workers * target_ms / 1000
    value = max(MIN_JOB_QUEUE, math.ceil(served))
    return Choice(value, f"Little's law: {workers} worker(s) answer at most ~{best.requests_per_s * workers:.0f} "
                         f"req/s (bucket {bucket_label(best.bucket)} at batch {best.batch}), so ~{served:.0f} queued requests "
                         f"are all that can still meet {target_ms:g} ms; more fail fast with 503; at least "
                         f"TorchServe's default {MIN_JOB_QUEUE} for requests that arrive while workers load")
