"""The request stages every serving mode runs, as plain functions: prepare (parse, measure,
bucket) -> ... -> answer.

A handler call's answers live in one `Call`. Each stage records a request's failure there and
hands only the others on, so a request that fails is answered alone, with its own status, and
never reaches the next stage. Pure: no torch, no TorchServe (the context is only read and written
through its methods), so tests and benchmarks call the same functions.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Collection, Sequence

from tsbatch.handlers.api import Request
from tsbatch.handlers.core.buckets import Item, bucket_for, bucket_label, bucket_tokens, is_length, longest, sizes
from tsbatch.handlers.core.errors import BadInput, InputTooLong, ModelFailed, OutOfMemory, Overloaded, ServingError
from tsbatch.handlers.core.reply import Answer
from tsbatch.handlers.edge.envelopes import LIST, wrap
from tsbatch.handlers.edge.parse import row_value

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
DEADLINE_HEADER = "x-deadline-ms"  # milliseconds from when the handler first sees the request
DEADLINE_AT_HEADER = "x-deadline-at"  # a wall-clock instant, Unix seconds: time in TorchServe's queue counts
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


def by_request(items: Sequence[Item]) -> list[list[Item]]:
    """Items grouped by request, in order (a request of several texts is several items)."""
    return [list(group) for _, group in itertools.groupby(items, key=lambda item: item.index)]


def prepare(model, edges: Sequence[int], unfit: Collection[int], data: list, context, call: Call,
            rows: Sequence[int] | None = None, limits=None) -> list[Item]:
    """Every row (or the given ones) as Items, one per text, each with its length and bucket, from
    the model's `split` and `prepare` (handlers/api.py); a row it refuses, or one too long for
    every bucket, or of a bucket where not one request fits in memory (`unfit`: 507), is answered
    in `call` alone, and so is a request of several texts when any one of them fails here or it
    has more texts or tokens than `limits` (the handler config) allow (413)."""
    items = []
    for index in range(len(data)) if rows is None else rows:
        media = content_type(context, index)
        try:
            request = Request(row_value(data[index], media), media)
            parts = _split(model, request, limits)
            envelope = (parts[0].envelope or LIST) if parts else ""  # a team's split() may not say
            row = [_prepare_one(model, edges, unfit, part, index, n, len(parts) if parts else 0, envelope)
                   for n, part in enumerate(parts or [request])]
            failed = next((n for n, item in enumerate(row) if isinstance(item, ServingError)), None)
            if failed is not None:
                raise row[failed].at(failed) if parts else row[failed]
            if parts and limits is not None:
                tokens = sum(bucket_tokens(item.length) for item in row)
                if tokens > limits.max_tokens_per_request:
                    raise InputTooLong(f"the texts of this request have {tokens} tokens in all, at most "
                                       f"{limits.max_tokens_per_request} per request: send fewer or shorter texts")
        except ServingError as error:
            call.fail(index, error)
            continue
        items.extend(row)
    return items


def _split(model, request: Request, limits) -> list[Request] | None:
    """The model's `split` of a request of several texts (None for one), within `limits`."""
    split = getattr(model, "split", None)
    try:
        parts = split(request) if split is not None else None
    except ServingError:
        raise
    except Exception as error:  # noqa: BLE001 - a team's split() must not fail the call
        raise BadInput(f"the model cannot take this request ({type(error).__name__}: {error})") from None
    if parts and limits is not None and len(parts) > limits.max_texts_per_request:
        raise InputTooLong(f"this request has {len(parts)} texts, at most {limits.max_texts_per_request} per "
                           f"request: send them in several requests")
    return parts


def _prepare_one(model, edges: Sequence[int], unfit: Collection[int], request: Request, index: int,
                 part: int, parts: int, envelope: str) -> Item | ServingError:
    """One text as an Item, or the error it alone is answered with."""
    try:
        length, prepared = model.prepare(request)
    except ServingError as error:
        return error
    except Exception as error:  # noqa: BLE001 - e.g. lone surrogates a tokenizer rejects
        return BadInput(f"the model cannot take this request ({type(error).__name__}: {error})")
    if isinstance(length, list):
        length = tuple(length)
    if not is_length(length, edges):
        return ModelFailed(f"the model's prepare() returned length {length!r}: it must be a whole "
                           f"number >= 0, or one per size for a model with several")
    largest = longest(edges)
    if any(size > most for size, most in zip(sizes(length), sizes(largest))):
        return InputTooLong(f"input is {bucket_label(length)} long, the model takes at most {bucket_label(largest)}")
    bucket = bucket_for(length, edges)
    if bucket in unfit:
        return OutOfMemory(
            f"inputs of up to {bucket_label(bucket)} tokens (this request has {bucket_label(length)}) do not fit in this worker's "
            f"memory even one at a time (learned from out of memory): send a shorter input")
    return Item(index, "", length, bucket, prepared, part, parts, envelope)


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
        if isinstance(outcome, ServingError):
            body = json.dumps(outcome.to_body())
        else:
            body = json.dumps(wrap(answered.envelope, outcome, getattr(context, "model_name", "")))
        bodies.append(body)
        if index >= requests:
            continue
        context.set_response_content_type(index, JSON)
        each = answered.parts or (answered,)  # a request of several texts: one value per text
        context.set_response_header(index, BATCH_SIZE_HEADER, ",".join(str(a.batch_size) for a in each))
        if answered.bucket:
            context.set_response_header(index, PADDED_HEADER, ",".join(bucket_label(a.bucket) for a in each))
        context.set_response_header(index, WORKER_HEADER, str(os.getpid()))
        if answered.started:
            ms = lambda seconds: f"{seconds * 1000:.1f}"  # noqa: E731
            threads = f"threads={answered.threads}; " if answered.threads else ""  # a lane's pass: borrowed or not
            context.set_response_header(index, TIMING_HEADER, f"wait={ms(answered.started - answered.arrived)}; "
                                        f"pass={ms(answered.finished - answered.started)}; {threads}"
                                        f"handler={ms(time.monotonic() - answered.arrived)}")
        if isinstance(outcome, ServingError):
            context.set_response_status(outcome.status, HTTPStatus(outcome.status).phrase, idx=index)
            if isinstance(outcome, Overloaded):
                context.set_response_header(index, "Retry-After", RETRY_AFTER_SECONDS)
    return bodies


HTTP_ONLY_HEADERS = ("host", "content-length", "transfer-encoding")  # an HTTP request has one; gRPC none


def is_http(headers) -> bool:
    """Whether a request came over HTTP (its lower-cased headers): TorchServe 0.12 forwards no gRPC
    metadata, so a gRPC request carries none of these."""
    return any(name in headers for name in HTTP_ONLY_HEADERS)


def request_headers(context, index: int) -> dict:
    """The request's headers with lower-cased names (clients and proxies differ in case)."""
    try:
        headers = context.get_all_request_header(index) or {}
    except Exception:  # noqa: BLE001 - a context without headers means "none"
        return {}
    return {str(k).lower(): v for k, v in headers.items()}


def client_deadline(headers: dict, now: float, wall: float | None = None) -> float | None:
    """The deadline a client asked for, as monotonic seconds (None: it asked for none; BadInput:
    it asked badly). `X-Deadline-Ms: N` counts from `now`, when the handler first saw the request;
    `X-Deadline-At: T`, a wall-clock instant in Unix seconds (time.time()), also counts the time
    the request waited in TorchServe's queue, which the handler cannot see (client and server
    clocks must agree, as NTP keeps them). Both: the earlier."""
    asked = []
    if headers.get(DEADLINE_HEADER) is not None:
        value = _text(headers[DEADLINE_HEADER])
        try:
            ms = int(value)
        except ValueError:
            raise BadInput(f"X-Deadline-Ms must be a whole number of milliseconds, got {value!r}") from None
        if ms < 1:
            raise BadInput(f"X-Deadline-Ms must be positive, got {ms}")
        asked.append(now + ms / 1000)
    if headers.get(DEADLINE_AT_HEADER) is not None:
        value = _text(headers[DEADLINE_AT_HEADER])
        try:
            at = float(value)
        except ValueError:
            at = float("nan")
        if not at > 0 or at == float("inf"):
            raise BadInput(f"X-Deadline-At must be a wall-clock instant in Unix seconds (as time.time() gives it), "
                           f"got {value!r}")
        asked.append(now + at - (time.time() if wall is None else wall))
    return min(asked) if asked else None


def _text(value) -> str:
    return value.decode("utf-8", "replace").strip() if isinstance(value, (bytes, bytearray)) else str(value).strip()


def content_type(context, index: int) -> str | None:
    """The content type TorchServe recorded for the request's payload parameter."""
    headers = request_headers(context, index)
    for name in ("body", "data"):
        if isinstance(headers.get(name), dict):
            return headers[name].get("content-type")
    value = headers.get("content-type")
    return value if isinstance(value, str) else None

