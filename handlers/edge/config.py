"""The configuration classes of model-config.yaml, each validated once with one message per bad field.

- `HandlerConfig`: the `handler:` section, read by the handler's `initialize()` (a bad field fails
  the load, never a request); `FaultInjection` is its `fault_injection:` sub-section.
- `HandlerConfig.model`: the `model:` section, a team's model's own settings. tsbatch checks only
  that it is a mapping and hands it to `load_model` read-only as `config.model`; the model
  validates its own keys (raise ConfigError).
- `FrontendConfig`: the TorchServe frontend keys tsbatch writes at the top of model-config.yaml,
  checked by the archiver before it builds an archive.

One place defines a key: its dataclass field, declared with
`setting(default, doc, check, modes=..., encoder_only=...)`. The known keys, the did-you-mean for
unknown ones, each value's check and conversion (strings to enums at this boundary) and
docs/configuration.md (`python -m tsbatch.archiver config-docs`) are all read from those fields.
To add a key: add one field with setting() (a Check from the list below, or a new one), then
regenerate docs/configuration.md; tests/unit/test_config_docs.py fails for a field without doc or
check and for a stale docs file.
"""
from __future__ import annotations

import copy
import difflib
import enum
import re
import time
from dataclasses import MISSING, Field, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, Mapping

from tsbatch.handlers.core.buckets import (Bucket, batch_cap, bucket_grid, bucket_label, bucket_order, bucket_tokens, check_edges,
                                           default_edges, parse_bucket, power_of_two_edges)
from tsbatch.handlers.core.errors import ConfigError

SETTING = "tsbatch.setting"  # the metadata key of a field declared with setting()
DOCS = "docs/configuration.md"
# how requests reach the handler (handlers/edge/modes/): TorchServe's own batching, continuousBatching, asyncCommunication
MODES = ("default", "continuous", "async")
SCHEDULER_MODES = ("continuous", "async")  # tsbatch's scheduler and lanes run in the worker


class Task(str, enum.Enum):
    EMBEDDING = "embedding"
    SEQUENCE_CLASSIFICATION = "sequence_classification"
    TOKEN_CLASSIFICATION = "token_classification"


class Dtype(str, enum.Enum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class DeviceType(str, enum.Enum):
    CPU = "cpu"
    GPU = "gpu"


class InjectedFault(RuntimeError):
    """Raised by the fault-injection seam in place of a real model failure."""


# -- checks: a YAML value in, the field's value out, or one ConfigError naming the key and what it got

@dataclass(frozen=True)
class Check:
    """How one key's YAML value becomes its field's value. `kind` is the type as the docs show it;
    `convert(label, value)` returns the value or raises ConfigError("LABEL must be ..., got ...")."""

    kind: str
    convert: Callable[[str, Any], Any]

    def __call__(self, label: str, value: Any) -> Any:
        return self.convert(label, value)


def _positive_int(label: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{label} must be a positive integer, got {value!r}")
    return value


def _bool(label: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{label} must be true or false, got {value!r}")
    return value


def _str(label: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{label} must be a string, got {value!r}")
    return value


def _non_empty_str(label: str, value: Any) -> str:
    if not _str(label, value):
        raise ConfigError(f"{label} must not be empty")
    return value


def one_of(kind: type[enum.Enum]) -> Check:
    """A string turned into its enum member here, at the boundary."""
    values = [k.value for k in kind]

    def convert(label: str, value: Any):
        try:
            return kind(value)
        except (ValueError, TypeError):
            raise ConfigError(f"{label} must be one of {values}, got {value!r}") from None

    return Check("one of " + ", ".join(f"`{v}`" for v in values), convert)


def optional(check: Check, meaning: str = "") -> Check:
    """The check, or null for None (`meaning` says what null does, for the docs)."""
    return Check(f"{check.kind}, or `null`" + (f" ({meaning})" if meaning else ""),
                 lambda label, value: None if value is None else check(label, value))


def _device(label: str, value: Any) -> str:
    device = _str(label, value)
    if device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
        raise ConfigError(f"{label} must be auto, cpu or cuda[:N], got {device!r}")
    return device


def _edges(label: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{label} must be a non-empty list of token lengths, got {value!r}")
    edges = tuple(_positive_int(f"{label}[{i}]", v) for i, v in enumerate(value))
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ConfigError(f"{label} must be strictly increasing, got {list(edges)}")
    return edges


def _buckets(label: str, value: Any):
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple)) for v in value):
        return tuple(_edges(f"{label}[{i}]", v) for i, v in enumerate(value))
    return _edges(label, value)


def _bucket_key(label: str, key: Any) -> Bucket:
    """A batch_caps key: an edge (16, "16") or one edge per size ("32x16")."""
    try:
        bucket = parse_bucket(key)
    except (TypeError, ValueError):
        bucket = key
    for edge in bucket if isinstance(bucket, tuple) else (bucket,):
        _positive_int(f"{label} key {key!r}", edge)
    return bucket


def _batch_caps(label: str, value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{label} must map bucket edges to batch sizes, got {value!r}")
    return {_bucket_key(label, k): _positive_int(f"{label}[{k}]", v) for k, v in value.items()}


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _memory_budget(label: str, value: Any) -> float | int:
    """0 < fraction <= 1 of the device, a whole number of bytes, or a size such as "50GB" / "48GiB"."""
    if isinstance(value, float) and 0 < value <= 1:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 1:
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?b|b)?\s*", value.lower())
        if match and float(match.group(1)) > 0:
            return int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    raise ConfigError(f"{label} must be a fraction of the device (0 < f <= 1), bytes, or a size "
                      f"such as \"50GB\", got {value!r}")


def _fault_injection(label: str, value: Any) -> "FaultInjection":
    if value is None:
        return FaultInjection()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{label} must be a mapping, got {value!r}")
    return FaultInjection(**parse_section(FaultInjection, value, f"{label}."))


def _model_section(label: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{label} must be a mapping of your model's own settings, got {value!r}")
    return MappingProxyType(copy.deepcopy(dict(value)))  # the model's own copy: YAML's dicts stay the caller's


def _loopback_address(label: str, value: Any) -> str:
    """http://HOST:PORT with a loopback HOST: the worker sends to it, so never off this host."""
    address = _str(label, value).rstrip("/")
    match = re.fullmatch(r"http://(127\.\d+\.\d+\.\d+|localhost|\[::1\]):(\d{1,5})", address)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(f"{label} must be TorchServe's inference address on loopback, such as "
                          f"http://127.0.0.1:8080, got {value!r}")
    return address


POSITIVE_INT = Check("positive integer", _positive_int)
BOOL = Check("`true` or `false`", _bool)
STRING = Check("string", _str)
NON_EMPTY_STRING = Check("non-empty string", _non_empty_str)
DEVICE = Check("`auto`, `cpu`, `cuda` or `cuda:N`", _device)
BUCKETS = Check("list of increasing token lengths, or one such list per size", _buckets)
BATCH_CAPS = Check("mapping of bucket (`16`, or `\"32x16\"` for two sizes) to positive integer", _batch_caps)
MEMORY_BUDGET = Check("fraction of the device (0 < f <= 1), bytes, or a size such as `\"50GB\"`", _memory_budget)
FAULT_INJECTION = Check("mapping (`handler.fault_injection` below)", _fault_injection)
MODEL_SECTION = Check("mapping of your model's own keys", _model_section)
LOOPBACK_ADDRESS = Check("`http://127.0.0.1:PORT` (a loopback address)", _loopback_address)


# -- declaring a key, and reading a section by its declared keys

@dataclass(frozen=True)
class Setting:
    """What a config field's metadata holds: its documentation and its check."""

    doc: str
    check: Check
    modes: tuple[str, ...] = MODES  # the serving modes that read it
    encoder_only: bool = False  # read only by the built-in encoder (handlers/models/encoder.py), not a team's model
    section: str | None = None  # another section of model-config.yaml than its class's (HandlerConfig.model)


def setting(default: Any = MISSING, doc: str = "", check: Check | None = None, *, factory: Callable[[], Any] | None = None,
            modes: tuple[str, ...] = MODES, encoder_only: bool = False, section: str | None = None) -> Any:
    """A config field that is a key of model-config.yaml: its default, what it means, how it is checked."""
    meta = {SETTING: Setting(doc, check, tuple(modes), encoder_only, section)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def declared(cls) -> list[tuple[Field, Setting | None]]:
    """Every field of a config class with its Setting (None where the field was declared without one)."""
    return [(f, f.metadata.get(SETTING)) for f in fields(cls)]


def keys_of(cls) -> dict[str, Setting]:
    """The keys of the class's own section; a field declared without setting() is a bug, said here."""
    keys = {}
    for f, meta in declared(cls):
        if not isinstance(meta, Setting) or not meta.doc or not isinstance(meta.check, Check):
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting(default, doc, check): it would be "
                            f"no key of model-config.yaml (see {__name__}'s docstring)")
        if meta.section is None:
            keys[f.name] = meta
    return keys


def default_of(f: Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def parse_section(cls, section: Mapping[str, Any], prefix: str, where: str | None = None) -> dict[str, Any]:
    """The checked values of a section's keys; ConfigError for unknown keys (with the nearest known
    key) and for the first bad value. `prefix` starts each key's label ("handler."), `where` names
    the section in the unknown-keys message."""
    keys = keys_of(cls)
    unknown = sorted(map(str, set(section) - set(keys)))
    if unknown:
        hints = {k: difflib.get_close_matches(k, sorted(keys), n=1) for k in unknown}
        near = "; ".join(f"{k!r}: did you mean {m[0]!r}?" for k, m in hints.items() if m)
        raise ConfigError(f"{where or prefix.rstrip('.')}: unknown key(s) {unknown}" + (f" ({near})" if near else "")
                          + f"; {DOCS} lists the known keys")
    return {name: keys[name].check(prefix + name, value) for name, value in section.items()}


def _mapping(label: str, section: Any) -> Mapping[str, Any]:
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"{label}: must be a mapping of settings, got {section!r}")
    return section


# -- the classes

@dataclass(frozen=True)
class FaultInjection:
    """Chaos-testing seam: only model-config.yaml can switch it on, never a client. It acts before
    every forward pass, whatever the model (handlers/api.py)."""

    substring: str | None = setting(None, "a pass holding a request whose text (or, for other inputs, their printed "
                                          "form) contains this fails as the model would", optional(NON_EMPTY_STRING))
    oom_above_batch: int | None = setting(None, "a pass of more requests than this fails with out of memory",
                                          optional(POSITIVE_INT))
    oom_above_tokens: int | None = setting(None, "a pass of more padded tokens (batch x bucket) than this fails with out "
                                                 "of memory: memory that grows with the shape", optional(POSITIVE_INT))
    slow_substring: str | None = setting(None, "a pass holding a request that contains this first keeps its CPU busy for "
                                               "`slow_ms`: a slow model, for drills that kill a busy worker",
                                         optional(NON_EMPTY_STRING))
    slow_ms: int = setting(3000, "how long a pass holding `slow_substring` keeps its CPU busy", POSITIVE_INT)

    @property
    def enabled(self) -> bool:
        return (self.substring is not None or self.oom_above_batch is not None or self.oom_above_tokens is not None
                or self.slow_substring is not None)

    def check(self, batch) -> None:
        """Raise what the configured fault says this batch meets, as the model would (or, for
        `slow_substring`, first take as long as a slow model would)."""
        if self.slow_substring is not None and any(self.slow_substring in _shown(item.input) for item in batch.items):
            until = time.perf_counter() + self.slow_ms / 1000
            while time.perf_counter() < until:  # busy, as a pass is: drills wait for the worker's CPU
                sum(range(1000))
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
    """The `handler:` section, plus the `model:` section as `model`: a read-only mapping that
    reaches `TsbatchHandler.load_model(model_path, config, gpu_id)` as `config.model`, so a
    subclass written before the section existed loads unchanged."""

    task: Task | None = setting(None, "what the built-in encoder serves (`tsbatch archive --task`, default "
                                      "embedding); none for your own model", one_of(Task), encoder_only=True)
    model_dir: str = setting("model", "the model's files, relative to the archive's root", STRING)
    truncation: bool = setting(True, "inputs longer than max_length are truncated; `false` answers them 413",
                               BOOL, encoder_only=True)
    max_length: int | None = setting(None, "most tokens per input; null: the model's own (sentence-transformers' "
                                           "max_seq_length, else its positions)", optional(POSITIVE_INT),
                                     encoder_only=True)
    buckets: tuple[int, ...] | tuple[tuple[int, ...], ...] | None = setting(
        None, "length bucket edges: a request is padded to its bucket's edge only. A model with two sizes takes one "
              "list per size (`[[16, 64, 128], [8, 32, 256]]`). null: 8 apart to 64, 16 to 128, 32 to 256, 64 to "
              "512, then 128 apart (powers of two per size for several sizes), up to the model's max_length",
        optional(BUCKETS))
    max_batch_tokens: int = setting(4096, "padded tokens one pass may hold: a bucket of edge E runs at most "
                                          "max_batch_tokens / E requests at once", POSITIVE_INT)
    max_batch_size: int = setting(16, "most requests in one pass (batch sizes are powers of two)", POSITIVE_INT)
    batch_caps: dict[Bucket, int] = setting(
        doc="per bucket, the largest batch; `tsbatch tune` writes it from the latency profile",
        check=BATCH_CAPS, factory=dict)
    isolation_budget: int = setting(16, "extra passes one failing batch may spend finding the failing requests "
                                        "before the rest fail fast with 503", POSITIVE_INT)
    device: str = setting("auto", "where the model runs; auto: the GPU TorchServe assigns, else the CPU", DEVICE)
    torch_threads: int | None = setting(None, "intra-op threads per worker; null: torch's, never more than this "
                                              "worker's share of the cores", optional(POSITIVE_INT))
    fault_injection: FaultInjection = setting(doc="chaos testing: fail passes on purpose (off unless set)",
                                              check=FAULT_INJECTION, factory=FaultInjection)
    max_wait_ms: int = setting(2, "the longest a bucket's oldest request is held for company (only while waiting "
                                  "pays)", POSITIVE_INT, modes=SCHEDULER_MODES)
    poll_ms: int = setting(5, "a call returns for new arrivals after this long even if no pass finished",
                           POSITIVE_INT, modes=("continuous",))
    max_call_ms: int = setting(100, "with sibling workers: the work one call that found a backlog may take in per "
                                    "lane; the rest get 503 with Retry-After", POSITIVE_INT, modes=("continuous",))
    queue_cap: int = setting(64, "texts waiting for one lane of a worker (a request of several counts each; "
                                 "short and long lanes each have their own, so a long backlog never refuses short "
                                 "requests); past it 503 with Retry-After", POSITIVE_INT, modes=SCHEDULER_MODES)
    max_texts_per_request: int = setting(32, "most texts in one request (`{\"text\": [...]}`, KServe instances); "
                                             "more: 413", POSITIVE_INT)
    max_tokens_per_request: int = setting(8192, "most tokens of one request's texts together; more: 413", POSITIVE_INT)
    age_bound_ms: int = setting(250, "a bucket whose oldest request waited this long goes next, whatever its length",
                                POSITIVE_INT, modes=SCHEDULER_MODES)
    priority_aging_ms: int = setting(1000, "a waiting request gains one priority class per this many ms",
                                     POSITIVE_INT, modes=SCHEDULER_MODES)
    deadline_ms: int = setting(30000, "a request that cannot be answered within this is refused at once (503, "
                                      "Retry-After) when its lane holds more work, else answered 504, never late; "
                                      "clients may ask for less with X-Deadline-Ms",
                               POSITIVE_INT, modes=SCHEDULER_MODES)
    deadline_margin_ms: int = setting(50, "the part of every deadline kept for what the worker cannot see (the "
                                          "frontend's intake, the reply's way back)", POSITIVE_INT,
                                      modes=SCHEDULER_MODES)
    long_lane_from: int | None = setting(128, "buckets whose row costs at least this many tokens (for two sizes, "
                                              "the sum of the edges) run on a lane of their own",
                                         optional(POSITIVE_INT, "one lane"), modes=SCHEDULER_MODES)
    borrow_cores: bool = setting(False, "the long lane's pass runs on every lane's threads while the other lanes "
                                        "are idle with nothing queued, the profile says that saves 10 ms or more and "
                                        "the pass is likely over before the next arrival (light load: lower p50, "
                                        "higher p99 when work arrives mid-pass; only beside lanes of one thread, so "
                                        "the worker keeps one OpenMP team); warmup then also times every shape on "
                                        "all the lanes' threads",
                                 BOOL, modes=SCHEDULER_MODES)
    warmup: bool = setting(True, "run every (batch size, bucket) shape in initialize(), before READY", BOOL)
    warmup_repeats: int = setting(3, "timed passes per shape at warmup, at least", POSITIVE_INT)
    warmup_max_repeats: int = setting(6, "timed passes per shape at most, until two agree within 10% (at least "
                                         "warmup_repeats)", POSITIVE_INT)
    frontend_warmup: str | None = setting(None, "TorchServe's inference address: as the worker goes READY it sends "
                                                "this model three short requests through the frontend, so the "
                                                "frontend's and the handler's first-request costs fall on them, not "
                                                "on a client (the metrics count them); `tsbatch archive` sets it "
                                                "from config.properties (not with token authorization)",
                                          optional(LOOPBACK_ADDRESS, "no such request"))
    compile: bool = setting(False, "torch.compile with static shapes; warmup compiles every shape before READY",
                            BOOL, encoder_only=True)
    trace: bool = setting(True, "run a TorchScript trace of the model, kept only if it answers exactly as eager; "
                                "off with compile", BOOL, encoder_only=True)
    dtype: Dtype = setting(Dtype.FLOAT32, "the model's weights and activations (inputs stay token ids, answers come "
                                          "back float32); on a CPU without matrix units for them float16 and bfloat16 "
                                          "run slower than float32 (a warning says so)", one_of(Dtype), encoder_only=True)
    cuda_graphs: bool = setting(False, "on CUDA: each shape warmup runs is captured as a CUDA graph before READY and "
                                       "replayed for its passes, kept only if it answers exactly as eager; off on the "
                                       "CPU and with compile", BOOL, encoder_only=True)
    memory_budget: float | int | None = setting(None, "per worker: the device memory it may use; enforced on CUDA "
                                                      "only", optional(MEMORY_BUDGET))
    model: Mapping[str, Any] = setting(doc="your model's own settings, handed to load_model read-only as "
                                           "`config.model`; tsbatch checks only that it is a mapping",
                                       check=MODEL_SECTION, factory=lambda: MappingProxyType({}), section="model")

    @classmethod
    def from_yaml(cls, section: Mapping[str, Any] | None, model: Mapping[str, Any] | None = None) -> "HandlerConfig":
        """Build from the parsed `handler:` section (and `model:` section); raise ConfigError naming the bad field."""
        values = parse_section(cls, _mapping("handler", section), "handler.")
        values["model"] = _model_section("model", model)
        config = cls(**values)
        if config.warmup_max_repeats < config.warmup_repeats:
            raise ConfigError(
                f"handler.warmup_max_repeats ({config.warmup_max_repeats}) must be at least "
                f"warmup_repeats ({config.warmup_repeats})"
            )
        return config

    @property
    def lanes(self) -> int:
        """Lanes a worker runs at most: two with a long lane (one when no bucket reaches it)."""
        return 1 if self.long_lane_from is None else 2

    @property
    def held(self) -> int:
        """Texts a worker may hold waiting: queue_cap for each lane."""
        return self.queue_cap * self.lanes

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


@dataclass(frozen=True)
class FrontendConfig:
    """The TorchServe frontend keys tsbatch writes at the top of model-config.yaml (the names are
    TorchServe's); defaults are configs/model-config.yaml's, which `tsbatch tune` replaces. TorchServe
    ignores a wrongly typed value with a warning, so the archiver checks them before it builds."""

    continuousBatching: bool = setting(True, "continuous mode (the default): the frontend hands the worker every "
                                             "request it holds plus new ones on each call; tsbatch's scheduler "
                                             "answers each when its own pass ends", BOOL, modes=("continuous",))
    asyncCommunication: bool = setting(False, "async mode (`--mode async`): the worker runs handle() as asyncio "
                                              "tasks; TorchServe 0.12 never replaces an async worker that dies",
                                       BOOL, modes=("async",))
    batchSize: int = setting(160, "requests the frontend hands one call: in continuous mode handler.queue_cap for "
                                  "each lane plus 32 new ones; 1 in async mode; in default mode TorchServe's batch",
                             POSITIVE_INT)
    maxBatchDelay: int = setting(1, "ms the frontend waits to fill a batch for an idle worker (0 would become 100)",
                                 POSITIVE_INT)
    minWorkers: int = setting(1, "workers started with the model (tuned: the cores over each worker's threads)",
                              POSITIVE_INT)
    maxWorkers: int = setting(4, "most workers scaling may start (tuned: as many as minWorkers)", POSITIVE_INT)
    jobQueueSize: int = setting(1024, "requests no worker has taken yet (e.g. while workers load); past it 503",
                                POSITIVE_INT)
    responseTimeout: int = setting(120, "seconds one call may take before TorchServe fails its requests and "
                                        "restarts the worker (not enforced in async mode; tuned from the slowest pass)", POSITIVE_INT)
    startupTimeout: int = setting(300, "seconds a worker may take to load and warm every shape before READY "
                                       "(tuned: twice load + warmup)", POSITIVE_INT)
    deviceType: DeviceType | None = setting(None, "`gpu`: TorchServe hands each worker a GPU id; tuned from the "
                                                  "profile's device", optional(one_of(DeviceType), "TorchServe's choice"))

    SECTIONS = ("handler", "model")  # the other top-level keys: HandlerConfig's sections

    @classmethod
    def from_yaml(cls, config: Mapping[str, Any]) -> "FrontendConfig":
        """Check a whole model-config.yaml as tsbatch writes it: its frontend keys here, its
        `handler:` and `model:` sections by HandlerConfig."""
        config = _mapping("model-config.yaml", config)
        handler = check_handler(config.get("handler"), config.get("model"))
        frontend = {k: v for k, v in config.items() if k not in cls.SECTIONS}
        built = cls(**parse_section(cls, frontend, "model-config.yaml: ", "model-config.yaml"))
        if not isinstance(handler, HandlerConfig) and not built.asyncCommunication:
            raise ConfigError("model-config.yaml: the generation handler serves in async mode only: "
                              "asyncCommunication: true")
        if built.continuousBatching and built.asyncCommunication:
            raise ConfigError("model-config.yaml sets both asyncCommunication and continuousBatching: TorchServe "
                              "cannot do both")
        if built.maxWorkers < built.minWorkers:
            raise ConfigError(f"model-config.yaml: maxWorkers ({built.maxWorkers}) must be at least minWorkers "
                              f"({built.minWorkers})")
        return built


def check_handler(section: Mapping[str, Any] | None, model: Mapping[str, Any] | None = None):
    """The `handler:` (and `model:`) section checked by the class of the handler that reads it:
    `task: generation` is the built-in generation handler's GenerationConfig
    (handlers/edge/generation_api.py), anything else HandlerConfig."""
    from tsbatch.handlers.edge.generation_api import TASK, GenerationConfig  # it declares its keys with setting()

    section = _mapping("handler", section)
    if section.get("task") != TASK:
        return HandlerConfig.from_yaml(section, model)
    if model:
        raise ConfigError("the generation handler reads no model: section: put its settings under handler:")
    return GenerationConfig.from_section(section)
