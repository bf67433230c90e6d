"""`make bench-many`: 32 texts sent as one request against the same 32 as 32 requests at once, to
the archive as `tsbatch archive` builds it (one worker), rounds in turns. Reports the time until
the last answer, the tokens computed (padding included, from x-tsbatch-padded-to) against what
padding all 32 to the longest would cost, and that every vector of the list equals its single
request's. Writes bench/results/many-texts.json and .md.

    python bench/many_texts.py [--rounds 10] [--profile P]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import requests  # noqa: E402

from tsbatch.archiver import server  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.workload import Mix, make_requests  # noqa: E402

PADDED = "x-tsbatch-padded-to"


def cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / ((sum(x * x for x in a) ** 0.5) * (sum(y * y for y in b) ** 0.5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--profile", help="latency profile to tune from (default: take one here)")
    parser.add_argument("--out", default=reports.RESULTS)
    args = parser.parse_args()
    texts = [r.text for r in make_requests(32, Mix(), seed=20)]  # the make bench mix: 85% short, 15% long
    root = tempfile.mkdtemp(prefix="tsbatch-many-")
    store = os.path.join(root, "store")
    cmd = [sys.executable, "-m", "tsbatch.archiver", "archive", "--name", "m", "--out", store]
    subprocess.run(cmd + (["--profile", args.profile] if args.profile else []), check=True, stdout=subprocess.DEVNULL)
    server.stop_on_sigterm()
    one, many, tokens, worst, refused, alone = [], [], [], [], [], None
    with server.local_server(os.path.join(root, "serve"), store, ["m"], timeout=900) as served, \
            ThreadPoolExecutor(32) as pool, requests.Session() as session:
        url = f"{served.inference}/predictions/m"

        def single(text: str):
            return requests.post(url, data=text.encode(), headers={"Content-Type": "text/plain"}, timeout=60)

        list(pool.map(single, texts))  # first requests: not measured
        for turn in range(args.rounds):
            for arm in (("list", "singles") if turn % 2 == 0 else ("singles", "list")):
                started = time.monotonic()
                if arm == "list":
                    answer = session.post(url, json={"text": texts}, timeout=60)
                    many.append((time.monotonic() - started) * 1000)
                    assert answer.status_code == 200, answer.text
                    listed = [r["embedding"] for r in answer.json()]
                    padded = [int(p) for p in answer.headers[PADDED].split(",")]
                    tokens.append(sum(padded))
                    worst.append(max(padded) * len(padded))
                else:
                    singles = list(pool.map(single, texts))
                    one.append((time.monotonic() - started) * 1000)
                    refused.append(sum(1 for s in singles if s.status_code != 200))  # e.g. 503 past the deadline
                    if not refused[-1]:
                        alone = [s.json()["embedding"] for s in singles]
        agreement = min(cosine(a, b) for a, b in zip(listed, alone)) if alone else None
    median = lambda xs: round(statistics.median(xs), 1)  # noqa: E731
    report = {"when": reports.utc_now(), "machine": reports.machine(), "rounds": args.rounds,
              "command": "make bench-many", "texts": len(texts),
              "long_texts": sum(1 for r in make_requests(32, Mix(), seed=20) if r.kind == "long"),
              "list_ms": [round(x, 1) for x in many], "singles_ms": [round(x, 1) for x in one],
              "singles_not_200": refused,
              "padded_tokens": tokens[-1], "padded_to_longest_tokens": worst[-1], "min_cosine": agreement and round(agreement, 6)}
    text = "\n".join([
        f"# 32 texts: one request against 32 requests ({report['when']})", "",
        f"Machine: {report['machine']}. Command: `{report['command']}` (the archive `tsbatch archive` builds, one "
        f"worker). {args.rounds} rounds, the two arms in turns; {report['long_texts']} of the 32 texts are long "
        "(the make bench mix).", "",
        "| arm | median ms until the last answer | rounds (ms) |", "|---|---|---|",
        f"| one request of 32 texts | {median(many)} | {report['list_ms']} |",
        f"| 32 requests at once | {median(one)} | {report['singles_ms']} |", "",
        f"Of the 32 requests at once, answered other than 200 in each round (the archive's deadline refuses "
        f"what its queue cannot finish in time, 503): {refused}. The list is admitted whole or refused whole.",
        ""
        f"Tokens computed for the list, padding included: {tokens[-1]} (each text padded to its own bucket); "
        f"padded to its longest text it would be {worst[-1]}. Lowest cosine between a text's vector in the list "
        f"and alone: {report['min_cosine']}.", ""])
    reports.write(os.path.join(args.out, "many-texts"), report, text)
    print(text)


if __name__ == "__main__":
    main()
