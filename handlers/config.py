"""The handler's configuration: the `handler:` section of model-config.yaml, validated once at load.

A bad field fails `initialize()` with one message that names the field and what it got, so a
broken archive never reaches its first request.
"""
from __future__ import annotations

import difflib
import enum
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from tsbatch.handlers.buckets import (Bucket, batch_cap, bucket_grid, bucket_label, bucket_order, bucket_tokens, check_edges,
                                      default_edges, parse_bucket, power_of_two_edges)
from tsbatch.handlers.errors import ConfigError


class Task(str, enum.Enum):
    EMBEDDING = "embedding"
    SEQUENCE_CLASSIFICATION = "sequence_classification"
    TOKEN_CLASSIFICATION = "token_classification"


class InjectedFault(RuntimeError):
    """Raised by the fault-injection seam in place of a real model failure."""


@dataclass(frozen=True)
class FaultInjection:
    """Chaos-testing seam: only model-config.yaml can switch it on, never a client. It acts before
    every forward pass, whatever the model (handlers/api.py)."""

    substring: str | None = None  # in a request's text (or, for other inputs, their printed form)
    oom_above_batch: int | None = None
    oom_above_tokens: int | None = None  # batch x bucket tokens: memory that grows with the shape

    @property
    def enabled(self) -> bool:
        return self.substring is not None or self.oom_above_batch is not None or self.oom_above_tokens is not None

    def check(self, batch) -> None:
        """Raise what the configured fault says this batch meets, as the model would."""
        if self.substring is not None and any(self.substring in _shown(item.input) for item in batch.items):
            raise InjectedFault(f"fault injection: input contains {self.substring!r}")
        if self.oom_above_batch is not None and batch.size > self.oom_above_batch:
            raise MemoryError(f"fault injection: out of memory for batch of {batch.size} > {self.oom_above_batch}")
        if self.oom_above_tokens is not None and batch.padded_tokens > self.oom_above_tokens:
            raise MemoryError(f"fault injection: out of memory for {batch.size} x {bucket_label(batch.bucket)} tokens "
                              f"> {self.oom_above_tokens}")


def _shown(prepared: Any) -> str:
    text = getattr(prepared, "text", None)
    return text if isinstance(text, str) else str(prepared)


@dataclass(frozen=True)
class HandlerConfig:
    task: Task | None = None
    model_dir: str = "model"
    truncation: bool = True
    max_length: int | None = None
    # edges of one size, or one list of edges per size for a model with several (handlers/buckets.py)
    buckets: tuple[int, ...] | tuple[tuple[int, ...], ...] | None = None
    max_batch_tokens: int = 4096
    max_batch_size: int = 16
    batch_caps: dict[Bucket, int] = field(default_factory=dict)  # bucket -> tuned largest batch
    isolation_budget: int = 16
    device: str = "auto"
    torch_threads: int | None = None
    fault_injection: FaultInjection = field(default_factory=FaultInjection)
    # scheduler modes (continuousBatching or asyncCommunication): tsbatch's scheduler in each worker
    max_wait_ms: int = 2
    poll_ms: int = 5  # continuous mode: a call returns after this long even if nothing finished
    # continuous mode with sibling workers: the work one call may take in (it is answered whole)
    max_call_ms: int = 100
    queue_cap: int = 64  # texts waiting in this worker (a request of several texts counts each)
    # a request of several texts ({"text": [...]}, handlers/parse.py): most texts, most tokens in all
    max_texts_per_request: int = 32
    max_tokens_per_request: int = 8192
    age_bound_ms: int = 250
    priority_aging_ms: int = 1000
    deadline_ms: int = 30000
    # of every deadline, kept for what the worker cannot see: the frontend's intake before handle()
    # and the reply's way back to the client (make chaos: up to 20 ms under 3x overload)
    deadline_margin_ms: int = 50
    long_lane_from: int | None = 128
    # warmup: every (batch size, bucket) shape before the worker reports READY
    warmup: bool = True
    warmup_repeats: int = 3
    warmup_max_repeats: int = 6
    compile: bool = False
    # the built-in encoder runs a TorchScript trace of the model (the same kernels without Python's
    # per-module work: 2-3 ms of a pass of one short text on one CPU thread), kept only if it
    # answers exactly as eager
    trace: bool = True
    # per worker: a fraction of the device (0 < f <= 1) or bytes; enforced on CUDA only (handlers/memory.py)
    memory_budget: float | int | None = None

    @classmethod
    def from_yaml(cls, section: Mapping[str, Any] | None) -> "HandlerConfig":
        """Build from the parsed `handler:` section; raise ConfigError naming the bad field."""
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"handler: must be a mapping of settings, got {section!r}")
        section = dict(section)
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(section) - known))
        if unknown:
            hints = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
            near = "; ".join(f"{k!r}: did you mean {m[0]!r}?" for k, m in hints.items() if m)
            raise ConfigError(
                f"handler: unknown key(s) {unknown}" + (f" ({near})" if near else "")
                + "; the README's handler table lists the known keys"
            )
        values: dict[str, Any] = {}
        if "task" in section:  # the built-in encoder needs it (handlers/runner.py); a team's own model may not
            values["task"] = _enum(Task, "task", section["task"])
        if "model_dir" in section:
            values["model_dir"] = _str("model_dir", section["model_dir"])
        for name in ("truncation", "warmup", "compile", "trace"):
            if name in section:
                values[name] = _bool(name, section[name])
        if section.get("max_length") is not None:
            values["max_length"] = _positive_int("max_length", section["max_length"])
        if section.get("buckets") is not None:
            buckets = section["buckets"]
            if isinstance(buckets, (list, tuple)) and buckets and all(isinstance(v, (list, tuple)) for v in buckets):
                values["buckets"] = tuple(_edges(f"buckets[{i}]", v) for i, v in enumerate(buckets))
            else:
                values["buckets"] = _edges("buckets", buckets)
        for name in ("max_batch_tokens", "max_batch_size", "isolation_budget", "max_wait_ms", "poll_ms", "max_call_ms", "queue_cap",
                     "max_texts_per_request", "max_tokens_per_request",
                     "age_bound_ms", "priority_aging_ms", "deadline_ms", "deadline_margin_ms", "warmup_repeats",
                     "warmup_max_repeats"):
            if name in section:
                values[name] = _positive_int(name, section[name])
        if "device" in section:
            device = _str("device", section["device"])
            if device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
                raise ConfigError(f"handler.device must be auto, cpu or cuda[:N], got {device!r}")
            values["device"] = device
        if section.get("torch_threads") is not None:
            values["torch_threads"] = _positive_int("torch_threads", section["torch_threads"])
        if section.get("batch_caps") is not None:
            caps = section["batch_caps"]
            if not isinstance(caps, Mapping):
                raise ConfigError(f"handler.batch_caps must map bucket edges to batch sizes, got {caps!r}")
            values["batch_caps"] = {_bucket_key(k): _positive_int(f"batch_caps[{k}]", v) for k, v in caps.items()}
        if "long_lane_from" in section:
            lane = section["long_lane_from"]
            values["long_lane_from"] = None if lane is None else _positive_int("long_lane_from", lane)
        if section.get("memory_budget") is not None:
            values["memory_budget"] = _memory_budget(section["memory_budget"])
        if section.get("fault_injection") is not None:
            values["fault_injection"] = _fault_injection(section["fault_injection"])
        config = cls(**values)
        if config.warmup_max_repeats < config.warmup_repeats:
            raise ConfigError(
                f"handler.warmup_max_repeats ({config.warmup_max_repeats}) must be at least "
                f"warmup_repeats ({config.warmup_repeats})"
            )
        return config

    def edges_for(self, max_length: int | tuple[int, ...]) -> tuple[Bucket, ...]:
        """The buckets this model serves, shortest first: edges configured or default, cut at
        `max_length` (one maximum per size for a model with several sizes, whose buckets are every
        combination of one edge per size), and the rule that the token budget holds one request
        of the largest."""
        if isinstance(max_length, tuple):
            configured = self.buckets or (None,) * len(max_length)
            if not isinstance(configured[0], (tuple, type(None))) or len(configured) != len(max_length):
                raise ConfigError(f"handler.buckets must give one list of edges per size: this model has "
                                  f"{len(max_length)} sizes, got {list(self.buckets)}")
            edges = bucket_grid([check_edges(given or power_of_two_edges(most), most)
                                 for given, most in zip(configured, max_length)])
        else:
            if self.buckets and isinstance(self.buckets[0], tuple):
                raise ConfigError(f"handler.buckets must be one list of edges: this model has one size, "
                                  f"got {[list(b) for b in self.buckets]}")
            edges = check_edges(self.buckets or default_edges(max_length), max_length)
        largest = max(edges, key=bucket_order)
        if self.max_batch_tokens < bucket_tokens(largest):
            raise ConfigError(
                f"handler.max_batch_tokens ({self.max_batch_tokens}) must hold one request of the "
                f"largest bucket ({bucket_tokens(largest)} tokens): raise it or lower max_length")
        return edges

    def batch_limit(self, bucket: Bucket) -> int:
        """Largest batch of a bucket by configuration: the token budget, max_batch_size and the
        tuned batch_caps (the worker lowers it further after out of memory: Worker.cap_for)."""
        return min(batch_cap(bucket, self.max_batch_tokens), self.max_batch_size,
                   self.batch_caps.get(bucket, self.max_batch_size))


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _memory_budget(value: Any) -> float | int:
    """0 < fraction <= 1 of the device, a whole number of bytes, or a size such as "50GB" / "48GiB"."""
    if isinstance(value, float) and 0 < value <= 1:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 1:
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?b|b)?\s*", value.lower())
        if match and float(match.group(1)) > 0:
            return int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    raise ConfigError(f"handler.memory_budget must be a fraction of the device (0 < f <= 1), bytes, or a size "
                      f"such as \"50GB\", got {value!r}")


def _fault_injection(value: Any) -> FaultInjection:
    if not isinstance(value, Mapping):
        raise ConfigError(f"handler.fault_injection must be a mapping, got {value!r}")
    unknown = sorted(map(str, set(value) - {"substring", "oom_above_batch", "oom_above_tokens"}))
    if unknown:
        raise ConfigError(
            f"handler.fault_injection: unknown key(s) {unknown}; known: substring, oom_above_batch, oom_above_tokens"
        )
    substring = value.get("substring")
    if substring is not None:
        substring = _str("fault_injection.substring", substring)
        if not substring:
            raise ConfigError("handler.fault_injection.substring must not be empty")
    oom = value.get("oom_above_batch")
    if oom is not None:
        oom = _positive_int("fault_injection.oom_above_batch", oom)
    tokens = value.get("oom_above_tokens")
    if tokens is not None:
        tokens = _positive_int("fault_injection.oom_above_tokens", tokens)
    return FaultInjection(substring=substring, oom_above_batch=oom, oom_above_tokens=tokens)


def _enum(kind: type[enum.Enum], name: str, value: Any):
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(
            f"handler.{name} must be one of {[k.value for k in kind]}, got {value!r}"
        ) from None


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"handler.{name} must be a string, got {value!r}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"handler.{name} must be true or false, got {value!r}")
    return value


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"handler.{name} must be a positive integer, got {value!r}")
    return value


def _bucket_key(key: Any) -> Bucket:
    """A batch_caps key: an edge (16, "16") or one edge per size ("32x16")."""
    try:
        bucket = parse_bucket(key)
    except (TypeError, ValueError):
        bucket = key
    edges = bucket if isinstance(bucket, tuple) else (bucket,)
    for edge in edges:
        _positive_int(f"batch_caps key {key!r}", edge)
    return bucket


def _edges(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"handler.{name} must be a non-empty list of token lengths, got {value!r}")
    edges = tuple(_positive_int(f"{name}[{i}]", v) for i, v in enumerate(value))
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ConfigError(f"handler.{name} must be strictly increasing, got {list(edges)}")
    return edges
