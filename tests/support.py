"""Test support: TorchServe-shaped contexts and tiny random models built from a config."""
from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

TINY_LABELS = {
    "sequence_classification": ["NEGATIVE", "POSITIVE"],
    "token_classification": ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"],
}
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def example_maker(folder: str):
    """An example's make_model.make, loaded from its file under a name of its own (every example
    has a make_model.py; importing them by that one name would hand the second test the first's)."""
    import importlib.util

    path = os.path.join(folder, "make_model.py")
    spec = importlib.util.spec_from_file_location(f"{os.path.basename(folder)}_make_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make


class FakeClock:
    """A clock for pure code under test: one millisecond passes each time it is read."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def scratch_dir(prefix: str) -> str:
    """A temporary directory that outlives the test (a handler keeps using its archive directory)
    and is removed when the test process exits, so test runs leave nothing in TMPDIR."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def make_context(model_dir: str, handler: dict, batch_size: int = 8, name: str = "m",
                 frontend: dict | None = None):
    """A real ts.context.Context, as TorchServe's worker builds it, with our handler: section
    (and model-config.yaml's frontend keys, e.g. continuousBatching, when given)."""
    from ts.context import Context
    from ts.metrics.metrics_store import MetricsStore

    return Context(name, model_dir, {"model": {}}, batch_size, None, "0.12.0",
                   metrics=MetricsStore(uuid.uuid4(), name),
                   model_yaml_config={**(frontend or {}), "handler": handler})


def load_handler(model_dir: str, frontend: dict | None = None, archive_dir: str | None = None, **handler):
    """An EncoderHandler initialized on a TorchServe-shaped context; warmup off unless asked
    (warmup has its own tests and would slow the rest). `archive_dir` plays TorchServe's extracted
    archive, which every worker of one model shares: a fresh one per handler unless given."""
    from tsbatch.handlers.models.encoder_handler import EncoderHandler

    handler = {"task": "embedding", "model_dir": model_dir, "warmup": False, **handler}
    context = make_context(archive_dir or scratch_dir("tsbatch-archive-"), handler, frontend=frontend)
    loaded = EncoderHandler()
    loaded.initialize(context)
    return loaded, context


@dataclass
class Reply:
    status: int
    body: dict
    headers: dict


def _row(payload: Any, content_type: str, headers: dict | None = None):
    from ts.context import RequestProcessor

    if isinstance(payload, tuple):
        payload, content_type = payload
    return {"body": payload}, RequestProcessor({"body": {"content-type": content_type}, **(headers or {})})


def call(handler, context, payloads: Sequence[Any], content_type: str = "text/plain") -> list[Reply]:
    """Run one TorchServe batch through handler.handle, as the worker's service would."""
    rows, processors = zip(*[_row(p, content_type) for p in payloads]) if payloads else ((), ())
    rows = list(rows)
    context.request_processor = list(processors)
    context.request_ids = {i: f"req-{i}" for i in range(len(rows))}
    bodies = handler.handle(rows, context)
    if len(bodies) != len(rows):
        raise AssertionError(f"handler returned {len(bodies)} bodies for {len(rows)} requests")
    replies = []
    for i, body in enumerate(bodies):
        status, _phrase = context.get_response_status(i)
        replies.append(Reply(status, json.loads(body), context.get_response_headers(i)))
    return replies


class ContinuousFrontend:
    """TorchServe 0.12's continuous batching frontend (wlm/ContinuousBatching.java), as seen by a
    handler: every call carries every request not yet answered, in arrival order, plus new ones;
    a request is answered when its index is still in `context.request_ids` after the call."""

    def __init__(self, handler, context):
        self.handler, self.context = handler, context
        self.waiting: dict[str, tuple] = {}  # request id -> (row, request processor)
        self.replies: dict[str, Reply] = {}
        self.answered_in: dict[str, int] = {}  # request id -> call number that answered it
        self.calls = 0
        self.returned = []  # (time.monotonic() as each call returned, requests it left held)

    def submit(self, rid: str, payload: Any, content_type: str = "text/plain", headers: dict | None = None) -> None:
        self.waiting[rid] = _row(payload, content_type, headers)

    def step(self) -> list[str]:
        """One call of handle(); returns the request ids it answered."""
        order = list(self.waiting)
        rows = [self.waiting[rid][0] for rid in order]
        self.context.request_processor = [self.waiting[rid][1] for rid in order]
        self.context.request_ids = dict(enumerate(order))
        bodies = self.handler.handle(rows, self.context)
        returned = time.monotonic()
        self.calls += 1
        if len(bodies) != len(rows):
            raise AssertionError(f"handler returned {len(bodies)} bodies for {len(rows)} requests")
        done = []
        for index, rid in self.context.request_ids.items():
            if rid in self.replies:
                raise AssertionError(f"{rid} answered twice")
            status, _phrase = self.context.get_response_status(index)
            self.replies[rid] = Reply(status, json.loads(bodies[index]), self.context.get_response_headers(index))
            self.answered_in[rid] = self.calls
            del self.waiting[rid]
            done.append(rid)
        self.returned.append((returned, len(self.waiting)))
        return done

    def drain(self, max_calls: int = 10_000) -> dict[str, Reply]:
        while self.waiting:
            if self.calls >= max_calls:
                raise AssertionError(f"{len(self.waiting)} requests unanswered after {max_calls} calls")
            self.step()
        return self.replies


class SharedQueueFrontend:
    """TorchServe 0.12's continuous batching with several workers of one model, where it matters
    for them (wlm/ContinuousBatching.java, Model.pollInferJob): one job queue and one model-wide
    lock. Each worker is a thread that, like WorkerThread, takes the lock to poll, calls handle()
    and polls again. A worker holding no requests blocks for the first one *while holding the
    lock*, then takes more for up to `max_batch_delay`; a worker still holding requests needs the
    lock too, and then takes only what is queued. So a worker that returns with requests
    unfinished waits for the lock until a new request reaches an idle sibling."""

    def __init__(self, workers: Sequence[tuple], batch_size: int = 96, max_batch_delay: float = 0.001):
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.batch_size, self.max_batch_delay = batch_size, max_batch_delay
        self.replies: dict[str, Reply] = {}
        self.answered_at: dict[str, float] = {}
        self.calls = [0] * len(workers)
        self.answered = threading.Condition()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._worker, args=(i, h, c), daemon=True, name=f"fake-worker-{i}")
                         for i, (h, c) in enumerate(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, rid: str, payload: Any, content_type: str = "text/plain") -> None:
        self.jobs.put((rid, _row(payload, content_type)))

    def wait(self, rids: Sequence[str], timeout: float) -> bool:
        """True once every request in `rids` is answered; False after `timeout` seconds."""
        with self.answered:
            return self.answered.wait_for(lambda: all(r in self.replies for r in rids), timeout=timeout)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)

    def _poll(self, held: dict) -> None:
        with self.lock:
            quota = self.batch_size - len(held)
            if not held:
                while True:  # Long.MAX_VALUE, holding the lock
                    try:
                        rid, row = self.jobs.get(timeout=0.05)
                        break
                    except queue.Empty:
                        if self._stop.is_set():
                            return
                held[rid] = row
                quota -= 1
                until = time.monotonic() + self.max_batch_delay
                while quota > 0:
                    try:
                        rid, row = self.jobs.get(timeout=max(0.0, until - time.monotonic()))
                    except queue.Empty:
                        break
                    held[rid] = row
                    quota -= 1
            else:
                while quota > 0:
                    try:
                        rid, row = self.jobs.get_nowait()
                    except queue.Empty:
                        break
                    held[rid] = row
                    quota -= 1

    def _worker(self, index: int, handler, context) -> None:
        held: dict[str, tuple] = {}
        while not self._stop.is_set():
            self._poll(held)
            if not held:
                continue
            order = list(held)
            context.request_processor = [held[rid][1] for rid in order]
            context.request_ids = dict(enumerate(order))
            bodies = handler.handle([held[rid][0] for rid in order], context)
            self.calls[index] += 1
            with self.answered:
                for i, rid in context.request_ids.items():
                    status, _phrase = context.get_response_status(i)
                    self.replies[rid] = Reply(status, json.loads(bodies[i]), context.get_response_headers(i))
                    self.answered_at[rid] = time.monotonic()
                    del held[rid]
                self.answered.notify_all()


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
