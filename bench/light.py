"""`make bench`'s light-load rows: every arm at 14 req/s and at 30% of the shipped arm's
capacity, where every server keeps up and a request's latency is what its own path costs.

`make bench BENCH_ARGS=--light-only` runs only these rows (the capacity from the last bench.json)
and writes bench/results/light.json and light.md; bench/run.py adds them to every full run.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Callable

from tsbatch.archiver import server
from bench.loadtest import report as reports
from bench.loadtest.sweep import at_rate_interleaved, measure
from bench.loadtest.workload import Maker, two_cluster

LIGHT_RATE = 14.0  # req/s: light load on this machine, every arm keeping up
LIGHT_SHARE = 0.3  # of the shipped arm's capacity
KEPT = ("short", "long", "all", "lost", "status", "short_breakdown_ms")


def light_rates(shipped_capacity: float) -> list[float]:
    """14 req/s and 30% of the shipped arm's capacity (once, if they round to the same rate)."""
    rates = [LIGHT_RATE]
    share = round(LIGHT_SHARE * shipped_capacity, 1)
    if share > 0 and share != LIGHT_RATE:
        rates.append(share)
    return rates


def light_load(urls: dict[str, str], rates: list[float], duration: float, rounds: int,
               requests: Maker = two_cluster) -> dict:
    """Every arm at each light rate, `rounds` interleaved windows each, pooled."""
    out = {}
    for rate in rates:
        points = at_rate_interleaved(urls, rate, duration, rounds, requests)
        out[str(rate)] = {arm: {k: point[k] for k in KEPT} for arm, point in points.items()}
    return out


def light_markdown(light: dict, labels: dict[str, str]) -> list[str]:
    lines = ["| arm | " + " | ".join(f"short p50 / p99 @{r}/s (ms) | all p99 @{r}/s (ms)" for r in light) + " |",
             "|---|" + "---|---|" * len(light)]
    for arm in next(iter(light.values())):
        cells = []
        for rate in light:
            point = light[rate][arm]
            cells += [f"{point['short']['p50']} / {point['short']['p99']}", f"{point['all']['p99']}"]
        lines.append(f"| {arm}: {labels[arm]} | " + " | ".join(cells) + " |")
    return lines


def light_only(args, arms: list[str], build: Callable[[str], str], labels: dict[str, str], command: str) -> int:
    """`--light-only`: the light-load rows alone, at the shipped capacity of the last full run;
    `build(root)` builds every arm's archive under root and returns the model store; `command`: the
    run's own, every argument named."""
    with open(os.path.join(args.out, "bench.json")) as f:
        shipped = json.load(f)["arms"]["d"]["capacity"]
    report = {"when": reports.utc_now(), "machine": reports.machine(),
              "command": command,
              "mix": "85% short (lognormal, median ~16 tokens), 15% long (200-256 tokens)",
              "duration": args.duration, "rounds": args.rounds, "shipped_capacity": shipped,
              "before": reports.checkout_of(args.before) if args.before else None,
              "after": reports.checkout_of(sys.executable)}
    with tempfile.TemporaryDirectory(prefix="tsbatch-bench-") as root, \
            server.local_server(os.path.join(root, "server"), build(root), [f"arm_{a}" for a in arms],
                                max_request_size=1 << 22) as served:
        urls = {arm: f"{served.inference}/predictions/arm_{arm}" for arm in arms}
        for arm in arms:
            measure(urls[arm], 4, 3, seed=1)  # first requests: not measured
        report["light"] = light_load(urls, light_rates(shipped), args.duration, args.rounds)
    lines = [f"# tsbatch at light load ({report['when']})", "",
             f"Machine: {report['machine']}. Command: `{report['command']}`.",
             f"Workload: open-loop Poisson, {report['mix']}; {args.duration} s windows, {args.rounds} per arm and "
             f"rate, arms interleaved, pooled. Rates: {LIGHT_RATE:g} req/s and {LIGHT_SHARE:.0%} of the shipped "
             f"arm's capacity in the last make bench ({shipped} req/s).",
             f"After: {report['after']}."]
    if report["before"]:
        lines.append(f"Before: {report['before']}.")
    text = "\n".join(lines + [""] + light_markdown(report["light"], labels)) + "\n"
    reports.write(os.path.join(args.out, "light"), report, text)
    print(text)
    return 0
