"""tsbatch's TorchServe handler for Hugging Face encoders (embedding, sequence and token classification).

TorchServe imports this file by its basename from the archive root, next to the `handlers/` and
`warmup/` packages, and instantiates its one class. `handle` is a short shell over the stages
parse -> tokenize -> bucket -> plan batches -> execute (with isolation) -> answer.
It never raises on input: every request gets a result or its own JSON error and status.
"""
from __future__ import annotations

import json
import logging
import os
import time
from http import HTTPStatus
from typing import Any

from handlers.buckets import Item, batch_cap, bucket_for, check_edges, default_edges, plan_batches
from handlers.config import HandlerConfig
from handlers.errors import BadInput, ModelFailed, ServingError
from handlers.isolate import Isolator, OomCaps
from handlers.parse import parse_text, row_value

logger = logging.getLogger(__name__)

JSON = "application/json"
BATCH_SIZE_HEADER = "x-tsbatch-batch-size"  # requests in the frontend batch this one came in
WORKER_HEADER = "x-tsbatch-worker"  # pid of the worker process that answered


class EncoderHandler:
    """Serves one encoder model; configured by the `handler:` section of model-config.yaml."""

    def __init__(self):
        self.initialized = False
        self.config: HandlerConfig | None = None
        self.runner = None
        self.edges: tuple[int, ...] = ()
        self.isolator: Isolator | None = None

    def initialize(self, context) -> None:
        from handlers.runner import ModelRunner  # torch stays at the edge, loaded only here

        started = time.monotonic()
        model_dir = context.system_properties.get("model_dir")
        self.config = HandlerConfig.from_yaml((context.model_yaml_config or {}).get("handler"))
        self.runner = ModelRunner(self.config, os.path.join(model_dir, self.config.model_dir))
        max_length = self.runner.max_length
        self.edges = check_edges(self.config.buckets or default_edges(max_length), max_length)
        self.isolator = Isolator(self.runner.run, self.config.isolation_budget, OomCaps())
        if self.config.fault_injection.enabled:
            logger.warning("fault injection is ON: %s", self.config.fault_injection)
        logger.info(
            "tsbatch loaded task=%s buckets=%s max_batch_tokens=%d %s in %.1fs",
            self.config.task.value, list(self.edges), self.config.max_batch_tokens,
            self.runner.describe(), time.monotonic() - started,
        )
        self.initialized = True

    def cap_for(self, bucket: int) -> int:
        """Largest batch of this bucket: the token budget, lowered by any out-of-memory cap."""
        return self.isolator.caps.cap(bucket, batch_cap(bucket, self.config.max_batch_tokens))

    def handle(self, data: list, context) -> list:
        outcomes: list[Any] = [None] * len(data)
        try:
            items = self.tokenize(self.parse(data, context, outcomes), outcomes)
            for batch in plan_batches(items, self.cap_for):
                results, _report = self.isolator.execute(batch)
                for item, outcome in zip(batch.items, results):
                    outcomes[item.index] = outcome
        except Exception as error:  # noqa: BLE001 - a bug here must not fail the worker
            logger.exception("tsbatch pipeline failed")
            failure = ModelFailed(f"internal error in tsbatch: {type(error).__name__}: {error}")
            outcomes = [o if o is not None else failure for o in outcomes]
        return self.answer(outcomes, context)

    # -- stages
    def parse(self, data: list, context, outcomes: list) -> list[tuple[int, str]]:
        texts = []
        for index, row in enumerate(data):
            try:
                texts.append((index, parse_text(row_value(row), _content_type(context, index))))
            except ServingError as error:
                outcomes[index] = error
        return texts

    def tokenize(self, texts: list[tuple[int, str]], outcomes: list) -> list[Item]:
        items = []
        for index, text in texts:
            try:
                tokens, encoding = self.runner.tokenize(text)
            except ServingError as error:
                outcomes[index] = error
                continue
            except Exception as error:  # noqa: BLE001 - e.g. lone surrogates the tokenizer rejects
                outcomes[index] = BadInput(f"text cannot be tokenized ({type(error).__name__}: {error})")
                continue
            items.append(Item(index, text, tokens, bucket_for(tokens, self.edges), encoding))
        return items

    def answer(self, outcomes: list, context) -> list:
        """Write each request's status once, here, and return one body per request."""
        bodies = []
        for index, outcome in enumerate(outcomes):
            context.set_response_content_type(index, JSON)
            context.set_response_header(index, BATCH_SIZE_HEADER, str(len(outcomes)))
            context.set_response_header(index, WORKER_HEADER, str(os.getpid()))
            if isinstance(outcome, ServingError):
                context.set_response_status(outcome.status, HTTPStatus(outcome.status).phrase, idx=index)
                bodies.append(json.dumps(outcome.to_body()))
            else:
                bodies.append(json.dumps(outcome))
        return bodies


def _content_type(context, index: int) -> str | None:
    """The content type TorchServe recorded for the request's payload parameter."""
    try:
        headers = context.get_all_request_header(index) or {}
    except Exception:  # noqa: BLE001 - a context without headers means "unknown"
        return None
    for name in ("body", "data"):
        value = headers.get(name)
        if isinstance(value, dict):
            return value.get("content-type")
    for name in ("Content-Type", "content-type"):
        if isinstance(headers.get(name), str):
            return headers[name]
    return None
