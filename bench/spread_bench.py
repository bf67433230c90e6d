"""`make bench-spread`: how much one pass varies on this host, over hundreds of passes.

The simulator draws each pass from the latency profile's median and p90. A profile's p90 cannot
show a host's spread: warmup times a shape until two timings agree within 10% (3 runs, mostly), so
its p90 sits within a few percent of its median by construction. On a quiet host that is about
right (fc-v1252's idle report: p90 within 1.03-1.06x of the median over 25 passes); on a noisy one
it is not (fc-v1272: p90 1.18-1.21x, p99 1.30-1.33x the median, bench/results/fc-v1272/spread.md),
and a short request's p99 is set by those slow passes. This times a few short shapes many times
each, in process, no HTTP, no TorchServe, one lane's thread count, a short fixed pause between
passes (a lane's between passes at moderate load, and the same for every pass so the cold cost of
a pause, make bench-idle's, does not spread them), and pools every pass over its own shape's
median. The pooled quantiles are the simulator's Overheads `spread`: each pass drawn there is
the profile's median times a ratio drawn from them. Writes bench/results/spread.json and
spread.md; `bench/overheads.py --refit ... --spread` takes its `fit` into an overheads report.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.beside_bench import shape  # noqa: E402
from bench.idle_bench import load_encoder  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.stats import percentile  # noqa: E402

QUANTILES = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


def fit_spread(ratios: list[float]) -> list[list[float]]:
    """(quantile, pass over its shape's median) at QUANTILES of the pooled ratios: the simulator
    interpolates between them (so its slowest draw is the slowest pass measured, no further)."""
    if len(ratios) < 100:
        raise ValueError(f"{len(ratios)} passes cannot give a p99: time at least 100")
    return [[q, round(percentile(ratios, 100 * q), 4)] for q in QUANTILES]


def rows_and_ratios(times: dict[str, list[float]]) -> tuple[list[dict], list[float]]:
    """Per shape its median, p90, p99 and slowest pass (ms), and every pass over its shape's median."""
    rows, ratios = [], []
    for name, values in times.items():
        median = percentile(values, 50)
        ratios += [v / median for v in values]
        rows.append({"shape": name, "samples": len(values), "p50_ms": round(median, 2),
                     "p90_ms": round(percentile(values, 90), 2), "p99_ms": round(percentile(values, 99), 2),
                     "max_ms": round(max(values), 2), "p99_vs_p50": round(percentile(values, 99) / median, 3)})
    return rows, ratios


def markdown(report: dict) -> str:
    lines = [f"# How much one pass varies ({report['when']}, {report['machine']})", "",
             f"Command: `{report['command']}`. In process, {report['threads']} intra-op thread(s), "
             f"{report['pause_ms']:g} ms between passes, shapes in turns.", "",
             "| shape | passes | median | p90 | p99 | slowest | p99 / median |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['samples']} | {r['p50_ms']} ms | {r['p90_ms']} ms | {r['p99_ms']} ms | "
              f"{r['max_ms']} ms | {r['p99_vs_p50']}x |" for r in report["rows"]]
    lines += ["", "For the simulator (`fit_spread`: Overheads' spread, (quantile, pass over its shape's median), "
              f"every pass pooled): {report['fit']['spread']}. `bench/overheads.py --refit ... --spread` puts it "
              "into an overheads report."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: the packaged all-MiniLM-L6-v2")
    parser.add_argument("--shapes", default="1x16,2x32,4x32", help="batch x tokens, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (a lane's on 2 cores: 1)")
    parser.add_argument("--samples", type=int, default=400, help="passes per shape")
    parser.add_argument("--pause-ms", type=float, default=5.0)
    parser.add_argument("--out", default=reports.RESULTS)
    args = parser.parse_args()

    from tsbatch.handlers.runtime.warming import example_batch

    runner, model_dir = load_encoder(args.model_dir)
    runner.use_threads(args.threads)
    batches = {name: example_batch(runner, *shape(name)) for name in args.shapes.split(",")}
    for batch in batches.values():
        for _ in range(3):
            runner.forward(batch)
    times: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(args.samples):  # shapes in turns: the host's drift falls on each alike
        for name, batch in batches.items():
            time.sleep(args.pause_ms / 1000)
            started = time.perf_counter()
            runner.forward(batch)
            times[name].append((time.perf_counter() - started) * 1000)
    rows, ratios = rows_and_ratios(times)
    report = {"when": reports.utc_now(seconds=True), "machine": reports.machine(),
              "command": "python bench/spread_bench.py " + " ".join(sys.argv[1:]), "model_dir": model_dir,
              "threads": args.threads, "pause_ms": args.pause_ms, "rows": rows, "fit": {"spread": fit_spread(ratios)}}
    text = markdown(report)
    reports.write(os.path.join(args.out, "spread"), report, text, indent=2)
    print(text)


if __name__ == "__main__":
    main()
