"""CUDA graphs per shape (`handler.cuda_graphs`): which warmed shapes get a graph, what a capture
that fails or answers otherwise becomes, and the memory the graphs hold.

Warmup runs every (batch size, bucket) shape the handler forms before READY; the first pass of a
shape then runs eager and is captured as a graph, which every later pass of that shape replays
(warmup's timed passes included, so the latency profile measures what traffic gets). A graph
holds its own memory pool for as long as the worker lives, so the graphs' memory is booked here:
past GRAPH_MEMORY_SHARE of the budget (`memory_budget`, or the device) the remaining shapes run
eager. They are the largest, which gain least from a graph: a long pass is bound by its kernels,
not by their launches. The CUDA allocator's per-process limit counts the pools too, so warmup
learns its out-of-memory caps with the graphs already held, as serving holds them.

A capture that runs out of memory, or whose replay answers other than the eager pass, leaves its
shape eager; any other capture error means the model's forward cannot be captured (a sync with
the host, a tensor made on the CPU) and turns graphs off for every shape. Every such decision is
logged once with its reason. Pure: no torch, no clock; handlers/models/encoder.py captures and replays.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tsbatch.warmup.plan import Shape, bucket_label

logger = logging.getLogger(__name__)

GRAPH_MEMORY_SHARE = 0.25  # of the budget: the graphs' pools may hold this much, passes keep the rest


def shape_label(shape: Shape) -> str:
    """"4x32": batch size x bucket, as the logs and the profile write a shape."""
    return f"{shape.batch}x{bucket_label(shape.bucket)}"


@dataclass
class GraphBook:
    """The decisions and the bookkeeping of one model's graphs. `limit_bytes`: what the graphs
    may hold in all (GRAPH_MEMORY_SHARE of the budget; None: no limit)."""

    limit_bytes: int | None = None
    captured: dict[Shape, int] = field(default_factory=dict)  # shape -> bytes its graph holds
    refused: dict[Shape, str] = field(default_factory=dict)  # shape -> why it runs eager
    off: str | None = None  # why graphs are off for every shape (the forward cannot be captured)
    ready: bool = False
    missed: set[Shape] = field(default_factory=set)  # shapes met after READY with no graph

    @property
    def held_bytes(self) -> int:
        return sum(self.captured.values())

    def should_capture(self, shape: Shape) -> bool:
        """Capture this shape now? Only before READY, once per shape, while graphs are on and
        within their memory share (a shape past it is refused, with the reason)."""
        if self.ready or self.off is not None or shape in self.captured or shape in self.refused:
            return False
        if self.limit_bytes is not None and self.held_bytes >= self.limit_bytes:
            self.refuse(shape, f"graphs already hold {_mib(self.held_bytes)} of the {_mib(self.limit_bytes)} "
                               f"they may ({GRAPH_MEMORY_SHARE:.0%} of the memory budget)")
            return False
        return True

    def has_graph(self, shape: Shape) -> bool:
        return shape in self.captured

    def record(self, shape: Shape, held_bytes: int) -> None:
        """A capture that answered as eager: its shape replays from now on."""
        self.captured[shape] = max(0, int(held_bytes))

    def refuse(self, shape: Shape, reason: str) -> None:
        """This shape runs eager (out of memory at capture, a replay that answered otherwise, the
        memory share spent)."""
        self.refused[shape] = reason
        logger.warning("tsbatch cuda graphs: shape %s runs eager: %s", shape_label(shape), reason)

    def turn_off(self, shape: Shape, reason: str) -> None:
        """The forward cannot be captured: every shape runs eager."""
        self.off = f"capturing shape {shape_label(shape)} failed: {reason}"
        logger.warning("tsbatch cuda graphs are off for this model, every pass runs eager: %s", self.off)

    def met_eager(self, shape: Shape) -> None:
        """A pass after READY with no graph for its shape: said once per shape."""
        if self.ready and shape not in self.missed and shape not in self.refused and self.off is None:
            self.missed.add(shape)
            logger.warning("tsbatch cuda graphs: shape %s met after READY has no graph (warmup did not run it): "
                           "it runs eager", shape_label(shape))

    def mark_ready(self) -> None:
        """Warmup is over: no capture from now on. Logs what was captured."""
        self.ready = True
        if self.off is None and not self.captured and not self.refused:
            logger.warning("tsbatch cuda graphs: no shape ran before READY (handler.warmup is off?): every pass runs eager")
            return
        logger.info("tsbatch cuda graphs: %d shapes captured, holding %s; %d run eager%s", len(self.captured),
                    _mib(self.held_bytes), len(self.refused), f" ({self.off})" if self.off else "")

    def summary(self) -> dict:
        """What describe() and the profile record: shapes captured, bytes held, refusals."""
        return {"captured": len(self.captured), "held_bytes": self.held_bytes, "limit_bytes": self.limit_bytes,
                "eager": {shape_label(s): why for s, why in self.refused.items()}, "off": self.off}


def graph_limit(budget_bytes: int | None) -> int | None:
    """What the graphs may hold: GRAPH_MEMORY_SHARE of the budget in bytes (None: no limit)."""
    return None if budget_bytes is None else int(budget_bytes * GRAPH_MEMORY_SHARE)


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"
