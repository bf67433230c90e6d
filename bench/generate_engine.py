"""The generation engine's throughput in process, no server: asks of bench-generate's mix, all
submitted at once, stepped until every one is answered; output tokens/s per repeat.

    python bench/generate_engine.py [--asks 96] [--repeats 2] [--max-running 16] [--token-budget 512]

What it isolates: the engine and the runner (KV-cache handling, prefill and decode), without the
frontend, the protocol or arrival times (make bench-generate measures those).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.generate_arms import make_lm  # noqa: E402
from bench.generate_mix import draw, make_pool  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--asks", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from tsbatch.handlers.core.generation_policy import GenerationPolicy, GenerationRequest
    from tsbatch.handlers.edge.generation_api import GenerationConfig
    from tsbatch.handlers.models.generation_runner import GenerationRunner
    from tsbatch.handlers.runtime.generation_engine import GenerationEngine
    from tsbatch.warmup.generation_profile import prefill_edges

    torch.set_num_threads(args.threads)
    runner = GenerationRunner(make_lm(tempfile.mkdtemp()))
    settings = GenerationConfig.from_section({}).settings(None, prefill_edges(runner.max_positions))
    settings = dataclasses.replace(settings, queue_cap=args.asks, max_running=args.max_running,
                                   token_budget=args.token_budget)
    asks = draw(make_pool(64, 0.15), args.asks, 1)
    for repeat in range(args.repeats):
        engine = GenerationEngine(GenerationPolicy(settings), runner)
        seqs = [engine.submit(GenerationRequest(str(i), tuple(runner.encode(a.text)), a.new_tokens, time.monotonic()))
                for i, a in enumerate(asks)]
        started = time.perf_counter()
        while engine.step() is not None:
            pass
        seconds = time.perf_counter() - started
        tokens = sum(len(seq.tokens) for seq in seqs)
        print(f"repeat {repeat + 1}: {len(asks)} asks, {tokens} output tokens in {seconds:.1f} s: "
              f"{tokens / seconds:.0f} tokens/s over {engine.steps} steps")


if __name__ == "__main__":
    main()
