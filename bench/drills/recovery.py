"""`make bench-recovery`: after a worker is killed, how long until requests are answered in time again?

The archive `tsbatch archive` ships (tuned; --profile FILE to skip profiling here), served by a
torchserve of its own (private TMPDIR, free loopback ports, always stopped), one worker. Each arm
sends the same open-loop Poisson schedule of the mix (two-cluster: 85% short, 15% long), --rate
req/s for --seconds, and SIGKILLs the Python worker --kill-at seconds in. Arms, in turns:
  none       no deadline header (what clients send today);
  at:MS      every request carries X-Deadline-At = its scheduled send time + MS (wall clock), so
             time spent in TorchServe's queue counts and what is already late gets 504 at once.
Every arm is judged against each deadline a client holds (--deadlines-ms; "archive" is the
archive's handler.deadline_ms): a request is in time when it got a 200 by its scheduled send
time + the deadline. Recovery (recovery_time): the 2-s windows of scheduled arrivals after the
kill; the first instant, counted from the kill, after which every request in every following
window was in time (no late 200, no refusal, nothing unanswered). Writes bench/results/recovery.*.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from typing import Iterable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from tsbatch.handlers.edge.stages import WORKER_HEADER  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.arrivals import at_arrivals, poisson_arrivals  # noqa: E402
from bench.loadtest.client import shoot  # noqa: E402
from bench.loadtest.stats import by_status, percentile, rounded  # noqa: E402
from bench.loadtest.torchserve import read_text, reap_workers, wait_until, warmups, worker_pids  # noqa: E402

NAME = "minilm"


@dataclass(frozen=True)
class Outcome:
    """One request of a run, in seconds from the run's start: when it was scheduled to leave, its
    status (None: unanswered), when its answer was complete (None: unanswered)."""

    at: float
    status: int | None
    done: float | None


def in_time(o: Outcome, deadline_s: float) -> bool:
    return o.status == 200 and o.done is not None and o.done <= o.at + deadline_s


def windows(outcomes: Iterable[Outcome], kill_at: float, deadline_s: float, window_s: float = 2.0) -> list[dict]:
    """Requests scheduled from the kill on, in windows of `window_s` of scheduled arrivals (the first
    starts at the kill): per window its start (s after the kill), how many were sent, in time, 200
    but late, refused (any other status) and unanswered. Windows with nothing sent are kept."""
    after = [o for o in outcomes if o.at >= kill_at]
    count = 1 + max((int((o.at - kill_at) // window_s) for o in after), default=-1)
    out = [{"from_s": round(k * window_s, 3), "sent": 0, "in_time": 0, "late_200": 0, "refused": 0, "unanswered": 0}
           for k in range(count)]
    for o in after:
        w = out[int((o.at - kill_at) // window_s)]
        w["sent"] += 1
        key = ("in_time" if in_time(o, deadline_s) else "late_200") if o.status == 200 and o.done is not None else \
            ("unanswered" if o.status is None else "refused")
        w[key] += 1
    return out


def recovery_time(outcomes: Sequence[Outcome], kill_at: float, deadline_s: float, window_s: float = 2.0) -> float | None:
    """Seconds from the kill to the start of the first window of scheduled arrivals after which
    every request sent was in time (200 by its send time + deadline_s), up to the run's end; 0.0
    if the kill cost no request sent after it anything; None if no window after the last miss
    had a request in it (not recovered while the run lasted)."""
    table = windows(outcomes, kill_at, deadline_s, window_s)
    missed = [k for k, w in enumerate(table) if w["in_time"] < w["sent"]]
    if not missed:
        return 0.0
    if not any(w["sent"] for w in table[missed[-1] + 1:]):
        return None
    return round((missed[-1] + 1) * window_s, 3)


def figures(outcomes: Sequence[Outcome], kill_at: float, deadline_s: float, window_s: float) -> dict:
    """One arm judged against one deadline: the 200s' latency (from the scheduled send), the late
    ones, the last request that missed and the recovery time, all in seconds."""
    ok = [o for o in outcomes if o.status == 200 and o.done is not None]
    latency = [o.done - o.at for o in ok]
    late = [o.done - o.at - deadline_s for o in ok if not in_time(o, deadline_s)]
    misses = [o.at - kill_at for o in outcomes if o.at >= kill_at and not in_time(o, deadline_s)]
    before = [in_time(o, deadline_s) for o in outcomes if o.at < kill_at]
    return {"deadline_s": deadline_s, "ok": len(ok), "ok_p50_s": rounded(percentile(latency, 50)),
            "ok_p99_s": rounded(percentile(latency, 99)), "ok_max_s": rounded(max(latency, default=None)),
            "late_200": len(late), "late_by_max_s": rounded(max(late, default=None)),
            "last_miss_after_kill_s": rounded(max(misses, default=None)),
            "before_kill": {"sent": len(before), "in_time": sum(before)},
            "recovery_s": recovery_time(outcomes, kill_at, deadline_s, window_s),
            "windows": windows(outcomes, kill_at, deadline_s, window_s)}


def build(store: str, ports: list[int], profile: str | None) -> list[str]:
    """`tsbatch archive` as `make archive` runs it (tuned, from --profile if given), on free ports."""
    cmd = [sys.executable, "-m", "tsbatch.archiver", "archive", "--name", NAME, "--task", "embedding", "--out", store]
    cmd += ["--profile", os.path.abspath(profile)] if profile else []
    for flag, port in zip(("inference", "management", "metrics", "grpc-inference", "grpc-management"), ports):
        cmd += [f"--{flag}-port", str(port)]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return cmd


def run_arm(inference: str, management: str, log_path: str, header_ms: int | None, texts: Sequence[bytes],
            arrivals: Sequence[float], kill_at: float, client_timeout: float, ready_timeout: float) -> dict:
    """One arm: the schedule sent open loop, the one worker SIGKILLed `kill_at` s in; Outcomes and
    the restart (kill -> the first answer from a new worker), then wait until that worker is READY."""
    url, old = f"{inference}/predictions/{NAME}", worker_pids(management, NAME)
    assert len(old) == 1, f"one worker expected, found {old}"
    killed, lags = {}, []

    def kill(mono0: float):
        os.kill(old[0], signal.SIGKILL)
        killed["at"] = time.monotonic() - mono0

    async def main():
        wall0, mono0 = time.time(), time.monotonic()

        async def send(i: int, at: float):
            headers = {} if header_ms is None else {"X-Deadline-At": f"{wall0 + at + header_ms / 1000:.3f}"}
            return await shoot(url, texts[i], headers=headers, timeout=client_timeout)

        asyncio.get_running_loop().call_later(kill_at, kill, mono0)
        return mono0, await at_arrivals(range(len(arrivals)), arrivals, send, lags=lags)

    mono0, results = asyncio.run(main())
    outcomes = [Outcome(round(at, 4), s.status, None if s.done_at is None else round(s.done_at - mono0, 4))
                for at, s in zip(arrivals, results)]
    # answers from a new worker (the handler stamps its pid on 200s and on its own 503s and 504s)
    new = [(s.done_at - mono0, s.status) for s in results if s.answered and int(s.headers.get(WORKER_HEADER, old[0])) not in old]
    first, first_200 = min(new, default=None), min((t for t, status in new if status == 200), default=None)
    refused: dict[str, int] = {}  # each error by who answered it (tsbatch's JSON or TorchServe's own) and why
    for s in results:
        if s.answered and s.status != 200:
            body = s.json() if isinstance(s.json(), dict) else {}
            why = str(body.get("error") or body.get("message") or s.body[:60])[:60]
            key = f"{'handler' if 'error' in body else 'frontend'} {s.status} {why}"
            refused[key] = refused.get(key, 0) + 1
    ready = wait_until(lambda: [w for w in server.workers(management, NAME)
                                if w.get("status") == "READY" and int(w["pid"]) not in old], ready_timeout,
                       every=0.5, what="a new READY worker")
    new_pid = int(ready[0]["pid"])
    return {"header": "none" if header_ms is None else f"X-Deadline-At = scheduled send + {header_ms} ms",
            "header_ms": header_ms, "victim_pid": old[0], "killed_at_s": round(killed["at"], 3),
            "requests": len(results), "answered": sum(s.answered for s in results),
            "unanswered": sum(not s.answered for s in results), "by_status": by_status(results),
            "refused_by": refused, "client_lag_p99_ms": round(percentile([x * 1000 for x in lags], 99), 1),
            "restart_s": None if first is None else round(first[0] - killed["at"], 2),
            "first_200_s": None if first_200 is None else round(first_200 - killed["at"], 2), "new_pid": new_pid,
            "new_worker_warmup_s": warmups(read_text(log_path)).get(new_pid), "outcomes": outcomes}


def run(args) -> dict:
    import yaml

    from bench.loadtest.workload import Mix, make_requests

    python = os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO) else sys.executable
    report = {"command": " ".join([python, "bench/drills/recovery.py"] + args.argv), "started": reports.utc_now(),
              "machine": reports.machine(), "load_start": reports.load_average(), "rate": args.rate,
              "seconds": args.seconds, "kill_at_s": args.kill_at, "window_s": args.window,
              "client_timeout_s": args.client_timeout, "workload": "two-cluster (the mix)", "seed": args.seed}
    arrivals = poisson_arrivals(args.rate, args.seconds, args.seed)
    texts = [r.text.encode() for r in make_requests(len(arrivals), Mix(), seed=args.seed)]
    with tempfile.TemporaryDirectory(prefix="tsbatch-recovery-") as root:
        store, ports = os.path.join(root, "store"), server.free_ports(5)
        cmd = build(store, ports, args.profile)
        report["archive"] = " ".join(["tsbatch archive"] + cmd[4:cmd.index("--inference-port")]).replace(REPO + "/", "")
        with zipfile.ZipFile(os.path.join(store, f"{NAME}.mar")) as mar:  # the model-config.yaml it ships
            config = yaml.safe_load(mar.read("model-config.yaml"))
        handler = config.get("handler") or {}
        report["archive_config"] = {k: config.get(k) for k in ("minWorkers", "maxWorkers", "jobQueueSize",
                                                               "batchSize", "responseTimeout")}
        report["archive_config"].update({f"handler.{k}": handler.get(k) for k in ("deadline_ms", "deadline_margin_ms")})
        archive_ms = int(handler.get("deadline_ms", 30000))
        deadlines = list(dict.fromkeys(archive_ms if d == "archive" else int(d) for d in args.deadlines_ms.split(",")))
        report["deadlines_ms"], report["archive_deadline_ms"] = deadlines, archive_ms
        paths = server.ServerPaths(os.path.join(root, "tmp"), os.path.join(root, "logs"))
        management = f"http://127.0.0.1:{ports[1]}"
        server.start(os.path.join(store, "config.properties"), store, paths)
        try:
            server.wait_ready(management, NAME, args.ready_timeout, log_hint=f"; see {paths.logs}")
            report["arms"] = {}
            for arm in ["none"] + [f"at:{d}" for d in deadlines]:
                time.sleep(args.settle)  # the new worker idle a moment, as at the start
                drill = run_arm(f"http://127.0.0.1:{ports[0]}", management, os.path.join(paths.logs, "model_log.log"),
                                None if arm == "none" else int(arm[3:]), texts, arrivals, args.kill_at,
                                args.client_timeout, args.ready_timeout)
                outcomes = drill.pop("outcomes")
                judged = deadlines if arm == "none" else [int(arm[3:])]
                drill["judged"] = {str(d): figures(outcomes, drill["killed_at_s"], d / 1000, args.window) for d in judged}
                print(arm, {k: v for k, v in drill.items() if k != "judged"},
                      {d: {k: v for k, v in f.items() if k != "windows"} for d, f in drill["judged"].items()}, flush=True)
                report["arms"][arm] = drill
        finally:
            server.stop(paths)
            report["workers_left_after_stop"] = reap_workers(paths.tmpdir)
    report["load_end"] = reports.load_average()
    return report


def _sec(value) -> str:
    return "never (not within the run)" if value is None else f"{value:g} s"


def verdicts(report: dict) -> list[str]:
    """Per criterion, one plain line per arm (and deadline it is judged against)."""
    lines = []
    for arm, d in report["arms"].items():
        lines.append(f"- {'met' if d['unanswered'] == 0 else 'NOT met'}: nothing lost, arm {arm} "
                     f"({d['answered']} of {d['requests']} answered, {d['unanswered']} open after "
                     f"{report['client_timeout_s']:g} s)")
    for arm, d in report["arms"].items():
        for ms, f in d["judged"].items():
            lines.append(f"- {'met' if f['late_200'] == 0 else 'NOT met'}: no 200 after its deadline, arm {arm} "
                         f"judged at {int(ms) / 1000:g} s ({f['late_200']} of {f['ok']} late"
                         + (f", by up to {f['late_by_max_s']} s)" if f["late_200"] else ")"))
    for arm, d in report["arms"].items():
        for ms, f in d["judged"].items():
            since = "" if f["recovery_s"] is None or d["restart_s"] is None else \
                f", {f['recovery_s'] - d['restart_s']:.1f} s after the new worker's first answer"
            lines.append(f"- recovery time, arm {arm} judged at {int(ms) / 1000:g} s: {_sec(f['recovery_s'])} after "
                         f"the kill{since} (restart {_sec(d['restart_s'])}; last miss sent "
                         f"{_sec(f['last_miss_after_kill_s'])} after the kill)")
    return lines


def markdown(report: dict) -> str:
    c = report["archive_config"]
    lines = ["# Recovery after a worker is killed: with and without an absolute deadline", "",
             f"Command: `{report['command']}` ({report['started']})", "",
             f"Machine: {report['machine']}; shared with others; load average {report['load_start'][0]} at the "
             f"start, {report['load_end'][0]} at the end.", "",
             f"Archive: `{report['archive']}`; {c['minWorkers']} worker, jobQueueSize {c['jobQueueSize']}, "
             f"handler.deadline_ms {c['handler.deadline_ms']}.", "",
             f"Load: {report['workload']}, open-loop Poisson at {report['rate']:g} req/s for {report['seconds']:g} s, "
             f"the same schedule in every arm; the worker SIGKILLed {report['kill_at_s']:g} s in; clients give up "
             f"after {report['client_timeout_s']:g} s. Latency from each request's scheduled send. Recovery: the "
             f"{report['window_s']:g}-s windows of scheduled arrivals after the kill; the first instant after "
             "which every request of every following window got a 200 within its deadline.", "",
             "## Verdicts", "", *verdicts(report), "",
             "| arm | judged at | answered | unanswered | by status | 200s p50 / p99 / max | 200s after deadline "
             "| restart: first answer / first 200 | recovery |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, d in report["arms"].items():
        for ms, f in d["judged"].items():
            lines.append(f"| {arm} | {int(ms) / 1000:g} s | {d['answered']} | {d['unanswered']} | {d['by_status']} | "
                         f"{f['ok_p50_s']} / {f['ok_p99_s']} / {f['ok_max_s']} s | {f['late_200']} | "
                         f"{_sec(d['restart_s'])} / {_sec(d['first_200_s'])} | {_sec(f['recovery_s'])} |")
    lines += ["", "Per arm: the new worker's warmup, the client's lag, each error by who answered it and why (the message's start).", ""]
    for arm, d in report["arms"].items():
        lines.append(f"- {arm}: warmup {d['new_worker_warmup_s']} s, client lag p99 {d['client_lag_p99_ms']} ms, "
                     + "; ".join(f"{k}…: {n}" for k, n in sorted(d["refused_by"].items())))
    lines += ["", "Per 2-s window after the kill (in time / sent; JSON has late, refused, unanswered):", ""]
    for arm, d in report["arms"].items():
        for ms, f in d["judged"].items():
            cells = " ".join(f"{w['in_time']}/{w['sent']}" for w in f["windows"])
            b = f["before_kill"]
            lines.append(f"- {arm} at {int(ms) / 1000:g} s: sent before the kill {b['in_time']}/{b['sent']}; after: {cells}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", help="latency profile the archive is tuned from (default: take one here)")
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-at", type=float, default=10.0, help="seconds into the run the worker is killed")
    parser.add_argument("--deadlines-ms", default="archive,1000",
                        help="comma-separated client deadlines, each an at: arm; 'archive' is handler.deadline_ms")
    parser.add_argument("--window", type=float, default=2.0, help="seconds of scheduled arrivals per window")
    parser.add_argument("--client-timeout", type=float, default=60.0, help="a request open this long is unanswered")
    parser.add_argument("--settle", type=float, default=5.0, help="idle seconds before each arm")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=38)
    parser.add_argument("--out", default=os.path.join(reports.RESULTS, "recovery"))
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = argv
    server.stop_on_sigterm()  # so `finally` stops the torchserve
    report = run(args)
    reports.write(args.out, report, markdown(report))
    print(markdown(report))
    return 0 if all(d["unanswered"] == 0 for d in report["arms"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
