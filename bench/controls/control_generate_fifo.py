"""CONTROL (generation), not tsbatch: what a careful engineer writes with TorchServe's batching.

The frontend's batch (first come, first served, batchSize / maxBatchDelay) runs as one greedy
`generate()`: prompts left-padded to the longest, as many new tokens as the batch's largest ask,
each answer cut to its own ask (and its first end-of-sequence token). Any exception fails the
whole batch. Same answers as examples/generate, different batching.
"""
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


class ControlGenerateFifo:
    def initialize(self, context):
        model_dir = os.path.join(context.system_properties["model_dir"], "model")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.lm = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, use_safetensors=True).eval()
        self.pad_id = self.tokenizer.pad_token_id or 0
        eos = self.lm.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        threads = ((context.model_yaml_config or {}).get("handler") or {}).get("torch_threads")
        if threads:
            torch.set_num_threads(threads)
        self.initialized = True

    def handle(self, data, context):
        asks = []
        for row in data:
            value = row.get("body") if row.get("body") is not None else row.get("data")
            if isinstance(value, (bytes, bytearray)):
                value = json.loads(value)
            ids = self.tokenizer(value["text"], add_special_tokens=False)["input_ids"]
            asks.append((ids, int(value.get("max_new_tokens", 16))))
        longest = max(len(ids) for ids, _ in asks)
        ids = torch.full((len(asks), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(asks), longest), dtype=torch.long)
        for row, (prompt, _) in enumerate(asks):
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        with torch.inference_mode():
            out = self.lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(n for _, n in asks),
                                   do_sample=False, pad_token_id=self.pad_id)
        answers = []
        for row, (_, new) in enumerate(asks):
            generated = out[row, longest: longest + new].tolist()
            ends = [i for i, token in enumerate(generated) if token in self.eos_ids]
            generated = generated[: ends[0]] if ends else generated
            context.set_response_header(row, "x-tsbatch-batch-size", str(len(asks)))
            answers.append(json.dumps({"generated_text": self.tokenizer.decode(generated, skip_special_tokens=True),
                                       "new_tokens": len(generated)}))
        return answers
