"""Text generation with a causal LM, served with tsbatch: greedy `generate()` per request.

Each request names how many tokens it wants (`max_new_tokens`); a pass costs about as many decode
steps as its largest ask, so a request for 8 tokens sharing a pass with one for 256 would wait for
all 256. The length tsbatch buckets by is therefore two sizes, (prompt tokens, max_new_tokens):
a pass holds prompts padded to one prompt edge that all ask for new tokens up to one edge. Any
local causal-LM directory with safetensors weights and a tokenizer serves (`make_model.py` writes
a tiny random one for tests).

Requests: JSON {"text": "...", "max_new_tokens": 8} (max_new_tokens optional), or plain text.
Answer: {"generated_text": "...", "new_tokens": n}, the same as the request gets served alone
(prompts are left-padded and masked, decoding is greedy).
"""
from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tsbatch.handlers.api import BadInput, Batch, Model, Request
from tsbatch.handlers.models.threads import use_intra_op_threads

DEFAULT_NEW_TOKENS = 16


class GenerationModel(Model):
    """The tsbatch Model for a causal LM: prepare, forward, example."""

    def __init__(self, model_dir: str, device: str = "cpu", max_prompt_tokens: int = 128,
                 max_new_tokens: int = 256):
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.lm = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).to(self.device).eval()
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:  # many causal LMs have none; padding is masked out anyway
            self.pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        eos = self.lm.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.max_length = (max_prompt_tokens, max_new_tokens)

    def prepare(self, request: Request) -> tuple[tuple[int, int], tuple[list[int], int]]:
        body = request.body
        new_tokens = DEFAULT_NEW_TOKENS
        if isinstance(body, (bytes, bytearray)):
            body = body.decode("utf-8", errors="strict") if body else ""
        if isinstance(body, str) and body.lstrip().startswith("{"):
            try:
                body = json.loads(body)
            except ValueError:
                raise BadInput('send JSON {"text": "...", "max_new_tokens": N} or plain text') from None
        if isinstance(body, dict):
            new_tokens = body.get("max_new_tokens", DEFAULT_NEW_TOKENS)
            body = body.get("text")
        if not isinstance(body, str) or not body.strip():
            raise BadInput('send JSON {"text": "...", "max_new_tokens": N} with a non-empty text')
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or not 1 <= new_tokens <= self.max_length[1]:
            raise BadInput(f"max_new_tokens must be a whole number from 1 to {self.max_length[1]}, got {new_tokens!r}")
        ids = self.tokenizer(body, add_special_tokens=False)["input_ids"]
        if not ids:
            raise BadInput("the text has no tokens")
        return (len(ids), new_tokens), (ids, new_tokens)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> list:
        prompt_edge, _ = batch.bucket
        rows = [item.input for item in batch.items]
        ids = torch.full((len(rows), prompt_edge), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), prompt_edge), dtype=torch.long)
        for row, (prompt, _) in enumerate(rows):  # left padding: every prompt ends where generation starts
            ids[row, prompt_edge - len(prompt):] = torch.tensor(prompt)
            mask[row, prompt_edge - len(prompt):] = 1
        most = max(new for _, new in rows)
        out = self.lm.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                               max_new_tokens=most, do_sample=False, pad_token_id=self.pad_id)
        results = []
        for row, (_, new) in enumerate(rows):
            generated = out[row, prompt_edge: prompt_edge + new].tolist()
            ends = [i for i, token in enumerate(generated) if token in self.eos_ids]
            generated = generated[: ends[0]] if ends else generated  # a row served alone stops there too
            results.append({"generated_text": self.tokenizer.decode(generated, skip_special_tokens=True),
                            "new_tokens": len(generated)})
        return results

    def example(self, length: tuple[int, int]) -> tuple[list[int], int]:
        prompt, new_tokens = length
        token = self.tokenizer("hello", add_special_tokens=False)["input_ids"][:1] or [self.pad_id]
        return token * prompt, new_tokens

    def describe(self) -> dict:
        return {"device": str(self.device), "max_length": list(self.max_length), "model": type(self.lm).__name__,
                "torch_threads": torch.get_num_threads(), "torch": torch.__version__}

    def use_threads(self, count: int, background: bool = False) -> None:
        use_intra_op_threads(count)  # a bare torch.set_num_threads on a lane does not stay set
