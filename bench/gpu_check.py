"""`make gpu-check`: every CUDA path of tsbatch on one GPU, in process, one command, minutes.

With the built-in encoder on CUDA (the default model, or --model-dir), the handler loaded as a
TorchServe worker loads it (initialize() on a TorchServe-shaped context):
  (a) warmup: every shape, its first pass after READY against its steady median, graphs off and on;
      with graphs on against off: a short pass's p50 and the served peak of device memory;
  (b) real out of memory: a memory_budget measured to fit the short shapes and not the long ones;
      the caps learned at warmup, kept in oom_caps.json, and a served mix where every request is
      answered (200, or 507 for a bucket not even one request of fits);
  (c) NVML metrics: the handler's sampler, real values;
  (d) float16 and bfloat16 answers within tolerance of float32 (cosine);
  (e) the scheduler (continuous mode, frontend played in process) against the in-process ceilings
      (bench/ceilings.py) on the same GPU and texts;
  (f) the first-come control (bench/controls/control_pad_longest.py) on the same GPU and texts.
Writes bench/results/gpu-DATE.md (and .json) naming the GPU; exit status 1 if a check failed.

Where torch sees no CUDA device (or with --dry-run) it runs a dry run: every step's code on the
CPU at tiny sizes (a tiny random model, two buckets, fault injection in place of the allocator's
out of memory), its report in a temporary directory, never in bench/results. CI runs it
(tests/integration/test_dtype_graphs.py).

This is the in-process half: nothing here starts TorchServe's Java frontend, so the served runs
through HTTP (make bench) are not part of it. A GPU machine needs torch with CUDA, transformers,
tokenizers, safetensors and nvidia-ml-py installed; what it may lack can be carried in (under
64 MiB): TorchServe's Python package `ts` without its frontend/ folder (1.5 MiB: the handler's
context and metrics store) on PYTHONPATH, and the model as a directory (the default model's
weights in float16 are 45 MiB) given by --model-dir. Nothing is fetched.

    python bench/gpu_check.py [--dry-run] [--model-dir DIR] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench", "controls"))

from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.workload import Mix, make_requests  # noqa: E402
from tsbatch.warmup.profile import percentile  # noqa: E402

TOLERANCE = {"bfloat16": 0.999, "float16": 0.9999}  # cosine to float32, at least (as the CPU test)
GRAPH_ON_OFF = {"graphs off": False, "graphs on": True}


@dataclass
class Setup:
    """What one run uses: where the model is, the device, its shapes and how much of everything."""

    model_dir: str
    device: str  # "cuda" or "cpu"
    section: dict  # the handler: section every step starts from
    texts: list[str]
    steady_runs: int
    short_runs: int
    ceiling_seconds: float
    control_batch: int
    work: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="tsbatch-gpu-check-"))
    dry_run: bool = False


def gpu_setup(model_dir: str | None) -> Setup:
    from tsbatch.archiver.cli import default_model_dir

    texts = [r.text for r in make_requests(400, Mix(), seed=7)]
    return Setup(model_dir or default_model_dir(), "cuda", {"task": "embedding", "device": "cuda"}, texts,
                 steady_runs=7, short_runs=200, ceiling_seconds=5.0, control_batch=8)


def dry_setup() -> Setup:
    """Tiny sizes on the CPU: a 2-layer random BERT with the default model's tokenizer."""
    from tests.support import TOKENIZER_FILES
    from tsbatch.archiver.cli import default_model_dir

    work = tempfile.mkdtemp(prefix="tsbatch-gpu-check-")
    model_dir = os.path.join(work, "tiny")
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=64)).save_pretrained(model_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(default_model_dir(), name), os.path.join(model_dir, name))
    section = {"task": "embedding", "device": "cpu", "buckets": [16, 32], "max_length": 32, "max_batch_size": 2,
               "max_batch_tokens": 64, "warmup_repeats": 1, "warmup_max_repeats": 1, "torch_threads": 1}
    texts = [r.text for r in make_requests(12, Mix(0.3, 8, 24, 20, 28), seed=7)]  # all within 32 tokens
    return Setup(model_dir, "cpu", section, texts, steady_runs=2, short_runs=5, ceiling_seconds=0.2,
                 control_batch=4, work=work, dry_run=True)


# -- the handler as a worker loads it

def load(setup: Setup, name: str, frontend: dict | None = None, **handler):
    """An EncoderHandler initialized in its own archive directory (caps and profile apart)."""
    from tsbatch.handlers.encoder_handler import EncoderHandler
    from tests.support import make_context

    root = os.path.join(setup.work, name)
    os.makedirs(root, exist_ok=True)
    if not os.path.exists(os.path.join(root, "model")):
        os.symlink(setup.model_dir, os.path.join(root, "model"))
    context = make_context(root, {**setup.section, **handler}, frontend=frontend, name="minilm")
    context.model_yaml_config["startupTimeout"] = 3600
    loaded = EncoderHandler()
    loaded.initialize(context)
    return loaded, context, root


def served(handler, context, texts: list[str], batch: int = 8):
    """The texts through handle() in TorchServe batches of `batch` (default mode)."""
    from tests.support import call

    replies = []
    for start in range(0, len(texts), batch):
        replies += call(handler, context, texts[start:start + batch])
    return replies


def timed_ms(run, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return times


# -- the steps: each returns its figures and "ok"

def step_warmup(setup: Setup) -> dict:
    """(a) and graphs on/off: first pass after READY vs steady state per shape; short p50; served peak."""
    from tsbatch.handlers.warming import example_batch
    from tsbatch.warmup.plan import plan_shapes

    arms = {}
    for arm, graphs in GRAPH_ON_OFF.items():
        handler, context, _ = load(setup, f"warm-{'on' if graphs else 'off'}", warmup=True, cuda_graphs=graphs)
        model = handler.model
        shapes = []
        for shape in plan_shapes(handler.edges, handler.worker.batch_sizes):
            batch = example_batch(model, shape.batch, shape.bucket)
            first = timed_ms(lambda: model.forward(batch), 1)[0]
            steady = statistics.median(timed_ms(lambda: model.forward(batch), setup.steady_runs))
            shapes.append({"batch": shape.batch, "bucket": shape.bucket, "first_ms": round(first, 3),
                           "steady_ms": round(steady, 3), "ratio": round(first / steady, 2)})
        short = example_batch(model, 1, handler.edges[0])
        p50 = percentile(timed_ms(lambda: model.forward(short), setup.short_runs), 50)
        peak = _device_peak(lambda: served(handler, context, setup.texts), setup.device)
        graphs_record = model.graphs.book.summary() if model.graphs is not None else None
        arms[arm] = {"shapes": shapes, "short_p50_ms": round(p50, 3), "served_peak_bytes": peak,
                     "graphs": graphs_record, "worst_ratio": max(s["ratio"] for s in shapes)}
        handler.close()
        del handler, model
    on = arms["graphs on"]["graphs"]
    # on the GPU every warmed shape has a graph; on the CPU graphs are off (runner.py says so in the log)
    ok = (on is None) if setup.device == "cpu" else (on is not None and on["captured"] == len(arms["graphs on"]["shapes"]))
    return {"ok": ok, "arms": arms}


def step_oom(setup: Setup) -> dict:
    """(b) a budget the long shapes do not fit: caps learned at warmup, kept, every request answered."""
    from tsbatch.handlers.memory import OOM_CAPS_FILE

    if setup.device == "cuda":
        budget = _budget_between_short_and_long(setup)
        extra = {"memory_budget": budget}
    else:  # nothing enforces a budget on the CPU: the fault seam raises out of memory past 32 tokens a pass
        budget, extra = None, {"fault_injection": {"oom_above_tokens": 32}}
    try:
        handler, context, root = load(setup, "oom", warmup=True, **extra)
        caps_file = os.path.join(root, OOM_CAPS_FILE)
        kept = json.load(open(caps_file))["caps"] if os.path.exists(caps_file) else {}
        replies = served(handler, context, setup.texts)
        statuses = {str(s): sum(r.status == s for r in replies) for s in sorted({r.status for r in replies})}
        learned = {str(k): v for k, v in handler.profile.oom_caps.items()}
        handler.close()
    finally:
        if setup.device == "cuda":
            import torch

            torch.cuda.set_per_process_memory_fraction(1.0)
            torch.cuda.empty_cache()
    answered = len(replies) == len(setup.texts) and set(statuses) <= {"200", "507"}
    return {"ok": bool(learned) and kept == learned and answered and statuses.get("200", 0) > 0,
            "memory_budget_bytes": budget, "learned_at_warmup": learned, "oom_caps_json": kept, "statuses": statuses}


def step_nvml(setup: Setup) -> dict:
    """(c) the handler's NVML sampler on this GPU: memory used and total, utilization."""
    from tsbatch.handlers.metrics import nvml_sampler

    sampler = nvml_sampler([0])
    if sampler is None:
        return {"ok": setup.device == "cpu", "samples": None, "why": "no NVIDIA driver or nvidia-ml-py here"}
    samples = [{"device": d, "used_bytes": u, "total_bytes": t, "utilization": b} for d, u, t, b in sampler()]
    ok = all(s["total_bytes"] > 0 and 0 < s["used_bytes"] <= s["total_bytes"] and 0 <= s["utilization"] <= 1
             for s in samples)
    return {"ok": ok and bool(samples), "samples": samples}


def step_dtypes(setup: Setup) -> dict:
    """(d) float16 and bfloat16 against float32: cosine of every text's embedding."""
    from tests.support import cosine

    texts = setup.texts[:64]
    answers = {}
    for dtype in ("float32", "float16", "bfloat16"):
        handler, context, _ = load(setup, f"dtype-{dtype}", dtype=dtype, warmup=False)
        answers[dtype] = [r.body.get("embedding") for r in served(handler, context, texts)]
        handler.close()
    out = {}
    for dtype, floor in TOLERANCE.items():
        cos = [cosine(a, b) for a, b in zip(answers[dtype], answers["float32"])]
        out[dtype] = {"min_cosine": round(min(cos), 6), "median_cosine": round(statistics.median(cos), 6),
                      "tolerance": floor, "ok": min(cos) >= floor}
    return {"ok": all(d["ok"] for d in out.values()), **out}


def step_throughput(setup: Setup) -> dict:
    """(e) the scheduler (continuous mode) against the in-process ceilings, the same texts and GPU."""
    from bench.ceilings import ceilings
    from tests.support import ContinuousFrontend

    ceiling = ceilings(setup.model_dir, setup.section, setup.texts, setup.ceiling_seconds)
    handler, context, _ = load(setup, "scheduler", frontend={"continuousBatching": True}, warmup=True)
    frontend = ContinuousFrontend(handler, context)
    for i, text in enumerate(setup.texts):  # every request at once: the worker saturated
        frontend.submit(f"r{i}", text)
    started = time.perf_counter()
    replies = frontend.drain()
    seconds = time.perf_counter() - started
    handler.close()
    rate = len(replies) / seconds
    ok = len(replies) == len(setup.texts) and all(r.status == 200 for r in replies.values())
    return {"ok": ok, "scheduler_req_per_s": round(rate, 1), "ceilings": ceiling,
            "over_served_ceiling": round(rate / ceiling["served"]["req_per_s"], 3)}


def step_control(setup: Setup) -> dict:
    """(f) the first-come control: frontend batches of `control_batch` in arrival order, each padded
    to its longest, its own code with its tensors on the same device."""
    from control_pad_longest import ControlPadToLongest
    from tests.support import call, make_context

    root = os.path.join(setup.work, "control")
    os.makedirs(root, exist_ok=True)
    if not os.path.exists(os.path.join(root, "model")):
        os.symlink(setup.model_dir, os.path.join(root, "model"))
    context = make_context(root, {"torch_threads": setup.section.get("torch_threads")})
    control = ControlPadToLongest()
    control.initialize(context)
    control.model.to(setup.device)
    control.tokenizer = _OnDevice(control.tokenizer, setup.device)
    call(control, context, setup.texts[:setup.control_batch])  # its first pass, as warmup would have run
    started = time.perf_counter()
    answered = 0
    for start in range(0, len(setup.texts), setup.control_batch):
        answered += sum(r.status == 200 for r in call(control, context, setup.texts[start:start + setup.control_batch]))
    seconds = time.perf_counter() - started
    return {"ok": answered == len(setup.texts), "control_req_per_s": round(answered / seconds, 1),
            "batch": setup.control_batch}


STEPS = {"a_warmup_and_graphs": step_warmup, "c_nvml": step_nvml, "d_dtypes": step_dtypes,
         "e_throughput": step_throughput, "f_control": step_control, "b_out_of_memory": step_oom}


class _OnDevice:
    """The control's tokenizer with its tensors moved to the device the control's model is on."""

    def __init__(self, tokenizer, device: str):
        self.tokenizer, self.device = tokenizer, device

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs).to(self.device)


def _device_peak(run, device: str) -> int | None:
    """Peak device memory reserved while `run` runs (None on the CPU)."""
    if device != "cuda":
        run()
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_reserved())


def _budget_between_short_and_long(setup: Setup) -> int:
    """Bytes that hold the model and the shortest bucket's largest batch but not the longest
    bucket's: measured on a probe of the same model, freed before the handler loads."""
    import torch

    from tsbatch.handlers.config import HandlerConfig
    from tsbatch.handlers.runner import EncoderModel
    from tsbatch.handlers.warming import example_batch

    config = HandlerConfig.from_yaml({**setup.section, "trace": False})
    probe = EncoderModel(config, setup.model_dir)
    edges = config.edges_for(probe.max_length)
    peaks = []
    for bucket in (edges[0], edges[-1]):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        probe.forward(example_batch(probe, config.batch_limit(bucket), bucket))
        peaks.append(torch.cuda.max_memory_reserved())
    del probe
    torch.cuda.empty_cache()
    return int(peaks[0] + (peaks[1] - peaks[0]) * 0.4)


def gpu_name(device: str) -> str:
    if device != "cuda":
        return "none (CPU dry run)"
    import torch

    props = torch.cuda.get_device_properties(0)
    return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"


def markdown(report: dict) -> str:
    steps = report["steps"]
    lines = [f"# GPU check ({report['when']}, {report['gpu']})", "",
             f"Command: `{report['command']}`. In process, the built-in encoder ({report['model']}); "
             f"torch {report['torch']}.{' DRY RUN on the CPU: no GPU figures.' if report['dry_run'] else ''}", "",
             "| step | ok | seconds |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if step.get('ok') else 'NO: ' + step.get('error', 'see below')} | {step.get('seconds')} |"
              for name, step in steps.items()]
    arms = steps.get("a_warmup_and_graphs", {}).get("arms")
    if arms:
        lines += ["", "## (a) warmup, and CUDA graphs on against off", "",
                  "| arm | shapes | worst first/steady | short pass p50 ms | served peak MiB | graphs |", "|---|---|---|---|---|---|"]
        for arm, r in arms.items():
            peak = "" if r["served_peak_bytes"] is None else f"{r['served_peak_bytes'] / 2**20:.0f}"
            graphs = "off" if r["graphs"] is None else (f"{r['graphs']['captured']} captured, "
                                                        f"{r['graphs']['held_bytes'] / 2**20:.0f} MiB, "
                                                        f"{len(r['graphs']['eager'])} eager {r['graphs']['eager'] or ''}")
            lines.append(f"| {arm} | {len(r['shapes'])} | {r['worst_ratio']} | {r['short_p50_ms']} | {peak} | {graphs} |")
        lines += ["", "First pass after READY / steady median, ms, per shape:", "",
                  "| batch x bucket | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
        for i, shape in enumerate(next(iter(arms.values()))["shapes"]):
            cells = [f"{a['shapes'][i]['first_ms']} / {a['shapes'][i]['steady_ms']}" for a in arms.values()]
            lines.append(f"| {shape['batch']} x {shape['bucket']} | " + " | ".join(cells) + " |")
    oom = steps.get("b_out_of_memory", {})
    if "statuses" in oom:
        lines += ["", "## (b) out of memory", "", f"memory_budget {oom['memory_budget_bytes']} bytes; caps learned at "
                  f"warmup {oom['learned_at_warmup']}; oom_caps.json {oom['oom_caps_json']}; served statuses "
                  f"{oom['statuses']}."]
    nvml = steps.get("c_nvml", {})
    if "samples" in nvml:
        lines += ["", "## (c) NVML", "", f"{nvml['samples'] or nvml.get('why')}"]
    dtypes = steps.get("d_dtypes", {})
    if "bfloat16" in dtypes:
        lines += ["", "## (d) half precision against float32 (cosine)", "", "| dtype | min | median | at least |", "|---|---|---|---|"]
        lines += [f"| {d} | {dtypes[d]['min_cosine']} | {dtypes[d]['median_cosine']} | {dtypes[d]['tolerance']} |"
                  for d in TOLERANCE]
    rate, control = steps.get("e_throughput", {}), steps.get("f_control", {})
    if "ceilings" in rate:
        lines += ["", "## (e) and (f) throughput, same texts, same device", "", "| what | req/s |", "|---|---|",
                  f"| tsbatch scheduler (continuous mode, in process) | {rate['scheduler_req_per_s']} |"]
        lines += [f"| ceiling: {c['shapes']} | {c['req_per_s']} |" for c in rate["ceilings"].values()]
        if "control_req_per_s" in control:
            lines.append(f"| first-come control, batches of {control['batch']} padded to their longest | "
                         f"{control['control_req_per_s']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU at tiny sizes, report in a temp dir")
    parser.add_argument("--model-dir", help="a Hugging Face encoder directory (default: the default model)")
    parser.add_argument("--out", help="where the report goes (default: bench/results, or a temp dir for a dry run)")
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated step names")
    args = parser.parse_args(argv)
    import torch
    import transformers

    dry = args.dry_run or not torch.cuda.is_available()
    if dry and args.out and os.path.abspath(args.out) == os.path.abspath(reports.RESULTS):
        raise SystemExit("a dry run never writes into bench/results: give --out another directory")
    setup = dry_setup() if dry else gpu_setup(args.model_dir)
    out = args.out or (setup.work if dry else reports.RESULTS)
    report = {"when": reports.utc_now(), "gpu": gpu_name(setup.device), "dry_run": dry, "torch": torch.__version__,
              "transformers": transformers.__version__, "model": setup.model_dir, "machine": reports.machine(),
              "command": "make gpu-check" + (" GPU_ARGS=--dry-run" if dry else ""), "steps": {}}
    for name in args.steps.split(","):
        started = time.perf_counter()
        try:
            report["steps"][name] = STEPS[name](setup)
        except Exception as error:  # noqa: BLE001 - one step's failure is reported, the others still run
            report["steps"][name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        report["steps"][name]["seconds"] = round(time.perf_counter() - started, 1)
        print(f"{name}: {'ok' if report['steps'][name]['ok'] else 'FAILED'} in {report['steps'][name]['seconds']}s",
              report["steps"][name].get("error", ""), flush=True)
    stem = os.path.join(out, f"gpu-{time.strftime('%Y-%m-%d', time.gmtime())}")
    reports.write(stem, report, markdown(report))
    print(f"report: {stem}.md")
    if os.path.commonpath([os.path.abspath(out), setup.work]) != setup.work:
        shutil.rmtree(setup.work, ignore_errors=True)  # the archives and the tiny model; the report is elsewhere
    return 0 if all(step["ok"] for step in report["steps"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
