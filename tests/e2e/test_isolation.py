"""Per-request fallback through a real torchserve: a failing batch costs only its failing requests."""
from __future__ import annotations

from tsbatch.handlers.edge.stages import BATCH_SIZE_HEADER
from tests.e2e.client import post, post_together
from tests.support import cosine

TEXTS = [f"request {i}: {word} weather today" for i, word in
         enumerate(["sunny", "cloudy", "windy", "stormy", "foggy", "snowy", "mild", "humid"])]


def singles(url: str, texts):
    answers = [post(url, text) for text in texts]
    assert all(a.status == 200 for a in answers)
    return [a.body["embedding"] for a in answers]


def test_one_poisoned_request_among_eight_fails_alone(torchserve):
    url = f"{torchserve.inference}/predictions/minilm"
    payloads = list(TEXTS)
    payloads[5] = "this one carries POISON for the model"
    answers = post_together(url, payloads)
    assert [a.headers.get(BATCH_SIZE_HEADER) for a in answers] == ["8"] * 8
    statuses = [a.status for a in answers]
    assert statuses.count(500) == 1 and statuses[5] == 500, statuses
    assert answers[5].body["code"] == 500
    assert "InjectedFault" in answers[5].body["error"] and "POISON" in answers[5].body["error"]
    good = [i for i in range(8) if i != 5]
    alone = singles(url, [TEXTS[i] for i in good])
    for i, ref in zip(good, alone):
        assert statuses[i] == 200
        assert cosine(answers[i].body["embedding"], ref) >= 0.9999


def test_out_of_memory_splits_the_batch_and_serves_everyone(torchserve):
    url = f"{torchserve.inference}/predictions/minilm_oom"
    answers = post_together(url, TEXTS)
    assert [a.headers.get(BATCH_SIZE_HEADER) for a in answers] == ["8"] * 8
    assert [a.status for a in answers] == [200] * 8, [a.body for a in answers]
    alone = singles(url, TEXTS)
    for answer, ref in zip(answers, alone):
        assert cosine(answer.body["embedding"], ref) >= 0.9999
    assert "capped at 2" in torchserve.log()
