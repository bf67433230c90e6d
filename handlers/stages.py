"""The request stages every serving mode runs, as plain functions: prepare (parse, measure,
bucket) -> ... -> answer.

A handler call's answers live in one `Call`. Each stage records a request's failure there and
hands only the others on, so a request that fails is answered alone, with its own status, and
never reaches the next stage. Pure: no torch, no TorchServe (the context is only read and written
through its methods), so tests and benchmarks call the same functions.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Collection, Sequence

from tsbatch.handlers.api import Request
from tsbatch.handlers.buckets import Item, bucket_for, bucket_label, is_length, longest, sizes
from tsbatch.handlers.errors import BadInput, InputTooLong, ModelFailed, OutOfMemory, Overloaded, ServingError
from tsbatch.handlers.parse import row_value
from tsbatch.handlers.scheduler import Answer

logger = logging.getLogger(__name__)

# One vocabulary for the headers tsbatch reads and writes (the README and the tests use these).
JSON = "application/json"
BATCH_SIZE_HEADER = "x-tsbatch-batch-size"  # requests in the pass that computed the answer
WORKER_HEADER = "x-tsbatch-worker"  # pid of the worker process that answered
PADDED_HEADER = "x-tsbatch-padded-to"  # tokens the request was padded to (its bucket's edge)
# ms, from when the handler first saw the request: in tsbatch's queue, its pass, and until its
# answer was written (the rest of what a client measures is TorchServe's: frontend, socket, reply)
TIMING_HEADER = "x-tsbatch-timing"
PRIORITY_HEADER = "x-priority"
DEADLINE_HEADER = "x-deadline-ms"
RETRY_AFTER_SECONDS = "1"


@dataclass
class Call:
    """One handler call: per row, its answer so far (None: not answered yet). `batch_size` is
    what a request that never ran reports: the frontend's batch in default mode, else 1."""

    answers: list[Answer | None]
    batch_size: int = 1

    @classmethod
    def of(cls, rows: int, batch_size: int = 1) -> "Call":
        return cls([None] * rows, batch_size)

    def fail(self, index: int, error: ServingError) -> None:
        self.answers[index] = Answer(error, self.batch_size, 0)

    def settle(self, index: int, answer: Answer) -> None:
        self.answers[index] = answer

    def fail_unanswered(self, error: Exception) -> None:
        """A bug in tsbatch: every request not yet answered gets a 500 that says so."""
        logger.exception("tsbatch pipeline failed")
        failure = ModelFailed(f"internal error in tsbatch: {type(error).__name__}: {error}")
        self.answers = [a if a is not None else Answer(failure, self.batch_size, 0) for a in self.answers]


def prepare(model, edges: Sequence[int], unfit: Collection[int], data: list, context, call: Call,
            rows: Sequence[int] | None = None) -> list[Item]:
    """Every row (or the given ones) as an Item with its length and bucket, from the model's
    `prepare` (handlers/api.py); a row it refuses, or one too long for every bucket, or of a
    bucket where not one request fits in memory (`unfit`: 507), is answered in `call` alone."""
    items = []
    for index in range(len(data)) if rows is None else rows:
        try:
            length, prepared = model.prepare(Request(row_value(data[index]), content_type(context, index)))
        except ServingError as error:
            call.fail(index, error)
            continue
        except Exception as error:  # noqa: BLE001 - e.g. lone surrogates a tokenizer rejects
            call.fail(index, BadInput(f"the model cannot take this request ({type(error).__name__}: {error})"))
            continue
        if isinstance(length, list):
            length = tuple(length)
        if not is_length(length, edges):
            call.fail(index, ModelFailed(f"the model's prepare() returned length {length!r}: it must be a whole "
                                         f"number >= 0, or one per size for a model with several"))
            continue
        largest = longest(edges)
        if any(size > most for size, most in zip(sizes(length), sizes(largest))):
            call.fail(index, InputTooLong(f"input is {bucket_label(length)} long, the model takes at most "
                                          f"{bucket_label(largest)}"))
            continue
        bucket = bucket_for(length, edges)
        if bucket in unfit:
            call.fail(index, OutOfMemory(
                f"inputs of up to {bucket_label(bucket)} tokens (this request has {bucket_label(length)}) do not fit in this worker's "
                f"memory even one at a time (learned from out of memory): send a shorter input"))
            continue
        items.append(Item(index, "", length, bucket, prepared))
    return items


def answer(call: Call, context) -> list[str]:
    """Write each answered request's status and headers once, here, and return one body per row
    ("" for a row not answered in this call: continuous mode leaves it with the frontend).

    Rows beyond the context's requests (KServe's envelope hands one request's instances as
    several rows) get their bodies but no per-request headers: there is no request to set."""
    bodies = []
    requests = len(getattr(context, "request_processor", None) or call.answers)
    for index, answered in enumerate(call.answers):
        if answered is None:
            bodies.append("")
            continue
        outcome = answered.outcome
        body = json.dumps(outcome.to_body() if isinstance(outcome, ServingError) else outcome)
        bodies.append(body)
        if index >= requests:
            continue
        context.set_response_content_type(index, JSON)
        context.set_response_header(index, BATCH_SIZE_HEADER, str(answered.batch_size))
        if answered.bucket:
            context.set_response_header(index, PADDED_HEADER, bucket_label(answered.bucket))
        context.set_response_header(index, WORKER_HEADER, str(os.getpid()))
        if answered.started:
            ms = lambda seconds: f"{seconds * 1000:.1f}"  # noqa: E731
            context.set_response_header(index, TIMING_HEADER, f"wait={ms(answered.started - answered.arrived)}; "
                                        f"pass={ms(answered.finished - answered.started)}; "
                                        f"handler={ms(time.monotonic() - answered.arrived)}")
        if isinstance(outcome, ServingError):
            context.set_response_status(outcome.status, HTTPStatus(outcome.status).phrase, idx=index)
            if isinstance(outcome, Overloaded):
                context.set_response_header(index, "Retry-After", RETRY_AFTER_SECONDS)
    return bodies


def request_headers(context, index: int) -> dict:
    """The request's headers with lower-cased names (clients and proxies differ in case)."""
    try:
        headers = context.get_all_request_header(index) or {}
    except Exception:  # noqa: BLE001 - a context without headers means "none"
        return {}
    return {str(k).lower(): v for k, v in headers.items()}


def content_type(context, index: int) -> str | None:
    """The content type TorchServe recorded for the request's payload parameter."""
    headers = request_headers(context, index)
    for name in ("body", "data"):
        if isinstance(headers.get(name), dict):
            return headers[name].get("content-type")
    value = headers.get("content-type")
    return value if isinstance(value, str) else None

