"""`make bench-saturation`: where a saturated worker's time goes, against what the model can do.

In one run, on the mix `make bench` sends:
1. The in-process ceilings (no HTTP, no TorchServe, the archive's torch threads or every core, passes back to back, the same
   texts): every text sorted by length and batched under a 4,096-token padded budget (the best
   this model does on this machine), and the served archive's own shapes (its bucket edges and
   batch caps, plan_batches): the honest ceiling for what the archive may form; and the sorted one
   again with the model eager, untraced (bench/ceilings.py).
2. The archive `tsbatch archive` builds (tuned, as `make serve` serves it), one worker, sent
   open-loop Poisson traffic above what it answers: CPU seconds of every process (TorchServe's
   Java frontend, the worker, this client) and of each worker thread (/proc), the machine's cores by
   state, and three py-spy samplers on the worker's threads (every sample, on-CPU samples, the
   GIL holder's) classified into forward passes, tokenizing, collating, response encoding,
   metrics, TorchServe's protocol, and waits named by the tsbatch function waiting.
Writes bench/results/saturation.{json,md}. `--archive DIR` serves an archive already built
(DIR/minilm.mar); `--rate` the offered req/s; `--seconds` the window.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Iterator

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.ceilings import THREADS, ceilings  # noqa: E402
from bench.loadtest.arrivals import poisson_arrivals  # noqa: E402
from bench.loadtest.load import run_open_loop  # noqa: E402
from bench.loadtest.proc import cpu_seconds, machine_cpu, threads_cpu  # noqa: E402
from bench.loadtest.stats import summarize  # noqa: E402
from bench.loadtest.torchserve import worker_pids  # noqa: E402
from bench.loadtest.workload import Mix, make_requests  # noqa: E402

NAME = "minilm"
# what a worker thread's sample is doing, from its innermost frame ("path:function") that names it
CATEGORIES = (
    ("forward pass", ("torch/nn/", "modeling_bert", "models/encoder.py:forward", "models/encoder.py:_embeddings")),
    ("collate", ("models/encoder.py:_collate",)),
    ("tokenize", ("tokenization_utils", "tokenizers", "models/encoder.py:tokenize", "models/encoder.py:_encode")),
    ("response encoding (JSON)", ("json/",)),
    ("metrics", ("ts/metrics/", "handlers/edge/metrics.py")),
    ("TorchServe protocol: reading calls (recv per field, parsing)", ("socket.py:recv", "otf_message_handler.py:retrieve_msg",
                                                                    "otf_message_handler.py:_retrieve")),
    ("TorchServe protocol (reply, socket write)", ("otf_message_handler.py", "socket.py", "model_service_worker.py")),
)


def thread_names(pid: int, py_spy: str) -> dict[int, str]:
    """Python thread names by native id (py-spy dump); native-only threads (OpenMP, the JIT) absent."""
    text = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60).stdout
    names = {}
    for line in text.splitlines():
        if line.startswith("Thread "):  # Thread 123 (idle): "MainThread"
            parts = line.split()
            names[int(parts[1])] = line.split('"')[1] if '"' in line else parts[1]
    return names


def frame_key(frame: str) -> str:
    """py-spy's "function (path:line)" as "path:function"."""
    name, _, where = frame.partition(" (")
    return f"{where.rsplit(':', 1)[0]}:{name}"


def classify(frames: list[str]) -> str:
    """One sample's category: a wait is named by the tsbatch function waiting, the rest by CATEGORIES."""
    keys = [frame_key(f) for f in frames]
    if keys and ("threading.py:wait" in keys[-1] or "threading.py:wait_for" in keys[-1]
                 or (len(keys) > 1 and "threading.py:wait" in keys[-2])):
        waiter = next((k for k in reversed(keys) if "tsbatch/" in k), "?")
        return f"waiting ({waiter.split('tsbatch/')[-1]})"
    for key in reversed(keys):
        for category, marks in CATEGORIES:
            if any(mark in key for mark in marks):
                return category
    return "other: " + next((k.split("/")[-1] for k in reversed(keys) if "tsbatch/" in k), keys[-1] if keys else "?")


VIEWS = {"wall": ["--idle"], "cpu": [], "gil": ["--gil"]}  # every sample, on-CPU ones, the GIL holder's


def sample(pid: int, seconds: float, py_spy: str, path: str, view: str) -> subprocess.Popen:
    """py-spy record of every thread of the worker (raw collapsed stacks, thread names) in one of VIEWS."""
    return subprocess.Popen([py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "100",
                             "--format", "raw", "--threads", "--nonblocking", "-o", path] + VIEWS[view],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def raw_stacks(path: str) -> Iterator[tuple[str, list[str], int]]:
    """py-spy's raw output, whose lines read "thread (TID): NAME;frame;frame... COUNT", as
    (thread name, frames, count). A frame may span lines (py-spy names a module's import by its
    docstring; a name sampled mid-change can be bytes that are not UTF-8): a record ends at the
    first line that ends in a count."""
    with open(path, errors="replace") as f:
        record = ""
        for line in f:
            record += line
            stack, _, n = record.rstrip("\n").rpartition(" ")
            if not n.isdigit():
                continue
            head, *frames = stack.split(";")
            yield head.split("): ", 1)[-1], [fr for fr in frames if not fr.startswith("process ")], int(n)
            record = ""


def samples_per_thread(path: str) -> collections.Counter:
    """How many samples py-spy's raw output holds of each thread (by name)."""
    counts = collections.Counter()
    for name, _frames, n in raw_stacks(path):
        counts[name] += n
    return counts


def gil_shares(all_path: str, gil_path: str) -> dict[str, float]:
    """Share of the window each thread held the GIL: its --gil samples over its samples at the same rate."""
    every, held = samples_per_thread(all_path), samples_per_thread(gil_path)
    return {name: round(held[name] / n, 3) for name, n in every.most_common() if n}


def read_samples(path: str) -> dict[str, dict[str, float]]:
    """{thread name: {category: share of that thread's samples}} from py-spy's raw output."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, frames, n in raw_stacks(path):
        counts[name][classify(frames)] += n
    return {name: {cat: round(k / sum(c.values()), 3) for cat, k in c.most_common(8)} for name, c in counts.items()}


def overload(url: str, worker: int, java: int, rate: float, seconds: float, py_spy: str, root: str) -> dict:
    """One open-loop window at `rate`; CPU of each process and worker thread over it; py-spy of the worker."""
    requests = make_requests(int(rate * seconds * 1.5), Mix(), seed=21)
    arrivals = poisson_arrivals(rate, seconds, seed=22)
    # first the same window with no profiler attached (the samplers take ~0.2 of the 2 cores)
    clean = summarize(run_open_loop(url, requests[:len(arrivals)], arrivals, rate, seconds, timeout=60))
    names = thread_names(worker, py_spy)
    processes = {"frontend (java)": java, "worker": worker, "client (this process)": os.getpid()}
    before = {name: cpu_seconds(pid) for name, pid in processes.items()}
    threads_before = threads_cpu(worker)
    paths = {view: os.path.join(root, f"worker.{view}.stacks") for view in VIEWS}
    spies = [sample(worker, seconds - 2, py_spy, path, view) for view, path in paths.items()]
    machine_before, started = machine_cpu(), time.monotonic()
    run = run_open_loop(url, requests[:len(arrivals)], arrivals, rate, seconds, timeout=60)
    elapsed = time.monotonic() - started
    machine = {k: round((v - machine_before[k]) / elapsed, 3) for k, v in machine_cpu().items()}
    for spy in spies:
        spy.wait(timeout=120)
    after = {name: cpu_seconds(pid) for name, pid in processes.items()}
    threads_after = threads_cpu(worker)
    cpu = {k: round((after[k] - before[k]) / elapsed, 3) for k in before}
    cpu["the rest (py-spy, kernel, other processes, idle)"] = round(THREADS - sum(cpu.values()), 3)
    per_thread = collections.Counter()
    for tid, secs in threads_after.items():
        per_thread[names.get(tid, "native (OpenMP, JIT, I/O)")] += (secs - threads_before.get(tid, 0.0)) / elapsed
    point = summarize(run)
    return {"rate": rate, "seconds": round(elapsed, 1), "answered_per_s": point["throughput"],
            "unprofiled": {"answered_per_s": clean["throughput"], "summary": clean},
            "summary": point, "cores_busy": cpu, "machine_cores": machine,
            "worker_threads_cores": {k: round(v, 3) for k, v in per_thread.most_common() if v > 0.005},
            "worker_samples": {view: read_samples(paths[view]) for view in ("wall", "cpu") if os.path.exists(paths[view])},
            "gil_held": gil_shares(paths["wall"], paths["gil"]) if os.path.exists(paths["gil"]) else {}}


def per_core(report: dict) -> dict:
    """Requests/s per core the passes had: the profiled window's answers over its lanes' CPU, and
    the sorted ceiling's over its torch threads. Equal figures: the served worker lacks only cores."""
    o, threads = report["overload"], report["handler"].get("torch_threads") or THREADS
    lanes = sum(v for k, v in o["worker_threads_cores"].items() if k.startswith("tsbatch-lane"))
    return {"lanes_cores": round(lanes, 3), "served_per_lane_core": round(o["answered_per_s"] / lanes, 1) if lanes else None,
            "ceiling_per_core": round(report["ceilings"]["sorted"]["req_per_s"] / threads, 1)}


def markdown(report: dict) -> str:
    c, o = report["ceilings"], report["overload"]
    lines = [f"# Where a saturated worker's time goes ({report['when']}, {report['machine']})", "",
             f"Command: `{report['command']}`. Archive: {report['archive']}. Mix: {report['mix']}.", "",
             "| in process (the worker's torch threads, back to back) | req/s | real tokens/s | passes | padding |", "|---|---|---|---|---|"]
    lines += [f"| {v['shapes']} | {v['req_per_s']} | {v['real_tokens_per_s']} | {v['passes']} | {v['padding']} |" for v in c.values()]
    s, u = o["summary"], o["unprofiled"]
    lines += ["", f"Served, one worker, offered {o['rate']} req/s for {o['seconds']} s, no profiler attached: answered "
              f"**{u['answered_per_s']} req/s** ({u['summary']['sent'] - u['summary']['ok']} of {u['summary']['sent']} not 200); "
              f"short p50/p99 {u['summary']['short']['p50']}/{u['summary']['short']['p99']} ms, long p50/p99 "
              f"{u['summary']['long']['p50']}/{u['summary']['long']['p99']} ms.",
              f"Served ÷ sorted ceiling: **{report['served_over_sorted']}**; served ÷ the archive's own shapes in process: "
              f"**{report['served_over_shapes']}**" + (f"; ÷ sorted, the model eager: **{report['served_over_sorted_eager']}**."
                                                       if "sorted_eager" in c else "."), "",
              f"The same window again with the samplers below attached: answered {o['answered_per_s']} req/s "
              f"({s['sent'] - s['ok']} not 200). Everything below is from that window.", "",
              f"Cores busy over the window (CPU seconds per second, of {THREADS}):", ""]
    lines += [f"- {k}: {v}" for k, v in o["cores_busy"].items()]
    if pc := report.get("per_core"):
        lines += ["", f"Per core the passes had: the lanes answered {pc['served_per_lane_core']} req/s per core of the "
                  f"{pc['lanes_cores']} they got; the sorted ceiling does {pc['ceiling_per_core']} per core. " +
                  ("What the served worker lacks against the ceiling is the cores the rest of the path above took."
                   if (pc["served_per_lane_core"] or 0) >= pc["ceiling_per_core"] else
                   "The served passes also do less per core than the ceiling's.")]
    lines += ["", "The machine's cores by state (the kernel's cpu counters; nice is the long lane, which runs at a lower priority): " + ", ".join(f"{k} {v}" for k, v in o.get("machine_cores", {}).items())]
    lines += ["", "Worker threads (cores):", ""] + [f"- {k}: {v}" for k, v in o["worker_threads_cores"].items()]
    titles = {"wall": "every sample, waits included (share of the window)", "cpu": "on-CPU samples only (share of the thread's CPU)"}
    for view, threads in o["worker_samples"].items():
        lines += ["", f"Worker threads' py-spy samples by category, {titles[view]}:", ""]
        lines += [f"- {name}: " + ", ".join(f"{k} {v}" for k, v in cats.items()) for name, cats in threads.items()]
    held = o.get("gil_held", {})
    lines += ["", f"Share of the window each thread held the GIL (py-spy --gil): {held}; held by some thread: "
              f"{round(sum(held.values()), 3)}."]
    lines += ["", "Handler timing of short requests (median ms; x-tsbatch-timing):",
              f"{s.get('short_breakdown_ms', {})}", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archive", help="a folder holding minilm.mar and its config.properties (default: build one)")
    parser.add_argument("--rate", type=float, default=130.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--ceiling-seconds", type=float, default=20.0)
    parser.add_argument("--out", default=os.path.join(reports.RESULTS, "saturation"))
    args = parser.parse_args()
    py_spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    from tsbatch.archiver.cli import default_model_dir

    server.stop_on_sigterm()
    root = tempfile.mkdtemp(prefix="tsbatch-saturation-")
    store = args.archive
    if store is None:
        store = os.path.join(root, "store")
        subprocess.run([sys.executable, "-m", "tsbatch.archiver", "archive", "--name", NAME, "--out", store],
                       check=True, stdout=subprocess.DEVNULL)
    with zipfile.ZipFile(os.path.join(store, f"{NAME}.mar")) as mar:
        section = yaml.safe_load(mar.read("model-config.yaml"))["handler"]
    texts = [r.text for r in make_requests(400, Mix(), seed=99)]
    report = {"when": reports.utc_now(), "machine": reports.machine(), "mix": "make bench's (85% short, 15% long)",
              "command": "make bench-saturation" + (f" BENCH_ARGS='--archive {args.archive}'" if args.archive else ""),
              "archive": "tsbatch archive (tuned, as make serve builds it)", "handler": section}
    report["ceilings"] = ceilings(default_model_dir(), section, texts, args.ceiling_seconds, eager=True)
    print(report["ceilings"], flush=True)
    with server.local_server(os.path.join(root, "serve"), store, [NAME], timeout=900) as served:
        url = f"{served.inference}/predictions/{NAME}"
        run_open_loop(url, make_requests(40, Mix(), seed=3), poisson_arrivals(10, 4, seed=3), 10, 4, timeout=60)
        worker = worker_pids(served.management, NAME)[0]
        report["overload"] = overload(url, worker, server.running_pid(served.paths), args.rate, args.seconds, py_spy, root)
    answered = report["overload"]["unprofiled"]["answered_per_s"]
    for name, key in (("sorted", "served_over_sorted"), ("served", "served_over_shapes"), ("sorted_eager", "served_over_sorted_eager")):
        if name in report["ceilings"]:
            report[key] = round(answered / report["ceilings"][name]["req_per_s"], 3)
    report["per_core"] = per_core(report)
    reports.write(args.out, report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
