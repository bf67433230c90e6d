"""borrow_cores decided in the simulator: the template's two lanes with and without it, against
first-come, on make bench's four workloads. Prints one line per workload and arm: capacity at
p99 <= 500 ms, short p99 at 70% of first-come's capacity, and both classes' p50/p99 at 4 and 14
req/s. Deterministic (seed 0); the figures docs/experiments.md quotes.

    python bench/borrow_sim.py [--saving-ms 0,10,20]

The profile is bench/results/simulator-profile-lanes.json (each lane on one thread) with the
shapes of simulator-profile-2t.json marked as timed on two threads, what warmup with borrow_cores
writes; first-come's passes run on two threads.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from multiprocessing import Pool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import yaml  # noqa: E402

from tsbatch.archiver import simulate as sim  # noqa: E402
from tsbatch.handlers.core import policy  # noqa: E402
from tsbatch.handlers.edge.config import HandlerConfig  # noqa: E402
from tsbatch.warmup.profile import LatencyProfile  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "results")
WORKLOADS = ("search", "short", "long", "two-cluster")
MAX_LENGTH, TARGET_MS, LIGHT = 256, 500.0, (4, 14)


def profiles() -> dict:
    lanes = LatencyProfile.load(os.path.join(RESULTS, "simulator-profile-lanes.json"))
    two = LatencyProfile.load(os.path.join(RESULTS, "simulator-profile-2t.json"))
    lanes.shapes += [replace(timing, threads=2) for timing in two.shapes]
    return {1: lanes, 2: two}


def arm(name: str, borrow: bool) -> sim.Arm:
    if name == "first-come":
        return sim.Arm(name, kind="first-come", threads=2, batch_size=8, max_batch_delay_ms=10)
    with open(os.path.join(REPO, "configs", "model-config.yaml")) as f:
        template = yaml.safe_load(f)
    handler = HandlerConfig.from_yaml({**template["handler"], "borrow_cores": borrow})
    return sim.Arm(name, config=handler, batch_size=int(template["batchSize"]))


def serve(job: tuple) -> tuple:
    """(workload, arm name, borrow, saving s, first-come's capacity or None) -> its figures."""
    workload, name, borrow, saving, first_come = job
    policy.BORROW_SAVING = saving
    tokens, served, found = sim.workload_tokens(workload), profiles(), arm(name, borrow)
    cap = sim.capacity(found, tokens, served, MAX_LENGTH, TARGET_MS, 30.0)
    at = {rate: sim.at_rate(found, rate, tokens, served, MAX_LENGTH, 60.0) for rate in LIGHT}
    at70 = sim.at_rate(found, round(0.7 * first_come, 1), tokens, served, MAX_LENGTH, 60.0) if first_come else None
    return job, cap, at, at70


def line(job, cap, at, at70) -> str:
    workload, name = job[:2]
    pair = lambda d: f"{d['p50']:g}/{d['p99']:g}" if d.get("n") else "-"  # noqa: E731
    light = " | ".join(f"@{r}: short {pair(p.latency['short'])} long {pair(p.latency['long'])}" for r, p in at.items())
    short70 = f"{at70.latency['short']['p99']:g} at {at70.rate:g}" if at70 else "-"
    return f"{workload:<12} {name:<16} capacity {cap:>6g} | short p99 {short70} | {light}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saving-ms", default="10", help="BORROW_SAVING values to try, comma separated")
    args = parser.parse_args()
    savings = [float(s) / 1000 for s in args.saving_ms.split(",")]
    with Pool(2) as pool:
        first = {job[0]: cap for job, cap, _, _ in pool.map(serve, [(w, "first-come", False, 0.0, None) for w in WORKLOADS])}
        jobs = [(w, "first-come", False, 0.0, first[w]) for w in WORKLOADS]
        jobs += [(w, "template", False, policy.BORROW_SAVING, first[w]) for w in WORKLOADS]
        jobs += [(w, f"borrow {s * 1000:g} ms", True, s, first[w]) for s in savings for w in WORKLOADS]
        for result in pool.map(serve, jobs):
            print(line(*result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
