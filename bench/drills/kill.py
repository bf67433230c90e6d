"""The kill drill: closed-loop clients keep a worker busy, it gets SIGKILL mid-batch, and a prober
times how long until a new worker answers. What the kill cost is counted too: requests that got an
error, requests never answered, and what TorchServe's frontend logged while it restarted workers."""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Sequence

from tsbatch.archiver import server
from bench.loadtest.load import Load
from bench.loadtest.stats import by_status
from bench.loadtest.torchserve import read_text, wait_busy, wait_until, warmups
from tsbatch.handlers.edge.stages import WORKER_HEADER

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
