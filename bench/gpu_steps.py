"""The steps of `make gpu-check` (bench/gpu_check.py), each on the handler as a TorchServe worker loads it.

  (a) warmup: first pass after READY against the steady median per shape, CUDA graphs off and on;
      with graphs on against off, a short pass's p50 and the served peak of device memory;
  (b) real out of memory: a memory_budget the long shapes do not fit; caps learned at warmup, kept
      in oom_caps.json, every request answered (200, or 507);
  (c) the handler's NVML sampler, real values;
  (d) float16 and bfloat16 within tolerance of float32 (cosine);
  (e) the scheduler (continuous mode) against the in-process ceilings (bench/ceilings.py);
  (f) the first-come control (bench/controls/control_pad_longest.py).
Kept apart from the CLI (report, dry-run switch) so each module stays small; a Setup carries the
device and sizes, so the same step code runs on a GPU and in the CPU dry run.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "controls"))

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


# -- the handler as a worker loads it

def load(setup: Setup, name: str, frontend: dict | None = None, **handler):
    """An EncoderHandler initialized in its own archive directory (caps and profile apart)."""
    from tsbatch.handlers.models.encoder_handler import EncoderHandler
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
    from tsbatch.handlers.runtime.warming import example_batch
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
    # on the GPU every warmed shape has a graph; on the CPU graphs are off (handlers/models/encoder.py says so in the log)
    ok = (on is None) if setup.device == "cpu" else (on is not None and on["captured"] == len(arms["graphs on"]["shapes"]))
    return {"ok": ok, "arms": arms}


def step_oom(setup: Setup) -> dict:
    """(b) a budget the long shapes do not fit: caps learned at warmup, kept, every request answered."""
    from tsbatch.handlers.runtime.memory import OOM_CAPS_FILE

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
    from tsbatch.handlers.edge.metrics import nvml_sampler

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

    from tsbatch.handlers.edge.config import HandlerConfig
    from tsbatch.handlers.models.encoder import EncoderModel
    from tsbatch.handlers.runtime.warming import example_batch

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
