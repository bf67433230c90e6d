"""Out of memory at warmup, caps kept across workers, and the CUDA memory budget (a fake allocator)."""
from __future__ import annotations

import pytest

from tsbatch.handlers.core.buckets import power_of_two_sizes
from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.core.isolate import is_out_of_memory
from tsbatch.handlers.edge.config import HandlerConfig
from tsbatch.handlers.runtime.memory import apply_budget, budget_bytes, keep_caps, load_caps
from tests.support import FakeClock
from tsbatch.warmup.plan import Shape, WarmupPlan, plan_shapes
from tsbatch.warmup.profile import LatencyProfile
from tsbatch.warmup.run import run_plan

pytestmark = pytest.mark.unit
GiB = 2**30


class FakeAllocator:
    """A device of `total` bytes; a pass needs `per_token` bytes per batch x bucket token, and the
    per-process limit (set_per_process_memory_fraction) turns anything past it into out of memory,
    as torch.cuda's caching allocator does."""

    class OutOfMemoryError(RuntimeError):
        pass

    def __init__(self, total: int, per_token: int):
        self.total, self.per_token, self.fraction, self.emptied = total, per_token, 1.0, 0

    def get_device_properties(self, index):
        return type("Props", (), {"total_memory": self.total})()

    def set_per_process_memory_fraction(self, fraction, index):
        self.fraction = fraction

    def empty_cache(self):
        self.emptied += 1

    def run(self, shape: Shape) -> None:
        if shape.tokens * self.per_token > self.fraction * self.total:
            raise self.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {shape.tokens * self.per_token} bytes")


def warm(device: FakeAllocator, edges=(16, 64, 256), cap=16) -> LatencyProfile:
    plan = WarmupPlan(tuple(plan_shapes(edges, lambda b: power_of_two_sizes(cap))), repeats=2, max_repeats=2)
    return run_plan(plan, device.run, LatencyProfile("m", {}), clock=FakeClock(), is_oom=is_out_of_memory,
                    on_oom=lambda shape, error: device.empty_cache())


def test_warmup_caps_each_bucket_at_the_largest_batch_that_fit_and_finishes():
    device = FakeAllocator(total=80 * GiB, per_token=GiB // 64)  # 80 GiB: 5,120 tokens fit
    profile = warm(device)
    assert profile.oom_caps == {}  # 16 x 256 = 4,096 tokens: everything fits
    apply_budget(0.125, device, 0)  # a budget of 10 GiB: 640 tokens
    profile = warm(device)
    assert profile.oom_caps == {64: 8, 256: 2}
    assert max(s.batch for s in profile.shapes if s.bucket == 256) == 2
    assert max(s.batch for s in profile.shapes if s.bucket == 16) == 16
    assert device.emptied == 2  # once per bucket that ran out (the cache is given back each time)


def test_a_bucket_where_one_request_does_not_fit_is_capped_at_zero_and_warmup_goes_on():
    device = FakeAllocator(total=GiB, per_token=GiB // 100)  # 100 tokens
    profile = warm(device, edges=(16, 64, 256), cap=8)
    assert profile.oom_caps == {16: 4, 64: 1, 256: 0}
    assert {s.bucket for s in profile.shapes} == {16, 64}


def test_an_error_that_is_not_out_of_memory_still_fails_the_load():
    def broken(shape):
        raise ValueError("weights are corrupt")

    with pytest.raises(ValueError):
        run_plan(WarmupPlan((Shape(1, 16),), 1, 1), broken, LatencyProfile("m", {}), clock=FakeClock())


def test_the_budget_sets_the_allocators_per_process_fraction():
    device = FakeAllocator(total=80 * GiB, per_token=1)
    assert apply_budget(50 * 10**9, device, 0).startswith("46.6 GiB of 80.0 GiB")  # "one model under 50 GB"
    assert device.fraction == pytest.approx(50 * 10**9 / (80 * GiB))
    apply_budget(0.5, device, 0)
    assert device.fraction == 0.5
    with pytest.raises(ValueError):
        apply_budget(100 * GiB, device, 0)
    assert budget_bytes(0.25, 4 * GiB) == GiB and budget_bytes(123, 4 * GiB) == 123


@pytest.mark.parametrize("value, expected", [(0.5, 0.5), (1.0, 1.0), ("50GB", 50 * 10**9), ("48GiB", 48 * GiB),
                                             (2_000_000, 2_000_000)])
def test_memory_budget_config(value, expected):
    assert HandlerConfig.from_yaml({"task": "embedding", "memory_budget": value}).memory_budget == expected


@pytest.mark.parametrize("value", [0, 0.0, 1.5, -3, "lots", True, "0GB"])
def test_memory_budget_config_refuses_nonsense(value):
    with pytest.raises(ConfigError, match="memory_budget"):
        HandlerConfig.from_yaml({"task": "embedding", "memory_budget": value})


def test_kept_caps_only_shrink_and_survive_a_torn_file(tmp_path):
    path = str(tmp_path / "oom_caps.json")
    assert load_caps(path) == {}
    assert keep_caps(path, {16: 8, 256: 2}, "test") == {16: 8, 256: 2}
    assert keep_caps(path, {16: 4, 256: 4, 64: 0}, "test") == {16: 4, 64: 0, 256: 2}
    assert load_caps(path) == {16: 4, 64: 0, 256: 2}
    (tmp_path / "oom_caps.json").write_text('{"caps": {"16": ')
    assert load_caps(path) == {}
