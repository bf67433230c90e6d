"""The built-in model: Hugging Face encoders, the only module that touches torch and transformers.

A Model of the public API (handlers/api.py) like any team's own: `prepare` tokenizes one request
(so its length is known before batching), `forward` runs one planned Batch as one pass, padded to
the batch's bucket edge, and `example` makes warmup's inputs. A pass runs the model in
`handler.dtype` (inputs stay token ids, answers come back as float32), as a TorchScript trace
kept only if it answers exactly as eager, and on CUDA with `handler.cuda_graphs` as the graph
captured for its shape at warmup (handlers/runtime/graphs.py decides which; the capture is here).
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
from tsbatch.handlers.core.buckets import Batch
from tsbatch.handlers.core.errors import ConfigError, InputTooLong
from tsbatch.handlers.core.isolate import describe, is_out_of_memory
from tsbatch.handlers.edge.config import Dtype, HandlerConfig, Task
from tsbatch.handlers.models.entities import group_entities
from tsbatch.handlers.models.threads import use_intra_op_threads
from tsbatch.handlers.runtime.graphs import GraphBook, graph_limit
from tsbatch.handlers.runtime.memory import budget_bytes
from tsbatch.warmup.plan import Shape

logger = logging.getLogger(__name__)

_MODEL_CLASSES = {
    Task.EMBEDDING: AutoModel,
    Task.SEQUENCE_CLASSIFICATION: AutoModelForSequenceClassification,
    Task.TOKEN_CLASSIFICATION: AutoModelForTokenClassification,
}
_PAD_VALUES = {"attention_mask": 0, "token_type_ids": 0}
# Inputs longer than max_length x this many characters are tokenized from a prefix first (see
# EncoderModel._tokenize_prefix): ordinary text has 4-6 characters per token.
PREFIX_CHARS_PER_TOKEN = 32
# ... and no input has more than max_length x this many of its characters read: the bound on what
# one request costs the thread that takes requests in (about a microsecond a character).
READ_CHARS_PER_TOKEN = 64
DTYPES = {Dtype.FLOAT32: torch.float32, Dtype.FLOAT16: torch.float16, Dtype.BFLOAT16: torch.bfloat16}


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
    """Loads a Hugging Face encoder from a local directory and runs planned batches on it.
    `graph_capture`: how CUDA graphs are captured (default: CudaGraphCapture on a CUDA device;
    tests inject a fake to run the graph path on the CPU)."""

    def __init__(self, config: HandlerConfig, model_path: str, gpu_id: int | None = None,
                 graph_capture: "CudaGraphCapture | None" = None):
        if config.task is None:
            raise ConfigError(f"handler.task is required: one of {[t.value for t in Task]}")
        if not os.path.isdir(model_path):
            raise ConfigError(f"model directory {model_path} does not exist")
        if config.cuda_graphs and config.compile:
            raise ConfigError("handler.cuda_graphs and handler.compile are both on: pick one (torch.compile "
                              "captures its own graphs; tsbatch captures the trace's or the eager model's)")
        self.config = config
        self.task = config.task
        self.device = resolve_device(config.device, gpu_id)
        self.dtype = DTYPES[Dtype(config.dtype)]
        if self.device.type == "cpu" and self.dtype is not torch.float32:
            # allowed (answers stay within tolerance), but rarely what a CPU wants
            logger.warning("tsbatch: handler.dtype is %s on the CPU: unless the CPU has matrix units for it "
                           "(AMX, AVX512-BF16/FP16), its passes run slower than float32 (torch sees %s)",
                           Dtype(config.dtype).value, torch.backends.cpu.get_cpu_capability())
        if config.torch_threads:
            use_intra_op_threads(config.torch_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        if not getattr(self.tokenizer, "is_fast", False) and self.task is Task.TOKEN_CLASSIFICATION:
            raise ConfigError("token_classification needs a fast tokenizer (tokenizer.json) for offsets")
        model = _MODEL_CLASSES[self.task].from_pretrained(
            model_path, local_files_only=True, use_safetensors=True
        )
        self.model = model.to(self.device, dtype=self.dtype).eval()
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
        self.graphs = self._graphs(graph_capture)

    def _graphs(self, capture: "CudaGraphCapture | None") -> "_Graphs | None":
        """The shapes' CUDA graphs, captured as warmup first runs each (handler.cuda_graphs)."""
        if not self.config.cuda_graphs:
            return None
        if capture is None:
            if self.device.type != "cuda":
                logger.info("tsbatch: handler.cuda_graphs is off on %s: CUDA graphs need a CUDA device", self.device)
                return None
            capture = CudaGraphCapture(self.device)
        total = capture.total_bytes()
        budget = budget_bytes(self.config.memory_budget, total) if self.config.memory_budget is not None else total
        return _Graphs(GraphBook(graph_limit(budget)), capture)

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
        use_intra_op_threads(count)
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
        """From now on any compilation is a shape warmup missed: remember the count to compare;
        no CUDA graph is captured after this."""
        self._graphs_at_ready = _compiled_graphs() if self.compiled else None
        if self.graphs is not None:
            self.graphs.book.mark_ready()

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
            "dtype": Dtype(self.config.dtype).value,
            "compile": self.compiled,
            "trace": self.traced is not None,
            "cuda_graphs": self.graphs is not None,  # what each shape got: the log at READY, graphs.book
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
        """A huge input is truncated anyway, so only a prefix is tokenized: tokenizing 1 MB takes
        about a second, a prefix milliseconds, and one huge request must not stall the worker's
        intake. Exact where it can be: a prefix cut at whitespace (whole words tokenize the same
        alone) that fills max_length; else two cuts mid-word that fill it with the same tokens
        (the cut never reached them). Otherwise (a giant word, a gap of whitespace) the model gets
        the tokens of the first max_length x READ_CHARS_PER_TOKEN characters: the bound. None: the
        text is short enough to read whole."""
        limit = self.max_length * PREFIX_CHARS_PER_TOKEN
        cut = max(text.rfind(space, 0, limit) for space in " \n\t\r")
        if cut > 0:
            out = self._encode(text[:cut], True)
            if len(out["input_ids"]) >= self.max_length:
                return out
        first, second = self._encode(text[:limit], True), self._encode(text[:limit + limit // 2], True)
        if len(first["input_ids"]) >= self.max_length and list(first["input_ids"]) == list(second["input_ids"]):
            return first
        bound = self.max_length * READ_CHARS_PER_TOKEN
        return self._encode(text[:bound], True) if len(text) > bound else None

    # -- forward: one planned batch -> one result per item, in the batch's order
    @torch.inference_mode()
    def forward(self, batch: Batch) -> list[dict[str, Any]]:
        inputs = self._collate([item.input for item in batch.items], batch.bucket)
        try:
            if self.graphs is not None:
                output = self.graphs.run(Shape(batch.size, batch.bucket), inputs, self._pass)
            else:
                output = self._pass(inputs)
        except Exception as error:
            if self.device.type == "cuda" and is_out_of_memory(error):
                torch.cuda.empty_cache()  # give the split halves the memory this pass held
            raise
        self._check_recompiled(batch)
        output = output.float()  # pooling and softmax in float32 whatever the model's dtype
        if self.task is Task.EMBEDDING:
            return self._embeddings(output, inputs["attention_mask"], batch)
        if self.task is Task.SEQUENCE_CLASSIFICATION:
            return self._sequence_labels(output)
        return self._entities(output, batch)

    def _pass(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's first output: last_hidden_state for embeddings, logits for classifiers."""
        return self.traced(inputs) if self.traced is not None else self.model(**inputs)[0]

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


class CudaGraphCapture:
    """The CUDA side of a graph: capture one pass into a torch.cuda.CUDAGraph with its own memory
    pool, and what the device holds: the caching allocator's reserved bytes once its free cache is
    emptied (a graph's pool stays reserved for as long as the graph lives, and capture itself
    empties the cache, so a plain before/after of memory_reserved could even come out negative).
    Only called at warmup, before READY."""

    def __init__(self, device: torch.device):
        self.device = device

    def total_bytes(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def held_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def capture(self, run, static_inputs: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """The graph of `run(static_inputs)` and its output tensor, which every replay rewrites.
        Capture records kernels without running them, so the buffers' contents do not matter until
        a replay (a forward that branches on its values syncs with the host, and that fails capture)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            capturing = torch.cuda.graph(graph)
            # one pass on the stream capture will use first, as torch's docs prescribe: whatever
            # that stream makes lazily (a cuBLAS workspace) is made before capture, not inside it
            capturing.capture_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(capturing.capture_stream):
                run(static_inputs)
            torch.cuda.current_stream().wait_stream(capturing.capture_stream)
            with capturing:
                output = run(static_inputs)
        return graph, output

    def release(self) -> None:
        """After a capture that failed or was dropped: give its pool back."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


class _ShapeGraph:
    """One shape's graph and its static buffers: a pass copies its inputs in, replays, and takes a
    copy of the output (the next replay rewrites it). One pass at a time per graph: lanes are
    threads."""

    def __init__(self, graph: Any, static_inputs: dict[str, torch.Tensor], output: torch.Tensor):
        self.graph, self.static_inputs, self.output = graph, static_inputs, output
        self.lock = threading.Lock()

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.lock:
            for key, buffer in self.static_inputs.items():
                buffer.copy_(inputs[key])
            self.graph.replay()
            return self.output.clone()


class _Graphs:
    """Passes through the CUDA graph of their shape: the first pass of a shape before READY runs
    eager and is then captured, kept only if its replay answers exactly as that pass did (as the
    trace is checked); the decisions and the memory bookkeeping are handlers/runtime/graphs.py's."""

    def __init__(self, book: GraphBook, capture: CudaGraphCapture):
        self.book, self.capture = book, capture
        self.by_shape: dict[Shape, _ShapeGraph] = {}

    def run(self, shape: Shape, inputs: dict[str, torch.Tensor], run) -> torch.Tensor:
        graph = self.by_shape.get(shape)
        if graph is not None:
            return graph(inputs)
        output = run(inputs)
        if self.book.should_capture(shape):
            self._capture(shape, inputs, run, output)
        else:
            self.book.met_eager(shape)
        return output

    def _capture(self, shape: Shape, inputs: dict[str, torch.Tensor], run, eager: torch.Tensor) -> None:
        before = self.capture.held_bytes()
        candidate, reason, off = None, None, False
        try:
            # zeros at capture, then the pass's own inputs copied in for the check: it covers the copy too
            static = {key: torch.zeros_like(tensor) for key, tensor in inputs.items()}
            graph, output = self.capture.capture(run, static)
            candidate = _ShapeGraph(graph, static, output)
            del graph, output
            if not torch.equal(candidate(inputs), eager):
                reason = "its replay answered differently from the eager pass"
        except Exception as error:  # noqa: BLE001 - a shape that cannot be captured runs eager
            off = not is_out_of_memory(error)
            reason = describe(error) if off else f"out of memory at capture ({describe(error)})"
        if reason is None:
            self.by_shape[shape] = candidate
            self.book.record(shape, self.capture.held_bytes() - before)
            return
        candidate = None  # its pool goes back once nothing holds the graph
        self.capture.release()
        (self.book.turn_off if off else self.book.refuse)(shape, reason)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
