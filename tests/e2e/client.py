"""A small HTTP client for the tests: concurrent posts released together by a barrier."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import requests


@dataclass
class Answer:
    status: int
    body: Any
    headers: dict


def post(url: str, payload: Any, content_type: str = "text/plain", timeout: float = 60) -> Answer:
    data = json.dumps(payload).encode() if content_type == "application/json" and not isinstance(payload, (bytes, str)) else payload
    if isinstance(data, str):
        data = data.encode("utf-8")
    response = requests.post(url, data=data, headers={"Content-Type": content_type}, timeout=timeout)
    try:
        body = response.json()
    except ValueError:
        body = response.text
    return Answer(response.status_code, body, dict(response.headers))


def post_together(url: str, payloads: Sequence[Any], timeout: float = 60) -> list[Answer]:
    """Send every payload at the same moment from its own thread; answers in payload order.

    A payload is text (sent as text/plain) or a (body, content type) tuple.
    """
    barrier = threading.Barrier(len(payloads))
    answers: list[Any] = [None] * len(payloads)

    def send(i: int, payload: Any) -> None:
        body, ct = payload if isinstance(payload, tuple) else (payload, "text/plain")
        barrier.wait()
        try:
            answers[i] = post(url, body, ct, timeout)
        except Exception as error:  # noqa: BLE001 - recorded, then failed on by the test
            answers[i] = error

    threads = [threading.Thread(target=send, args=(i, p)) for i, p in enumerate(payloads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    for answer in answers:
        if not isinstance(answer, Answer):
            raise AssertionError(f"a request got no answer: {answer!r}")
    return answers
