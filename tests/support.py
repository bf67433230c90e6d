"""Test support: TorchServe-shaped contexts and tiny random models built from a config."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

TINY_LABELS = {
    "sequence_classification": ["NEGATIVE", "POSITIVE"],
    "token_classification": ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"],
}
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def make_context(model_dir: str, handler: dict, batch_size: int = 8, name: str = "m"):
    """A real ts.context.Context, as TorchServe's worker builds it, with our handler: section."""
    from ts.context import Context
    from ts.metrics.metrics_store import MetricsStore

    return Context(name, model_dir, {"model": {}}, batch_size, None, "0.12.0",
                   metrics=MetricsStore(uuid.uuid4(), name), model_yaml_config={"handler": handler})


def load_handler(model_dir: str, **handler):
    """An EncoderHandler initialized on a TorchServe-shaped context; warmup off unless asked
    (warmup has its own tests and would slow the rest)."""
    from handlers.encoder_handler import EncoderHandler

    handler = {"task": "embedding", "model_dir": model_dir, "warmup": False, **handler}
    context = make_context(model_dir, handler)
    loaded = EncoderHandler()
    loaded.initialize(context)
    return loaded, context


@dataclass
class Reply:
    status: int
    body: dict
    headers: dict


def call(handler, context, payloads: Sequence[Any], content_type: str = "text/plain") -> list[Reply]:
    """Run one TorchServe batch through handler.handle, as the worker's service would."""
    from ts.context import RequestProcessor

    rows, processors = [], []
    for payload in payloads:
        ct = content_type
        if isinstance(payload, tuple):
            payload, ct = payload
        rows.append({"body": payload})
        processors.append(RequestProcessor({"body": {"content-type": ct}}))
    context.request_processor = processors
    context.request_ids = {i: f"req-{i}" for i in range(len(rows))}
    bodies = handler.handle(rows, context)
    if len(bodies) != len(rows):
        raise AssertionError(f"handler returned {len(bodies)} bodies for {len(rows)} requests")
    replies = []
    for i, body in enumerate(bodies):
        status, _phrase = context.get_response_status(i)
        replies.append(Reply(status, json.loads(body), context.get_response_headers(i)))
    return replies


def build_tiny_model(path: str, task: str, source_dir: str, seed: int = 0) -> str:
    """A 2-layer random BERT with the default model's tokenizer, saved as safetensors."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, BertConfig

    labels = TINY_LABELS[task]
    config = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=512,
        id2label=dict(enumerate(labels)), label2id={l: i for i, l in enumerate(labels)},
    )
    torch.manual_seed(seed)
    cls = AutoModelForSequenceClassification if task == "sequence_classification" else AutoModelForTokenClassification
    model = cls.from_config(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(source_dir, name), os.path.join(path, name))
    return path


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na = sum(x * x for x in a) ** 0.5
    nb = sum(y * y for y in b) ** 0.5
    return dot / (na * nb)
