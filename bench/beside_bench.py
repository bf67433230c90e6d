"""`make bench-beside`: how much slower a pass runs while another lane's pass runs beside it.

A tsbatch worker runs a short lane and a long lane in one process, one intra-op thread each on a
2-core machine: two passes at once share the memory bus, the caches and the interpreter. The
simulator slows a pass that has a long pass beside it by Overheads' `beside`, fitted to the short
passes of a live run; a long pass beside a long one (the short lane helping the long lane) was
slowed by the same factor, never measured. This measures every pairing in process, no HTTP, no
TorchServe: the subject pass on this thread, back to back, alone and while a second thread loops
a short or a long pass (lane 1, as the worker's long lane: its own thread, its own team, nice 10),
the three conditions taking turns round by round so the machine's drift falls on each alike.
And the short pass beside a thread that does Python work part of the time (`--python-duty`), as a
worker's intake thread does per request (parsing, replies: here JSON of a 384-float vector): two
threads of one process share one interpreter, so a lane pays for the intake's Python even when the
intake runs on the other core (the simulator's `intake`, fitted live by bench/intake_fit.py).
Writes bench/results/beside.json and beside.md; `bench/overheads.py --refit ... --beside` takes
its `fit` into an overheads report.
"""
from __future__ import annotations

import argparse
import json
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
PYTHON_PERIOD = 0.005  # seconds: the Python thread's cycle of work then sleep (a request each 5 ms is 200 req/s)


def python_beside(duty: float) -> str:
    return f"python {duty:.0%}"


def order(beside: str) -> tuple[int, int]:
    """Lanes' conditions first, as BESIDE lists them, then Python's by its share of time."""
    return (BESIDE.index(beside), 0) if beside in BESIDE else (len(BESIDE), int(beside.split()[1].rstrip("%")))


def shape(text: str) -> tuple[int, int]:
    """'4x32' -> (batch 4, 32 tokens)."""
    size, _, length = text.partition("x")
    return int(size), int(length)


def slowdowns(times: dict[tuple[str, str], list[float]]) -> list[dict]:
    """Per (subject, beside) the median pass and its ratio to the same subject's alone."""
    rows = []
    for (subject, beside), values in sorted(times.items(), key=lambda kv: (kv[0][0], order(kv[0][1]))):
        alone = percentile(times[(subject, "alone")], 50)
        p50 = percentile(values, 50)
        rows.append({"subject": subject, "beside": beside, "samples": len(values), "p50_ms": round(p50, 2),
                     "p90_ms": round(percentile(values, 90), 2), "vs_alone": round(p50 / alone, 3)})
    return rows


def fit(rows: list[dict]) -> dict:
    """The simulator's factors: a short pass beside a long one (`beside`, for comparison with the
    one fitted live) and a long pass beside a long one (`beside_long`)."""
    ratio = {(r["subject"], r["beside"]): r["vs_alone"] for r in rows}
    python = {beside: vs for (subject, beside), vs in ratio.items() if subject == "short" and beside not in BESIDE}
    return {"beside": ratio[("short", "long")], "beside_long": ratio[("long", "long")],
            "short_beside_short": ratio[("short", "short")], **({"short_beside_python": python} if python else {})}


def python_work(duty: float, stop: threading.Event) -> None:
    """Python for `duty` of every PYTHON_PERIOD, asleep (the interpreter free) for the rest."""
    vector = [0.123456789 * i for i in range(384)]
    while not stop.is_set():
        begun = time.perf_counter()
        while time.perf_counter() - begun < duty * PYTHON_PERIOD:
            json.loads(json.dumps({"embedding": vector}))
        rest = PYTHON_PERIOD - (time.perf_counter() - begun)
        if rest > 0:
            time.sleep(rest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: the packaged all-MiniLM-L6-v2")
    parser.add_argument("--short", default="4x32", help="the short pass: batch x tokens")
    parser.add_argument("--long", default="2x256", help="the long pass: batch x tokens")
    parser.add_argument("--samples", type=int, default=8, help="subject passes per condition and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--python-duty", default="0.2,0.5",
                        help="comma-separated shares of time a Python thread works beside the short pass (empty: none)")
    parser.add_argument("--out", default=reports.RESULTS)
    args = parser.parse_args()

    from tsbatch.handlers.edge.tsbatch_handler import LANE_SWITCH_INTERVAL_S
    from tsbatch.handlers.runtime.warming import example_batch

    sys.setswitchinterval(LANE_SWITCH_INTERVAL_S)  # as a worker with lanes runs
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

    duties = [float(d) for d in args.python_duty.split(",") if d.strip()]
    times: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        for subject in ("short", "long"):
            pythons = [(python_beside(d), d) for d in duties] if subject == "short" else []
            for beside, duty in [(b, None) for b in BESIDE] + pythons:
                stop, started = threading.Event(), threading.Event()
                other = None
                if duty is not None:
                    other = threading.Thread(target=python_work, args=(duty, stop), daemon=True)
                    other.start()
                    time.sleep(2 * PYTHON_PERIOD)
                elif beside != "alone":
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
             f"thread at nice 10; {args.rounds} rounds of {args.samples} passes per condition, in turns; the "
             f"interpreter's switch interval the worker's ({LANE_SWITCH_INTERVAL_S * 1000:g} ms)."
             + (f" Beside `python N%`: a thread doing Python (JSON of a 384-float vector) N% of every "
                f"{PYTHON_PERIOD * 1000:g} ms, asleep the rest." if duties else ""), "",
             "| pass | beside it | median | p90 | median vs alone |", "|---|---|---|---|---|"]
    lines += [f"| {r['subject']} | {r['beside']} | {r['p50_ms']} ms | {r['p90_ms']} ms | {r['vs_alone']}x |"
              for r in rows]
    f = report["fit"]
    lines += ["", f"For the simulator (`bench/overheads.py --refit ... --beside`): a long pass beside a long one "
              f"runs {f['beside_long']}x slower (Overheads' beside_long); a short one beside a long one "
              f"{f['beside']}x here, in process (the simulator's `beside` stays the one fitted to a live run's short "
              f"passes, which also carry the frontend's work beside them)."]
    if f.get("short_beside_python"):
        lines += ["", "A short pass beside Python work in the same process: " + ", ".join(
            f"{k} {v}x" for k, v in f["short_beside_python"].items()) + " (the simulator's `intake` is fitted live, "
            "bench/intake_fit.py; this says how much of it one interpreter shared with the intake can explain)."]
    reports.write(os.path.join(args.out, "beside"), report, "\n".join(lines) + "\n", indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
