"""Generation at token granularity (#37): tsbatch's generation engine against three controls.

Arms, one torchserve each, all up for the whole run (an idle one costs nothing), one worker each:
- tsbatch: the archive exactly as `tsbatch archive --task generation` builds it (async mode, the
  engine's defaults);
- fifo (a): bench/controls/control_generate_fifo.py under TorchServe's batching (batchSize 8,
  maxBatchDelay 20 ms): one generate() per batch;
- bucketed (b): examples/generate archived with `tsbatch archive --handler ... --no-tune` (buckets
  of prompt tokens x new tokens, its prompt buckets reaching 400 tokens, caps of 8, the template's
  other values, warmup off: profiling or warming every bucket and batch size takes minutes here);
- continuous (c): bench/controls/control_generate_continuous.py, TorchServe's documented
  continuous-batching pattern (batchSize 16, maxBatchDelay 5 ms);
- mixed (with --mixed): the first arm with `handler.prefill_apart: false`, prefills sharing the
  running sequences' decode step (what the engine did before the alternation that ships).
The model: a random GPT-2 made here (make_lm), greedy, no end-of-sequence token (every answer is
as long as its ask). The mix: bench/generate_mix.py (prompts of 8-400 tokens; most asks for 8-32
new tokens, some for 256), drawn from one pool whose answers alone are computed in process first.

One run, open-loop Poisson arrivals, arms in turns:
0. Alone, one request in flight: a short and a long ask twice each, then every short ask of the
   pool twice, streamed: the floor of the short asks' time to first token, which no scheduler
   beats on this machine (the first criterion says it beside its target).
1. (a)'s capacity: a short geometric rate sweep (whole answers), then one bisection; a rate
   passes when every request is answered 200 and the p99 of whole answers is within --target-ms.
2. At 70% of it, every arm in turns for --rounds windows of streamed asks: short-ask time to first
   token (first piece of body from the scheduled arrival; (a) and (b) do not stream, so their first
   piece is the whole answer).
3. Saturation: every arm at --saturation-factor x (a)'s capacity (whole answers), doubled for an
   arm that is not saturated by it (up to twice): output tokens/s over the busy period.
Every answer of every window is checked against its ask's answer alone. Writes
bench/results/generate.json and .md.

    python bench/generate.py [--quick] [--target-ms 8000] [--rounds 2] ...
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench import generate_mix as mix  # noqa: E402
from bench.generate_client import one_by_one, open_loop  # noqa: E402
from bench.generate_report import criteria, markdown  # noqa: E402
from bench.loadtest.arrivals import poisson_arrivals  # noqa: E402
from bench.loadtest.report import load_average, machine, utc_now, write  # noqa: E402
from bench.loadtest.sweep import rotated  # noqa: E402
from bench.generate_arms import (CONTINUOUS_FRONTEND, FIFO_FRONTEND, LABELS, MODEL, Arms, alone_answers,  # noqa: E402
                                 build, make_lm)
from tsbatch.archiver import server  # noqa: E402

class Run:
    """The measurements, in order; every window's answers are kept for the equality tally."""

    def __init__(self, urls: dict[str, str], pool: list[mix.Ask], references: dict, args):
        self.urls, self.pool, self.references, self.args = urls, pool, references, args
        self.tally = {arm: mix.Tally() for arm in urls}
        self.log: list[dict] = []

    def window(self, arm: str, rate: float, seconds: float, stream: bool, seed: int, phase: str) -> tuple[dict, list]:
        arrivals = poisson_arrivals(rate, seconds, seed)
        asks = mix.draw(self.pool, len(arrivals), seed)
        started = time.monotonic()
        answers = open_loop(self.urls[arm], asks, arrivals, stream, timeout=self.args.timeout)
        point = mix.summarize(answers, rate, seconds, self.references)
        point.update(arm=arm, phase=phase, stream=stream, seed=seed, wall_s=round(time.monotonic() - started, 1),
                     load_average=load_average())
        self.tally[arm].add(answers, self.references)
        self.log.append(point)
        print(f"{phase} {arm} rate {rate:g}: ok {point['ok']}/{point['sent']} lost {point['lost']} refused "
              f"{point['refused']} differ {point['differ']} p99 {point['all']['p99']} short ttft p99 "
              f"{point['short']['ttft_p99']} out tok/s {point['output_tokens_per_s']} wall {point['wall_s']}s",
              flush=True)
        return point, answers

    def capacity_of_fifo(self) -> tuple[float, list[dict]]:
        a = self.args
        points = []
        for i, rate in enumerate(mix.next_rates(a.start_rate, a.factor, a.max_sweep)):
            point, _ = self.window("fifo", rate, a.sweep_seconds, False, 100 + i, "sweep")
            points.append(point)
            if not mix.passes(point, a.target_ms):
                break
        middle = mix.bisect_rate(points, a.target_ms)
        if middle is not None:
            point, _ = self.window("fifo", middle, a.sweep_seconds, False, 150, "sweep")
            points = sorted(points + [point], key=lambda p: p["offered_rate"])
        return mix.capacity(points, a.target_ms), points

    def ttft(self, rate: float) -> dict:
        pooled: dict[str, list] = {arm: [] for arm in self.urls}
        rounds: dict[str, list] = {arm: [] for arm in self.urls}
        for turn in range(self.args.rounds):
            for arm in rotated(list(self.urls), turn):
                point, answers = self.window(arm, rate, self.args.ttft_seconds, True, 200 + turn, "ttft")
                pooled[arm].extend(answers)
                rounds[arm].append(point["short"]["ttft_p99"])
        out = {}
        for arm, answers in pooled.items():
            point = mix.summarize(answers, rate, self.args.ttft_seconds * self.args.rounds, self.references)
            point["rounds_short_ttft_p99"] = rounds[arm]
            out[arm] = point
        return out

    def saturation(self, rate: float) -> dict:
        out = {}
        for arm in rotated(list(self.urls), 1):
            tried = []
            for step in range(3):
                point, _ = self.window(arm, rate * 2 ** step, self.args.saturation_seconds, False, 300 + step,
                                       "saturation")
                tried.append(point)
                if mix.saturated(point, self.args.target_ms):
                    break
            out[arm] = mix.saturation_row(tried, self.args.target_ms)
        return out


def one_in_flight(urls: dict[str, str], sample: list[mix.Ask], references: dict, tally: dict, label: str,
                  figures) -> dict:
    """Each arm with one request in flight: the sample's asks one by one, streamed, checked against
    their answers alone; `figures(answers)` is what each arm's answers say."""
    out = {}
    for arm, url in urls.items():
        answers = one_by_one(url, sample, True)
        tally[arm].add(answers, references)
        out[arm] = figures(answers)
        print(f"{label} {arm}: {out[arm]}", flush=True)
    return out


def lone(urls: dict[str, str], pool: list[mix.Ask], references: dict, tally: dict) -> dict:
    """A short ask and a long one, twice: what a request costs with no company (its TTFT, and the
    whole 256-token answer), the best of two."""
    sample = [next(a for a in pool if a.kind == "short"), next(a for a in pool if a.kind == "long")] * 2

    def best(answers):
        return {kind: {name: min((round(getattr(a, field) * 1000, 1) for a in answers
                                  if a.ask.kind == kind and getattr(a, field) is not None), default=None)
                       for name, field in (("ttft_ms", "first_chunk"), ("whole_ms", "done"))}
                for kind in ("short", "long")}

    return one_in_flight(urls, sample, references, tally, "alone", best)


def floors(urls: dict[str, str], pool: list[mix.Ask], references: dict, tally: dict) -> dict:
    """Every short ask of the pool, twice (its best counts): the time to first token no scheduler
    can beat on this machine (mix.floor)."""
    return one_in_flight(urls, [a for a in pool if a.kind == "short"] * 2, references, tally, "floor", mix.floor)


def warm(urls: dict[str, str], pool: list[mix.Ask]) -> None:
    """A few asks one by one on every arm before anything is timed (first calls pay for lazy set-up)."""
    sample = [a for a in pool if a.kind == "short"][:3] + [a for a in pool if a.kind == "long"][:1]
    for arm, url in urls.items():
        for stream in (False, True):
            bad = [a for a in one_by_one(url, sample, stream) if a.status != 200]
            if bad:
                raise SystemExit(f"{arm} failed to warm up: {bad[0].status} {bad[0].error} {bad[0].body[:300]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-share", type=float, default=0.15, help="share of asks for 256 new tokens")
    parser.add_argument("--pool", type=int, default=64, help="distinct asks (each answered alone first)")
    parser.add_argument("--target-ms", type=float, default=8000, help="p99 of whole answers within which a rate passes")
    parser.add_argument("--start-rate", type=float, default=0.75)
    parser.add_argument("--factor", type=float, default=1.5, help="the sweep's step, a ratio")
    parser.add_argument("--max-sweep", type=int, default=8)
    parser.add_argument("--sweep-seconds", type=float, default=12)
    parser.add_argument("--ttft-seconds", type=float, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--saturation-factor", type=float, default=2.0)
    parser.add_argument("--saturation-seconds", type=float, default=12)
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--mixed", action="store_true", help="one more arm: the engine with prefill_apart off")
    parser.add_argument("--quick", action="store_true", help="a few seconds per window: a smoke run (no report)")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "generate"))
    args = parser.parse_args()
    if args.quick:
        args.sweep_seconds = args.ttft_seconds = args.saturation_seconds = 4
        args.rounds, args.pool, args.max_sweep = 1, 24, 3
    server.stop_on_sigterm()
    started = time.monotonic()
    command = "make bench-generate" + (f" BENCH_ARGS='{' '.join(sys.argv[1:])}'" if sys.argv[1:] else "")
    when = utc_now()
    root = tempfile.mkdtemp(prefix="tsbatch-generate-")
    model_dir = make_lm(os.path.join(root, "model"))
    pool = mix.make_pool(args.pool, args.long_share)
    t0 = time.monotonic()
    built = build(root, model_dir, mixed=args.mixed)
    build_s = time.monotonic() - t0
    t0 = time.monotonic()
    references = alone_answers(model_dir, pool)
    alone_s = time.monotonic() - t0
    print(f"built in {build_s:.0f}s, answers alone in {alone_s:.0f}s", flush=True)
    with Arms(root, built) as arms:
        warm(arms.urls, pool)
        run = Run(arms.urls, pool, references, args)
        lone_figures = lone(arms.urls, pool, references, run.tally)
        floor_figures = floors(arms.urls, pool, references, run.tally)
        cap, sweep = run.capacity_of_fifo()
        print(f"(a)'s capacity: {cap} req/s", flush=True)
        rate70 = round(0.7 * cap, 2) if cap else args.start_rate * 0.7
        ttft = run.ttft(rate70)
        saturation = run.saturation(max(cap, args.start_rate) * args.saturation_factor)
    report = {
        "when": when, "finished": utc_now(), "machine": machine(), "command": command, "args": vars(args),
        "seconds": round(time.monotonic() - started), "build_s": round(build_s), "alone_s": round(alone_s),
        "model": {**MODEL, "kind": "random GPT-2, no end-of-sequence token, MiniLM WordPiece tokenizer"},
        "mix": {"prompt_tokens": mix.PROMPT_TOKENS, "short_new": mix.SHORT_NEW, "long_new": mix.LONG_NEW,
                "long_share": args.long_share, "pool": args.pool},
        "arms": {arm: LABELS[arm] for arm in built},
        "frontends": {"fifo": FIFO_FRONTEND, "continuous": CONTINUOUS_FRONTEND},
        "lone": lone_figures, "floor": floor_figures, "fifo_capacity": cap, "sweep": sweep, "rate70": rate70,
        "ttft": ttft, "saturation": saturation,
        "tally": {arm: t.as_dict() for arm, t in run.tally.items()}, "windows": run.log,
    }
    checks = criteria({arm: p["short"]["ttft_p99"] for arm, p in ttft.items()},
                      {arm: s["output_tokens_per_s"] for arm, s in saturation.items()},
                      {arm: t.lost for arm, t in run.tally.items()}, report["tally"],
                      floors={arm: f["ttft_p99"] for arm, f in floor_figures.items()})
    report["criteria"] = [vars(c) for c in checks]
    print("\n".join(c.line() for c in checks), flush=True)
    if args.quick:
        write(os.path.join(root, "generate"), report, markdown(report, checks))
        print(f"quick run: report in {root}/generate.md (bench/results untouched)")
        return
    write(args.out, report, markdown(report, checks))


if __name__ == "__main__":
    main()
