"""`make bench-overload`: the shipped archive past its capacity, and which requests it refuses.

Past capacity a worker has to refuse something, and what it refuses decides who is still served.
The archive `tsbatch archive` builds, one worker, served by a fresh torchserve per window; the make
bench mix (85% short texts, 15% long) offered open loop at each rate; per class the 200s, 503s and
504s and the 200s' p50/p99. `--before PY` adds the archive another checkout builds (that
checkout's venv Python) from the same profile: arms in turns, who goes first rotating by round.
Writes bench/results/overload.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from bench.compare import build as build_archive  # noqa: E402
from bench.frontend import NAME, window  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.stats import percentile  # noqa: E402
from bench.loadtest.workload import Mix, make_requests  # noqa: E402


def build(python: str, store: str, profile: str | None) -> str:
    """`tsbatch archive` as the checkout `python` runs builds it; its git commit, for the report."""
    build_archive(python, store, NAME, profile)
    source = subprocess.run([python, "-c", "import tsbatch.handlers, os; print(os.path.dirname(tsbatch.handlers.__file__))"],
                            check=True, capture_output=True, text=True, cwd=tempfile.gettempdir()).stdout.strip()
    return subprocess.run(["git", "-C", source, "log", "-1", "--format=%h %s"], capture_output=True,
                          text=True).stdout.strip()[:100]


def pooled(rounds: list[dict]) -> dict:
    """One arm at one rate: statuses summed over the rounds, latencies the rounds' median."""
    med = lambda key: percentile([r[key] for r in rounds if r[key] is not None], 50)  # noqa: E731
    status = {}
    for kind in ("short", "long"):
        status[kind] = {}
        for r in rounds:
            for code, n in r["status_by_kind"][kind].items():
                status[kind][code] = status[kind].get(code, 0) + n
    return {"answered_per_s": med("answered_per_s"), "per_round": [r["answered_per_s"] for r in rounds],
            "status": status, **{k: med(k) for k in ("short_p50", "short_p99", "long_p50", "long_p99")},
            "worker_cores": percentile([r["cores"]["worker"] for r in rounds], 50)}


def markdown(report: dict) -> str:
    lines = [f"# The shipped archive past its capacity ({report['when']}, {report['machine']})", "",
             f"Command: `{report['command']}`. One worker, the make bench mix open loop, {report['seconds']:g} s "
             f"per window, a fresh torchserve per arm, rate and round ({report['rounds']} rounds, arms in turns, who "
             "goes first rotating); statuses summed over the rounds, latencies (200s only, from each request's "
             "scheduled arrival) the median of the rounds.", ""]
    for arm, commit in report["arms"].items():
        lines.append(f"- **{arm}**: {commit}")
    lines += ["", "| rate | arm | answered req/s | short 200 / 503 / 504 | long 200 / 503 / 504 | "
                  "short p50 / p99 ms | long p50 / p99 ms |", "|---|---|---|---|---|---|---|"]
    for rate, arms in report["rates"].items():
        for arm, p in arms.items():
            counts = {k: " / ".join(str(p["status"][k].get(c, 0)) for c in ("200", "503", "504")) for k in p["status"]}
            lines.append(f"| {rate} | {arm} | {p['answered_per_s']} {p['per_round']} | {counts['short']} | "
                         f"{counts['long']} | {p['short_p50']} / {p['short_p99']} | {p['long_p50']} / {p['long_p99']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="130,80", help="offered req/s, comma separated (default 130,80)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", help="a latency profile (`tsbatch profile`): every arm skips profiling")
    parser.add_argument("--before", metavar="PY", help="another checkout's venv python: its archive too")
    parser.add_argument("--out", default=os.path.join(reports.RESULTS, "overload"))
    args = parser.parse_args()
    server.stop_on_sigterm()
    root = tempfile.mkdtemp(prefix="tsbatch-overload-")
    pythons = {"this checkout": sys.executable, **({"before": args.before} if args.before else {})}
    stores = {arm: os.path.join(root, f"store-{i}") for i, arm in enumerate(pythons)}
    commits = {arm: build(python, stores[arm], args.profile) for arm, python in pythons.items()}
    rates = [float(r) for r in args.rates.split(",")]
    requests = make_requests(int(max(rates) * args.seconds * 1.5), Mix(), seed=21)
    windows: dict[str, dict[str, list]] = {f"{rate:g}": {arm: [] for arm in pythons} for rate in rates}
    for r in range(args.rounds):
        for rate in rates:
            order = list(pythons)[r % len(pythons):] + list(pythons)[:r % len(pythons)]
            for arm in order:
                serve_root = os.path.join(root, f"serve-{r}-{rate:g}-{order.index(arm)}")
                windows[f"{rate:g}"][arm].append(window(stores[arm], serve_root, (), rate, args.seconds, requests))
                print(f"round {r} {rate:g} req/s {arm}: {windows[f'{rate:g}'][arm][-1]}", flush=True)
                shutil.rmtree(serve_root, ignore_errors=True)
    command = "make bench-overload" + (f" BENCH_ARGS='--rates {args.rates} --seconds {args.seconds:g} "
                                       f"--rounds {args.rounds}" + (" --profile P" if args.profile else "")
                                       + (" --before PY" if args.before else "") + "'")
    report = {"when": reports.utc_now(), "machine": reports.machine(), "command": command, "seconds": args.seconds,
              "rounds": args.rounds, "arms": commits,
              "rates": {rate: {arm: pooled(ws) for arm, ws in arms.items()} for rate, arms in windows.items()}}
    reports.write(args.out, report, markdown(report))
    print(markdown(report))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
