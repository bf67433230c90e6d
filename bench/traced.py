"""The built-in encoder's pass, eager against traced (`trace: true`), in process: one CPU thread
(a lane's), the default model, each shape's passes timed in turns so both see the same machine.
A pass is EncoderModel.forward, collating and pooling included.

    python bench/traced.py [--rounds 6] [--out bench/results/traced]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.loadtest import report as reports  # noqa: E402

SHAPES = ((1, 8), (1, 16), (1, 32), (4, 16), (8, 32), (16, 32), (4, 128), (4, 256))  # (texts, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default=os.path.join(reports.RESULTS, "traced"))
    args = parser.parse_args()
    from tsbatch.archiver.cli import default_model_dir
    from tsbatch.handlers.edge.config import HandlerConfig, Task
    from tsbatch.handlers.models.encoder import EncoderModel
    from tsbatch.handlers.runtime.warming import example_batch

    models = {trace: EncoderModel(HandlerConfig(task=Task.EMBEDDING, torch_threads=1, trace=trace), default_model_dir())
              for trace in (False, True)}
    assert models[True].traced is not None, "the default model did not trace"
    batches = {shape: example_batch(models[False], *shape) for shape in SHAPES}
    best = {(shape, trace): [] for shape in SHAPES for trace in models}
    same = {}
    for shape, batch in batches.items():
        same[shape] = models[False].forward(batch) == models[True].forward(batch)
    for _ in range(args.rounds):
        for shape, batch in batches.items():
            for trace, model in models.items():
                model.forward(batch)
                times = []
                for _ in range(5 if shape[0] * shape[1] <= 64 else 2):
                    start = time.perf_counter()
                    model.forward(batch)
                    times.append(time.perf_counter() - start)
                best[(shape, trace)].append(min(times))
    rows = []
    for shape in SHAPES:
        eager, traced = (statistics.median(best[(shape, t)]) * 1000 for t in (False, True))
        rows.append({"texts": shape[0], "tokens": shape[1], "eager_ms": round(eager, 2),
                     "traced_ms": round(traced, 2), "traced_over_eager": round(traced / eager, 3),
                     "same_answers": same[shape]})
    report = {"when": reports.utc_now(), "machine": reports.machine(), "rounds": args.rounds,
              "command": "python bench/traced.py" + (f" --rounds {args.rounds}" if args.rounds != 6 else ""), "rows": rows}
    lines = [f"# The encoder's pass, eager and traced ({report['when']}, {report['machine']})", "",
             f"Command: `{report['command']}`. In process, one torch thread, the default model; per shape the "
             "best of 5 passes (2 for large ones) in each of the rounds, eager and traced in turns, the median of "
             "the rounds (ms). Same answers: the pass's results compared exactly (every float).", "",
             "| texts | tokens each | eager | traced | traced ÷ eager | same answers |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['texts']} | {r['tokens']} | {r['eager_ms']} | {r['traced_ms']} | {r['traced_over_eager']} | "
              f"{r['same_answers']} |" for r in rows]
    reports.write(args.out, report, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
