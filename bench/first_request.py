"""`make bench-first-request`: the first request of each length after READY, timed from outside,
against its steady state (issue #38's "warm means warm").

The archive `tsbatch archive` builds, served with its own config.properties by a fresh torchserve
per round. After READY, five texts of 3, 10, 30, 100 and 200 words go one after the other, each on
a new connection as curl would send it: each length's first request. Then STEADY more rounds of
the five; a length's steady state is the median of the last ten. Arms, in turns: the
config.properties as shipped, and the same file with the frontend JVM's own two-tier JIT (without
FRONTEND_JIT): what the first requests paid before tsbatch chose C1 only. The frontend's CPU
seconds in the first round and per steady round say where the time went. Writes
bench/results/first-request.{json,md}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from tsbatch.archiver.properties import FRONTEND_JIT  # noqa: E402
from tsbatch.handlers.edge.stages import TIMING_HEADER  # noqa: E402
from bench.compare import build  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.client import shoot  # noqa: E402
from bench.loadtest.load import timing_of  # noqa: E402
from bench.loadtest.proc import cpu_seconds  # noqa: E402
from bench.loadtest.workload import WORDS  # noqa: E402

NAME = "minilm"
LENGTHS = (3, 10, 30, 100, 200)  # words
STEADY = 20  # rounds of the five lengths after the first; the last ten are steady state
WITHIN = 1.3  # the bound on first / steady
ARMS = ("as shipped (C1 JIT)", "JIT C1+C2 (JVM default)")


def text(words: int, salt: int) -> bytes:
    """`words` common words, different for each salt (so no answer is a repeat of another)."""
    return json.dumps({"text": " ".join(WORDS[(j * 7 + salt) % len(WORDS)] for j in range(words))}).encode()


def without_jit(properties: str) -> str:
    """The shipped config.properties with FRONTEND_JIT taken off its vmargs line."""
    lines = properties.splitlines()
    jit = " ".join(FRONTEND_JIT)
    vmargs = [i for i, line in enumerate(lines) if line.startswith("vmargs=") and jit in line]
    if len(vmargs) != 1:
        raise ValueError(f"the shipped config.properties has no vmargs line with {jit}")
    lines[vmargs[0]] = lines[vmargs[0]].replace(" " + jit, "").replace(jit, "")
    return "\n".join(lines) + "\n"


def one_round(store: str, properties: str, root: str, ports: list[int]) -> dict:
    """A fresh torchserve: every length's first request after READY, then STEADY rounds."""
    paths = server.ServerPaths(os.path.join(root, "tmp"), os.path.join(root, "logs"))
    server.start(properties, store, paths)
    try:
        server.wait_ready(f"http://127.0.0.1:{ports[1]}", NAME, 900, log_hint=f"; see {paths.logs}")
        java = server.running_pid(paths)
        url = f"http://127.0.0.1:{ports[0]}/predictions/{NAME}"
        rounds, parts, cpu = [], [], []
        for k in range(1 + STEADY):
            before = cpu_seconds(java)
            shots = [asyncio.run(shoot(url, text(words, k), "application/json", timeout=60)) for words in LENGTHS]
            cpu.append(round(cpu_seconds(java) - before, 3))
            if any(s.status != 200 for s in shots):
                raise RuntimeError(f"round {k}: statuses {[s.status for s in shots]}")
            rounds.append([round(s.latency * 1000, 1) for s in shots])
            parts.append([split(s) for s in shots])
    finally:
        server.stop(paths)
    steady = [statistics.median(r[i] for r in rounds[-10:]) for i in range(len(LENGTHS))]
    steady_parts = [{key: round(statistics.median(p[i][key] for p in parts[-10:]), 1) for key in parts[0][i]}
                    for i in range(len(LENGTHS))]
    return {"first_ms": rounds[0], "steady_ms": steady, "ratios": [round(f / s, 2) for f, s in zip(rounds[0], steady)],
            "first_parts_ms": parts[0], "steady_parts_ms": steady_parts,
            "java_cpu_s": {"first_round": cpu[0], "steady_round": statistics.median(cpu[-10:])}}


def split(shot) -> dict:
    """Where a request's time went, by the handler's x-tsbatch-timing: its pass, the rest of the
    handler's time, and what lay outside the handler (frontend, protocol, connection)."""
    timing = timing_of(shot.headers.get(TIMING_HEADER, ""))
    total, handler, passed = shot.latency * 1000, timing.get("handler", 0.0), timing.get("pass", 0.0)
    return {"pass": round(passed, 1), "handler_besides_pass": round(handler - passed, 1),
            "outside_handler": round(total - handler, 1)}


def combine(rounds: list[dict]) -> dict:
    """An arm's rounds: per length the median ratio over rounds, and the worst of any round."""
    per_length = [{"words": words, "ratios": [r["ratios"][i] for r in rounds],
                   "median_ratio": statistics.median(r["ratios"][i] for r in rounds),
                   "first_ms": [r["first_ms"][i] for r in rounds], "steady_ms": [r["steady_ms"][i] for r in rounds],
                   "first_parts_ms": {k: statistics.median(r["first_parts_ms"][i][k] for r in rounds)
                                      for k in rounds[0]["first_parts_ms"][i]},
                   "steady_parts_ms": {k: statistics.median(r["steady_parts_ms"][i][k] for r in rounds)
                                       for k in rounds[0]["steady_parts_ms"][i]}}
                  for i, words in enumerate(LENGTHS)]
    return {"lengths": per_length, "worst_median_ratio": max(p["median_ratio"] for p in per_length),
            "worst_single": max(max(p["ratios"]) for p in per_length),
            "within": sum(p["median_ratio"] <= WITHIN for p in per_length),
            "java_cpu_s": {key: round(statistics.median(r["java_cpu_s"][key] for r in rounds), 3)
                           for key in ("first_round", "steady_round")}}


def markdown(report: dict) -> str:
    lines = [f"# The first request of each length after READY ({report['when']}, {report['machine']})", "",
             f"Command: `{report['command']}`. The archive `tsbatch archive` builds, served with its own "
             f"config.properties, a fresh torchserve per round ({report['rounds']} rounds, arms in turns). After READY "
             f"one request of each of {', '.join(map(str, LENGTHS))} words, back to back, each on a new connection, "
             f"timed by the client; then {STEADY} more rounds, steady state the median of the last ten. Ratio: first "
             "÷ steady, per length the median over rounds. Frontend CPU: the Java process's CPU seconds in the "
             "first round of five and in a steady one (medians of rounds).", "",
             f"| arm | worst first ÷ steady (median of rounds) | lengths within {WITHIN}× | worst single round "
             "| frontend CPU s, first round / steady round |", "|---|---|---|---|---|"]
    for arm, r in report["arms"].items():
        lines.append(f"| {arm} | {r['worst_median_ratio']} | {r['within']}/{len(LENGTHS)} | {r['worst_single']} | "
                     f"{r['java_cpu_s']['first_round']} / {r['java_cpu_s']['steady_round']} |")
    for arm, r in report["arms"].items():
        lines += ["", f"{arm}, per length (words: ratio per round; first ms per round; steady ms per round):", ""]
        lines += [f"- {p['words']}: {p['ratios']}; {p['first_ms']}; {p['steady_ms']}" for p in r["lengths"]]
        lines += ["", f"{arm}, where the time went, first / steady, median of rounds (ms: pass; rest of the handler; "
                  "outside the handler):", ""]
        lines += [f"- {p['words']}: " + "; ".join(f"{p['first_parts_ms'][k]} / {p['steady_parts_ms'][k]}"
                                                   for k in ("pass", "handler_besides_pass", "outside_handler"))
                  for p in r["lengths"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="fresh servers per arm")
    parser.add_argument("--profile", help="latency profile the archive is tuned from (default: take one here)")
    parser.add_argument("--out", default=reports.RESULTS)
    args = parser.parse_args(argv)
    server.stop_on_sigterm()
    root = tempfile.mkdtemp(prefix="tsbatch-first-")
    store = os.path.join(root, "store")
    ports = server.free_ports(5)
    build(sys.executable, store, NAME, args.profile and os.path.abspath(args.profile), extra=[
        f"--{flag}-port={port}" for flag, port in zip(("inference", "management", "metrics", "grpc-inference",
                                                        "grpc-management"), ports)])
    shipped = os.path.join(store, "config.properties")
    with open(shipped) as f:
        default_jit = os.path.join(root, "jit-default.properties")
        with open(default_jit, "w") as out:
            out.write(without_jit(f.read()))
    files = dict(zip(ARMS, (shipped, default_jit)))
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for turn in range(args.rounds):
        for arm in (ARMS if turn % 2 == 0 else ARMS[::-1]):
            rounds[arm].append(one_round(store, files[arm], os.path.join(root, f"r{turn}-{ARMS.index(arm)}"), ports))
            print(f"{arm}, round {turn + 1}: {rounds[arm][-1]['ratios']}", flush=True)
    args_text = " ".join(argv if argv is not None else sys.argv[1:])
    report = {"when": reports.utc_now(), "machine": reports.machine(), "rounds": args.rounds, "steady": STEADY,
              "command": "make bench-first-request" + (f" BENCH_ARGS='{args_text}'" if args_text else ""),
              "lengths_words": list(LENGTHS), "arms": {arm: combine(rs) for arm, rs in rounds.items()},
              "per_round": rounds}
    text_md = markdown(report)
    reports.write(os.path.join(args.out, "first-request"), report, text_md)
    print(text_md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
