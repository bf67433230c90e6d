"""tsbatch.handlers.core.cost: the cost model (keyword-only, 0.0 where unknown, read from a latency
profile), a lane's pace and idle share, and when its queue is through."""
from __future__ import annotations

import math

import pytest

from tsbatch.handlers.core.cost import BUSY_HORIZON, PACE_BOUNDS, CostModel, Helper, LaneLoad, finish_in
from tsbatch.warmup.profile import LatencyProfile

pytestmark = pytest.mark.unit


def test_pace_follows_the_ratio_of_passes_to_their_median_and_ignores_unknown_shapes():
    load = LaneLoad()
    for _ in range(50):
        load.ran(0.3, 0.1, 0.0)
    assert load.pace == pytest.approx(3.0, rel=1e-3)
    load.ran(5.0, 0.0, 0.0)  # no median for this shape: the pace stays
    assert load.pace == pytest.approx(3.0, rel=1e-3)


def test_one_odd_pass_moves_the_pace_only_so_far():
    load = LaneLoad()
    load.ran(100.0, 0.01, 0.0)  # a stall 10,000x the median
    assert load.pace == pytest.approx(1 + 0.2 * (PACE_BOUNDS[1] - 1))


def test_idle_share_is_the_share_of_recent_time_without_own_work_and_fades():
    load = LaneLoad()
    assert load.idle_share(0.0) == 1.0
    t = 0.0
    while t < 20:  # busy with its own passes half the time, for ten horizons
        t += 0.05
        load.ran(0.05, 0.05, t, own=(round(t / 0.05) % 2 == 0))
    assert load.idle_share(t) == pytest.approx(0.5, abs=0.03)
    assert load.idle_share(t + 3 * BUSY_HORIZON) == pytest.approx(1 - 0.5 * math.exp(-3), abs=0.02)


def test_passes_for_a_later_lane_are_not_own_work():
    load = LaneLoad()
    load.ran(1.0, 1.0, 1.0, own=False)
    assert load.idle_share(1.0) == 1.0


@pytest.mark.parametrize("own, behind, helpers, expected", [
    (1.0, 0.2, (), 1.0),  # no other lane
    (1.0, 0.2, ((0.0, 0.0),), 1.0),  # a helper with no time to spare
    (1.0, 0.2, ((0.0, 1.0),), 0.6),  # idle helper: 0.8 s shared by two lanes, then 0.2 s alone
    (1.0, 0.2, ((0.5, 1.0),), 0.85),  # the helper is through its own work at 0.5 s
    (1.0, 0.2, ((0.9, 1.0),), 1.0),  # ... at 0.9 s: only 0.1 s left then, not behind
    (1.0, 0.2, ((0.0, 0.5),), 0.2 + 0.8 / 1.5),
    (1.0, 0.2, ((0.4, 0.5), (0.0, 0.5)), 0.4 + 0.2 / 2 + 0.2),  # the first joins at 0.4 s, with 0.4 s left
    (1.0, 0.0, ((0.0, 1.0),), 0.5),  # a helper to the end (a later lane): two lanes throughout
    (1.0, 0.0, ((0.5, 1.0),), 0.75),
])
def test_finish_in(own, behind, helpers, expected):
    assert finish_in(own, [Helper(ready, share, behind) for ready, share in helpers]) == pytest.approx(expected)


def test_finish_in_with_an_earlier_lane_that_stops_and_a_later_one_that_does_not():
    """An earlier lane helps until 0.2 s of work are left, a later one from 0.1 s to the end:
    0.1 s at two lanes (0.2 done), then 0.6 at three, then the last 0.2 at two."""
    helpers = [Helper(0.0, 1.0, below=0.2), Helper(0.1, 1.0)]
    assert finish_in(1.0, helpers) == pytest.approx(0.1 + 0.6 / 3 + 0.2 / 2)


def test_finish_in_never_exceeds_the_lane_alone_and_is_continuous_at_behind():
    for free in (0.0, 0.3, 0.79, 0.8, 0.81, 2.0):
        for share in (0.0, 0.25, 1.0):
            for below in (0.0, 0.2):
                assert finish_in(1.0, [Helper(free, share, below)]) <= 1.0 + 1e-12
    assert finish_in(1.0, [Helper(0.8, 1.0, 0.2)]) == pytest.approx(1.0)
    assert finish_in(1.0, [Helper(0.8 - 1e-9, 1.0, 0.2)]) == pytest.approx(1.0)


# -- CostModel -----------------------------------------------------------------------------------

def test_cost_model_questions_are_keyword_only_so_bucket_and_size_cannot_be_swapped():
    cost = CostModel(median=lambda *, bucket, size: bucket * size, p90=lambda *, bucket, size: 2 * bucket * size)
    assert cost.median(bucket=16, size=2) == 32 and cost.p90(bucket=16, size=2) == 64
    for ask in (cost.median, cost.p90, cost.typical):
        with pytest.raises(TypeError):
            ask(16, 2)
        with pytest.raises(TypeError):
            ask(16, size=2)


def test_without_a_profile_every_shape_is_unknown_and_unknown_is_zero_not_free():
    for cost in (CostModel(), CostModel.from_profile(None)):
        assert not cost.known
        asked = (cost.median(bucket=16, size=1), cost.p90(bucket=16, size=1), cost.typical(bucket=16, size=1))
        assert asked == (0.0, 0.0, 0.0)
    assert CostModel(p90=lambda *, bucket, size: 0.2).known and CostModel(median=lambda *, bucket, size: 0.1).known


def test_typical_is_the_median_or_the_p90_where_only_that_is_known():
    both = CostModel(median=lambda *, bucket, size: 0.1, p90=lambda *, bucket, size: 0.3)
    assert both.typical(bucket=16, size=1) == 0.1
    only_p90 = CostModel(p90=lambda *, bucket, size: 0.3)
    assert only_p90.typical(bucket=16, size=1) == 0.3
    some = CostModel(median=lambda *, bucket, size: 0.1 if size == 1 else 0.0, p90=lambda *, bucket, size: 0.3)
    assert (some.typical(bucket=16, size=1), some.typical(bucket=16, size=2)) == (0.1, 0.3)


def test_from_profile_reads_the_median_and_p90_of_each_shape_in_seconds():
    profile = LatencyProfile(model="m", environment={})
    one = profile.add(1, 16, 50.0, [10.0, 11.0, 12.0, 13.0, 30.0])
    four = profile.add(4, 16, 50.0, [20.0, 21.0, 22.0, 40.0, 41.0])
    pair = profile.add(2, (16, 32), 50.0, [5.0, 6.0, 7.0])
    cost = CostModel.from_profile(profile)
    assert cost.known
    assert cost.median(bucket=16, size=1) == pytest.approx(one.median_ms / 1000) == pytest.approx(0.012)
    assert cost.p90(bucket=16, size=1) == pytest.approx(one.p90_ms / 1000) == pytest.approx(0.030)
    assert (cost.median(bucket=16, size=4), cost.p90(bucket=16, size=4)) == \
        pytest.approx((four.median_ms / 1000, four.p90_ms / 1000))
    assert cost.median(bucket=(16, 32), size=2) == pytest.approx(pair.median_ms / 1000)  # a bucket of pairs
    assert cost.median(bucket=16, size=2) == 0.0 and cost.p90(bucket=32, size=1) == 0.0  # shapes warmup did not run
    assert cost.median(bucket=32, size=1) == 0.0 and cost.typical(bucket=16, size=8) == 0.0


def test_shapes_timed_on_more_threads_answer_questions_asked_with_those_threads():
    profile = LatencyProfile(model="m", environment={"threads_per_bucket": {"16": 1, "256": 1}})
    profile.add(1, 256, 100.0, [80.0, 80.0, 80.0])
    profile.add(1, 256, 60.0, [45.0, 45.0, 45.0], threads=2)  # borrow_cores: the same shape on both lanes' threads
    cost = CostModel.from_profile(profile)
    assert cost.threads == 1 and set(cost.wider) == {2}
    assert cost.median(bucket=256, size=1) == cost.median(bucket=256, size=1, threads=1) == pytest.approx(0.080)
    assert cost.median(bucket=256, size=1, threads=2) == pytest.approx(0.045)
    assert cost.p90(bucket=256, size=1, threads=2) == pytest.approx(0.045)
    assert cost.typical(bucket=256, size=1, threads=4) == 0.0  # never timed on 4: unknown, not the 1-thread time
    assert profile.lookup(batch=1, bucket=256).median_ms == 80.0
    assert profile.lookup(batch=1, bucket=256, threads=2).median_ms == 45.0
    assert [t.threads for t in profile.own_shapes()] == [None]


def test_a_profile_with_wider_timings_reads_back_the_same_and_one_without_reads_as_before():
    profile = LatencyProfile(model="m", environment={})
    profile.add(1, 16, 5.0, [2.0, 2.0, 2.0])
    assert "threads" not in profile.to_json()  # the file format is unchanged without borrow_cores
    profile.add(1, 16, 5.0, [1.5, 1.5, 1.5], threads=2)
    again = LatencyProfile.from_json(profile.to_json())
    assert again.shapes == profile.shapes and [s.threads for s in again.shapes] == [None, 2]


def test_a_cost_model_without_thread_counts_answers_the_same_for_any_threads():
    cost = CostModel(median=lambda *, bucket, size: 0.1)
    assert cost.median(bucket=16, size=1, threads=1) == cost.median(bucket=16, size=1, threads=8) == 0.1
