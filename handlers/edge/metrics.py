"""tsbatch's batching metrics, emitted through TorchServe's metrics API (`context.metrics`).

The frontend turns them into Prometheus series on its metrics endpoint, beside its own, as long
as each is declared under `model_metrics` in the metrics yaml (configs/metrics.yaml, which
`tsbatch archive` installs as `metrics_config`). Names follow Prometheus conventions: base units
(seconds, tokens), `_total` for counters. Emitting never fails a request: errors are logged once.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from tsbatch.handlers.core.buckets import Bucket, bucket_label, bucket_tokens

logger = logging.getLogger(__name__)

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str
    unit: str
    labels: tuple[str, ...]
    help: str


# One vocabulary with the code, configs/metrics.yaml, the dashboard and the README.
SPECS = {s.name: s for s in (
    Spec("tsbatch_batch_size", HISTOGRAM, "count", ("bucket",), "texts per forward pass (each text of a request of several counts)"),
    Spec("tsbatch_real_tokens_total", COUNTER, "count", ("bucket",), "tokens of real input computed"),
    Spec("tsbatch_padded_tokens_total", COUNTER, "count", ("bucket",), "tokens computed, padding included"),
    Spec("tsbatch_padding_waste_ratio", GAUGE, "ratio", ("bucket",), "padding share of the last batch's tokens"),
    Spec("tsbatch_queue_wait_seconds", HISTOGRAM, "seconds", ("bucket", "priority"), "time in tsbatch's queue (scheduler modes)"),
    Spec("tsbatch_forward_seconds", HISTOGRAM, "seconds", ("bucket",), "one forward pass"),
    Spec("tsbatch_isolated_failures_total", COUNTER, "count", ("bucket",), "requests that failed alone after isolation"),
    Spec("tsbatch_isolation_passes_total", COUNTER, "count", ("bucket",), "extra passes spent isolating failures"),
    Spec("tsbatch_oom_splits_total", COUNTER, "count", ("bucket",), "batches halved after out of memory"),
    Spec("tsbatch_batch_cap", GAUGE, "count", ("bucket",), "largest batch the bucket may form (learned from out of memory; 0: none fits)"),
    Spec("tsbatch_rejected_total", COUNTER, "count", ("reason",), "requests refused with 503 (queue full, or a call's work budget): a request of several texts counts once"),
    Spec("tsbatch_deadline_missed_total", COUNTER, "count", ("bucket",), "texts answered 504 at their deadline (a request of several: each text)"),
    Spec("tsbatch_handler_calls_total", COUNTER, "count", (), "times TorchServe called the handler (re-polls included)"),
    Spec("tsbatch_warmup_seconds", GAUGE, "seconds", ("bucket", "batch"), "warmup time spent on one shape"),
    Spec("tsbatch_warmup_total_seconds", GAUGE, "seconds", (), "warmup time before READY"),
    Spec("tsbatch_gpu_memory_used_bytes", GAUGE, "bytes", ("device",), "GPU memory used (nvidia-ml-py)"),
    Spec("tsbatch_gpu_memory_total_bytes", GAUGE, "bytes", ("device",), "GPU memory total (nvidia-ml-py)"),
    Spec("tsbatch_gpu_utilization_ratio", GAUGE, "ratio", ("device",), "GPU busy share (nvidia-ml-py)"),
    # generation (task: generation): the decode loop of handlers/runtime/generation_engine.py
    Spec("tsbatch_generation_time_to_first_token_seconds", HISTOGRAM, "seconds", (), "from a request's arrival at the handler to its first token"),
    Spec("tsbatch_generation_time_per_output_token_seconds", HISTOGRAM, "seconds", (), "a finished request's time after its first token, per later token"),
    Spec("tsbatch_generation_running_sequences", GAUGE, "count", (), "sequences decoding in the worker's steps"),
    Spec("tsbatch_generation_waiting_sequences", GAUGE, "count", (), "sequences waiting to join (preempted ones included)"),
    Spec("tsbatch_generation_kv_cache_tokens", GAUGE, "count", (), "KV-cache tokens the running sequences hold"),
    Spec("tsbatch_generation_kv_cache_bound_tokens", GAUGE, "count", (), "KV-cache tokens allowed at once (learned lower after out of memory)"),
    Spec("tsbatch_generation_token_budget_tokens", GAUGE, "count", (), "tokens fed to the model in one step at most"),
    Spec("tsbatch_generation_output_tokens_total", COUNTER, "count", (), "tokens generated, all sequences (rate(): tokens/s)"),
    Spec("tsbatch_generation_preemptions_total", COUNTER, "count", (), "sequences preempted (their seat lost, recomputed later)"),
    Spec("tsbatch_generation_out_of_memory_steps_total", COUNTER, "count", (), "steps that ran out of memory (none advanced)"),
    Spec("tsbatch_generation_cancelled_total", COUNTER, "count", (), "sequences freed because their client disconnected"),
)}
# engine stats -> the counter that reports their growth
GENERATION_COUNTERS = {"tokens": "tsbatch_generation_output_tokens_total",
                       "preemptions": "tsbatch_generation_preemptions_total",
                       "out_of_memory_steps": "tsbatch_generation_out_of_memory_steps_total",
                       "cancelled": "tsbatch_generation_cancelled_total"}
GENERATION_GAUGES = {"running": "tsbatch_generation_running_sequences",
                     "waiting": "tsbatch_generation_waiting_sequences",
                     "kv_tokens": "tsbatch_generation_kv_cache_tokens",
                     "kv_bound": "tsbatch_generation_kv_cache_bound_tokens"}
GENERATION_EVERY_S = 0.5  # a step takes milliseconds: its gauges and counters go out at most this often
BASE_LABELS = ("ModelName", "Level")  # TorchServe's own dimensions for model metrics


class Metrics:
    """Named emitters over a TorchServe MetricsStore; `store=None` makes every call a no-op."""

    def __init__(self, store: Any, model_name: str, gpu_sampler: Callable[[], list] | None = None,
                 gpu_every_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.model_name = model_name
        self.gpu_sampler = gpu_sampler
        self.gpu_every_s = gpu_every_s
        self.clock = clock
        self._last_gpu = float("-inf")
        self._failed: set[str] = set()
        self._lock = threading.Lock()
        self._calls = 0  # handler calls not yet emitted
        self._calls_emitted = clock()
        self._generation_sent: dict[str, int] = {}  # engine counters as last emitted
        self._generation_at = float("-inf")

    def emit(self, name: str, value: float, **labels: Any) -> None:
        spec = SPECS[name]
        if self.store is None:
            return
        try:
            from ts.metrics.dimension import Dimension
            from ts.metrics.metric_type_enum import MetricTypes

            dims = [Dimension("ModelName", self.model_name), Dimension("Level", "Model")]
            dims += [Dimension(label, bucket_label(labels[label]) if label == "bucket" else str(labels[label]))
                     for label in spec.labels]
            kind = {COUNTER: MetricTypes.COUNTER, GAUGE: MetricTypes.GAUGE, HISTOGRAM: MetricTypes.HISTOGRAM}[spec.kind]
            with self._lock:
                self.store.add_metric(name, value, spec.unit, None, dims, kind)
        except Exception as error:  # noqa: BLE001 - metrics must never fail a request
            if name not in self._failed:
                self._failed.add(name)
                logger.warning("tsbatch metric %s could not be emitted: %s", name, error)

    # -- what happened, in the words the README and dashboard use
    def batch(self, bucket: Bucket, size: int, real_tokens: int, report: Any) -> None:
        padded = bucket_tokens(bucket) * size
        self.emit("tsbatch_batch_size", size, bucket=bucket)
        self.emit("tsbatch_real_tokens_total", real_tokens, bucket=bucket)
        self.emit("tsbatch_padded_tokens_total", padded, bucket=bucket)
        self.emit("tsbatch_padding_waste_ratio", round(1 - real_tokens / padded, 4) if padded else 0.0, bucket=bucket)
        if report is not None:
            if report.failed:
                self.emit("tsbatch_isolated_failures_total", report.failed, bucket=bucket)
            if report.isolation_passes:
                self.emit("tsbatch_isolation_passes_total", report.isolation_passes, bucket=bucket)
            if report.oom_splits:
                self.emit("tsbatch_oom_splits_total", report.oom_splits, bucket=bucket)
        self.sample_gpu()

    def forward(self, bucket: Bucket, seconds: float) -> None:
        self.emit("tsbatch_forward_seconds", round(seconds, 6), bucket=bucket)

    def cap(self, bucket: Bucket, cap: int) -> None:
        self.emit("tsbatch_batch_cap", cap, bucket=bucket)

    def queue_wait(self, bucket: Bucket, priority: str, seconds: float) -> None:
        self.emit("tsbatch_queue_wait_seconds", round(max(0.0, seconds), 6), bucket=bucket, priority=priority)

    def rejected(self, reason: str) -> None:
        self.emit("tsbatch_rejected_total", 1, reason=reason)

    def deadline_missed(self, bucket: Bucket) -> None:
        self.emit("tsbatch_deadline_missed_total", 1, bucket=bucket)

    def handler_call(self) -> None:
        """Counted on every call, emitted at most once a second: a metric line per call would cost
        about what a continuous-mode re-poll itself costs. Called from TorchServe's thread only."""
        self._calls += 1
        now = self.clock()
        if now - self._calls_emitted >= 1.0:
            self.emit("tsbatch_handler_calls_total", self._calls)
            self._calls, self._calls_emitted = 0, now

    def generation_budget(self, token_budget: int) -> None:
        self.emit("tsbatch_generation_token_budget_tokens", token_budget)

    def generation_step(self, stats: dict, ended: list) -> None:
        """After an engine step: the time to first token and per output token of each sequence that
        finished, and (at most every GENERATION_EVERY_S, and whenever the worker falls idle) the
        gauges and the counters' growth. Called from the engine's thread only."""
        for seq in ended:
            first, end, tokens = seq.first_token_at, seq.ended_at, len(seq.tokens)
            if first is None or end is None or getattr(seq.status, "value", "") != "finished":
                continue
            self.emit("tsbatch_generation_time_to_first_token_seconds", round(first - seq.request.arrived, 6))
            if tokens > 1:
                self.emit("tsbatch_generation_time_per_output_token_seconds", round((end - first) / (tokens - 1), 6))
        now = self.clock()
        idle = not stats["running"] and not stats["waiting"]
        if not idle and now - self._generation_at < GENERATION_EVERY_S:
            return
        self._generation_at = now
        for key, name in GENERATION_GAUGES.items():
            self.emit(name, stats[key])
        for key, name in GENERATION_COUNTERS.items():
            grown = stats[key] - self._generation_sent.get(key, 0)
            if grown > 0:
                self.emit(name, grown)
                self._generation_sent[key] = stats[key]

    def warmup(self, profile: Any) -> None:
        for shape in profile.own_shapes():
            self.emit("tsbatch_warmup_seconds", round(shape.total_ms / 1000, 4), bucket=shape.bucket, batch=shape.batch)
        self.emit("tsbatch_warmup_total_seconds", profile.warmup_seconds)

    def sample_gpu(self, force: bool = False) -> None:
        if self.gpu_sampler is None:
            return
        now = self.clock()
        if not force and now - self._last_gpu < self.gpu_every_s:
            return
        self._last_gpu = now
        try:
            samples = self.gpu_sampler()
        except Exception as error:  # noqa: BLE001
            logger.warning("tsbatch: GPU sampling failed, stopping it: %s", error)
            self.gpu_sampler = None
            return
        for device, used, total, utilization in samples:
            self.emit("tsbatch_gpu_memory_used_bytes", used, device=device)
            self.emit("tsbatch_gpu_memory_total_bytes", total, device=device)
            self.emit("tsbatch_gpu_utilization_ratio", utilization, device=device)


def nvml_sampler(device_indices: list[int]) -> Callable[[], list] | None:
    """A sampler over nvidia-ml-py for these GPUs, or None when there is no NVIDIA GPU/driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in device_indices]
    except Exception:  # noqa: BLE001 - no driver, no library, no GPU: no GPU metrics, no error
        return None

    def sample() -> list:
        out = []
        for index, handle in handles:
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            busy = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            out.append((str(index), int(memory.used), int(memory.total), busy))
        return out

    return sample


def metrics_yaml_section() -> dict:
    """tsbatch's `model_metrics` entries, as configs/metrics.yaml declares them."""
    section: dict = {}
    for spec in SPECS.values():
        section.setdefault(spec.kind, []).append(
            {"name": spec.name, "unit": spec.unit, "dimensions": list(BASE_LABELS + spec.labels)})
    return section
