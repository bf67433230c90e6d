"""`make gpu-check`: every CUDA path of tsbatch on one GPU, in process, one command, minutes.

Runs the steps (a)-(f) of bench/gpu_steps.py with the built-in encoder on CUDA (the default model,
or --model-dir) and writes bench/results/gpu-DATE.md (and .json) naming the GPU; exit status 1 if a
check failed. Where torch sees no CUDA device (or with --dry-run) it runs a dry run: every step's
code on the CPU at tiny sizes (a tiny random model, two buckets, fault injection in place of the
allocator's out of memory), its report in a temporary directory, never in bench/results. CI runs it
(tests/integration/test_dtype_graphs.py).

In process only: TorchServe's Java frontend is not started (the served HTTP runs are `make bench`).
A GPU machine needs torch with CUDA, transformers, tokenizers, safetensors and nvidia-ml-py; it may
carry in (under 64 MiB) TorchServe's Python package `ts` without frontend/ (1.5 MiB) on PYTHONPATH
and the model directory (the default model in float16 is 45 MiB) via --model-dir. Nothing is fetched.

    python bench/gpu_check.py [--dry-run] [--model-dir DIR] [--out DIR] [--steps a_warmup_and_graphs,...]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.gpu_steps import STEPS, TOLERANCE, Setup  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402
from bench.loadtest.workload import Mix, make_requests  # noqa: E402


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
