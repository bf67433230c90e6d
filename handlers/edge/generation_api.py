"""The generation handler's contract: its `handler:` settings, what a request says, what it is answered.

Request: JSON {"text": "...", "max_new_tokens": 16, "stream": false} (max_new_tokens and stream
optional) or a plain-text body; headers X-Priority (high, normal, low), X-Deadline-Ms and
X-Deadline-At, read by the encoder modes' own rules (handlers/edge/stages.py). Answer: {"generated_text": "...", "new_tokens": n, "finish_reason": "eos" or
"length"}. A streamed answer is newline-delimited JSON: one {"token": id, "text": "..."} line per
token as it is made, then the whole answer as its last line (or {"error": ..., "code": N} when it
failed after its first line; before that it is answered with its own status like any request).
Pure: no torch.
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from tsbatch.handlers.core.errors import BadInput, ConfigError
from tsbatch.handlers.core.generation_policy import GenerationSettings, Priority
from tsbatch.handlers.edge.config import BOOL, NON_EMPTY_STRING, POSITIVE_INT, STRING, Check, keys_of, optional, setting
from tsbatch.handlers.edge.stages import client_deadline

PRIORITY_HEADER = "x-priority"  # the encoder modes' name for the same header
TASK = "generation"
EXAMPLE = 'send JSON {"text": "...", "max_new_tokens": N, "stream": false} or a plain-text body'


def _generation_task(label: str, value: Any) -> str:
    if value != TASK:
        raise ConfigError(f"{label} must be {TASK!r} for the generation handler, got {value!r}")
    return value


def _cpu_or_auto(label: str, value: Any) -> str:
    if value not in ("auto", "cpu"):
        raise ConfigError(f"{label} must be auto or cpu, got {value!r}")
    return value


def _fraction(label: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{label} must be a fraction above 0 and at most 1, got {value!r}")
    return float(value)


def _setting(default: Any, doc: str, check: Check) -> Any:
    """A generation key: read in async mode, the only one the generation handler serves in."""
    return setting(default, doc, check, modes=("async",))


GENERATION_TASK = Check("`generation`", _generation_task)
CPU_OR_AUTO = Check("`auto` or `cpu`", _cpu_or_auto)
FRACTION = Check("fraction (0 < f <= 1)", _fraction)


@dataclass(frozen=True)
class GenerationConfig:
    """The `handler:` section of a generation model's model-config.yaml; one message per bad key.
    Each key is declared with _setting() as HandlerConfig's are (handlers/edge/config.py), so its
    check and its documentation (docs/configuration.md) have one home."""

    task: str = _setting(TASK, "selects the built-in generation handler (`tsbatch archive --task generation`)",
                        GENERATION_TASK)
    model_dir: str = _setting("model", "the model's files, relative to the archive's root", STRING)
    device: str = _setting("auto", "auto: the GPU TorchServe assigns, else the CPU; or cpu", CPU_OR_AUTO)
    torch_threads: int | None = _setting(None, "intra-op threads of the worker", optional(POSITIVE_INT, "torch's own"))
    max_new_tokens: int = _setting(256, "the most new tokens one request may ask for; more: 400", POSITIVE_INT)
    default_new_tokens: int = _setting(16, "what a request that names no max_new_tokens gets", POSITIVE_INT)
    token_budget: int = _setting(512, "tokens fed to the model in one step (a decode feeds 1, a prefill its prompt)",
                                POSITIVE_INT)
    kv_bound: int = _setting(16384, "KV-cache tokens live at once, all sequences together (learned lower on out of "
                                   "memory); on CUDA at most what kv_memory_share of the free memory holds",
                            POSITIVE_INT)
    kv_memory_share: float = _setting(0.8, "on CUDA: the share of the device's free memory at load the KV cache may "
                                          "take", FRACTION)
    max_running: int = _setting(16, "sequences decoding in one step at most", POSITIVE_INT)
    queue_cap: int = _setting(64, "requests waiting at most; past it 503 with Retry-After", POSITIVE_INT)
    priority_aging_ms: int = _setting(1000, "a waiting request gains one priority class per this many ms",
                                     POSITIVE_INT)
    preempt_for_priority: bool = _setting(True, "a waiting request may preempt running ones of a lower class "
                                               "(recomputed later)", BOOL)
    prefill_apart: bool = _setting(True, "joining requests prefill in a step of their own and the next step decodes "
                                         "(false: they prefill in the running sequences' decode step)", BOOL)
    deadline_ms: int = _setting(120000, "the longest a request may take in all (504 past it); X-Deadline-Ms or "
                                       "X-Deadline-At may only shorten it", POSITIVE_INT)
    warmup: bool = _setting(True, "run every prefill shape and decode batch size the engine forms in initialize(), "
                                  "before READY; the timings are kept as generation_profile.json", BOOL)
    warmup_repeats: int = _setting(3, "timed passes per shape at warmup, at least", POSITIVE_INT)
    warmup_max_repeats: int = _setting(6, "timed passes per shape at most, until two agree within 10% (at least "
                                          "warmup_repeats)", POSITIVE_INT)
    fault_oom_substring: str | None = _setting(None, "chaos testing, off unless set: the first step that holds a "
                                                     "request whose text contains this runs out of memory (once per "
                                                     "request), as a step too big for the device would",
                                               optional(NON_EMPTY_STRING))

    @classmethod
    def from_section(cls, section: Mapping[str, Any] | None) -> "GenerationConfig":
        section = dict(section or {})
        known = keys_of(cls)
        for key in section:
            if key not in known:
                near = difflib.get_close_matches(str(key), known, n=1)
                raise ConfigError(f"handler.{key} is not a generation setting"
                                  + (f" (did you mean {near[0]}?)" if near else f"; known: {', '.join(known)}"))
        config = cls(**{key: known[key].check(f"handler.{key}", value) for key, value in section.items()})
        if config.default_new_tokens > config.max_new_tokens:
            raise ConfigError(f"handler.default_new_tokens ({config.default_new_tokens}) must be at most "
                              f"max_new_tokens ({config.max_new_tokens})")
        if config.warmup_max_repeats < config.warmup_repeats:
            raise ConfigError(f"handler.warmup_max_repeats ({config.warmup_max_repeats}) must be at least "
                              f"warmup_repeats ({config.warmup_repeats})")
        config.settings()  # the policy's own checks, at load
        return config

    def settings(self, kv_bound: int | None = None, prefill_edges: tuple[int, ...] = ()) -> GenerationSettings:
        """The policy's settings; `kv_bound`: the device's own bound, where it is known (kv_bound_for);
        `prefill_edges`: the model's (warmup/generation_profile.prefill_edges of its positions)."""
        kv_bound = self.kv_bound if kv_bound is None else min(self.kv_bound, kv_bound)
        return GenerationSettings(token_budget=self.token_budget, kv_bound=kv_bound, max_running=self.max_running,
                                queue_cap=self.queue_cap, priority_aging=self.priority_aging_ms / 1000,
                                preempt_for_priority=self.preempt_for_priority, prefill_edges=prefill_edges,
                                prefill_apart=self.prefill_apart)


def kv_bound_for(free_bytes: int, bytes_per_token: int, share: float) -> int:
    """KV-cache tokens that `share` of `free_bytes` holds (at least 1: the policy refuses what
    cannot fit, and out of memory lowers it further)."""
    return max(1, int(free_bytes * share) // max(1, bytes_per_token))


@dataclass(frozen=True)
class Ask:
    """One request, parsed: the text to continue, how many new tokens at most, streamed or not."""

    text: str
    max_new_tokens: int
    stream: bool = False


def parse_ask(body: Any, config: GenerationConfig) -> Ask:
    """A TorchServe row's payload (bytes, str for text/*, a parsed object for JSON) as an Ask, or BadInput."""
    if isinstance(body, (bytes, bytearray)):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError:
            raise BadInput(f"the body is not UTF-8: {EXAMPLE}") from None
    if isinstance(body, str) and body.lstrip().startswith("{"):
        try:
            body = json.loads(body)
        except ValueError:
            raise BadInput(f"the body is not valid JSON: {EXAMPLE}") from None
    new_tokens, stream = config.default_new_tokens, False
    if isinstance(body, Mapping):
        unknown = sorted(set(body) - {"text", "max_new_tokens", "stream"})
        if unknown:
            raise BadInput(f"unknown field {unknown[0]!r}: {EXAMPLE}")
        new_tokens = body.get("max_new_tokens", new_tokens)
        stream = body.get("stream", False)
        body = body.get("text")
    if not isinstance(body, str) or not body.strip():
        raise BadInput(f"the text is missing or empty: {EXAMPLE}")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or not 1 <= new_tokens <= config.max_new_tokens:
        raise BadInput(f"max_new_tokens must be a whole number from 1 to {config.max_new_tokens}, got {new_tokens!r}")
    if not isinstance(stream, bool):
        raise BadInput(f"stream must be true or false, got {stream!r}")
    return Ask(body, new_tokens, stream)


def priority_of(headers: Mapping[str, Any]) -> Priority:
    return Priority.parse(headers.get(PRIORITY_HEADER))


def deadline_of(headers: Mapping[str, Any], config: GenerationConfig, now: float, wall: float | None = None) -> float:
    """Monotonic seconds by which the answer must be complete: deadline_ms, or what the client asked
    (X-Deadline-Ms, X-Deadline-At: stages.client_deadline, the encoder modes' one rule) if sooner."""
    asked = client_deadline(dict(headers), now, wall)
    longest = now + config.deadline_ms / 1000
    return longest if asked is None else min(longest, asked)


def answer_body(text: str, new_tokens: int, finish_reason: str) -> dict:
    return {"generated_text": text, "new_tokens": new_tokens, "finish_reason": finish_reason}


def line(body: Mapping[str, Any]) -> str:
    """One line of a streamed answer."""
    return json.dumps(body) + "\n"


class TextStream:
    """A growing token list's text, piece by piece: each piece is what the newest token adds to the
    text of the few tokens before it. Only a window of the last tokens is decoded at each token:
    decoding them all cost a long answer quadratic time on the event loop that sends every stream's
    tokens. Text ending in an incomplete character (U+FFFD: a byte-level token that needs the next
    one) waits for the token that completes it. Where a later token changes text already handed out
    (a tokenizer's clean-up across tokens), that piece is empty and the stream goes on from the new
    text. The final line of a stream carries the whole text either way."""

    WINDOW = 8  # tokens decoded before the newest ones (the window slides when it is twice this)

    def __init__(self, decode):
        self.decode = decode  # token ids -> text
        self.tokens: list[int] = []
        self.start = 0  # the window's first token
        self.shown = ""  # the window's text handed out so far

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.decode(self.tokens[self.start:])
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self.shown):] if text.startswith(self.shown) else ""
        self.shown = text
        if len(self.tokens) - self.start >= 2 * self.WINDOW:
            self.start = len(self.tokens) - self.WINDOW
            self.shown = self.decode(self.tokens[self.start:])
        return piece
