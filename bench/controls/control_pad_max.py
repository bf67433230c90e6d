"""CONTROL (a), not tsbatch: batches like TorchServe's stock Hugging Face example handler.

Every request is padded to max_length, the frontend's batch runs first come first served as one
pass, and any exception fails the whole batch. The stock example itself cannot run on today's
transformers (it passes `pad_to_max_length`); this reproduces its batching with today's API.
"""
import json
import os

import torch
from transformers import AutoModel, AutoTokenizer


class ControlPadToMaxLength:
    padding = "max_length"

    def initialize(self, context):
        model_dir = os.path.join(context.system_properties["model_dir"], "model")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModel.from_pretrained(model_dir, local_files_only=True, use_safetensors=True).eval()
        self.max_length = 256
        threads = ((context.model_yaml_config or {}).get("handler") or {}).get("torch_threads")
        if threads:  # several workers on few cores: one OpenMP team each, no oversubscription
            torch.set_num_threads(threads)
        self.initialized = True

    def handle(self, data, context):
        texts = []
        for row in data:
            value = row.get("body") if row.get("body") is not None else row.get("data")
            if isinstance(value, (bytes, bytearray)):
                value = value.decode("utf-8")
            if isinstance(value, dict):
                value = value["text"]
            texts.append(value)
        inputs = self.tokenizer(texts, padding=self.padding, truncation=True,
                                max_length=self.max_length, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**inputs).last_hidden_state
        mask = inputs["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        vectors = torch.nn.functional.normalize(pooled, dim=1).tolist()
        real = inputs["attention_mask"].sum(1).tolist()
        padded = str(inputs["input_ids"].shape[1])
        for i in range(len(texts)):
            context.set_response_header(i, "x-tsbatch-padded-to", padded)
            context.set_response_header(i, "x-tsbatch-batch-size", str(len(texts)))
        return [json.dumps({"embedding": v, "tokens": int(n)}) for v, n in zip(vectors, real)]
