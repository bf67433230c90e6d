"""`make bench-window`: for each workload, the profiles and the live run in one window, then the
simulator against them (bench/validate_sim.py --own-profiles).

On a shared host the model's speed moves by tens of percent between hours (the fc-v1252 repeats:
first-come's capacity on the mix 28 then 44 req/s, three hours apart), so a simulator fed a
profile of one hour and judged by a live run of another is judged by the hour. Here each workload
gets its own minutes: `tsbatch profile` (tsbatch's passes; arm t is tuned from it), the first-come
control's passes (bench/control_profile.py), then `make bench` with arms b, t, d, then both
profiles again (its 70% point is measured last, minutes later, and is simulated with these), all
into OUT/WORKLOAD/. Then bench/validate_sim.py --own-profiles over the lot, into
OUT/simulator-vs-live. About 17 minutes a workload on a 2-core machine.
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATES = {"search": "8,16,32,48,64,80,96,112", "long": "8,16,24,32,40,48,56", "short": "64,128,192,256,320",
         "two-cluster": "16,32,64,96,128,160"}  # up to past every arm's knee on a 2-core machine


def step(what: str, command: list[str], log: str) -> None:
    print(f"{time.strftime('%H:%M:%S', time.gmtime())} UTC {what} (log: {log})", flush=True)
    with open(log, "w") as f:
        subprocess.run(command, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)


def profiles(workload: str, out: str, suffix: str = "") -> None:
    """tsbatch's passes (arm t is tuned from them) and first-come's, into OUT/profile{suffix}.json
    and OUT/control-profile{suffix}.json."""
    python = sys.executable
    when = suffix.replace("-", " ")
    step(f"{workload}: tsbatch profile{when}", [os.path.join(os.path.dirname(python), "tsbatch"), "profile", "--mode",
                                                "continuous", "--out", os.path.join(out, f"profile{suffix}.json")],
         os.path.join(out, f"profile{suffix}.log"))
    step(f"{workload}: first-come's passes{when}", [python, "bench/control_profile.py", "--runs", "7", "--out",
                                                    os.path.join(out, f"control-profile{suffix}.json")],
         os.path.join(out, f"control{suffix}.log"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="search,long,short,two-cluster")
    parser.add_argument("--overheads", metavar="JSON", help="bench/overheads.py's report for this machine")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=4,
                        help="windows of 15 s per arm at the 70%% point: its p99 pools them (2 rounds: 43%% apart)")
    args = parser.parse_args()
    python = sys.executable
    for workload in args.workloads.split(","):
        out = os.path.join(args.out, workload)
        os.makedirs(out, exist_ok=True)
        profiles(workload, out)
        step(f"{workload}: make bench", [python, "bench/run.py", "--workload", workload, "--rates", RATES[workload],
                                         "--arms", "b,t,d", "--profile", os.path.join(out, "profile.json"),
                                         "--duration", "15", "--rounds", str(args.rounds), "--no-limit", "--no-light", "--out", out],
             os.path.join(out, "bench.log"))
        # the 70% point is measured last, and the host's speed can move within a run: profile it again
        profiles(workload, out, "-after")
    live = sorted(glob.glob(os.path.join(args.out, "*", "bench*.json")))
    command = [python, "bench/validate_sim.py", "--own-profiles", *live, "--out",
               os.path.join(args.out, "simulator-vs-live")]
    if args.overheads:
        command += ["--overheads", args.overheads]
    return subprocess.run(command, cwd=REPO).returncode


if __name__ == "__main__":
    raise SystemExit(main())
