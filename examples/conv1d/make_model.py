"""Write a random ConvNet model directory (config.json + model.safetensors): no download needed.

    python examples/conv1d/make_model.py OUT_DIR [--max-length 512] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def make(out: str, max_length: int = 512, channels: int = 16, seed: int = 0) -> str:
    import torch
    from safetensors.torch import save_file

    from conv_model import ConvNet

    labels = ["calm", "noisy", "spiky"]
    torch.manual_seed(seed)
    net = ConvNet(channels, len(labels))
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"max_length": max_length, "channels": channels, "labels": labels}, f)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make(args.out, args.max_length, seed=args.seed))
