"""Typed errors that carry their HTTP status, and the one table that turns them into responses.

A request's failure is one of these; `to_body` is the only place a JSON error body is built,
so every client sees the same shape: {"error": "...", "code": N}.
"""
from __future__ import annotations

import copy


class ServingError(Exception):
    """A failure of one request, with the HTTP status the client should get."""

    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    index: int | None = None  # which text of a request of several failed

    def to_body(self) -> dict:
        body = {"error": self.message, "code": self.status}
        if self.index is not None:
            body["index"] = self.index
        return body

    def at(self, index: int) -> "ServingError":
        """This error as the failure of text `index` of a request of several: the whole request
        is answered with it, the message and the body's "index" naming the text."""
        error = copy.copy(self)
        error.message = f"text {index}: {self.message}"
        error.args = (error.message,)
        error.index = index
        return error


class BadInput(ServingError):
    """The request itself is malformed: the client must change it."""

    status = 400


class UnsupportedMediaType(ServingError):
    """The body's content type cannot carry the request as sent (a form that split a text)."""

    status = 415


class InputTooLong(ServingError):
    """More tokens than the model takes, and truncation is off."""

    status = 413


class ModelFailed(ServingError):
    """The model raised on this input (found alone, after isolation)."""

    status = 500


class ModelUnavailable(ServingError):
    """The model fails for every input: retrying elsewhere may help, retrying here will not."""

    status = 503


class Overloaded(ServingError):
    """The worker cannot take this request now (its queue is full, or what is queued ahead would
    outlast the request's deadline): retry later. `reason` labels tsbatch_rejected_total."""

    status = 503

    def __init__(self, message: str, reason: str = "queue_full"):
        super().__init__(message)
        self.reason = reason


class DeadlineExceeded(ServingError):
    """The request's deadline passed before it could be answered."""

    status = 504


class OutOfMemory(ServingError):
    """The input does not fit in memory even in a batch of one."""

    status = 507


class ConfigError(ValueError):
    """A bad handler configuration: raised at load, never on a request."""
