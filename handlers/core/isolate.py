"""Isolation: when a batch raises, find the requests that fail and serve all the others.

Bisection over the failing batch: split it, run the left half, and if that half succeeds the
right half must hold the failure, so it is split again without being rerun. A lone request that
still fails gets its own error; every other request gets the result of a pass without the
culprit, the same result it would get alone. k failures among n cost O(k·log n) extra passes.

Out of memory is different: nobody is to blame, so the batch is halved and both halves rerun;
the largest size that worked becomes the bucket's cap for the rest of the worker's life.

Pure: `run` is injected, nothing here imports torch or reads a clock.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tsbatch.handlers.core.buckets import Batch, Bucket, Item, bucket_label
from tsbatch.handlers.core.errors import ModelFailed, ModelUnavailable, OutOfMemory, ServingError

logger = logging.getLogger(__name__)

Outcome = Any  # a result (dict) or a ServingError
_MAX_MESSAGE = 500


def is_out_of_memory(error: BaseException) -> bool:
    """MemoryError, torch.cuda.OutOfMemoryError, and allocator errors that say they ran out."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error).lower()
    # torch's CPU allocator raises a plain RuntimeError: "DefaultCPUAllocator: can't allocate memory"
    return any(words in text for words in ("out of memory", "can't allocate memory", "cannot allocate memory"))


def describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


@dataclass
class IsolationReport:
    """What executing one planned batch cost: passes run, requests failed, splits made."""

    bucket: Bucket
    size: int
    passes: int = 0
    isolation_passes: int = 0  # passes spent bisecting (out-of-memory halving is not counted)
    failed: int = 0
    oom_splits: int = 0
    gave_up: bool = False

    @property
    def extra_passes(self) -> int:
        return max(0, self.passes - 1)


@dataclass
class OomCaps:
    """Per-bucket batch caps learned from out-of-memory errors; they only ever shrink."""

    caps: dict[int, int] = field(default_factory=dict)
    # called with (bucket, new cap) whenever a cap shrinks: the handler keeps caps across restarts
    on_learn: Callable[[int, int], None] | None = field(default=None, repr=False)

    def cap(self, bucket: Bucket, default: int) -> int:
        return min(default, self.caps.get(bucket, default))

    def learn(self, bucket: Bucket, failed_size: int, largest_ok: int) -> None:
        new_cap = max(1, min(largest_ok, failed_size - 1))
        if new_cap < self.caps.get(bucket, failed_size):
            self.caps[bucket] = new_cap
            logger.warning(
                "bucket %s: out of memory at batch size %d; batches of this bucket are capped at %d "
                "from now on (kept for this model's workers)",
                bucket_label(bucket), failed_size, new_cap,
            )
            if self.on_learn is not None:
                self.on_learn(bucket, new_cap)


class Isolator:
    """Executes a planned batch so that only the requests that really fail are lost."""

    def __init__(self, run: Callable[[Batch], Sequence[Outcome]], budget: int, caps: OomCaps | None = None):
        self._run = run
        self.budget = budget
        self.caps = caps if caps is not None else OomCaps()

    def execute(self, batch: Batch) -> tuple[list[Outcome], IsolationReport]:
        """One outcome per item of `batch`, in its order, and the report of what it cost."""
        state = _State(batch, IsolationReport(batch.bucket, batch.size))
        self._attempt(list(batch.items), state)
        if state.oom_failed_sizes:
            self.caps.learn(batch.bucket, max(state.oom_failed_sizes), state.largest_ok_after_oom)
        return [state.outcomes[id(item)] for item in batch.items], state.report

    def _attempt(self, items: list[Item], state: "_State", bisecting: bool = False) -> bool:
        """Run `items` as one pass; on failure isolate inside them. True if the pass succeeded.

        Only bisection passes count against the budget: halving for memory is bounded by itself
        (at most 2n-1 passes) and must not make healthy requests fail as "model broken".
        """
        if bisecting:
            if state.report.isolation_passes >= self.budget:
                state.give_up(items)
                return False
            state.report.isolation_passes += 1
        state.report.passes += 1
        try:
            results = self._run(Batch(state.bucket, tuple(items)))
            if len(results) != len(items):
                raise RuntimeError(f"run returned {len(results)} outputs for {len(items)} inputs")
        except Exception as error:  # noqa: BLE001 - every model error is isolated, never raised
            self._isolate(items, error, state)
            return False
        state.succeed(items, results)
        return True

    def _isolate(self, items: list[Item], error: BaseException, state: "_State") -> None:
        """`items` failed together with `error`; find out which of them fail alone."""
        if is_out_of_memory(error):
            state.oom_failed_sizes.append(len(items))
            if len(items) == 1:
                state.fail(items[0], OutOfMemory(
                    f"input of {items[0].length} tokens does not fit in memory even alone "
                    f"({describe(error)}): send a shorter text"
                ))
                return
            state.report.oom_splits += 1
            left, right = _halves(items)
            self._attempt(left, state)
            self._attempt(right, state)
            return
        if len(items) == 1:
            state.fail(items[0], ModelFailed(f"model failed on this input: {describe(error)}"))
            return
        left, right = _halves(items)
        if self._attempt(left, state, bisecting=True):
            self._isolate(right, error, state)  # the failure must be on the right: no rerun
        else:
            self._attempt(right, state, bisecting=True)


def _halves(items: list[Item]) -> tuple[list[Item], list[Item]]:
    middle = (len(items) + 1) // 2
    return items[:middle], items[middle:]


class _State:
    def __init__(self, batch: Batch, report: IsolationReport):
        self.bucket = batch.bucket
        self.report = report
        self.outcomes: dict[int, Outcome] = {}  # by id(item): indices repeat across async calls
        self.oom_failed_sizes: list[int] = []
        self.largest_ok_after_oom = 0

    def succeed(self, items: list[Item], results: Sequence[Outcome]) -> None:
        for item, result in zip(items, results):
            self.outcomes[id(item)] = result
        if self.oom_failed_sizes:
            self.largest_ok_after_oom = max(self.largest_ok_after_oom, len(items))

    def fail(self, item: Item, error: ServingError) -> None:
        self.outcomes[id(item)] = error
        self.report.failed += 1

    def give_up(self, items: list[Item]) -> None:
        if not self.report.gave_up:
            logger.error(
                "bucket %s: isolation budget of %d passes spent on a batch of %d; "
                "failing the rest fast: the model itself looks broken",
                bucket_label(self.bucket), self.report.isolation_passes, self.report.size,
            )
        self.report.gave_up = True
        for item in items:
            self.fail(item, ModelUnavailable(
                "the model is failing for every input (isolation budget exhausted): "
                "the worker or its device is broken; retry on another worker or later"
            ))
