"""tsbatch.handlers.runtime.warming with borrow_cores: every shape timed on each lane's threads, then
again on all of them, and the profile saying which timing is which."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tsbatch.handlers.core.cost import CostModel
from tsbatch.handlers.edge.config import HandlerConfig
from tsbatch.handlers.runtime.warming import borrowed_threads, warm_up
from tsbatch.warmup.profile import PROFILE_FILE, LatencyProfile

pytestmark = pytest.mark.unit


class ThreadsModel:
    """Records the intra-op threads each pass ran on; passes do nothing."""

    def __init__(self):
        self.threads = 1
        self.passes = []  # (bucket, size, threads)

    def describe(self):
        return {"torch_threads": 2}

    def use_threads(self, count, background=False):
        self.threads = count

    def example(self, length):
        return f"x{length}"

    def forward(self, batch):
        self.passes.append((batch.bucket, batch.size, self.threads))
        return [None] * batch.size


LANES = [((16,), 1), ((64,), 1)]


def warm(tmp_path, **overrides) -> tuple[LatencyProfile, ThreadsModel]:
    config = replace(HandlerConfig(), warmup_repeats=1, warmup_max_repeats=1, **overrides)
    model = ThreadsModel()
    profile = warm_up(model, config, (16, 64), lambda edge: (1, 2), LANES, "m", str(tmp_path), 120,
                      on_oom=lambda shape, error: None)
    return profile, model


def test_borrow_cores_times_every_shape_again_on_all_the_lanes_threads(tmp_path):
    profile, model = warm(tmp_path, borrow_cores=True)
    own = {(s.bucket, s.batch) for s in profile.own_shapes()}
    wide = {(s.bucket, s.batch) for s in profile.shapes if s.threads == 2}
    assert own == wide == {(16, 1), (16, 2), (64, 1), (64, 2)}
    assert {(b, n) for b, n, t in model.passes if t == 2} == own  # the wide timings really ran on 2
    assert all(t == 1 for b, n, t in model.passes[:len(model.passes) // 2])  # the lanes' own shapes first
    saved = LatencyProfile.load(str(tmp_path / PROFILE_FILE))
    assert set(CostModel.from_profile(saved).wider) == {2}


def test_without_borrow_cores_or_a_second_lane_warmup_times_the_lanes_own_threads_only(tmp_path):
    profile, model = warm(tmp_path)
    assert all(s.threads is None for s in profile.shapes) and {t for _, _, t in model.passes} == {1}
    config = replace(HandlerConfig(), borrow_cores=True)
    assert borrowed_threads(config, LANES) == 2
    assert borrowed_threads(config, LANES[:1]) is None and borrowed_threads(config, None) is None
    assert borrowed_threads(HandlerConfig(), LANES) is None
