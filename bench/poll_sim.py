"""`poll_ms` decided in the simulator: the archive `tsbatch archive --profile P` builds, with each
`poll_ms`, under the overheads a host measured (their `call`: what one return to the frontend costs
a running pass, make bench-poll). Prints, per poll: a lone long request (its pass and end to end),
the mix (85% short, 15% long) at light rates (each class's p50/p99, the median over seeds), and on
make bench's four workloads capacity at p99 <= 500 ms and short p99 at 70% of first-come's
capacity. Deterministic; the figures docs/experiments.md quotes.

    python bench/poll_sim.py --profile P --overheads JSON [--polls 5,20,50] [--rates 4,14] [--seeds 0,1,2]
        [--profile-first-come P2] [--out F]
"""
from __future__ import annotations

import argparse
import functools
import os
import shlex
import statistics
import sys
from dataclasses import replace
from multiprocessing import Pool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.loadtest import report as reports  # noqa: E402
from bench.validate_sim import tuned_arm  # noqa: E402
from tsbatch.archiver import pipeline  # noqa: E402
from tsbatch.archiver import simulate as sim  # noqa: E402
from tsbatch.handlers.core.cost import profile_threads  # noqa: E402

WORKLOADS = ("search", "short", "long", "two-cluster")
MAX_LENGTH, TARGET_MS, LONE_TOKENS = 256, 500.0, 256
FIRST_COME = sim.Arm("first-come", kind="first-come", threads=2)


def setting(args, first_come: bool = False) -> tuple:
    """The profiles (first-come's own where given, as make bench times its control), the overheads, the tuned arm."""
    return _setting(args.profile, args.profile_first_come if first_come else None, args.overheads)


@functools.lru_cache(maxsize=None)
def _setting(profile_path: str, first_come_path: str | None, overheads: str) -> tuple:
    """Once per pool process: tuning the arm takes seconds, and every job would otherwise repeat it."""
    profile = pipeline.load_profile(first_come_path or profile_path)
    return {profile_threads(profile): profile}, sim.Overheads.from_report(overheads), tuned_arm(profile_path, TARGET_MS)


def with_poll(arm: sim.Arm, poll: int) -> sim.Arm:
    return replace(arm, name=f"poll {poll}", config=replace(arm.config, poll_ms=poll))


def light(job: tuple) -> tuple:
    """(args, poll) -> the lone long request's and the mix's figures at each light rate."""
    args, poll = job
    profiles, overheads, tuned = setting(args)
    arm = with_poll(tuned, poll)
    lone = sim.simulate(arm, [sim.Arrival(0.0, LONE_TOKENS)], profiles, MAX_LENGTH, overheads=overheads).latency["long"]
    tokens = sim.workload_tokens("two-cluster")
    rates = {}
    for rate in (float(r) for r in args.rates.split(",")):
        points = [sim.at_rate(arm, rate, tokens, profiles, MAX_LENGTH, args.duration, seed, overheads=overheads)
                  for seed in (int(s) for s in args.seeds.split(","))]
        rates[rate] = {kind: {q: statistics.median(p.latency[kind][q] for p in points) for q in ("p50", "p99")}
                       for kind in ("short", "long")}
    return poll, lone, rates


def loaded(job: tuple) -> tuple:
    """(args, workload, poll or None for first-come, first-come's capacity) -> capacity, short p99 at 70%."""
    args, workload, poll, first_come = job
    profiles, overheads, tuned = setting(args, first_come=poll is None)
    arm = FIRST_COME if poll is None else with_poll(tuned, poll)
    tokens = sim.workload_tokens(workload)
    cap = sim.capacity(arm, tokens, profiles, MAX_LENGTH, TARGET_MS, 30.0, overheads=overheads)
    at70 = None
    if first_come:
        at70 = sim.at_rate(arm, round(0.7 * first_come, 1), tokens, profiles, MAX_LENGTH, 120.0,
                           overheads=overheads).latency["short"]["p99"]
    return workload, poll, cap, at70


def markdown(report: dict) -> str:
    lines = [f"# `poll_ms` in the simulator ({report['when']}, {report['machine']})", "",
             f"Command: `{report['command']}`. One return to the frontend costs a running pass {report['call']} s "
             "(the overheads' `call`). Light rates: the median over seeds of each class's p50 / p99, the mix "
             f"simulated {report['duration']:g} s per seed.", "",
             "| poll_ms | lone long pass / end to end (ms) | " + " | ".join(
                 f"{rate} req/s: short p50 / p99, long p50 / p99 (ms)" for rate in report["rates"]) + " |",
             "|---|---|" + "---|" * len(report["rates"])]
    for row in report["light"]:
        lines.append(f"| {row['poll']} | {row['lone']['pass_p50']} / {row['lone']['p50']} | " + " | ".join(
            f"{f['short']['p50']:g} / {f['short']['p99']:g}, {f['long']['p50']:g} / {f['long']['p99']:g}"
            for f in row["rates"].values()) + " |")
    lines += ["", "| workload | arm | capacity (req/s) | short p99 at 70% of first-come's capacity (ms) |", "|---|---|---|---|"]
    for row in report["loaded"]:
        at70 = "-" if row["short_p99_at_70"] is None else f"{row['short_p99_at_70']:g} at {row['rate_70']:g} req/s"
        lines.append(f"| {row['workload']} | {row['arm']} | {row['capacity']:g} | {at70} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--profile-first-come", help="first-come's own profile (make bench-window's control-profile.json)")
    parser.add_argument("--overheads", required=True, help="an overheads report with `call` (bench/overheads.py --poll)")
    parser.add_argument("--polls", default="5,20,50")
    parser.add_argument("--rates", default="4,14")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds simulated per light rate and seed")
    parser.add_argument("--out", help="write OUT.md and OUT.json too")
    args = parser.parse_args()
    polls = [int(p) for p in args.polls.split(",")]
    report = {"when": reports.utc_now(), "machine": reports.machine(),
              "command": f"python bench/poll_sim.py {shlex.join(sys.argv[1:])}", "profile": args.profile,
              "overheads": args.overheads, "call": sim.Overheads.from_report(args.overheads).call,
              "duration": args.duration, "rates": [f"{float(r):g}" for r in args.rates.split(",")]}
    with Pool(2) as pool:
        report["light"] = [{"poll": poll, "lone": lone, "rates": {f"{r:g}": f for r, f in rates.items()}}
                           for poll, lone, rates in pool.map(light, [(args, poll) for poll in polls])]
        first = {w: cap for w, _, cap, _ in pool.map(loaded, [(args, w, None, None) for w in WORKLOADS])}
        jobs = [(args, w, poll, first[w]) for w in WORKLOADS for poll in [None] + polls]
        report["loaded"] = [{"workload": w, "arm": "first-come" if poll is None else f"poll_ms {poll}", "capacity": cap,
                             "rate_70": round(0.7 * first[w], 1), "short_p99_at_70": at70}
                            for w, poll, cap, at70 in pool.map(loaded, jobs)]
    text = markdown(report)
    if args.out:
        reports.write(args.out, report, text, indent=2)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
