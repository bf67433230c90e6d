"""Writes configs/workloads.json: token lengths of 2,000 requests of each `make bench` workload
(bench/loadtest/workload.py), as the default model's tokenizer counts them. The simulator and
`tsbatch tune --workload NAME` read lengths, not texts, so the installed package carries these
instead of the corpus. Run again when a workload changes: `python bench/workloads_file.py`.
"""
from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.loadtest.workload import WORKLOADS, token_counter, workload  # noqa: E402

COUNT, SEED = 2000, 1
OUT = os.path.join(REPO, "configs", "workloads.json")


def main() -> int:
    tokens = token_counter()
    out = {}
    for name, description in WORKLOADS.items():
        requests = workload(name, tokens)(COUNT, SEED)
        out[name] = {"description": description, "tokens": [tokens(r.text) for r in requests]}
    with open(OUT, "w") as f:
        json.dump({"made_by": "python bench/workloads_file.py", "count": COUNT, "seed": SEED, "workloads": out}, f)
        f.write("\n")
    print(f"wrote {OUT}: {COUNT} requests of each of {', '.join(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
