"""`make bench-frontend`: what TorchServe's own settings do for a saturated tsbatch worker.

The archive `tsbatch archive` builds (as `make serve` serves it), one worker, open-loop Poisson
traffic above what it answers, served by a fresh torchserve per variant of config.properties:
as shipped, Netty's threads at 1 and at 4 (TorchServe's default is one per core), the serial
garbage collector (the JVM picks G1 on a 2-core box), the access log off, and the JVM's own
two-tier JIT (tsbatch ships C1 only). Variants take
turns, who goes first rotating by round. Per variant: answered req/s, not-200s, short p50/p99,
and the cores the Java frontend and the worker process used. Writes
bench/results/frontend.{json,md}. This answers whether the frontend's configuration is where a
saturated worker's ceiling is (issue #22), not what the handler does.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tsbatch.archiver import server  # noqa: E402
from tsbatch.archiver.properties import FRONTEND_JIT  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.arrivals import poisson_arrivals  # noqa: E402
from bench.loadtest.load import run_open_loop  # noqa: E402
from bench.loadtest.proc import cpu_seconds  # noqa: E402
from bench.loadtest.stats import percentile, summarize  # noqa: E402
from bench.loadtest.torchserve import worker_pids  # noqa: E402
from bench.loadtest.workload import Mix, make_requests  # noqa: E402

NAME = "minilm"
LOG4J = os.path.join(REPO, "configs", "log4j2.xml")


def variants(root: str) -> dict[str, tuple[tuple[str, str, str], ...]]:
    """config.properties lines each variant adds to the shipped ones (the last of a key wins).
    vmargs carries tsbatch's log4j2.xml, so a variant that sets it names that file too."""
    quiet_log = os.path.join(root, "log4j2-no-access.xml")
    with open(LOG4J) as f:
        text = f.read()
    with open(quiet_log, "w") as f:
        f.write(access_log_off(text))
    jit = " ".join(FRONTEND_JIT)
    log = lambda path, more="": f"-Dlog4j.configurationFile=file://{path} {more}".strip()  # noqa: E731
    return {
        "shipped": (),
        "netty 1+1": (("number_of_netty_threads", "1", "bench"), ("netty_client_threads", "1", "bench")),
        "netty 4+4": (("number_of_netty_threads", "4", "bench"), ("netty_client_threads", "4", "bench")),
        "serial GC": (("vmargs", log(LOG4J, f"{jit} -XX:+UseSerialGC"), "bench"),),
        "no access log": (("vmargs", log(quiet_log, jit), "bench"),),
        "JIT C1+C2 (JVM default)": (("vmargs", log(LOG4J), "bench"),),
    }


def access_log_off(log4j_xml: str) -> str:
    """tsbatch's log4j2.xml with the ACCESS_LOG logger off; ValueError when the file has none."""
    out, n = re.subn(r'(<Logger name="ACCESS_LOG" level=)"[a-z]+"', r'\1"off"', log4j_xml)
    if n != 1:
        raise ValueError("configs/log4j2.xml has no ACCESS_LOG logger to turn off")
    return out


def window(store: str, root: str, tuned, rate: float, seconds: float, requests) -> dict:
    """A fresh torchserve with these extra lines, one warm-up trickle, one window at `rate`."""
    with server.local_server(root, store, [NAME], timeout=900, tuned=tuned) as served:
        url = f"{served.inference}/predictions/{NAME}"
        run_open_loop(url, requests[:40], poisson_arrivals(10, 4, seed=3), 10, 4, timeout=60)
        pids = {"frontend (java)": server.running_pid(served.paths),
                "worker": worker_pids(served.management, NAME)[0]}
        before, started = {k: cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
        arrivals = poisson_arrivals(rate, seconds, seed=22)
        run = run_open_loop(url, requests[:len(arrivals)], arrivals, rate, seconds, timeout=60)
        elapsed = time.monotonic() - started
        cores = {k: round((cpu_seconds(p) - before[k]) / elapsed, 3) for k, p in pids.items()}
    point = summarize(run)
    return {"answered_per_s": point["throughput"], "not_200": point["sent"] - point["ok"], "sent": point["sent"],
            "short_p50": point["short"]["p50"], "short_p99": point["short"]["p99"],
            "long_p50": point["long"]["p50"], "long_p99": point["long"]["p99"], "cores": cores,
            "status_by_kind": {kind: dict(Counter(str(r.status) for r in run.results if r.kind == kind))
                               for kind in ("short", "long")}}


def pooled(rounds: list[dict]) -> dict:
    """A variant's rounds: each round's answered req/s, and the medians."""
    med = lambda key: percentile([r[key] for r in rounds if r[key] is not None], 50)  # noqa: E731
    return {"answered_per_s": med("answered_per_s"), "per_round": [r["answered_per_s"] for r in rounds],
            "not_200": sum(r["not_200"] for r in rounds), "sent": sum(r["sent"] for r in rounds),
            "short_p50": med("short_p50"), "short_p99": med("short_p99"),
            "java_cores": percentile([r["cores"]["frontend (java)"] for r in rounds], 50),
            "worker_cores": percentile([r["cores"]["worker"] for r in rounds], 50)}


def markdown(report: dict) -> str:
    lines = [f"# TorchServe's own settings under a saturated tsbatch worker ({report['when']}, {report['machine']})", "",
             f"Command: `{report['command']}`. The archive `tsbatch archive` builds, one worker, the make bench mix "
             f"offered at {report['rate']:g} req/s for {report['seconds']:g} s per window, a fresh torchserve per "
             f"variant and round ({report['rounds']} rounds, variants in turns, who goes first rotating); figures "
             "are the median of the rounds.", "",
             "| variant | answered req/s | per round | not 200 | short p50 / p99 ms | java cores | worker cores |",
             "|---|---|---|---|---|---|---|"]
    for name, p in report["variants"].items():
        lines.append(f"| {name} | {p['answered_per_s']} | {p['per_round']} | {p['not_200']} of {p['sent']} | "
                     f"{p['short_p50']} / {p['short_p99']} | {p['java_cores']} | {p['worker_cores']} |")
    shipped = report["variants"]["shipped"]["answered_per_s"]
    best = max(report["variants"].items(), key=lambda kv: kv[1]["answered_per_s"])
    lines += ["", f"Best: **{best[0]}**, {best[1]['answered_per_s']} req/s, "
                  f"{best[1]['answered_per_s'] / shipped:.3f}x the shipped configuration's {shipped}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=130.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(reports.RESULTS, "frontend"))
    args = parser.parse_args()
    server.stop_on_sigterm()
    root = tempfile.mkdtemp(prefix="tsbatch-frontend-")
    store = os.path.join(root, "store")
    subprocess.run([sys.executable, "-m", "tsbatch.archiver", "archive", "--name", NAME, "--out", store],
                   check=True, stdout=subprocess.DEVNULL)
    named = variants(root)
    requests = make_requests(int(args.rate * args.seconds * 1.5), Mix(), seed=21)
    rounds: dict[str, list[dict]] = {name: [] for name in named}
    for r in range(args.rounds):
        order = list(named)[r % len(named):] + list(named)[:r % len(named)]
        for name in order:
            serve_root = os.path.join(root, f"serve-{r}-{len(rounds[name])}-{name.replace(' ', '-')}")
            rounds[name].append(window(store, serve_root, named[name], args.rate, args.seconds, requests))
            print(f"round {r} {name}: {rounds[name][-1]}", flush=True)
            shutil.rmtree(serve_root, ignore_errors=True)
    report = {"when": reports.utc_now(), "machine": reports.machine(), "rate": args.rate, "seconds": args.seconds,
              "rounds": args.rounds, "command": "make bench-frontend" + (
                  f" BENCH_ARGS='--rate {args.rate:g} --seconds {args.seconds:g} --rounds {args.rounds}'"),
              "variants": {name: pooled(rs) for name, rs in rounds.items()}}
    reports.write(args.out, report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
