"""`make bench-beside`: how much slower a pass runs while another lane's pass runs beside it.

A tsbatch worker runs a short lane and a long lane in one process, one intra-op thread each on a
2-core machine: two passes at once share the memory bus, the caches and the interpreter. The
simulator slows a pass that has a long pass beside it by Overheads' `beside`, fitted to the short
passes of a live run; a long pass beside a long one (the short lane helping the long lane) was
slowed by the same factor, never measured. This measures every pairing in process, no HTTP, no
TorchServe: the subject pass on this thread, back to back, alone and while a second thread loops
a short or a long pass (lane 1, as the worker's long lane: its own thread, its own team, nice 10),
the three conditions taking turns round by round so the machine's drift falls on each alike.
Writes bench/results/beside.json and beside.md; `bench/overheads.py --refit ... --beside` takes
its `fit` into an overheads report.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.idle_bench import load_encoder  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.stats import percentile  # noqa: E402

BESIDE = ("alone", "short", "long")


def shape(text: str) -> tuple[int, int]:
    """'4x32' -> (batch 4, 32 tokens)."""
    size, _, length = text.partition("x")
    return int(size), int(length)


def slowdowns(times: dict[tuple[str, str], list[float]]) -> list[dict]:
    """Per (subject, beside) the median pass and its ratio to the same subject's alone."""
    rows = []
    for (subject, beside), values in sorted(times.items(), key=lambda kv: (kv[0][0], BESIDE.index(kv[0][1]))):
        alone = percentile(times[(subject, "alone")], 50)
        p50 = percentile(values, 50)
        rows.append({"subject": subject, "beside": beside, "samples": len(values), "p50_ms": round(p50, 2),
                     "p90_ms": round(percentile(values, 90), 2), "vs_alone": round(p50 / alone, 3)})
    return rows


def fit(rows: list[dict]) -> dict:
    """The simulator's factors: a short pass beside a long one (`beside`, for comparison with the
    one fitted live) and a long pass beside a long one (`beside_long`)."""
    ratio = {(r["subject"], r["beside"]): r["vs_alone"] for r in rows}
    return {"beside": ratio[("short", "long")], "beside_long": ratio[("long", "long")],
            "short_beside_short": ratio[("short", "short")]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: the packaged all-MiniLM-L6-v2")
    parser.add_argument("--short", default="4x32", help="the short pass: batch x tokens")
    parser.add_argument("--long", default="2x256", help="the long pass: batch x tokens")
    parser.add_argument("--samples", type=int, default=8, help="subject passes per condition and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=reports.RESULTS)
    args = parser.parse_args()

    from tsbatch.handlers.runtime.warming import example_batch

    runner, model_dir = load_encoder(args.model_dir)
    shapes = {"short": shape(args.short), "long": shape(args.long)}
    batches = {kind: example_batch(runner, *size_length) for kind, size_length in shapes.items()}
    runner.use_threads(1)
    for batch in batches.values():
        for _ in range(3):
            runner.forward(batch)

    def loop(kind: str, stop: threading.Event, started: threading.Event) -> None:
        runner.use_threads(1, background=True)
        runner.forward(batches[kind])  # its team warm before the subject is timed
        started.set()
        while not stop.is_set():
            runner.forward(batches[kind])

    times: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        for subject in ("short", "long"):
            for beside in BESIDE:
                stop, started = threading.Event(), threading.Event()
                other = None
                if beside != "alone":
                    other = threading.Thread(target=loop, args=(beside, stop, started), daemon=True)
                    other.start()
                    started.wait()
                runner.forward(batches[subject])
                for _ in range(args.samples):
                    begun = time.perf_counter()
                    runner.forward(batches[subject])
                    times.setdefault((subject, beside), []).append((time.perf_counter() - begun) * 1000)
                stop.set()
                if other:
                    other.join()
        print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    rows = slowdowns(times)
    report = {"when": reports.utc_now(seconds=True), "machine": reports.machine(),
              "command": "python bench/beside_bench.py " + " ".join(sys.argv[1:]), "model_dir": model_dir,
              "shapes": {kind: {"batch": s[0], "tokens": s[1]} for kind, s in shapes.items()}, "rows": rows,
              "fit": fit(rows)}
    lines = [f"# A pass beside another lane's pass ({report['when']}, {report['machine']})", "",
             f"Short pass: batch {shapes['short'][0]} x {shapes['short'][1]} tokens; long pass: batch "
             f"{shapes['long'][0]} x {shapes['long'][1]} tokens; one intra-op thread each, the second on its own "
             f"thread at nice 10; {args.rounds} rounds of {args.samples} passes per condition, in turns.", "",
             "| pass | beside it | median | p90 | median vs alone |", "|---|---|---|---|---|"]
    lines += [f"| {r['subject']} | {r['beside']} | {r['p50_ms']} ms | {r['p90_ms']} ms | {r['vs_alone']}x |"
              for r in rows]
    f = report["fit"]
    lines += ["", f"For the simulator (`bench/overheads.py --refit ... --beside`): a long pass beside a long one "
              f"runs {f['beside_long']}x slower (Overheads' beside_long); a short one beside a long one "
              f"{f['beside']}x here, in process (the simulator's `beside` stays the one fitted to a live run's short "
              f"passes, which also carry the frontend's work beside them)."]
    reports.write(os.path.join(args.out, "beside"), report, "\n".join(lines) + "\n", indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
