"""tsbatch's public model API: what a team writes to serve its own model with tsbatch.

A model is three methods, each with one job, and two attributes:

- `prepare(request) -> (length, input)`: one request becomes one input with a length in the
  model's own unit (tokens, samples, frames). tsbatch buckets requests by that length.
- `forward(batch) -> results`: one pass over inputs of one bucket. `batch.bucket` is the length
  to pad to, `batch.items[i].input` is what `prepare` returned for item i. One JSON-ready result
  per item, in order. Raise to fail: tsbatch finds the failing items and answers the others.
- `example(length) -> input`: an input of exactly `length`, for warmup.
- `max_length`: the longest input, the largest bucket. `device`: "cpu", "cuda", "cuda:1".

A model with a second size that sets a pass's cost, such as a generation's `max_new_tokens`, gives
one length per size: `prepare` returns `(length, input)` with `length` a tuple such as
`(prompt_tokens, max_new_tokens)`, `max_length` is the tuple of maxima, and a bucket is then one
edge per size (`batch.bucket == (32, 16)`; `example` gets such a tuple). tsbatch buckets by every
size, so a request asking for 8 new tokens never shares a pass with one asking for 256; the
handler configuration's `buckets` gives one list of edges per size.

Optional: `describe()` (what the latency profile and the log record), `use_threads()` (intra-op
threads for the calling lane), `ready()` (called once warmup is done), `split()` (a request of
several inputs as one request per input; by default JSON `{"text": [...]}` and its aliases, see
handlers/edge/parse.py; return None to take lists as they are).

Everything else comes from tsbatch: buckets, warmup of every batch size x bucket before READY,
the latency profile, isolation of failing requests, out-of-memory caps, the serving modes,
deadlines, priorities, metrics and JSON errors. The built-in encoder (handlers/models/encoder.py) is a
Model like any other. Pure: no torch, no TorchServe.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from tsbatch.handlers.core.buckets import Batch
from tsbatch.handlers.core.errors import BadInput, InputTooLong, ServingError  # noqa: F401 - what prepare() raises
from tsbatch.handlers.edge.parse import many, parse_text

__all__ = ["Batch", "BadInput", "InputTooLong", "Model", "Request", "ServingError"]


@dataclass(frozen=True)
class Request:
    """One client request as TorchServe handed it over: its body (bytes, or what TorchServe
    parsed from a JSON body) and its content type."""

    body: Any
    content_type: str | None = None
    # for one text of a request of several (split): the shape the request's answer goes back in
    # (handlers/edge/envelopes.py; empty when a team's split() does not say: a plain JSON list)
    envelope: str = ""

    def text(self) -> str:
        """The body as text: a text/plain body, or JSON {"text": "..."}; BadInput otherwise."""
        return parse_text(self.body, self.content_type)


class Model(abc.ABC):
    """Subclass it, or write any class with the same methods (TorchServe never sees it)."""

    max_length: int | tuple[int, ...]
    device: Any = "cpu"

    @abc.abstractmethod
    def prepare(self, request: Request) -> tuple[int | tuple[int, ...], Any]:
        """(length, input) for one request; raise BadInput (400) or InputTooLong (413) for a
        request the model cannot take: it alone is answered with that error."""

    @abc.abstractmethod
    def forward(self, batch: Batch) -> list:
        """One result per item of `batch` (all of one bucket), in order."""

    @abc.abstractmethod
    def example(self, length: int | tuple[int, ...]) -> Any:
        """An input of exactly `length` units, as `prepare` would make it: warmup runs these."""

    def describe(self) -> dict[str, Any]:
        return {"device": str(self.device), "max_length": self.max_length}

    def use_threads(self, count: int, background: bool = False) -> None:
        """Intra-op threads for passes run from the calling thread (a lane); nothing by default.
        A torch model sets them with handlers/models/threads.py's `use_intra_op_threads`: a bare
        `torch.set_num_threads` on a lane does not stay set (see there)."""

    def ready(self) -> None:
        """Warmup is done: every shape the handler forms has run once."""

    def split(self, request: Request) -> list[Request] | None:
        """A request of several inputs as one Request per input, or None for a request of one.
        Each input is then prepared, bucketed and batched on its own, and the client gets their
        results as one list in order. By default: JSON {"text": [...]} (or "inputs", "input"), KServe
        v1 instances and a KServe v2 tensor of texts (handlers/edge/envelopes.py)."""
        found = many(request.body, request.content_type)
        if found is None:
            return None
        bodies, envelope = found
        return [Request(body, request.content_type, envelope) for body in bodies]


def device_type(model: Model) -> str:
    """"cuda" or "cpu" (or whatever the device string starts with), for torch devices and strings."""
    device = getattr(model, "device", "cpu")
    return getattr(device, "type", None) or str(device).split(":")[0]
