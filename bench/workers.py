"""`make bench-workers`: the archive `tsbatch archive` builds, with 1, 2 and 3 workers of one model.

What a TorchServe team does after `make serve`: scale with the management API, then send lone
requests seconds apart and steady open-loop traffic. One torchserve serves the same archive under
two model names, so the 1-worker and the 2-worker figures come from the same minutes:
  lone      short and long requests sent alone with idle gaps of 0.2-3 s, per worker count
  mix       the open-loop short/long mix at --rate req/s, 1 and 2 workers in turns (--rounds each)
  idle      CPU of the frontend and of each worker over --idle-seconds with no traffic
  logs      bytes added to TorchServe's logs per 1,000 requests during the mix windows
  calls     times TorchServe called the handler per request in the mix windows
            (tsbatch_handler_calls_total, emitted at most once a second per worker)
`--candidates` adds async mode (the other design that does not strand requests) with 2 workers
in the same turns. Writes bench/results/workers.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.arrivals import poisson_arrivals  # noqa: E402
from bench.loadtest.load import run_open_loop  # noqa: E402
from bench.loadtest.proc import cpu_seconds  # noqa: E402
from bench.loadtest.stats import percentile, summarize  # noqa: E402
from bench.loadtest.torchserve import metric_total  # noqa: E402
from bench.loadtest.workload import Request, make_requests  # noqa: E402

SHORT = "How do I scale TorchServe workers without losing requests?"
LONG = " ".join(["A much longer passage about serving models, batching requests by length and"
                 " warming every shape before the worker reports that it is ready."] * 9)
GAPS = (0.2, 1.0, 3.0, 0.5, 2.0, 0.2)


def build(store: str, name: str, profile: str | None, extra: list[str] = ()) -> None:
    """`tsbatch archive` as a user runs it (tuned from a profile taken here unless one is given)."""
    cmd = [sys.executable, "-m", "tsbatch.archiver", "archive", "--name", name, "--out", store, *extra]
    if profile:
        cmd += ["--profile", profile]
    subprocess.run(cmd, check=True, cwd=REPO)


def scale(served: server.Served, name: str, workers: int) -> None:
    server.scale(served.management, name, workers, timeout=900)


def lone(url: str) -> list[dict]:
    """One request at a time, each after an idle gap: what a script embedding documents one by one sees."""
    out = []
    for i, gap in enumerate(GAPS):
        time.sleep(gap)
        text, kind = (SHORT, "short") if i % 2 == 0 else (LONG, "long")
        run = run_open_loop(url, [Request(text, kind)], [0.0], 1, 1, timeout=30)
        result = run.results[0]
        out.append({"kind": kind, "gap_s": gap, "status": result.status,
                    "ms": round(result.latency * 1000, 1) if result.latency is not None else None})
    return out


def idle_cpu(served: server.Served, names: list[str], seconds: float) -> dict:
    pids = {"frontend": server.running_pid(served.paths)}
    for name in names:
        for i, w in enumerate(server.workers(served.management, name)):
            pids[f"{name} worker {i}"] = int(w["pid"])
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    time.sleep(seconds)
    return {k: round((cpu_seconds(p) - before[k]) / seconds * 100, 2) for k, p in pids.items()}


def serving_cpu(served: server.Served, name: str) -> float:
    """CPU seconds so far of the frontend and of this model's workers."""
    pids = [server.running_pid(served.paths)] + [int(w["pid"]) for w in server.workers(served.management, name)]
    return sum(cpu_seconds(pid) for pid in pids)


def log_bytes(served: server.Served) -> int:
    return sum(os.path.getsize(os.path.join(served.paths.logs, f)) for f in os.listdir(served.paths.logs)
               if os.path.isfile(os.path.join(served.paths.logs, f)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="latency profile to tune from (default: take one here)")
    parser.add_argument("--rate", type=float, default=14.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--candidates", action="store_true", help="also default batching and async mode, 2 workers")
    parser.add_argument("--out", default=os.path.join(reports.RESULTS, "workers"))
    args = parser.parse_args()
    server.stop_on_sigterm()
    root = tempfile.mkdtemp(prefix="tsbatch-workers-")
    store = os.path.join(root, "store")
    build(store, "one", args.profile)
    profile = args.profile or os.path.join(store, "one.latency_profile.json")
    build(store, "two", profile)
    arms = {"one": "continuous (shipped), 1 worker", "two": "continuous (shipped), 2 workers"}
    if args.candidates:
        build(os.path.join(root, "async"), "async", profile, ["--mode", "async"])
        os.link(os.path.join(root, "async", "async.mar"), os.path.join(store, "async.mar"))
        arms["async"] = "async mode (candidate), 2 workers"
    report = {"machine": reports.machine(), "started": reports.utc_now(), "rate": args.rate,
              "seconds": args.seconds, "arms": arms, "lone": {}, "mix": {name: [] for name in arms}}
    with server.local_server(os.path.join(root, "serve"), store, list(arms), timeout=900) as served:
        url = lambda name: f"{served.inference}/predictions/{name}"  # noqa: E731
        report["idle_cpu_percent_1_worker"] = idle_cpu(served, ["one"], args.idle_seconds)
        report["lone"]["1"] = lone(url("one"))
        for name in arms:
            if name != "one":
                scale(served, name, 2)
                print(f"{name}: 2 workers READY", flush=True)
        report["lone"]["2"] = lone(url("two"))
        report["idle_cpu_percent_2_workers"] = idle_cpu(served, ["two"], args.idle_seconds)
        requests = make_requests(int(args.rate * args.seconds * 2), seed=7)
        for r in range(args.rounds):
            order = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]
            for name in order:
                arrivals = poisson_arrivals(args.rate, args.seconds, seed=100 + r)
                before, cpu = log_bytes(served), serving_cpu(served, name)
                calls = metric_total(served.metrics, "tsbatch_handler_calls_total", name)
                run = run_open_loop(url(name), requests[:len(arrivals)], arrivals, args.rate, args.seconds, timeout=60)
                point = summarize(run)
                point["log_bytes_per_1000"] = round((log_bytes(served) - before) / max(1, len(arrivals)) * 1000)
                point["cpu_ms_per_request"] = round((serving_cpu(served, name) - cpu) / max(1, len(arrivals)) * 1000, 1)
                # emitted at most once a second, on a call: under a second's calls per worker move
                # into this arm's next window
                point["calls_per_request"] = round(
                    (metric_total(served.metrics, "tsbatch_handler_calls_total", name) - calls) / max(1, len(arrivals)), 2)
                report["mix"][name].append(point)
                print(f"round {r} {name}: short p50 {point['short']['p50']} p99 {point['short']['p99']} "
                      f"lost {point['lost']} logs/1000 {point['log_bytes_per_1000']} calls/request {point['calls_per_request']}",
                      flush=True)
        for name in arms:
            if name != "one":
                scale(served, name, 1)
        scale(served, "two", 3)
        report["lone"]["3"] = lone(url("two"))
    report["pooled"] = {name: pooled(points) for name, points in report["mix"].items()}
    reports.write(args.out, report, markdown(report))
    print(markdown(report))


def pooled(points: list[dict]) -> dict:
    """Short-request percentiles over all rounds' windows, weighted by their requests."""
    sent = sum(p["sent"] for p in points)
    return {"sent": sent, "lost": sum(p["lost"] for p in points),
            "non_200": sum(p["sent"] - p["ok"] for p in points),
            "short_p50_ms_median_of_rounds": percentile([p["short"]["p50"] for p in points], 50),
            "short_p99_ms_per_round": [p["short"]["p99"] for p in points],
            "short_p99_ms_median_of_rounds": percentile([p["short"]["p99"] for p in points], 50),
            "log_bytes_per_1000": percentile([p["log_bytes_per_1000"] for p in points], 50),
            "cpu_ms_per_request": percentile([p["cpu_ms_per_request"] for p in points], 50),
            "calls_per_request": percentile([p.get("calls_per_request", 0) for p in points], 50)}


def markdown(report: dict) -> str:
    lines = ["# Workers: the archive `tsbatch archive` builds, scaled with the management API",
             "", f"{report['started']}, {report['machine']}. Mix at {report['rate']} req/s, "
                 f"{report['seconds']} s windows, arms in turns.", "",
             "## Lone requests (ms; status), idle gaps " + ", ".join(f"{g:g}" for g in GAPS) + " s", ""]
    for workers, results in report["lone"].items():
        lines.append(f"- {workers} worker(s): " + ", ".join(f"{r['kind']} {r['ms']} ({r['status']})" for r in results))
    lines += ["", "## Open-loop mix", "", "| arm | sent | lost | not 200 | short p50 (median of rounds) | "
              "short p99 per round | short p99 (median) | log bytes / 1,000 requests | CPU ms / request "
              "(frontend + workers) | handler calls / request |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in report["pooled"].items():
        lines.append(f"| {report['arms'][name]} | {p['sent']} | {p['lost']} | {p['non_200']} | "
                     f"{p['short_p50_ms_median_of_rounds']} | {p['short_p99_ms_per_round']} | "
                     f"{p['short_p99_ms_median_of_rounds']} | {p['log_bytes_per_1000']} | {p['cpu_ms_per_request']} | "
                     f"{p['calls_per_request']} |")
    lines += ["", "## Idle CPU (% of one core)", "",
              f"- 1 worker: {report.get('idle_cpu_percent_1_worker')}",
              f"- 2 workers: {report.get('idle_cpu_percent_2_workers')}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
