"""`make bench-poll`: what continuous mode's `poll_ms` costs, live. The archive `tsbatch archive
--profile P` builds, served with several `poll_ms` (5 is shipped), each in a torchserve of its own,
started one after the other so each worker warms alone.

While a lane is idle, a call holding a request goes back to TorchServe every `poll_ms` to take in
new arrivals; each return is work for the frontend and the worker's interpreter while the running
pass needs them. First lone long requests, 0.4 s apart, the arms in turns request by request (the
host's speed drifts between blocks of requests by more than the poll costs): end to end, their pass
(x-tsbatch-timing) and how many times TorchServe called the handler per request
(tsbatch_handler_calls_total). From them, the seconds one return costs a running pass (the
simulator's Overheads `call`): the pass's growth over the returns' growth from the slowest poll to
the fastest, per round. Then the mix (85% short, 15% long) at light rates, arms interleaved: what a
slower poll costs the requests that arrive during a pass. Writes bench/results/poll-live.json and
poll-live.md.

    make bench-poll BENCH_ARGS='--profile P [--polls 5,20,50] [--rates 4,14] [--rounds 3]'
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import requests  # noqa: E402

from bench.borrow_live import LONE_TEXT, build_with, light, lone_request, lone_summary  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.torchserve import metric_total  # noqa: E402
from tsbatch.archiver import server  # noqa: E402

CALLS = "tsbatch_handler_calls_total"
FLUSH_S = 1.1  # the worker emits its call count on the first call a second after the last emission


def build(root: str, poll: int, profile: str) -> tuple[str, str]:
    """The arm's model store and model name: the archive as `tsbatch archive --profile` builds it,
    `poll_ms` set."""
    name = f"poll_{poll}"
    return build_with(root, name, f"poll_ms: {poll}\n", profile), name


def flushed_calls(served, url: str, name: str) -> float:
    """The handler calls the worker has emitted, after a request that makes it emit what it counted."""
    time.sleep(FLUSH_S)
    requests.post(url, data=LONE_TEXT.encode(), headers={"Content-Type": "text/plain"}, timeout=30).raise_for_status()
    time.sleep(0.5)  # the frontend reads the metric from the worker's log
    return metric_total(served.metrics, CALLS, name)


def call_cost(slow: dict, fast: dict) -> float | None:
    """Seconds one return costs a running pass: pass growth over calls-per-request growth."""
    more = fast["calls_per_request"] - slow["calls_per_request"]
    return round((fast["pass_p50_ms"] - slow["pass_p50_ms"]) / 1000 / more, 6) if more > 0.5 else None


def markdown(report: dict) -> str:
    polls = report["polls"]
    # runs before the arms took turns request by request took them in blocks (e231488)
    turns = ("the arms in turns request by request" if report.get("turns") == "request"
             else f"the arms in turns {report['lone_requests']} requests at a time")
    mix = (f"; then the mix at each rate, {report['rounds']} windows of {report['duration']:g} s per arm, interleaved"
           if report["light"] else "")
    lines = [f"# `poll_ms` live ({report['when']}, {report['machine']})", "",
             f"Command: `{report['command']}`. Profile `{report['profile']}`. {report['lone_requests']} lone long "
             f"requests per arm and round, 0.4 s apart, {turns}{mix}.", "",
             "| poll_ms | lone long end to end, median per round (ms) | its pass (ms) | handler calls per request |",
             "|---|---|---|---|"]
    for poll in polls:
        rounds = report["lone"][str(poll)]
        lines.append(f"| {poll} | {' / '.join(str(r['end_to_end_p50_ms']) for r in rounds)} | "
                     f"{' / '.join(str(r['pass_p50_ms']) for r in rounds)} | "
                     f"{' / '.join(str(r['calls_per_request']) for r in rounds)} |")
    fits = report["fit"]["call_per_round"]
    lines += ["", f"One return to the frontend costs a running pass, per round (`poll_ms` {polls[-1]} against "
              f"{polls[0]}): {fits} s; median **{report['fit']['call']} s** (the simulator's Overheads `call`; "
              "`bench/overheads.py --refit ... --poll` puts it into an overheads report)."]
    if report["light"]:
        lines += ["", "| rate | poll_ms | short p50 / p99 (ms) | long p50 / p99 (ms) | lost |", "|---|---|---|---|---|"]
    for rate, arms in report["light"].items():
        for poll in polls:
            p = arms[str(poll)]
            lines.append(f"| {rate} | {poll} | {p['short']['p50']} / {p['short']['p99']} | "
                         f"{p['long']['p50']} / {p['long']['p99']} | {p['lost']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True, help="a latency profile (tsbatch archive --profile)")
    parser.add_argument("--polls", default="5,20,50", help="poll_ms of each arm, fastest first")
    parser.add_argument("--rates", default="4,14", help="the mix's rates after the lone requests ('': none)")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lone", type=int, default=16, help="lone long requests per arm and round")
    parser.add_argument("--out", default=reports.RESULTS)
    args = parser.parse_args()
    polls = sorted(int(p) for p in args.polls.split(","))
    if len(polls) < 2:
        parser.error("--polls needs two values or more")
    server.stop_on_sigterm()
    report = {"when": reports.utc_now(), "machine": reports.machine(), "profile": args.profile,
              "command": f"make bench-poll BENCH_ARGS='{shlex.join(sys.argv[1:])}'", "duration": args.duration,
              "rounds": args.rounds, "lone_requests": args.lone, "polls": polls, "turns": "request"}
    with tempfile.TemporaryDirectory(prefix="tsbatch-poll-") as root, contextlib.ExitStack() as servers:
        arms = {}
        for poll in polls:  # each torchserve started once the one before is READY: each warms alone
            store, name = build(root, poll, args.profile)
            served = servers.enter_context(server.local_server(os.path.join(root, name), store, [name]))
            arms[str(poll)] = (served, f"{served.inference}/predictions/{name}", name)
        report["lone"] = {arm: [] for arm in arms}
        order = list(arms)
        for turn in range(args.rounds):
            before = {arm: flushed_calls(*arms[arm]) for arm in order}
            timed = {arm: [] for arm in order}
            for i in range(args.lone):  # the arms in turns request by request: each sees the host's same seconds
                for arm in (order if (turn + i) % 2 == 0 else order[::-1]):
                    timed[arm].append(lone_request(arms[arm][1]))
            for arm in order:
                row = lone_summary(timed[arm])
                # the count between the two flushes: these requests and about one flush request's calls
                row["calls_per_request"] = round((flushed_calls(*arms[arm]) - before[arm]) / (args.lone + 1), 2)
                report["lone"][arm].append(row)
                print(f"lone, poll_ms {arm}, round {turn + 1}: {row}", flush=True)
        per_round = [call_cost(report["lone"][order[-1]][r], report["lone"][order[0]][r]) for r in range(args.rounds)]
        known = [c for c in per_round if c is not None]
        report["fit"] = {"call_per_round": per_round, "call": round(statistics.median(known), 6) if known else None}
        report["light"] = light({arm: url for arm, (_, url, _) in arms.items()}, args.rates, args.duration, args.rounds)
    text = markdown(report)
    reports.write(os.path.join(args.out, "poll-live"), report, text, indent=2)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
