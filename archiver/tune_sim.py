"""Tuning by simulation: the candidates around tune's analytic choice, each served in the simulator
(archiver/simulate.py) on a workload, and the one with the most capacity at the target shipped.

The analytic tuning (archiver/tune.py) bounds every pass by a per-pass budget; that model knows no
queueing, and live runs had it below the untuned template on every workload. So the analytic
choice is one candidate among variations of it and of the template (batch caps, max_wait_ms, one
lane or two, the deadline, one worker or one per core), and the simulator decides: highest capacity
at the p99 target (refusals and 504s count as misses), then the lower short-request p99 at 70% of
first-come's capacity. The template is always a candidate, so the shipped configuration is never
predicted worse than it; one predicted worse than TorchServe's first-come batching by a capacity
step (RESOLUTION) or more is refused. A smaller lead is inside the search's resolution: a profile
taken on a busy host put first-come 2 req/s ahead of a shipped arm that live runs never lost with,
and refusing there left the user with no archive (12-07), so it ships and its reason says so.
Leads of one capacity step are common and mostly a profile's noise; served on other profiles of
the same hour, neither preferring the template nor the lower p99 among near ties did better on both
the mean and the worst case (docs/experiments.md, 12-07 12:32), so the plain order stands.
Triton's Model Analyzer sweeps such candidates live for minutes; this takes seconds.

Pure: no torch, no clock.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from tsbatch.archiver.simulate import Arm, Overheads, at_rate, capacity, workload_tokens
from tsbatch.archiver.tune import Choice, TuneError, Tuning, continuous_batch_size
from tsbatch.handlers.core.buckets import longest
from tsbatch.handlers.core.cost import profile_threads
from tsbatch.handlers.core.policy import lane_threads
from tsbatch.handlers.edge.config import HandlerConfig

DEFAULT_WORKLOAD = "search"  # queries and passages: the traffic most encoder deployments see
DURATION_S = 15.0  # simulated seconds per rate
RESOLUTION = 3.0  # req/s to which capacity is searched
FIRST_COME = dict(batch_size=8, max_batch_delay_ms=10)  # make bench's control (bench/run.py FRONTEND)


@dataclass(frozen=True)
class Candidate:
    name: str
    handler: dict  # the handler: keys it ships (on top of the user's section)
    workers: int
    capacity: float = 0.0
    short_p99_ms: float | None = None


def search(tuning: Tuning, profile, section: Mapping[str, Any], workload: str = DEFAULT_WORKLOAD,
           overheads: Overheads | None = None, seed: int = 0) -> Tuning:
    """`tuning` with the candidate the simulator predicts best on `workload` (its handler keys and
    workers), every candidate's figures in `tuning.simulated`. TuneError when even the best is
    predicted below first-come batching by RESOLUTION or more."""
    overheads = overheads or Overheads()
    edges = [s.bucket for s in profile.shapes]
    if not edges or not all(isinstance(b, int) for b in edges):
        return tuning  # models with several sizes (generation): the analytic tuning only
    candidates = _candidates(tuning, section, tuning.machine.cores, profile)
    if not any(c.name == "template" for c in candidates):
        return tuning  # the profile never ran a pass on the threads these workers would give it
    tokens = workload_tokens(workload)
    max_length = longest(edges)
    cores = tuning.machine.cores
    profiles = {profile_threads(profile): profile}
    target = tuning.target_ms
    first_come = Arm("first-come", kind="first-come", threads=cores, **FIRST_COME)
    reference = capacity(first_come, tokens, profiles, max_length, target, DURATION_S, seed, RESOLUTION,
                         cores=cores, overheads=overheads)
    at = max(1.0, 0.7 * reference)
    rated = []
    for candidate in candidates:
        arm = _arm(candidate, section)
        cap = capacity(arm, tokens, profiles, max_length, target, DURATION_S, seed, RESOLUTION, cores=cores,
                       overheads=overheads)
        point = at_rate(arm, at, tokens, profiles, max_length, DURATION_S, seed, cores=cores, overheads=overheads)
        rated.append(replace(candidate, capacity=cap, short_p99_ms=point.latency["short"]["p99"]))
    best = max(rated, key=lambda c: (c.capacity, -(c.short_p99_ms or 1e9)))
    template = next(c for c in rated if c.name == "template")
    if reference - best.capacity >= RESOLUTION:
        raise TuneError(f"on workload {workload!r} the simulator predicts TorchServe's first-come batching serves "
                        f"{reference:g} req/s within {target:g} ms and tsbatch's best candidate ({best.name}) "
                        f"{best.capacity:g}: serve it in default mode (TorchServe's batching) or give a workload "
                        f"closer to your traffic (--workload FILE of token lengths)")
    why = (f"chosen by simulation of workload {workload!r} ({best.name}): {best.capacity:g} req/s within "
           f"{target:g} ms against the untuned template's {template.capacity:g} and first-come batching's "
           f"{reference:g} (archiver/tune_sim.py; every candidate in the header)")
    if best.capacity < reference:
        why += (f"; first-come's lead of {reference - best.capacity:g} req/s is within the search's resolution "
                f"({RESOLUTION:g} req/s), which profiles of one hour disagree by: `make bench` tells them apart")
    handler = dict(tuning.handler)
    for key in ("batch_caps", "max_wait_ms", "deadline_ms"):
        if key not in section:
            handler.pop(key, None)
    for key, value in best.handler.items():
        if key not in ("buckets", "torch_threads"):
            handler[key] = Choice(value, why)
    if "torch_threads" not in section:
        handler["torch_threads"] = Choice(best.handler["torch_threads"], why)
    frontend = dict(tuning.frontend)
    frontend["minWorkers"] = Choice(best.workers, why)
    frontend["maxWorkers"] = Choice(best.workers, "as many as minWorkers: more would oversubscribe the cores "
                                                  "(scale explicitly with PUT /models/NAME if you add hardware)")
    properties = dict(tuning.properties)
    properties["default_workers_per_model"] = Choice(best.workers, "the same as model-config.yaml's minWorkers, "
                                                                   "which wins for this model")
    report = tuple(rated) + (Candidate("first-come batching (TorchServe's, batchSize 8, maxBatchDelay 10)", {}, 1,
                                       reference, None),)
    kept = tuning.buckets if "batch_caps" in best.handler else ()
    return replace(tuning, handler=handler, frontend=frontend, properties=properties, buckets=kept,
                   simulated=report, workload=workload, chosen=best.name, reference_rate=round(at, 1))


def _candidates(tuning: Tuning, section: Mapping[str, Any], cores: int, profile) -> list[Candidate]:
    """The analytic choice, the template, and what lies between them, on the analytic workers x
    threads, and with one worker per core. Only candidates whose passes run on the threads the
    profile measured them with: the simulator does not guess how a pass scales with threads (a
    profile taken on another machine than the one tuned for simulates nothing). Keys the user's
    handler section sets keep the user's value in every candidate."""
    tuned = {k: c.value for k, c in tuning.handler.items() if k in ("batch_caps", "max_wait_ms", "deadline_ms")}
    template = HandlerConfig.from_yaml(dict(section))
    base = {"max_wait_ms": template.max_wait_ms, "deadline_ms": template.deadline_ms}
    workers = int(tuning.frontend["minWorkers"].value)
    threads = {"torch_threads": tuning.handler["torch_threads"].value}
    out = [
        Candidate("analytic", {**tuned, **threads}, workers),
        Candidate("template", {**base, **threads}, workers),
        Candidate("analytic caps, template waits", {**base, "batch_caps": tuned["batch_caps"], **threads}, workers),
        Candidate("template caps, tuned deadline", {**base, "deadline_ms": tuned["deadline_ms"], **threads}, workers),
    ]
    if cores > workers:
        out += [Candidate(f"analytic, {cores} workers", {**tuned, "torch_threads": 1}, cores),
                Candidate(f"template, {cores} workers", {**base, "torch_threads": 1}, cores)]
    buckets = tuning.handler["buckets"].value
    out = [replace(c, handler={k: v for k, v in {"buckets": buckets, **c.handler}.items() if k not in section})
           for c in out]
    measured = profile_threads(profile)  # a pass on threads the profile never ran with would be a guess
    recorded = profile.environment.get("cpu_count")
    if isinstance(recorded, int) and recorded != cores:
        return []
    return [c for c in out if _lane_threads(c, section) == measured]


def _lane_threads(candidate: Candidate, section: Mapping[str, Any]) -> int:
    """The intra-op threads each of the candidate's lanes would run a pass on."""
    config = HandlerConfig.from_yaml({**candidate.handler, **section})
    return lane_threads(config.torch_threads or 1, config.lanes)


def _arm(candidate: Candidate, section: Mapping[str, Any]) -> Arm:
    config = HandlerConfig.from_yaml({**candidate.handler, **section})
    return Arm(candidate.name, config=config, workers=candidate.workers, batch_size=continuous_batch_size(config))
