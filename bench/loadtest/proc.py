"""What /proc says about a process: CPU time, resident memory, whether it lives, and a sampler.

The one place bench/ reads /proc, so every report's "RSS" and "CPU seconds" mean the same thing:
VmRSS from /proc/PID/status, utime + stime from /proc/PID/stat. A process that is gone reads as
None rather than raising: drills kill processes on purpose.
"""
from __future__ import annotations

import os
import re
import threading
import time
import urllib.error
from typing import Callable


def _stat_fields(pid: int, tid: int | None = None) -> list[str]:
    """/proc/PID/stat (or one thread's, /proc/PID/task/TID/stat) after the command name (which may
    hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int, tid: int | None = None) -> float | None:
    """User + system CPU time of a process (or of one of its threads), from /proc; None once it is gone."""
    try:
        fields_ = _stat_fields(pid, tid)
        return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def threads_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of a process, by native thread id ({} once it is gone)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return {}
    return {tid: secs for tid in tids if (secs := cpu_seconds(pid, tid)) is not None}


def machine_cpu() -> dict[str, float]:
    """Seconds of the whole machine's cores by state since boot (/proc/stat's cpu line)."""
    with open("/proc/stat") as f:
        values = [int(v) / os.sysconf("SC_CLK_TCK") for v in f.readline().split()[1:9]]
    return dict(zip(("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"), values))


def rss_kb(pid: int | None) -> int | None:
    """Resident memory (VmRSS) in kB; None for no pid or a process that is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))
    except (OSError, AttributeError):
        return None


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def pids_with(*needles: str) -> list[int]:
    """Live processes whose command line contains every one of `needles`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        if all(n in cmdline for n in needles) and alive(int(entry)):
            found.append(int(entry))
    return found


class MemorySampler:
    """RSS of the JVM and of the model's workers every `every` seconds: start, end and peak.
    `pids` is asked again at each sample, since workers come and go during a drill."""

    def __init__(self, java_pid: int | None, pids: Callable[[], list[int]], every: float = 0.5):
        self.java_pid, self.pids, self.every = java_pid, pids, every
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def sample(self) -> dict:
        try:
            workers = {pid: rss_kb(pid) for pid in self.pids()}
        except (urllib.error.URLError, OSError, ValueError):
            workers = {}
        return {"t": time.monotonic(), "jvm_rss_kb": rss_kb(self.java_pid),
                "worker_rss_kb": sum(v for v in workers.values() if v)}

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
        self.samples.append(self.sample())

    def summary(self) -> dict:
        out = {}
        for key in ("jvm_rss_kb", "worker_rss_kb"):
            values = [s[key] for s in self.samples if s[key]]
            if values:
                out[key] = {"start": values[0], "end": values[-1], "peak": max(values)}
        return out


# -- keeping the load generator off the server's cores -------------------------------------------

CLIENT_CORE_FROM = 4  # cores from which the load generator gets one of its own


def split_cores() -> dict[str, list[int]]:
    """Which cores the server and the load generator get: from CLIENT_CORE_FROM cores up the last
    one is the client's and the rest the server's ({"server": [...], "client": [...]}); on a
    smaller machine they share every core ({"shared": [...]}), and reports say so."""
    available = sorted(os.sched_getaffinity(0))
    if len(available) < CLIENT_CORE_FROM:
        return {"shared": available}
    return {"server": available[:-1], "client": available[-1:]}


def use_cores(split: dict[str, list[int]], role: str) -> None:
    """Run this process (and what it starts from now on) on `role`'s cores; nothing when shared."""
    if role in split:
        os.sched_setaffinity(0, split[role])


def cores_note(split: dict[str, list[int]]) -> str:
    if "shared" in split:
        return (f"the load generator shares all {len(split['shared'])} cores with the server (fewer than "
                f"{CLIENT_CORE_FROM}: none to spare)")
    return f"the load generator on core {split['client'][0]}, the server on cores {split['server']}"
