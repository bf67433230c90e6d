"""Fit the simulator's `intake`: how much slower a tsbatch pass runs per request/s the worker takes in.

Live short passes on fc-v1252 ran slower than the simulated ones the more requests per second
arrived (short texts: 64 -> 192 req/s, +11-17% in each of four runs), while each run's level moved
with the host by itself (0.86x to 1.14x at 64 req/s, profiles minutes apart agreeing). So the fit
gives every live run and arm its own level and asks one slope of them all: the median pass served,
live over simulated (validate_sim's sweep rows, simulated without `intake`), at the rates of a
sweep up to MAX_LOAD of that arm's live capacity (beyond it the batches differ, not only the speed).
Writes a copy of an overheads report with the slope in it (`fit.intake`, and `intake` for where it
came from), for `validate_sim --overheads` and `tsbatch tune --overheads`; the report it copies
stays as it was, so what was simulated with it can be simulated again.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench import overheads as overheads_report  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402

MAX_LOAD = 0.75  # the highest share of an arm's live capacity whose passes the fit reads
GRID = [i / 20000 for i in range(0, 61)]  # slopes tried: 0 to 0.003 per req/s


def points(report: dict, source: str = "") -> dict[str, list[tuple[float, float]]]:
    """(rate, live pass over simulated pass) per live run and tsbatch arm of a validate_sim report."""
    out: dict[str, list[tuple[float, float]]] = {}
    for workload in report["workloads"]:
        for arm, row in workload["arms"].items():
            capacity = row["capacity"]["live"]
            for point in row["sweep"]:
                passes = point.get("short_pass_ms") or {}
                if passes.get("live") and passes.get("simulated") and point["rate"] <= MAX_LOAD * capacity:
                    key = f"{source} {workload['workload']} {arm}".strip()
                    out.setdefault(key, []).append((point["rate"], passes["live"] / passes["simulated"]))
    return out


def misfit(groups: dict[str, list[tuple[float, float]]], slope: float) -> float:
    """Squared log error left when each group keeps its own level and passes slow by 1 + slope x rate."""
    total = 0.0
    for pairs in groups.values():
        logs = [math.log(ratio / (1 + slope * rate)) for rate, ratio in pairs]
        level = sum(logs) / len(logs)
        total += sum((x - level) ** 2 for x in logs)
    return total


def fit(groups: dict[str, list[tuple[float, float]]]) -> dict:
    """The slope on GRID that leaves the least misfit, with the misfit without one beside it."""
    groups = {k: v for k, v in groups.items() if len(v) > 1}  # one rate says nothing about a slope
    if not groups:
        raise ValueError("no live run with passes timed at two rates or more below "
                         f"{MAX_LOAD:.0%} of its capacity")
    slope = min(GRID, key=lambda s: (misfit(groups, s), s))
    return {"intake": slope, "misfit": round(misfit(groups, slope), 4), "misfit_without": round(misfit(groups, 0.0), 4),
            "groups": len(groups), "points": sum(len(v) for v in groups.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="validate_sim reports (simulator-vs-live.json), simulated "
                                                    "without intake")
    parser.add_argument("--overheads", required=True, metavar="JSON", help="the overheads report the live runs were "
                                                                           "simulated with")
    parser.add_argument("--out", required=True, help="where the copy with the fit goes (.json and .md)")
    args = parser.parse_args(argv)
    groups = {}
    for path in args.reports:
        with open(path) as f:
            report = json.load(f)
        if report.get("intake"):
            parser.error(f"{path} was simulated with intake {report['intake']}: the fit reads passes simulated without")
        groups.update(points(report, os.path.relpath(path)))
    result = fit(groups)
    with open(args.overheads) as f:
        target = json.load(f)
    target["fit"]["intake"] = result["intake"]
    target["intake"] = {**result, "from": [os.path.relpath(p) for p in args.reports],
                        "command": "python bench/intake_fit.py " + " ".join(sys.argv[1:] if argv is None else argv),
                        "when": reports.utc_now()}
    text = overheads_report.markdown(target)
    reports.write(args.out, target, text)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
