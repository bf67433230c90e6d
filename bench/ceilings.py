"""The in-process ceilings of make bench and make bench-saturation: what the model does on this
machine with no HTTP and no TorchServe, the worker's torch threads (or every core), passes back to
back, on the same texts: sorted by length and batched under a 4,096-token padded budget (the best
this model does here), and at the served archive's own shapes (its bucket edges and batch caps,
plan_batches): the honest ceiling for what the archive may form. The worker runs the model traced
(handlers/models/encoder.py); the sorted ceiling can also be taken eager, as an outside in-process
measurement of the model would run it.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

BUDGET = 4096  # padded tokens per pass of the sorted ceiling
THREADS = len(os.sched_getaffinity(0))  # torch threads of the ceilings unless the archive sets its own


def ceilings(model_dir: str, section: dict, texts: list[str], seconds: float, eager: bool = False) -> dict:
    """Requests/s and real tokens/s of the model alone, at two sets of shapes (see the module doc);
    `eager`: the sorted ones also as an outside in-process measurement of the model would run it."""
    from tsbatch.handlers.core.buckets import Batch, Item, bucket_for, plan_batches
    from tsbatch.handlers.edge.config import HandlerConfig
    from tsbatch.handlers.models.encoder import EncoderModel

    config = HandlerConfig.from_yaml({**section, "torch_threads": section.get("torch_threads") or THREADS})
    runner = EncoderModel(config, model_dir)
    edges = config.edges_for(runner.max_length)
    items = []
    for i, text in enumerate(texts):
        tokens, enc = runner.tokenize(text)
        items.append(Item(i, text, tokens, bucket_for(tokens, edges), enc))
    ordered, sorted_batches, group = sorted(items, key=lambda it: it.length), [], []
    for item in ordered:
        if group and item.length * (len(group) + 1) > BUDGET:
            sorted_batches.append(Batch(group[-1].length, tuple(group)))
            group = []
        group.append(item)
    sorted_batches.append(Batch(group[-1].length, tuple(group)))
    shapes = {"sorted": (f"sorted by length, up to {BUDGET} padded tokens a pass", runner, sorted_batches),
              "served": ("the archive's bucket edges and batch caps (plan_batches)", runner,
                         plan_batches(items, config.batch_limit))}
    if eager and runner.traced is not None:  # the trace the worker runs (handlers/models/encoder.py), and the model without it
        shapes["sorted_eager"] = ("sorted as above, the model eager (no trace)",
                                  EncoderModel(replace(config, trace=False), model_dir), sorted_batches)
    out = {}
    for name, (label, runner, batches) in shapes.items():
        runner.forward(batches[0])
        done, real, start = 0, 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for batch in batches:
                runner.forward(batch)
                done, real = done + batch.size, real + batch.real_tokens
        elapsed = time.perf_counter() - start
        padded = sum(b.padded_tokens for b in batches)
        out[name] = {"req_per_s": round(done / elapsed, 1), "real_tokens_per_s": round(real / elapsed, 1),
                     "passes": len(batches), "padding": round(1 - sum(b.real_tokens for b in batches) / padded, 3),
                     "shapes": label}
    return out
