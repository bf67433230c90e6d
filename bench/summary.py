"""One table over the four make bench workloads, and a line for everything the shipped archive loses.

Reads bench-search.json, bench-short.json, bench-long.json and bench.json (two-cluster) from a
results folder, as `make bench BENCH_ARGS='--workload W'` writes them, and writes summary.{md,json}
beside them: per workload and arm, capacity at the target, short p50 / p99 at 70% of first-come's
capacity, long p50 / p99 at light load (where the run measured it) and the most it served. The
shipped archive is arm t (tuned, as `make serve` builds it), else d. It loses where another arm's
capacity or most served is higher, or where its short p99 at 70% of first-come's capacity is above
0.8x first-come's; each loss is a line under the table, never a test (timings of a shared machine).

    python bench/summary.py [--dir bench/results] [--out bench/results/summary]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.loadtest import report as reports  # noqa: E402

FILES = {"search": "bench-search.json", "short": "bench-short.json", "long": "bench-long.json",
         "two-cluster": "bench.json"}
SHORT_P99_SHARE = 0.8  # the shipped archive's short p99 at 70% of first-come's capacity, at most this of first-come's


def row(data: dict, light: dict | None, rounds_vs_b: list | None = None) -> dict:
    """One arm's figures; `rounds_vs_b`: its short p99 at 70% over first-come's, each round, as make
    bench's own ratios give it (bench/run.py ratios)."""
    at = data.get("at_70pct_b", {})
    out = {"capacity": data["capacity"], "capacity_at_least": bool(data.get("capacity_at_least")),
           "short_p50_at_70": at.get("short", {}).get("p50"), "short_p99_at_70": at.get("short", {}).get("p99"),
           "short_p99_rounds_vs_b": rounds_vs_b,
           "most_served": data["max_throughput"], "long_p50_light": None, "long_p99_light": None}
    if light:
        out["long_p50_light"], out["long_p99_light"] = light.get("long", {}).get("p50"), light.get("long", {}).get("p99")
    return out


def losses(workload: str, rows: dict[str, dict]) -> list[str]:
    """What the shipped arm loses on one workload, one sentence each."""
    shipped = "t" if "t" in rows else "d"
    ours = rows.get(shipped)
    if ours is None:
        return []
    out = []
    for arm, other in rows.items():
        if arm == shipped:
            continue
        if other["capacity"] > ours["capacity"]:
            out.append(f"{workload}: {shipped} capacity {ours['capacity']} < {arm}'s {other['capacity']} req/s")
        if other["most_served"] > ours["most_served"]:
            out.append(f"{workload}: {shipped} most served {ours['most_served']} < {arm}'s {other['most_served']} req/s")
    first_come = rows.get("b")
    if first_come and first_come["short_p99_at_70"] and ours["short_p99_at_70"] is not None:
        bound = SHORT_P99_SHARE * first_come["short_p99_at_70"]
        if ours["short_p99_at_70"] > bound:
            out.append(f"{workload}: {shipped} short p99 at 70% of b's capacity {ours['short_p99_at_70']} ms > "
                       f"{SHORT_P99_SHARE}x b's ({bound:.1f} ms)" + _each_round(ours))
    return out


def _each_round(ours: dict) -> str:
    """The rounds' own ratios: a pooled p99 a single slow round sets reads differently from one every
    round shares, and the reader should see which."""
    each = ours.get("short_p99_rounds_vs_b") or []
    if not each or not all(each):
        return ""
    return "; each round " + ", ".join(f"{x:.2f}x" for x in each) + " b's"


def summarize(folder: str) -> dict:
    out = {"when": reports.utc_now(), "machine": reports.machine(), "workloads": {}, "losses": [], "missing": []}
    for workload, name in FILES.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            out["missing"].append(workload)
            continue
        with open(path) as f:
            report = json.load(f)
        light = report.get("light") or {}
        lightest = light[min(light, key=float)] if light else {}
        each = report.get("ratios", {})
        rows = {arm: row(data, lightest.get(arm), each.get(f"short p99 at 70% of b: {arm}/b, each round"))
                for arm, data in report["arms"].items()}
        out["workloads"][workload] = {"when": report["when"], "command": report["command"], "rows": rows}
        out["losses"] += losses(workload, rows)
    return out


def markdown(summary: dict) -> str:
    lines = [f"# make bench on every workload ({summary['when']})", "",
             f"Machine: {summary['machine']}. Command: `python bench/summary.py` over each workload's make bench "
             "report (each run's own command and time below). Arms side by side within each run; capacity at "
             "the run's p99 target (req/s); short at 70% of first-come's (b) capacity; long at the run's "
             "lightest light-load rate (- where the run skipped light load).", "",
             "| workload | arm | capacity | short p50 / p99 @70% b (ms) | long p50 / p99, light (ms) | most served (req/s) |",
             "|---|---|---|---|---|---|"]
    for workload, data in summary["workloads"].items():
        for arm, r in data["rows"].items():
            cap = ("≥ " if r["capacity_at_least"] else "") + f"{r['capacity']:g}"
            light = f"{r['long_p50_light']} / {r['long_p99_light']}" if r["long_p50_light"] is not None else "-"
            lines.append(f"| {workload} | {arm} | {cap} | {r['short_p50_at_70']} / {r['short_p99_at_70']} | {light} | "
                         f"{r['most_served']} |")
    lines += ["", "Runs: " + "; ".join(f"{w}: {d['when']}, `{d['command']}`" for w, d in summary["workloads"].items()), ""]
    if summary["missing"]:
        lines += [f"**Not run:** {', '.join(summary['missing'])}.", ""]
    lines += ["## Where the shipped archive loses", ""]
    lines += [f"- **LOSES** {line}" for line in summary["losses"]] or ["- nowhere in these runs"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=reports.RESULTS)
    parser.add_argument("--out", default=None, help="default: DIR/summary")
    args = parser.parse_args(argv)
    summary = summarize(args.dir)
    text = markdown(summary)
    reports.write(args.out or os.path.join(args.dir, "summary"), summary, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
