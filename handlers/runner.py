"""The built-in model: Hugging Face encoders, the only module that touches torch and transformers.

A Model of the public API (handlers/api.py) like any team's own: `prepare` tokenizes one request
(so its length is known before batching), `forward` runs one planned Batch as one pass, padded to
the batch's bucket edge, and `example` makes warmup's inputs.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import transformers
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from tsbatch.handlers.api import Model, Request
from tsbatch.handlers.buckets import Batch
from tsbatch.handlers.config import HandlerConfig, Task
from tsbatch.handlers.entities import group_entities
from tsbatch.handlers.errors import ConfigError, InputTooLong
from tsbatch.handlers.isolate import is_out_of_memory

logger = logging.getLogger(__name__)

_MODEL_CLASSES = {
    Task.EMBEDDING: AutoModel,
    Task.SEQUENCE_CLASSIFICATION: AutoModelForSequenceClassification,
    Task.TOKEN_CLASSIFICATION: AutoModelForTokenClassification,
}
_PAD_VALUES = {"attention_mask": 0, "token_type_ids": 0}
# Inputs longer than max_length x this many characters are tokenized from a prefix first (see
# ModelRunner._tokenize_prefix): ordinary text has 4-6 characters per token.
PREFIX_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class Encoding:
    """One request's tokenizer output, unpadded, and its text (entities point into it)."""

    features: dict[str, list[int]]
    offsets: list[tuple[int, int]] | None = None
    text: str = ""


def resolve_device(name: str, gpu_id: int | None = None) -> torch.device:
    """`auto` is the GPU TorchServe assigned this worker (gpu_id), or the CPU when there is none."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device(f"cuda:{gpu_id}" if gpu_id is not None else "cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"handler.device is {name!r} but torch sees no CUDA device")
    return torch.device(name)


def model_max_length(model_path: str, tokenizer, model_config) -> int:
    """The longest input the model takes: sentence-transformers' setting first, as encode() does."""
    limits = []
    st_config = os.path.join(model_path, "sentence_bert_config.json")
    if os.path.exists(st_config):
        with open(st_config) as f:
            st_max = json.load(f).get("max_seq_length")
        if isinstance(st_max, int) and st_max > 0:
            limits.append(st_max)
    positions = getattr(model_config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        limits.append(positions)
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
        limits.append(tok_max)
    if not limits:
        raise ConfigError(f"cannot tell the maximum length of {model_path}: set handler.max_length")
    return min(limits)


class EncoderModel(Model):
    """Loads a Hugging Face encoder from a local directory and runs planned batches on it."""

    def __init__(self, config: HandlerConfig, model_path: str, gpu_id: int | None = None):
        if config.task is None:
            raise ConfigError(f"handler.task is required: one of {[t.value for t in Task]}")
        if not os.path.isdir(model_path):
            raise ConfigError(f"model directory {model_path} does not exist")
        self.config = config
        self.task = config.task
        self.device = resolve_device(config.device, gpu_id)
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        if not getattr(self.tokenizer, "is_fast", False) and self.task is Task.TOKEN_CLASSIFICATION:
            raise ConfigError("token_classification needs a fast tokenizer (tokenizer.json) for offsets")
        model = _MODEL_CLASSES[self.task].from_pretrained(
            model_path, local_files_only=True, use_safetensors=True
        )
        self.model = model.to(self.device, dtype=torch.float32).eval()
        self.compiled = False
        self._graphs_at_ready: int | None = None
        self.recompiles_after_ready = 0  # graphs compiled after READY: shapes warmup missed
        if config.compile:
            # static shapes: bucketing and power-of-two batches make the shape set finite,
            # and warmup compiles every one of them before READY
            self.model = torch.compile(self.model, dynamic=False)
            self.compiled = True
        limit = model_max_length(model_path, self.tokenizer, self.model.config)
        self.max_length = min(config.max_length, limit) if config.max_length else limit
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.id2label = {int(k): v for k, v in (self.model.config.id2label or {}).items()}
        self.traced = self._trace() if config.trace and not config.compile else None

    def _trace(self) -> "_Traced | None":
        """The model traced, kept only if it answers exactly as eager: on the padded batch it was
        traced with, on one of another shape and on one at the longest input (a branch on length
        would show there). A model the tracer cannot follow runs eager."""
        def probe(lengths: Sequence[int]) -> dict[str, torch.Tensor]:
            lengths = [max(2, min(n, self.max_length)) for n in lengths]
            return self._collate([self.example(n) for n in lengths], max(lengths))

        traced_on, checked_on = probe([6, 3]), (probe([11, 4, 2]), probe([self.max_length, 5]))
        try:
            traced = _Traced(self.model, traced_on)
            with torch.inference_mode():
                same = all(torch.equal(traced(inputs), self.model(**inputs)[0]) for inputs in (traced_on, *checked_on))
        except Exception as error:  # noqa: BLE001 - whatever the tracer cannot follow runs eager
            logger.info("tsbatch: the model runs eager, tracing failed: %s", error)
            return None
        if not same:
            logger.info("tsbatch: the model runs eager, its trace answered differently from eager")
            return None
        return traced

    def use_threads(self, count: int, background: bool = False) -> None:
        """Intra-op threads for passes run from the calling thread (each lane has its own OpenMP
        team, so a short pass never queues behind a long one for the same threads). A background
        lane also lowers its OS priority (its team's threads inherit it): under contention the
        short lane, the worker's I/O threads and the frontend run first, the long lane takes what
        is left."""
        torch.set_num_threads(max(1, count))
        if background and hasattr(os, "setpriority"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except OSError as error:
                logger.info("cannot lower the long lane's priority: %s", error)

    def example(self, length: int) -> Encoding:
        """A synthetic request of exactly `length` tokens, as the tokenizer makes it."""
        text = " ".join(["warm"] * (2 * length + 8))
        out = self.tokenizer(text, truncation=True, max_length=length,
                             return_offsets_mapping=self.task is Task.TOKEN_CLASSIFICATION, verbose=False)
        features = {k: list(v) for k, v in out.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        offsets = [tuple(o) for o in out["offset_mapping"]] if "offset_mapping" in out else None
        return Encoding(features, offsets, text)

    def ready(self) -> None:
        """From now on any compilation is a shape warmup missed: remember the count to compare."""
        self._graphs_at_ready = _compiled_graphs() if self.compiled else None

    def _check_recompiled(self, batch: Batch) -> None:
        if self._graphs_at_ready is None:
            return
        graphs = _compiled_graphs()
        if graphs > self._graphs_at_ready:
            self.recompiles_after_ready += graphs - self._graphs_at_ready
            logger.warning("tsbatch: torch.compile recompiled after READY for batch %d x %d tokens "
                           "(a shape warmup did not cover)", batch.size, batch.bucket)
            self._graphs_at_ready = graphs

    def describe(self) -> dict[str, Any]:
        """What the latency profile and logs record about this runner."""
        return {
            "device": str(self.device),
            "dtype": "float32",
            "compile": self.compiled,
            "trace": self.traced is not None,
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "task": self.task.value,
            "max_length": self.max_length,
        }

    # -- prepare: one request -> its token count and unpadded encoding
    def prepare(self, request: Request) -> tuple[int, Encoding]:
        return self.tokenize(request.text())

    def tokenize(self, text: str) -> tuple[int, Encoding]:
        truncate = self.config.truncation
        out = None
        if truncate and len(text) > self.max_length * PREFIX_CHARS_PER_TOKEN:
            out = self._tokenize_prefix(text)
        if out is None:
            out = self._encode(text, truncate)
        ids = out["input_ids"]
        if len(ids) > self.max_length:
            raise InputTooLong(
                f"input is {len(ids)} tokens, the model takes at most {self.max_length}: "
                "shorten the text (truncation is off for this model)"
            )
        features = {k: list(v) for k, v in out.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        offsets = [tuple(o) for o in out["offset_mapping"]] if "offset_mapping" in out else None
        return len(ids), Encoding(features, offsets, text)

    def _encode(self, text: str, truncate: bool):
        return self.tokenizer(
            text,
            truncation=truncate,
            max_length=self.max_length if truncate else None,
            return_offsets_mapping=self.task is Task.TOKEN_CLASSIFICATION,
            verbose=False,
        )

    def _tokenize_prefix(self, text: str):
        """A huge input is truncated anyway: tokenize only a prefix cut at whitespace (whole words
        tokenize the same alone), and keep it if it already fills max_length, which makes the kept
        tokens those of the whole text. Tokenizing 1 MB takes about a second; this takes
        milliseconds, so one huge request cannot stall the worker's intake. None: use the whole text."""
        limit = self.max_length * PREFIX_CHARS_PER_TOKEN
        cut = max(text.rfind(space, 0, limit) for space in " \n\t\r")
        if cut <= 0:
            return None
        out = self._encode(text[:cut], True)
        return out if len(out["input_ids"]) >= self.max_length else None

    # -- forward: one planned batch -> one result per item, in the batch's order
    @torch.inference_mode()
    def forward(self, batch: Batch) -> list[dict[str, Any]]:
        inputs = self._collate([item.input for item in batch.items], batch.bucket)
        try:
            # the first output: last_hidden_state for embeddings, logits for classifiers
            output = self.traced(inputs) if self.traced is not None else self.model(**inputs)[0]
        except Exception as error:
            if self.device.type == "cuda" and is_out_of_memory(error):
                torch.cuda.empty_cache()  # give the split halves the memory this pass held
            raise
        self._check_recompiled(batch)
        if self.task is Task.EMBEDDING:
            return self._embeddings(output, inputs["attention_mask"], batch)
        if self.task is Task.SEQUENCE_CLASSIFICATION:
            return self._sequence_labels(output)
        return self._entities(output, batch)

    def _collate(self, encodings: Sequence[Encoding], length: int) -> dict[str, torch.Tensor]:
        columns: dict[str, list[list[int]]] = {}
        for enc in encodings:
            for key, values in enc.features.items():
                pad = _PAD_VALUES.get(key, self.pad_id)
                columns.setdefault(key, []).append(values + [pad] * (length - len(values)))
        return {k: torch.tensor(v, dtype=torch.long, device=self.device) for k, v in columns.items()}

    def _embeddings(self, hidden: torch.Tensor, mask: torch.Tensor, batch: Batch) -> list[dict]:
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * weights).sum(dim=1)
        pooled = summed / weights.sum(dim=1).clamp(min=1e-9)
        vectors = torch.nn.functional.normalize(pooled, p=2, dim=1).float().cpu().tolist()
        return [
            {"embedding": vec, "tokens": item.length} for vec, item in zip(vectors, batch.items)
        ]

    def _label(self, index: int) -> str:
        return self.id2label.get(index, f"LABEL_{index}")

    def _sequence_labels(self, logits: torch.Tensor) -> list[dict]:
        probs = torch.softmax(logits.float(), dim=-1).cpu()
        results = []
        for row in probs:
            best = int(row.argmax())
            results.append(
                {
                    "label": self._label(best),
                    "score": float(row[best]),
                    "scores": {self._label(i): float(p) for i, p in enumerate(row.tolist())},
                }
            )
        return results

    def _entities(self, logits: torch.Tensor, batch: Batch) -> list[dict]:
        probs = torch.softmax(logits.float(), dim=-1).cpu()
        results = []
        for row, item in zip(probs, batch.items):
            tokens = []
            for pos, (start, end) in enumerate(item.input.offsets or []):
                if start == end:  # special or padding token
                    continue
                best = int(row[pos].argmax())
                tokens.append((self._label(best), float(row[pos][best]), start, end))
            results.append({"entities": group_entities(tokens, item.input.text)})
        return results



class _Traced:
    """The model as a TorchScript trace. A pass of a few short texts is mostly Python's work per
    module (hooks, dispatch: 2-3 ms of an 11 ms pass of one short text on one thread,
    bench/results/traced.md); the trace replays the same aten kernels without it: the same bits."""

    def __init__(self, model: torch.nn.Module, example: dict[str, torch.Tensor]):
        self.keys = tuple(example)  # the tokenizer's features: the same keys in every batch
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # TracerWarnings about branches on shapes
            self.module = torch.jit.trace(_FirstOutput(model, self.keys), self._arguments(example),
                                          check_trace=False, strict=False)

    def _arguments(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(inputs[key] for key in self.keys)

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        # no graph optimization: the trace runs as recorded, never re-specialized for a shape
        # after READY (the flag is per thread: each lane sets it for its own passes)
        with torch.jit.optimized_execution(False):
            return self.module(*self._arguments(inputs))


class _FirstOutput(torch.nn.Module):
    """The model's first output alone (a tensor: what a trace returns) from positional inputs."""

    def __init__(self, model: torch.nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.keys, tensors)))[0]


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
