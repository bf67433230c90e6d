"""bench/summary.py: one table over the four workloads, and a line for every loss of the shipped arm."""
import json

from bench.run import ratios
from bench.summary import losses, markdown, summarize


def arm(capacity, most, p50=30.0, p99=60.0, rounds=None):
    at = {"short": {"p50": p50, "p99": p99}, **({"rounds_short_p99": rounds} if rounds else {})}
    return {"capacity": capacity, "max_throughput": most, "at_70pct_b": at}


def report(arms, light=None):
    """As make bench writes it, its ratios from bench/run.py itself."""
    return {"when": "2026-12-02 06:00 UTC", "command": "make bench", "arms": arms, "ratios": ratios(arms),
            **({"light": light} if light else {})}


def test_every_loss_of_the_shipped_arm_is_named_and_a_win_is_not(tmp_path):
    (tmp_path / "bench-search.json").write_text(json.dumps(report(
        {"b": arm(12, 20, p99=200.0, rounds=[200.0, 100.0]), "d": arm(30, 44, rounds=[60.0, 60.0]),
         "t": arm(24, 40, p99=170.0, rounds=[170.0, 60.0])},
        light={"14.0": {"t": {"long": {"p50": 90.0, "p99": 180.0}}}, "5.0": {"t": {"long": {"p50": 80.0, "p99": 150.0}}}})))
    (tmp_path / "bench-short.json").write_text(json.dumps(report({"b": arm(100, 110, p99=100.0, rounds=[100.0]),
                                                                  "t": arm(120, 130, p99=50.0, rounds=[50.0])})))
    summary = summarize(str(tmp_path))
    assert summary["missing"] == ["long", "two-cluster"]
    assert summary["losses"] == ["search: t capacity 24 < d's 30 req/s", "search: t most served 40 < d's 44 req/s",
                                 "search: t short p99 at 70% of b's capacity 170.0 ms > 0.8x b's (160.0 ms); "
                                 "each round 0.85x, 0.60x b's"]
    rows = summary["workloads"]["search"]["rows"]
    assert rows["t"]["long_p50_light"] == 80.0 and rows["t"]["long_p99_light"] == 150.0  # the lightest rate
    text = markdown(summary)
    assert "**LOSES** search: t capacity 24 < d's 30 req/s" in text and "**Not run:** long, two-cluster" in text
    assert "short:" not in "".join(line for line in text.splitlines() if "LOSES" in line)


def test_without_a_tuned_arm_the_template_is_the_shipped_one():
    rows = {"b": {"capacity": 10, "most_served": 12, "short_p99_at_70": 100.0},
            "d": {"capacity": 9, "most_served": 15, "short_p99_at_70": 70.0}}
    assert losses("long", rows) == ["long: d capacity 9 < b's 10 req/s"]


def test_a_short_p99_loss_without_each_rounds_figures_names_none():
    rows = {"b": {"capacity": 10, "most_served": 12, "short_p99_at_70": 100.0},
            "t": {"capacity": 10, "most_served": 12, "short_p99_at_70": 90.0, "short_p99_rounds_vs_b": [0.9, None]}}
    assert losses("short", rows) == ["short: t short p99 at 70% of b's capacity 90.0 ms > 0.8x b's (80.0 ms)"]
