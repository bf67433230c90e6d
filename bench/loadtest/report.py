"""Writing a benchmark's report: JSON for the figures, markdown for people, into bench/results.

Every script stamps its report with the same time and machine lines, because on a shared machine
a figure means little without when and where it was taken.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "bench", "results")


def utc_now(seconds: bool = False) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC" if seconds else "%Y-%m-%d %H:%M UTC", time.gmtime())


def machine(with_platform: bool = True) -> str:
    """e.g. "x86_64, 2 cores, Linux-6.1-x86_64-with-glibc2.36"."""
    line = f"{platform.machine()}, {os.cpu_count()} cores"
    return f"{line}, {platform.platform()}" if with_platform else line


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages: how busy the shared machine was around a measurement."""
    return [round(v, 2) for v in os.getloadavg()]


def write_json(path: str, data: dict, indent: int = 1) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)


def write(stem: str, data: dict, markdown: str | None = None, indent: int = 1) -> None:
    """STEM.json, and STEM.md when there is markdown (e.g. bench/results/chaos)."""
    write_json(stem + ".json", data, indent)
    if markdown is not None:
        with open(stem + ".md", "w") as f:
            f.write(markdown)


def checkout_of(python: str) -> str:
    """Where the tsbatch checkout that `python` runs lives, and its last commit (before/after runs)."""
    code = "import tsbatch.handlers, os; print(os.path.dirname(os.path.dirname(tsbatch.handlers.__file__)))"
    root = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "-C", root, "log", "-1", "--format=%h %s"], capture_output=True, text=True).stdout
    return f"{root} at {head.strip()[:90]}"
