"""The torchserve under test, as drills and e2e tests see it: its workers, their warmup, their logs.

Shared by bench/chaos.py's drills and tests/e2e, so a test and the drill it shortens wait for,
find and clean up workers the same way.
"""
from __future__ import annotations

import os
import re
import signal
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Iterable

from tsbatch.archiver import server
from bench.loadtest.proc import alive, cpu_seconds, pids_with

WARMUP_DONE = re.compile(r"tsbatch warmup done in ([\d.]+)s by worker pid (\d+)")


def worker_pids(management: str, model: str) -> list[int]:
    return [int(w["pid"]) for w in server.workers(management, model) if w.get("pid")]


def wait_until(predicate: Callable[[], Any], timeout: float, every: float = 0.2, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy; TimeoutError after `timeout` seconds.
    A predicate that fails to reach the server counts as not yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except (urllib.error.URLError, OSError, ValueError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:.0f}s")
        time.sleep(every)


def wait_busy(pids: Iterable[int], cpu: float = 0.3, timeout: float = 60.0) -> int:
    """The first of `pids` to burn `cpu` seconds of CPU from now: the worker running a batch."""
    pids = list(pids)
    base = {pid: cpu_seconds(pid) or 0.0 for pid in pids}

    def busy():
        for pid in pids:
            now = cpu_seconds(pid)
            if now is not None and now - base[pid] >= cpu:
                return pid
        return None

    return wait_until(busy, timeout, every=0.02, what=f"a worker of {pids} busy for {cpu}s of CPU")


def warmups(log_text: str) -> dict[int, float]:
    """pid -> warmup seconds, from the model log's 'tsbatch warmup done' lines."""
    return {int(pid): float(sec) for sec, pid in WARMUP_DONE.findall(log_text)}


def read_text(path: str) -> str:
    """A log's text so far; empty if it does not exist (yet)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def restore_workers(management: str, model: str, workers: int, timeout: float) -> list[int]:
    """Scale to 0 and back: TorchServe 0.12's async worker thread never reports READY again after
    a crash (its loadingFinished flag survives the restart); a fresh thread does. Returns the pids
    of old workers still running 10 s after the scale-down: TorchServe 0.12 does not stop a
    restarted async worker (killing it only makes its thread start another), and the process
    outlives `torchserve --stop`; reap_workers() ends them once the server is stopped."""
    stale = worker_pids(management, model)
    left: list[int] = []
    for count in (0, workers):
        server.scale(management, model, count, timeout=timeout)
        if count == 0:
            try:
                wait_until(lambda: not any(alive(pid) for pid in stale), 10, what="scaled-down workers gone")
            except TimeoutError:
                left = [pid for pid in stale if alive(pid)]
    return left


def worker_processes(tmpdir: str) -> list[int]:
    """Live Python workers of the torchserve whose TMPDIR is `tmpdir` (their sockets live there)."""
    return pids_with("model_service_worker.py", os.path.join(tmpdir, ".ts.sock."))


def reap_workers(tmpdir: str) -> list[int]:
    """After `torchserve --stop`: kill, by pid, the workers of that server still running (see
    restore_workers); returns their pids."""
    pids = worker_processes(tmpdir)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def metric_total(metrics_url: str, name: str, model: str) -> float:
    """The sum of one series over every label set of this model on TorchServe's metrics endpoint
    (0 before the series is first emitted)."""
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and (f'ModelName="{model}"' in line or f'model_name="{model}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total
