"""The generation handler's contract: its `handler:` settings, what a request says, what it is answered.

Request: JSON {"text": "...", "max_new_tokens": 16, "stream": false} (max_new_tokens and stream
optional) or a plain-text body; headers X-Priority (high, normal, low) and X-Deadline-Ms, as in
the encoder modes. Answer: {"generated_text": "...", "new_tokens": n, "finish_reason": "eos" or
"length"}. A streamed answer is newline-delimited JSON: one {"token": id, "text": "..."} line per
token as it is made, then the whole answer as its last line (or {"error": ..., "code": N} when it
failed after its first line; before that it is answered with its own status like any request).
Pure: no torch.
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, fields
from typing import Any, Mapping

from tsbatch.handlers.core.errors import BadInput, ConfigError
from tsbatch.handlers.core.generation_policy import GenerationSettings, Priority

PRIORITY_HEADER = "x-priority"  # the encoder modes' names for the same two headers
DEADLINE_HEADER = "x-deadline-ms"
TASK = "generation"
EXAMPLE = 'send JSON {"text": "...", "max_new_tokens": N, "stream": false} or a plain-text body'


@dataclass(frozen=True)
class GenerationConfig:
    """The `handler:` section of a generation model's model-config.yaml; one message per bad key."""

    task: str = TASK
    model_dir: str = "model"  # the model's files, relative to the archive's root
    device: str = "auto"  # auto: the GPU TorchServe assigns, else the CPU; or cpu
    torch_threads: int | None = None  # intra-op threads; None: torch's own
    max_new_tokens: int = 256  # the most one request may ask for
    default_new_tokens: int = 16  # what a request that names none gets
    token_budget: int = 512  # tokens fed to the model in one step (a decode feeds 1, a prefill its prompt)
    kv_bound: int = 16384  # KV-cache tokens live at once, all sequences together (learned lower on out of memory)
    kv_memory_share: float = 0.8  # on CUDA: the bound is at most what this share of the free memory at load holds
    max_running: int = 16  # sequences decoding in one step at most
    queue_cap: int = 64  # requests waiting at most; past it 503
    priority_aging_ms: int = 1000  # a waiting request gains one class per this many ms
    preempt_for_priority: bool = True  # a waiting request may preempt running ones of a lower class
    deadline_ms: int = 120000  # the longest a request may take in all; X-Deadline-Ms may only shorten it

    @classmethod
    def from_section(cls, section: Mapping[str, Any] | None) -> "GenerationConfig":
        section = dict(section or {})
        known = {f.name: f for f in fields(cls)}
        for key in section:
            if key not in known:
                near = difflib.get_close_matches(key, known, n=1)
                raise ConfigError(f"handler.{key} is not a generation setting"
                                  + (f" (did you mean {near[0]}?)" if near else f"; known: {', '.join(known)}"))
        values = {}
        for key, value in section.items():
            values[key] = _check(key, value, cls.__dataclass_fields__[key].default)
        config = cls(**values)
        if config.task != TASK:
            raise ConfigError(f"handler.task must be {TASK!r} for the generation handler, got {config.task!r}")
        if config.device not in ("auto", "cpu"):
            raise ConfigError(f"handler.device must be auto or cpu, got {config.device!r}")
        if config.default_new_tokens > config.max_new_tokens:
            raise ConfigError(f"handler.default_new_tokens ({config.default_new_tokens}) must be at most "
                              f"max_new_tokens ({config.max_new_tokens})")
        config.settings()  # the policy's own checks, at load
        return config

    def settings(self, kv_bound: int | None = None) -> GenerationSettings:
        """The policy's settings; `kv_bound`: the device's own bound, where it is known (kv_bound_for)."""
        kv_bound = self.kv_bound if kv_bound is None else min(self.kv_bound, kv_bound)
        return GenerationSettings(token_budget=self.token_budget, kv_bound=kv_bound, max_running=self.max_running,
                                queue_cap=self.queue_cap, priority_aging=self.priority_aging_ms / 1000,
                                preempt_for_priority=self.preempt_for_priority)


def kv_bound_for(free_bytes: int, bytes_per_token: int, share: float) -> int:
    """KV-cache tokens that `share` of `free_bytes` holds (at least 1: the policy refuses what
    cannot fit, and out of memory lowers it further)."""
    return max(1, int(free_bytes * share) // max(1, bytes_per_token))


def _check(key: str, value: Any, default: Any) -> Any:
    label = f"handler.{key}"
    if key == "kv_memory_share":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError(f"{label} must be a fraction above 0 and at most 1, got {value!r}")
        return float(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{label} must be true or false, got {value!r}")
    elif isinstance(default, int) or key == "torch_threads":
        if value is None and key == "torch_threads":
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{label} must be a positive integer, got {value!r}")
    elif isinstance(default, str) and not isinstance(value, str):
        raise ConfigError(f"{label} must be a string, got {value!r}")
    return value


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


def deadline_of(headers: Mapping[str, Any], config: GenerationConfig, now: float) -> float:
    """Monotonic seconds by which the answer must be complete: deadline_ms, or X-Deadline-Ms if shorter."""
    ms = config.deadline_ms
    asked = headers.get(DEADLINE_HEADER)
    if asked is not None:
        try:
            asked = int(asked)
        except (TypeError, ValueError):
            raise BadInput(f"X-Deadline-Ms must be a whole number of milliseconds, got {asked!r}") from None
        if asked < 1:
            raise BadInput(f"X-Deadline-Ms must be positive, got {asked}")
        ms = min(ms, asked)
    return now + ms / 1000


def answer_body(text: str, new_tokens: int, finish_reason: str) -> dict:
    return {"generated_text": text, "new_tokens": new_tokens, "finish_reason": finish_reason}


def line(body: Mapping[str, Any]) -> str:
    """One line of a streamed answer."""
    return json.dumps(body) + "\n"


class TextStream:
    """A growing token list's text, piece by piece: each piece is what decoding all tokens so far
    adds to the text handed out. Where a later token changes earlier text the piece is empty; the
    final line of a stream carries the whole text either way."""

    def __init__(self, decode):
        self.decode = decode  # token ids -> text
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.decode(self.tokens)
        if not text.startswith(self.sent):
            return ""  # the text so far changed under a later token: the final line carries it whole
        piece, self.sent = text[len(self.sent):], text
        return piece
