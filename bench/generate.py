"""Text generation: asks for few tokens in a mixed load, tsbatch vs a first-come control.

The generation example (examples/generate) archived as `tsbatch archive --handler` builds it (with
its handler.yaml, profiled and tuned here) against bench/controls/control_generate_fifo.py under
TorchServe's own batching (batchSize 8, maxBatchDelay 20 ms, the same model and answers). One
open-loop Poisson schedule per window, the same for both; windows alternate between the two
servers (both up, the idle one costs nothing). Latency of each kind of ask, p50 / p99 in ms.
Writes bench/results/generate.json and .md.

    python bench/generate.py [--rate 4] [--seconds 30] [--rounds 2] [--long-share 0.2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.loadtest.arrivals import at_arrivals, poisson_arrivals  # noqa: E402
from bench.loadtest.client import shoot  # noqa: E402
from bench.loadtest.report import load_average, machine, utc_now, write  # noqa: E402
from tsbatch.archiver import server  # noqa: E402
from tsbatch.archiver.package import ArchiveSpec, build_archive  # noqa: E402
from tsbatch.archiver.properties import model_config  # noqa: E402
from tsbatch.archiver.tune import frontend_keys  # noqa: E402
from tsbatch.warmup.profile import percentile  # noqa: E402

EXAMPLE = os.path.join(REPO, "examples", "generate")
SHORT_ASK, LONG_ASK = 8, 256
TARGET_MS = 2000  # a 256-token generation takes ~0.4 s alone here: the default 500 ms target is out of reach
FIFO_FRONTEND = {"batchSize": 8, "maxBatchDelay": 20, "minWorkers": 1, "maxWorkers": 1, **frontend_keys("default")}
WORDS = ("the a ship sea story about old harbour captain storm night light city river market train winter "
         "question answer model server request batch token length prompt reply quick brown fox").split()


def asks(count: int, long_share: float, seed: int) -> list[tuple[str, bytes]]:
    """(kind, JSON body): prompts of 3-40 words; a `long_share` of them ask for 256 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        kind = "long" if rng.random() < long_share else "short"
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
        out.append((kind, json.dumps({"text": text, "max_new_tokens": LONG_ASK if kind == "long" else SHORT_ASK}).encode()))
    return out


def window(url: str, rate: float, seconds: float, long_share: float, seed: int) -> dict:
    arrivals = poisson_arrivals(rate, seconds, seed)
    work = asks(len(arrivals), long_share, seed)

    async def send(item, _at):
        kind, body = item
        return kind, await shoot(url, body, "application/json", timeout=120)

    shots = asyncio.run(at_arrivals(work, arrivals, send))
    out = {"sent": len(shots), "load_average": load_average()}
    for kind in ("short", "long"):
        ok = [s.latency * 1000 for k, s in shots if k == kind and s.status == 200]
        out[kind] = {"n": sum(1 for k, _ in shots if k == kind), "ok": len(ok),
                     "latencies_ms": [round(v, 1) for v in ok]}
    return out


def pooled(windows: list[dict], kind: str) -> dict:
    values = [v for w in windows for v in w[kind]["latencies_ms"]]
    return {"n": sum(w[kind]["n"] for w in windows), "ok": len(values),
            **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}}


def build(root: str, model_dir: str) -> dict[str, server.Served]:
    ports = server.free_ports(5)
    store = os.path.join(root, "tsbatch-store")
    subprocess.run([sys.executable, "-m", "tsbatch.archiver", "archive", "--handler", os.path.join(EXAMPLE, "gen_handler.py"),
                    "--extra-files", os.path.join(EXAMPLE, "gen_model.py"), "--handler-config",
                    os.path.join(EXAMPLE, "handler.yaml"), "--model-dir", model_dir, "--name", "gen", "--out", store,
                    "--target-ms", str(TARGET_MS), "--inference-port", str(ports[0]), "--management-port", str(ports[1]),
                    "--metrics-port", str(ports[2]), "--grpc-inference-port", str(ports[3]),
                    "--grpc-management-port", str(ports[4])], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    paths = server.ServerPaths(os.path.join(root, "tsbatch-tmp"), os.path.join(root, "tsbatch-logs"))
    tsbatch = server.Served(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}",
                            f"http://127.0.0.1:{ports[2]}", paths, store, os.path.join(store, "config.properties"))
    fifo_store = os.path.join(root, "fifo-store")
    build_archive(ArchiveSpec(model_dir, "gen", model_config({"torch_threads": 2}, FIFO_FRONTEND), fifo_store,
                              handler="bench/controls/control_generate_fifo.py"))
    return {"tsbatch": tsbatch, "fifo": fifo_store}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--long-share", type=float, default=0.2)
    args = parser.parse_args()
    sys.path.insert(0, EXAMPLE)
    from make_model import make

    root = tempfile.mkdtemp(prefix="tsbatch-generate-")
    model_dir = make(os.path.join(root, "model"))
    built = build(root, model_dir)
    tsbatch = built["tsbatch"]
    server.start(tsbatch.properties, tsbatch.store, tsbatch.paths)
    windows: dict[str, list[dict]] = {"tsbatch": [], "fifo": []}
    try:
        server.wait_ready(tsbatch.management, "gen", 900)
        with server.local_server(os.path.join(root, "fifo"), built["fifo"], ["gen"], timeout=600) as fifo:
            urls = {"tsbatch": f"{tsbatch.inference}/predictions/gen", "fifo": f"{fifo.inference}/predictions/gen"}
            for round_ in range(args.rounds):
                for arm in ("tsbatch", "fifo") if round_ % 2 == 0 else ("fifo", "tsbatch"):
                    result = window(urls[arm], args.rate, args.seconds, args.long_share, seed=round_)
                    windows[arm].append(result)
                    print(arm, round_, {k: pooled([result], k) for k in ("short", "long")}, flush=True)
    finally:
        server.stop(tsbatch.paths)
    report = {"when": utc_now(), "machine": machine(), "rate": args.rate, "seconds": args.seconds,
              "rounds": args.rounds, "long_share": args.long_share, "asks": [SHORT_ASK, LONG_ASK],
              "target_ms": TARGET_MS, "fifo_frontend": FIFO_FRONTEND,
              "arms": {arm: {"short": pooled(w, "short"), "long": pooled(w, "long"), "windows": w}
                       for arm, w in windows.items()}}
    short = {arm: report["arms"][arm]["short"] for arm in windows}
    report["short_p99_ratio"] = round(short["tsbatch"]["p99"] / short["fifo"]["p99"], 3)
    write(os.path.join(REPO, "bench", "results", "generate"), report, markdown(report))


def markdown(r: dict) -> str:
    lines = [f"# Generation: asks for {r['asks'][0]} tokens among asks for {r['asks'][1]}", "",
             f"{r['when']}, {r['machine']}. `python bench/generate.py --rate {r['rate']:g} --seconds "
             f"{r['seconds']:g} --rounds {r['rounds']} --long-share {r['long_share']:g}`: one open-loop Poisson "
             f"schedule per window, windows alternating between the servers, pooled over rounds. Model: "
             f"examples/generate/make_model.py (a tiny random GPT-2), greedy.", "",
             "| server | short p50 | short p99 | long p50 | long p99 | short ok / sent | long ok / sent |",
             "|---|---|---|---|---|---|---|"]
    names = {"tsbatch": f"tsbatch (examples/generate, handler.yaml, tuned for {r['target_ms']} ms)",
             "fifo": "control: TorchServe batching (batchSize 8, maxBatchDelay 20), one generate() per batch"}
    for arm, data in r["arms"].items():
        s, l = data["short"], data["long"]
        lines.append(f"| {names[arm]} | {s['p50']:.0f} | {s['p99']:.0f} | {l['p50']:.0f} | {l['p99']:.0f} | "
                     f"{s['ok']} / {s['n']} | {l['ok']} / {l['n']} |")
    lines += ["", f"Short-ask p99, tsbatch / control: **{r['short_p99_ratio']}** (the issue asks for at most 0.333).",
              "Load average per window: " + ", ".join(str(w["load_average"]) for a in r["arms"].values()
                                                       for w in a["windows"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
