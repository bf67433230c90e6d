"""tsbatch.handlers.admission: a lane's pace and idle share, and when its queue is through."""
from __future__ import annotations

import math

import pytest

from tsbatch.handlers.admission import BUSY_HORIZON, PACE_BOUNDS, LaneLoad, finish_in

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
    (1.0, 0.2, (), 1.0),  # no earlier lane
    (1.0, 0.2, ((0.0, 0.0),), 1.0),  # a helper with no time to spare
    (1.0, 0.2, ((0.0, 1.0),), 0.6),  # idle helper: 0.8 s shared by two lanes, then 0.2 s alone
    (1.0, 0.2, ((0.5, 1.0),), 0.85),  # the helper is through its own work at 0.5 s
    (1.0, 0.2, ((0.9, 1.0),), 1.0),  # ... at 0.9 s: only 0.1 s left then, not behind
    (1.0, 0.2, ((0.0, 0.5),), 0.2 + 0.8 / 1.5),
    (1.0, 0.2, ((0.4, 0.5), (0.0, 0.5)), 0.2 + 0.8 / 2),  # two helpers: the first free, both shares
])
def test_finish_in(own, behind, helpers, expected):
    assert finish_in(own, behind, helpers) == pytest.approx(expected)


def test_finish_in_never_exceeds_the_lane_alone_and_is_continuous_at_behind():
    for free in (0.0, 0.3, 0.79, 0.8, 0.81, 2.0):
        for share in (0.0, 0.25, 1.0):
            assert finish_in(1.0, 0.2, [(free, share)]) <= 1.0 + 1e-12
    assert finish_in(1.0, 0.2, [(0.8, 1.0)]) == pytest.approx(1.0)
    assert finish_in(1.0, 0.2, [(0.8 - 1e-9, 1.0)]) == pytest.approx(1.0)
