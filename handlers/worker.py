"""What every serving mode serves with: one record, built once by the handler's initialize().

It also holds the worker's one rule for a bucket's largest batch (`cap_for`: the configuration's
limit, lowered by caps learned from out of memory) and what the latency profile says a pass
takes. Pure: the model (torch) and the metrics store come in from the handler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tsbatch.handlers.api import Model
from tsbatch.handlers.buckets import Bucket, power_of_two_sizes
from tsbatch.handlers.config import HandlerConfig
from tsbatch.handlers.isolate import Isolator
from tsbatch.handlers.metrics import Metrics
from tsbatch.handlers.siblings import Siblings


@dataclass
class Worker:
    config: HandlerConfig
    model: Model  # handlers/api.py: the built-in encoder (handlers/runner.py) or a team's own
    edges: tuple[Bucket, ...]
    isolator: Isolator
    metrics: Metrics
    siblings: Siblings
    unfit: set[Bucket] = field(default_factory=set)  # buckets where not one request fits in memory: 507
    profile: Any = None  # warmup.profile.LatencyProfile, once warmed
    batch_size: int = 1  # the frontend's batchSize
    response_timeout: int = 120  # TorchServe's, from model-config.yaml

    def cap_for(self, bucket: Bucket) -> int:
        """Largest batch of this bucket: the configuration's limit (token budget, max_batch_size,
        tuned batch_caps), lowered by any out-of-memory cap learned since."""
        return self.isolator.caps.cap(bucket, self.config.batch_limit(bucket))

    def batch_sizes(self, bucket: Bucket) -> tuple[int, ...]:
        """Every batch size the handler forms in this bucket (what warmup runs)."""
        return power_of_two_sizes(self.cap_for(bucket))

    def pass_seconds(self, bucket: Bucket, size: int | None = None) -> float:
        """How long a pass of this bucket takes with `size` texts, by default at its cap (p90 from
        warmup's latency profile; 0 without one): a request that cannot finish by its deadline
        gets 504 before it runs, or 503 at once when its lane's queue says so (Engine)."""
        size = self.cap_for(bucket) if size is None else size
        timing = self.profile.lookup(size, bucket) if self.profile else None
        return timing.p90_ms / 1000 if timing else 0.0

    def typical_pass(self, size: int, bucket: Bucket) -> float:
        """The median time of a pass of this shape in warmup (0 without a profile or the shape)."""
        timing = self.profile.lookup(size, bucket) if self.profile else None
        return timing.median_ms / 1000 if timing else 0.0

    def after_batch(self, batch, report) -> None:
        """Metrics of a pass that ended (an out-of-memory split has lowered the bucket's cap)."""
        self.metrics.batch(batch.bucket, batch.size, batch.real_tokens, report)
        if report is not None and report.oom_splits:
            self.metrics.cap(batch.bucket, self.cap_for(batch.bucket))
