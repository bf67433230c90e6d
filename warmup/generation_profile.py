"""Generation's warmup plan and latency profile: the prefill shapes and decode batch sizes the
generation engine forms, and what each cost when warmup ran it.

Prefill pads every joining context to a length edge (`prefill_edge`), and the engine runs one
prefill per edge in a step, so the shapes it can form are finite: (rows, edge) with rows x edge
within the step's token budget, or one row of any edge (a step's first prefill may pass the
budget). Decode runs every running sequence in one batch of 1..max_running rows; its cost grows
with the longest context in it, so each batch size is timed at a short and a long context
(`DECODE_CONTEXTS`, within the model's positions).

Kept as generation_profile.json beside the model (the encoder's is latency_profile.json): the
tuner reads it to set token_budget and max_running for a time-to-first-token and a
time-per-output-token target. Pure: no torch, no clock.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from tsbatch.warmup.plan import Shape, default_edges
from tsbatch.warmup.profile import ShapeTiming, find_timing

GENERATION_PROFILE_FILE = "generation_profile.json"
DECODE_CONTEXTS = (64, 512)  # KV-cache tokens per row at which each decode batch size is timed


def prefill_edges(max_positions: int) -> tuple[int, ...]:
    """The lengths a prefill pads its contexts to: the encoder's bucket edges (`default_edges`, one
    rule for what a pass pads to), ending at the model's positions. A context pads by at most 7
    tokens below 64 and by under a quarter above (1.5x steps cost the pool's short asks a p90 of
    18.0 against 13.7 ms of prefill alone, warmup as long: docs/experiments.md, 12-05 04:05)."""
    return default_edges(max_positions)


def prefill_edge(length: int, edges: tuple[int, ...]) -> int:
    """The edge a context of `length` tokens is padded to: the first that holds it."""
    for edge in edges:
        if length <= edge:
            return edge
    raise ValueError(f"a context of {length} tokens is past the longest edge {edges[-1]}")


def prefill_shapes(edges: tuple[int, ...], max_running: int, token_budget: int) -> list[Shape]:
    """Every prefill the engine can form: `rows` contexts padded to `edge`, rows x edge within the
    budget, or one row alone. Shape.batch is rows, Shape.bucket the edge."""
    return [Shape(rows, edge) for edge in edges
            for rows in range(1, max(1, min(max_running, token_budget // edge)) + 1)]


def decode_shapes(max_running: int, max_positions: int) -> list[Shape]:
    """Every decode batch size, at each of DECODE_CONTEXTS that the model holds (Shape.bucket:
    the context, KV-cache tokens per row)."""
    contexts = sorted({min(context, max_positions - 1) for context in DECODE_CONTEXTS})
    return [Shape(rows, context) for context in contexts for rows in range(1, max_running + 1)]


@dataclass
class GenerationProfile:
    """What warmup measured: `prefill` per (rows, edge), `decode` per (rows, context), in ms."""

    model: str
    environment: dict[str, Any]
    prefill: list[ShapeTiming] = field(default_factory=list)
    decode: list[ShapeTiming] = field(default_factory=list)
    warmup_seconds: float = 0.0

    def add(self, kind: str, shape: Shape, first_ms: float, timings_ms: list[float]) -> ShapeTiming:
        """Record one warmed shape; `kind` is "prefill" or "decode"."""
        timing = ShapeTiming.measured(shape.batch, shape.bucket, first_ms, timings_ms)
        getattr(self, kind).append(timing)
        return timing

    def prefill_timing(self, *, rows: int, edge: int) -> ShapeTiming | None:
        return find_timing(self.prefill, batch=rows, bucket=edge)

    def decode_timing(self, *, rows: int, context: int) -> ShapeTiming | None:
        return find_timing(self.decode, batch=rows, bucket=context)

    def to_json(self) -> str:
        return json.dumps({"kind": "generation", **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "GenerationProfile":
        data = json.loads(text)
        if data.pop("kind", None) != "generation":
            raise ValueError("not a generation profile (no \"kind\": \"generation\"): an encoder's latency profile?")
        timings = {kind: [ShapeTiming(**s) for s in data.pop(kind, [])] for kind in ("prefill", "decode")}
        return cls(**data, **timings)

    @classmethod
    def load(cls, path: str) -> "GenerationProfile":
        with open(path) as f:
            return cls.from_json(f.read())

    def save(self, path: str) -> None:
        """Whole or not at all, as LatencyProfile.save writes."""
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)
