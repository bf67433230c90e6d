"""Two checkouts side by side: the archive each one's `tsbatch archive` builds from one latency
profile, served by one torchserve (one worker each; the .mar carries its own tsbatch), the same
open-loop short/long mix sent to each in turns at every rate. For before/after figures of a change.

    python bench/compare.py --before /path/to/other/.venv/bin/python [--rates 14,30] [--seconds 20]
        [--rounds 3] [--profile P] [--out bench/results/compare] [--short-only | --workload W] [--control]

--short-only sends short texts only (2-24 random common words), where length buckets have nothing
to gain; --workload sends one of make bench's workloads instead (e.g. search, short: real text);
--control adds a third arm: make bench's control (b), first come first served under TorchServe's
batching (batchSize 8, maxBatchDelay 10), each batch padded to its longest input.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.arrivals import poisson_arrivals  # noqa: E402
from bench.loadtest.load import run_open_loop  # noqa: E402
from bench.loadtest.stats import percentile, summarize  # noqa: E402
from bench.loadtest.workload import WORKLOADS, Mix, make_requests, workload  # noqa: E402
from tsbatch.archiver.cli import default_model_dir  # noqa: E402
from tsbatch.archiver.package import ArchiveSpec, build_archive  # noqa: E402
from tsbatch.archiver.properties import model_config  # noqa: E402
from tsbatch.archiver.tune import frontend_keys  # noqa: E402

CONTROL = "bench/controls/control_pad_longest.py"
CONTROL_FRONTEND = {"batchSize": 8, "maxBatchDelay": 10, "minWorkers": 1, "maxWorkers": 1, **frontend_keys("default")}
SHORT_ONLY = Mix(long_share=0.0, short_median_words=10, short_max_words=24)


def build(python: str, store: str, name: str, profile: str | None, model_dir: str | None = None,
          extra: list[str] | None = None) -> str:
    """`tsbatch archive` of the checkout `python` runs, tuned from `profile` (taken here if None);
    returns the profile's path. `extra`: more `tsbatch archive` arguments. It runs in the temporary
    directory (not this checkout, whose package would shadow `python`'s), so a relative profile
    path is made absolute first."""
    profile = os.path.abspath(profile) if profile else None
    cmd = [python, "-m", "tsbatch.archiver", "archive", "--name", name, "--out", store]
    cmd += (["--model-dir", model_dir] if model_dir else []) + (extra or [])
    subprocess.run(cmd + (["--profile", profile] if profile else []), check=True, stdout=subprocess.DEVNULL,
                   cwd=tempfile.gettempdir())
    return profile or os.path.join(store, f"{name}.latency_profile.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the Python of the other checkout's venv")
    parser.add_argument("--rates", default="14,30")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", help="latency profile both archives are tuned from (default: take one here)")
    parser.add_argument("--out", default=os.path.join(reports.RESULTS, "compare"))
    parser.add_argument("--short-only", action="store_true", help="short texts only (2-24 words)")
    parser.add_argument("--workload", choices=list(WORKLOADS), help="one of make bench's workloads instead")
    parser.add_argument("--control", action="store_true", help="add make bench's control (b)")
    args = parser.parse_args()
    server.stop_on_sigterm()
    root = tempfile.mkdtemp(prefix="tsbatch-compare-")
    store = os.path.join(root, "store")
    profile = build(sys.executable, store, "after", args.profile)
    build(args.before, store, "before", profile)
    arms = {"before": reports.checkout_of(args.before), "after": reports.checkout_of(sys.executable)}
    if args.control:
        build_archive(ArchiveSpec(default_model_dir(), "control", model_config({"task": "embedding"}, CONTROL_FRONTEND),
                                  store, extra_files={"control_pad_max.py": os.path.join(REPO, "bench/controls/control_pad_max.py")},
                                  handler=CONTROL))
        arms["control"] = "make bench's control (b): TorchServe batching, first come first served, padded to the longest"
    rates = [float(r) for r in args.rates.split(",")]
    report = {"machine": reports.machine(), "started": reports.utc_now(), "seconds": args.seconds,
              "rounds": args.rounds, "arms": arms, "short_only": args.short_only, "workload": args.workload,
              "points": {}}
    count = int(max(rates) * args.seconds * 2)
    requests = (workload(args.workload)(count, 7) if args.workload else
                make_requests(count, SHORT_ONLY if args.short_only else Mix(), seed=7))
    with server.local_server(os.path.join(root, "serve"), store, list(arms), timeout=900) as served:
        for rate in rates:
            windows: dict[str, list[dict]] = {name: [] for name in arms}
            for r in range(args.rounds):
                for name in list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]:  # who goes first rotates
                    arrivals = poisson_arrivals(rate, args.seconds, seed=100 + r)
                    run = run_open_loop(f"{served.inference}/predictions/{name}", requests[:len(arrivals)],
                                        arrivals, rate, args.seconds, timeout=60)
                    point = summarize(run)
                    windows[name].append(point)
                    print(f"{rate:g} req/s round {r} {name}: short p50 {point['short']['p50']} p99 "
                          f"{point['short']['p99']} long p99 {point['long']['p99']} not 200 {point['sent'] - point['ok']}",
                          flush=True)
            report["points"][f"{rate:g}"] = {name: pooled(w) for name, w in windows.items()}
    reports.write(args.out, report, markdown(report))
    print(markdown(report))


def pooled(windows: list[dict]) -> dict:
    """Medians over the rounds' windows, and each round's short p99."""
    med = lambda key, kind: percentile([w[kind][key] for w in windows if w[kind][key] is not None], 50)  # noqa: E731
    statuses = Counter()
    for w in windows:
        statuses.update({status: n for status, n in w["status"].items() if status != "200"})
    return {"sent": sum(w["sent"] for w in windows), "not_200": sum(w["sent"] - w["ok"] for w in windows),
            "statuses": dict(sorted(statuses.items())),
            "short_p50": med("p50", "short"), "short_p99": med("p99", "short"),
            "short_p99_per_round": [w["short"]["p99"] for w in windows],
            "long_p50": med("p50", "long"), "long_p99": med("p99", "long"), "all_p99": med("p99", "all"),
            "short_breakdown_ms": [w.get("short_breakdown_ms", {}) for w in windows]}


def markdown(report: dict) -> str:
    lines = [f"# Before / after, side by side ({report['started']}, {report['machine']})", "",
             f"`python bench/compare.py`: one torchserve, one worker per arm, {report['seconds']:g} s windows, "
             f"{report['rounds']} rounds per rate, arms in turns (who goes first rotates), figures the median of "
             "the rounds' windows (ms)" + ("; short texts only (2-24 words)" if report.get("short_only") else
                                           f"; workload {report['workload']}: {WORKLOADS[report['workload']]}"
                                           if report.get("workload") else
                                           "; the make bench mix (85% short, 15% long)") + ". Arms:", ""]
    lines += [f"- {name}: {where}" for name, where in report["arms"].items()]
    lines += ["", "| req/s | arm | sent | not 200 | short p50 | short p99 | short p99 per round | long p50 | long p99 | all p99 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for rate, arms in report["points"].items():
        for name, p in arms.items():
            statuses = ", ".join(f"{status}: {n}" for status, n in p.get("statuses", {}).items())
            lines.append(f"| {rate} | {name} | {p['sent']} | {p['not_200']}{f' ({statuses})' if statuses else ''} | "
                         f"{p['short_p50']} | {p['short_p99']} | "
                         f"{p['short_p99_per_round']} | {p['long_p50']} | {p['long_p99']} | {p['all_p99']} |")
    lines += ["", "Where a short request's time went, median per round (ms; x-tsbatch-timing: wait in tsbatch's "
              "queue, pass, handler in all, and outside the handler: TorchServe's frontend, socket and reply):", ""]
    for rate, arms in report["points"].items():
        for name, p in arms.items():
            lines.append(f"- {rate} req/s, {name}: " + "; ".join(
                ", ".join(f"{k} {v}" for k, v in b.items() if k not in ("n", "p99")) or "no timing header"
                for b in p["short_breakdown_ms"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
