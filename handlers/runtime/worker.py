"""What every serving mode serves with: one record, built once by the handler's initialize().

It owns the pass (`forward`: fault injection, the model, its timing metric), the isolator that
runs passes so only failing requests fail, the worker's one rule for a bucket's largest batch
(`cap_for`: the configuration's limit, lowered by caps learned from out of memory) and the cost
model read from the latency profile. Nothing here calls back into the TorchServe handler. Pure:
the model (torch) and the metrics store come in from the handler.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tsbatch.handlers.core.buckets import Batch, Bucket, power_of_two_sizes
from tsbatch.handlers.core.cost import CostModel
from tsbatch.handlers.core.isolate import Isolator, OomCaps
from tsbatch.handlers.runtime.memory import keep_caps

if TYPE_CHECKING:  # the edge builds these and hands them in: the runtime never imports the edge
    from tsbatch.handlers.api import Model
    from tsbatch.handlers.edge.config import HandlerConfig
    from tsbatch.handlers.edge.metrics import Metrics
    from tsbatch.handlers.edge.siblings import Siblings


@dataclass
class Worker:
    config: HandlerConfig
    model: Model  # handlers/api.py: the built-in encoder (handlers/models/encoder.py) or a team's own
    edges: tuple[Bucket, ...]
    metrics: Metrics
    siblings: Siblings
    caps: dict[Bucket, int] = field(default_factory=dict)  # learned from out of memory so far (> 0)
    caps_file: str | None = None  # where this model's workers keep them (handlers/runtime/memory.py)
    unfit: set[Bucket] = field(default_factory=set)  # buckets where not one request fits in memory: 507
    batch_size: int = 1  # the frontend's batchSize
    response_timeout: int = 120  # TorchServe's, from model-config.yaml
    profile: Any = None  # warmup.profile.LatencyProfile, once warmed
    cost: CostModel = field(default_factory=CostModel)
    isolator: Isolator = field(init=False)

    def __post_init__(self):
        self.isolator = Isolator(self.timed_forward, self.config.isolation_budget,
                                 OomCaps(dict(self.caps), on_learn=self._learned))

    def cap_for(self, bucket: Bucket) -> int:
        """Largest batch of this bucket: the configuration's limit (token budget, max_batch_size,
        tuned batch_caps), lowered by any out-of-memory cap learned since."""
        return self.isolator.caps.cap(bucket, self.config.batch_limit(bucket))

    def batch_sizes(self, bucket: Bucket) -> tuple[int, ...]:
        """Every batch size the handler forms in this bucket (what warmup runs)."""
        return power_of_two_sizes(self.cap_for(bucket))

    def forward(self, batch: Batch):
        """The model's pass, behind the fault-injection seam (warmup meets injected faults too)."""
        fault = self.config.fault_injection
        if fault.enabled:
            fault.check(batch)
        return self.model.forward(batch)

    def timed_forward(self, batch: Batch):
        """One served pass, timed for tsbatch_forward_seconds (failed passes count too)."""
        started = time.perf_counter()
        try:
            return self.forward(batch)
        finally:
            self.metrics.forward(batch.bucket, time.perf_counter() - started)

    def warmed(self, profile) -> None:
        """Warmup's profile: the cost model from now on, and the caps it learned from out of memory."""
        self.profile = profile
        self.cost = CostModel.from_profile(profile)
        if not profile.oom_caps:
            return
        caps = self.isolator.caps.caps
        for bucket, cap in profile.oom_caps.items():
            if cap == 0:
                self.unfit.add(bucket)
            else:
                caps[bucket] = min(cap, caps.get(bucket, cap))
        if self.caps_file:
            keep_caps(self.caps_file, profile.oom_caps, "learned at warmup")

    def after_batch(self, batch, report) -> None:
        """Metrics of a pass that ended (an out-of-memory split has lowered the bucket's cap)."""
        self.metrics.batch(batch.bucket, batch.size, batch.real_tokens, report)
        if report is not None and report.oom_splits:
            self.metrics.cap(batch.bucket, self.cap_for(batch.bucket))

    def _learned(self, bucket: Bucket, cap: int) -> None:
        """A cap learned while serving: keep it for this model's workers (a restarted one too)."""
        if self.caps_file:
            keep_caps(self.caps_file, {bucket: cap}, "learned while serving")
        self.metrics.cap(bucket, cap)
