"""A request's answer, and the one way it travels back: the Reply its tickets carry from admission.

Lane threads (or default mode's call) settle each text's Answer on the request's Reply; once every
text is in, the Reply is done and holds the request's Answer. The serving modes differ only in how
they wait on it: default mode reads it after its passes, continuous mode waits on a condition its
done-callback notifies, async mode awaits `asyncio.wrap_future(reply.future)`.

Pure: no torch, no TorchServe.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tsbatch.handlers.core.errors import ServingError
from tsbatch.warmup.plan import Bucket


@dataclass(frozen=True)
class Answer:
    """What one request got: its result or its error, the size of the pass that computed it, the
    bucket it was padded to (0 when it never ran), and when (monotonic seconds) the handler first
    saw it, its pass started and ended (0 when unknown) and the intra-op threads the pass ran on
    (0 when no lane ran it): x-tsbatch-timing. A request of several texts gets its texts' results
    as one list, or the first failed text's error."""

    outcome: Any  # a result (dict or list) or a ServingError
    batch_size: int = 1
    bucket: Bucket = 0
    arrived: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    threads: int = 0
    parts: tuple["Answer", ...] = ()  # a request of several texts: each text's own answer
    envelope: str = ""  # and the shape its results go back in (handlers/edge/envelopes.py)

    @property
    def failed(self) -> bool:
        return isinstance(self.outcome, ServingError)


class Reply:
    """One request's answer, built from its texts' answers (`parts`: 0 for a request of one text).
    Thread-safe; settled once: a text answered after the request was forced (504) is dropped."""

    def __init__(self, parts: int = 0, envelope: str = "", deadline: float | None = None):
        self.parts = parts
        self.envelope = envelope
        self.deadline = deadline  # monotonic seconds: when the handler stops waiting for it
        self.future: Future = Future()
        self._answers: list[Answer | None] = [None] * max(1, parts)
        self._lock = threading.Lock()
        self._settled = False  # under _lock: whoever sets it sets the future (outside the lock,
        # so a done-callback that takes its waiter's lock can never deadlock with a forcing waiter)

    @classmethod
    def of(cls, items: Sequence, deadline: float | None = None) -> "Reply":
        """For the Items of one request (handlers/core/buckets.Item)."""
        return cls(items[0].parts, items[0].envelope, deadline)

    def settle(self, part: int, answer: Answer) -> bool:
        """Record text `part`'s answer; True when that completed the request."""
        with self._lock:
            if self._settled:
                return False
            self._answers[part] = answer
            if any(a is None for a in self._answers):
                return False
            self._settled = True
            combined = self._combined()
        self.future.set_result(combined)
        return True

    def force(self, answer: Answer) -> None:
        """Answer the request now with `answer` (it waited too long), unless it is done already."""
        with self._lock:
            if self._settled:
                return
            self._settled = True
        self.future.set_result(answer)

    def done(self) -> bool:
        return self.future.done()

    def answer(self) -> Answer:
        """The request's answer (only once done)."""
        return self.future.result(timeout=0)

    def on_done(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once done (at once, in this thread, if it already is)."""
        self.future.add_done_callback(lambda _: callback())

    def _combined(self) -> Answer:
        if not self.parts:
            return self._answers[0]
        answers = tuple(self._answers)
        times = dict(arrived=min(a.arrived for a in answers),
                     started=min((a.started for a in answers if a.started), default=0.0),
                     finished=max(a.finished for a in answers), threads=max(a.threads for a in answers))
        failed = next((i for i, a in enumerate(answers) if a.failed), None)
        if failed is not None:
            return Answer(answers[failed].outcome.at(failed), answers[failed].batch_size, 0, **times)
        return Answer([a.outcome for a in answers], max(a.batch_size for a in answers), answers[0].bucket,
                      parts=answers, envelope=self.envelope, **times)
