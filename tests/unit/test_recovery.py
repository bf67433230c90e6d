"""The recovery drill's measure (bench/drills/recovery.py): when, after a worker is killed, are
requests answered within their deadline again? Windows of scheduled arrivals after the kill; the
first instant after which every request of every following window got a 200 in time."""
import pytest

from bench.drills.recovery import Outcome, figures, in_time, recovery_time, windows

pytestmark = pytest.mark.unit

KILL, DEADLINE = 10.0, 1.0


def ok(at: float, latency: float = 0.1) -> Outcome:
    return Outcome(at, 200, at + latency)


def steady(start: float, end: float, every: float = 0.5, latency: float = 0.1) -> list[Outcome]:
    """A request every `every` s from `start` to before `end`, each a 200 after `latency`."""
    n = round((end - start) / every)
    return [ok(start + i * every, latency) for i in range(n)]


def test_in_time_is_a_200_by_its_send_time_plus_the_deadline():
    assert in_time(Outcome(5.0, 200, 6.0), 1.0)  # exactly at the deadline counts
    assert not in_time(Outcome(5.0, 200, 6.01), 1.0)
    assert not in_time(Outcome(5.0, 504, 5.01), 1.0)  # a refusal is never in time, however prompt
    assert not in_time(Outcome(5.0, None, None), 1.0)


def test_windows_start_at_the_kill_and_count_each_kind_of_miss():
    outcomes = [ok(9.0, 5.0),  # sent before the kill: not in any window, however late
                ok(10.0), Outcome(10.5, 200, 12.0), Outcome(11.0, 503, 11.0), Outcome(11.9, None, None),
                ok(14.5)]  # nothing sent in [12, 14): an empty window is kept
    assert windows(outcomes, KILL, DEADLINE) == [
        {"from_s": 0.0, "sent": 4, "in_time": 1, "late_200": 1, "refused": 1, "unanswered": 1},
        {"from_s": 2.0, "sent": 0, "in_time": 0, "late_200": 0, "refused": 0, "unanswered": 0},
        {"from_s": 4.0, "sent": 1, "in_time": 1, "late_200": 0, "refused": 0, "unanswered": 0}]
    assert windows([ok(1.0)], KILL, DEADLINE) == []


def test_a_kill_that_cost_nothing_recovers_at_once():
    assert recovery_time(steady(0, 30), KILL, DEADLINE) == 0.0


def test_recovery_is_the_end_of_the_window_of_the_last_miss():
    outcomes = steady(0, 10) + [Outcome(10.2 + i, 503, 10.2 + i) for i in range(8)] + steady(18.2, 30)
    # last refusal sent at 17.2 s: 7.2 s after the kill, in the window [6, 8): recovered from 8 s on
    assert recovery_time(outcomes, KILL, DEADLINE) == 8.0
    assert recovery_time(outcomes, KILL, DEADLINE, window_s=1.0) == 8.0
    assert recovery_time(outcomes, KILL, DEADLINE, window_s=5.0) == 10.0


def test_a_late_200_is_a_miss_like_a_refusal():
    backlog = [ok(10.0 + i * 0.5, latency=20.0 - i * 0.5) for i in range(20)]  # stale, answered late
    outcomes = steady(0, 10) + backlog + steady(20.0, 40)
    late = [o for o in backlog if not in_time(o, DEADLINE)]
    assert late and max(o.at for o in late) < 20.0
    assert recovery_time(outcomes, KILL, DEADLINE) == 10.0
    # against a 30 s deadline the same answers were all in time
    assert recovery_time(outcomes, KILL, 30.0) == 0.0


def test_a_good_window_amid_misses_does_not_count_as_recovered():
    outcomes = steady(0, 10) + [Outcome(10.5, 503, 10.5)] + steady(12.0, 16) + [Outcome(16.5, 504, 16.5)] + steady(18, 30)
    assert recovery_time(outcomes, KILL, DEADLINE) == 8.0


def test_not_recovered_while_the_run_lasted_is_none():
    still_missing = steady(0, 10) + [Outcome(10.0 + i, 503, 10.0 + i) for i in range(20)]
    assert recovery_time(still_missing, KILL, DEADLINE) is None
    # a miss in the last window with requests, and only empty windows after it: none either
    assert recovery_time(steady(0, 10) + steady(10, 20) + [Outcome(21.0, None, None)], KILL, DEADLINE) is None


def test_figures_of_an_arm_judged_against_a_deadline():
    outcomes = steady(0, 10) + [ok(10.0, 3.0), ok(11.0, 2.5), Outcome(12.5, 504, 12.5)] + steady(14, 30)
    f = figures(outcomes, KILL, DEADLINE, 2.0)
    assert f["ok"] == len(outcomes) - 1 and f["late_200"] == 2 and f["late_by_max_s"] == 2.0
    assert f["ok_max_s"] == 3.0 and f["ok_p50_s"] == 0.1
    assert f["last_miss_after_kill_s"] == 2.5 and f["recovery_s"] == 4.0
    assert len(f["windows"]) == 10 and f["deadline_s"] == DEADLINE
    assert f["before_kill"] == {"sent": 20, "in_time": 20}


def test_the_drill_loads_neither_torch_nor_torchserve():
    """Its clients share the cores with the server it measures."""
    from tests.unit.test_pure_imports import imported_heavy_modules

    assert imported_heavy_modules("bench.drills.recovery") == []
