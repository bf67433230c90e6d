"""`make bench-warmup-served`: is the first request of every shape after READY as fast as steady
state on the path the shipped mode really takes: a real torchserve, continuous mode, passes on
the lanes' threads (started after warmup ran)?

Arms: the archive `tsbatch archive` builds (tuned from one profile, taken here unless --profile
names one), with warmup on as shipped and with `warmup: false` (--handler-config), otherwise the
same. Each round serves one arm on a fresh torchserve. After READY, for every shape the worker
warms (each bucket edge, each power-of-two batch up to the bucket's cap, from the archive's own
model-config.yaml), one request carries `batch` texts of exactly `bucket` tokens (one-token words):
its pass is that shape's first after READY. Then the same request STEADY more times. The handler
times the pass on the lane thread that ran it (x-tsbatch-timing's pass=); x-tsbatch-batch-size
and x-tsbatch-padded-to confirm the pass had that shape, and a request the scheduler split is
reported as not formed. Per shape: first / steady median; per arm: the median over rounds and
the worst single round (bench/warmup_bench.combine). Writes bench/results/warmup-served.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zipfile

import requests
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from tsbatch.handlers.core.buckets import power_of_two_sizes  # noqa: E402
from tsbatch.handlers.edge.stages import BATCH_SIZE_HEADER, PADDED_HEADER, TIMING_HEADER  # noqa: E402
from tsbatch.warmup.plan import plan_shapes  # noqa: E402
from bench.compare import build  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.load import timing_of  # noqa: E402
from bench.loadtest.workload import WORDS  # noqa: E402
from bench.warmup_bench import combine  # noqa: E402

ARMS = {"warmup on (as shipped)": {}, "warmup off": {"warmup": False}}
STEADY = 5


def shapes_of(mar: str) -> list[tuple[int, int]]:
    """(batch, bucket) of every shape the archive's worker warms, from its model-config.yaml."""
    with zipfile.ZipFile(mar) as archive:
        handler = yaml.safe_load(archive.read("model-config.yaml"))["handler"]
    caps = {int(k): int(v) for k, v in handler["batch_caps"].items()}
    return [(s.batch, s.bucket) for s in plan_shapes(sorted(caps), lambda edge: power_of_two_sizes(caps[edge]))]


def texts(batch: int, bucket: int) -> list[str]:
    """`batch` different texts of `bucket` tokens each ([CLS] + bucket - 2 one-token words + [SEP])."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(bucket - 2)) for i in range(batch)]


def one_pass(url: str, batch: int, bucket: int) -> dict:
    """One request of `batch` texts: the pass time the handler measured, and whether it was one
    pass of that shape."""
    answer = requests.post(url, json={"text": texts(batch, bucket)}, timeout=120)
    timing = timing_of(answer.headers.get(TIMING_HEADER, ""))
    sizes = {int(v) for v in answer.headers.get(BATCH_SIZE_HEADER, "0").split(",")}
    padded = {v.strip() for v in answer.headers.get(PADDED_HEADER, "").split(",")}
    return {"status": answer.status_code, "pass_ms": timing.get("pass", float("nan")),
            "formed": answer.status_code == 200 and sizes == {batch} and padded == {str(bucket)}}


def one_round(root: str, store: str, name: str) -> dict:
    """A fresh torchserve for one arm: READY time, then every shape's first and steady passes."""
    started = time.perf_counter()
    with server.local_server(os.path.join(root, f"serve-{name}-{time.monotonic_ns()}"), store, [name],
                             timeout=900) as served:
        ready_s = time.perf_counter() - started
        url = f"{served.inference}/predictions/{name}"
        out = []
        for batch, bucket in shapes_of(os.path.join(store, f"{name}.mar")):
            first = one_pass(url, batch, bucket)
            steady = [one_pass(url, batch, bucket) for _ in range(STEADY)]
            median = statistics.median(s["pass_ms"] for s in steady)
            out.append({"batch": batch, "bucket": bucket, "first_ms": first["pass_ms"], "steady_median_ms": median,
                        "ratio": round(first["pass_ms"] / median, 2) if median else None,
                        "formed": first["formed"] and all(s["formed"] for s in steady)})
    return {"ready_seconds": round(ready_s, 2), "shapes": out, "recompiled_after_ready": None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="fresh servers per arm (median and worst of them)")
    parser.add_argument("--profile", help="latency profile both archives are tuned from (default: take one here)")
    parser.add_argument("--out", default=reports.RESULTS)
    args = parser.parse_args(argv)
    server.stop_on_sigterm()
    root = tempfile.mkdtemp(prefix="tsbatch-warmserved-")
    store = os.path.join(root, "store")
    names = {}
    profile = args.profile
    for i, (arm, section) in enumerate(ARMS.items()):
        names[arm] = f"arm{i}"
        config = os.path.join(root, f"arm{i}.yaml")
        with open(config, "w") as f:
            json.dump(section, f)  # JSON is YAML
        profile = build(sys.executable, store, names[arm], profile, extra=["--handler-config", config])
    report = {"when": reports.utc_now(), "machine": reports.machine(with_platform=False),
              "command": "make bench-warmup-served", "rounds": args.rounds, "steady": STEADY, "arms": {}}
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for turn in range(args.rounds):
        for arm in (list(ARMS) if turn % 2 == 0 else list(reversed(ARMS))):  # arms in turns
            rounds[arm].append(one_round(root, store, names[arm]))
            print(f"{arm}, round {turn + 1}: READY in {rounds[arm][-1]['ready_seconds']} s", flush=True)
    for arm, arm_rounds in rounds.items():
        result = combine(arm_rounds)
        result["not_formed"] = [f"{s['batch']}x{s['bucket']}" for s in arm_rounds[0]["shapes"] if not s["formed"]]
        report["arms"][arm] = result
    text = markdown(report)
    reports.write(os.path.join(args.out, "warmup-served"), report, text)
    print(text)
    return 0


def markdown(report: dict) -> str:
    lines = [f"# Warmup on the served path ({report['when']}, {report['machine']})", "",
             f"Command: `{report['command']}`. The archive `tsbatch archive` builds, continuous mode, one worker, "
             f"served by a fresh torchserve per round ({report['rounds']} rounds per arm, arms in turns). Per shape, "
             f"the first pass after READY over the median of the next {report['steady']}, as the handler timed "
             "them on the lane thread (x-tsbatch-timing pass=); a shape's ratio is the median over rounds.", "",
             "| arm | READY s (median) | shapes | worst first/steady (median of rounds) | shapes with first ≤ 1.5× steady "
             "| worst single round | shapes the scheduler did not form as asked |",
             "|---|---|---|---|---|---|---|"]
    for arm, r in report["arms"].items():
        lines.append(f"| {arm} | {r['ready_seconds']} | {len(r['shapes'])} | {r['worst_first_to_steady']} | "
                     f"{r['shapes_within_1_5x']} | {r['worst_single_round']} | {', '.join(r['not_formed']) or 'none'} |")
    for arm, r in report["arms"].items():
        worst = sorted(r["shapes"], key=lambda s: -max(s["ratios"]))[:5]
        lines += ["", f"{arm}, the five shapes with the worst single round (batch x bucket: ratio per round, "
                  "first ms per round):", ""]
        lines += [f"- {s['batch']}x{s['bucket']}: {s['ratios']}, {s['first_ms']}" for s in worst]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
