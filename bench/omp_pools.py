"""`make bench-omp-pools`: a multi-threaded pass from a lane thread, with and without a second
thread of the process holding an OpenMP team.

PyTorch's CPU wheels run intra-op parallelism on GNU OpenMP. Each thread that runs a pass on more
than one intra-op thread gets a team of its own that outlives the pass, and once the teams of a
process hold more threads than it has cores, every team's workers sleep between parallel regions
instead of waiting for the next one: a multi-threaded pass then runs at about its one-thread
speed. A worker whose handler thread loaded and warmed the model on two threads and whose lane
then borrows both cores has two such teams. In process, no HTTP: one thread (a lane) runs the
long bucket at batch 1 on one thread and on all cores, first while it holds the only team, then
after another thread (the handler's) ran one pass on all cores. Writes bench/results/omp-pools.json
and omp-pools.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.loadtest import report as reports  # noqa: E402
from bench.idle_bench import load_encoder, measure  # noqa: E402

PAUSES_MS = (1, 400)


def on_thread(fn):
    """fn() on a thread of its own that then ends (its OpenMP team, if any, ends with it)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: the packaged all-MiniLM-L6-v2")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--bucket", type=int, default=256)
    parser.add_argument("--out", default=reports.RESULTS)
    args = parser.parse_args()

    import torch

    from tsbatch.handlers.runtime.warming import example_batch

    cores = torch.get_num_threads()
    torch.set_num_threads(1)  # this (the handler's) thread holds no team until the second half
    runner, model_dir = on_thread(lambda: load_encoder(args.model_dir))
    rows: list[dict] = []
    second_team, resume = threading.Event(), threading.Event()

    def lane() -> None:
        for teams in ("one", "two"):
            if teams == "two":
                second_team.set()
                resume.wait()
            for threads in sorted({1, cores}):
                for pause in PAUSES_MS:
                    row = {"teams": teams, **measure(runner, args.bucket, threads, pause, args.samples)}
                    rows.append(row)
                    print(f"{teams} team(s), {threads} thread(s), after {pause} ms idle: median {row['p50_ms']} ms, "
                          f"p90 {row['p90_ms']} ms", flush=True)

    thread = threading.Thread(target=lane)
    thread.start()
    second_team.wait()
    runner.use_threads(cores)
    runner.forward(example_batch(runner, 1, args.bucket))  # the handler's thread now holds a team of `cores` threads too
    resume.set()
    thread.join()

    report = {"when": reports.utc_now(seconds=True), "machine": reports.machine(), "cores": cores,
              "command": "make bench-omp-pools", "model_dir": model_dir, "bucket": args.bucket, "rows": rows}
    lines = [f"# A lane's pass with one OpenMP team in the process, and with two ({report['when']}, "
             f"{report['machine']})", "",
             f"Command: `{report['command']}`. Batch 1 x {args.bucket} tokens, {args.samples} passes a row, run from "
             "one lane thread; \"two\": after the process's main thread also ran one pass on every core.", "",
             "| teams | threads | pause | median | p90 |", "|---|---|---|---|---|"]
    lines += [f"| {r['teams']} | {r['threads']} | {r['pause_ms']} ms | {r['p50_ms']} ms | {r['p90_ms']} ms |"
              for r in rows]
    reports.write(os.path.join(args.out, "omp-pools"), report, "\n".join(lines) + "\n", indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
