"""tsbatch's scheduler modes through a real torchserve: continuous (shipped) and async."""
from __future__ import annotations

import pytest
import requests

from tsbatch.handlers.stages import BATCH_SIZE_HEADER
from tests.e2e.client import post, post_together
from tests.support import cosine

TEXTS = [f"async request {i} about {w}" for i, w in enumerate(
    ["owls", "boats", "tea", "maps", "snow", "drums", "lamps", "kites"])]


SCHEDULER_MODELS = pytest.mark.parametrize("model", ["minilm_cont", "minilm_async"])


@SCHEDULER_MODELS
def test_scheduler_modes_answer_each_request_with_its_own_status(torchserve, model):
    url = f"{torchserve.inference}/predictions/{model}"
    singles = [post(url, t) for t in TEXTS]
    assert [a.status for a in singles] == [200] * 8
    payloads = list(TEXTS)
    payloads[2] = "POISON in here"
    payloads[6] = (b"{broken", "application/json")
    answers = post_together(url, payloads)
    assert [a.status for a in answers] == [200, 200, 500, 200, 200, 200, 400, 200], [(a.status, str(a.body)[:80], a.headers) for a in answers]
    assert answers[2].body["code"] == 500 and answers[6].body["code"] == 400
    for i in (0, 1, 3, 4, 5, 7):
        assert cosine(answers[i].body["embedding"], singles[i].body["embedding"]) >= 0.9999
    # tsbatch, not the frontend, formed the batches: some request shared a pass with others
    assert max(int(a.headers[BATCH_SIZE_HEADER]) for a in answers if a.status == 200) > 1


@SCHEDULER_MODELS
def test_priority_and_deadline_headers(torchserve, model):
    url = f"{torchserve.inference}/predictions/{model}"
    high = requests.post(url, data=b"urgent", headers={"Content-Type": "text/plain", "X-Priority": "high"}, timeout=30)
    assert high.status_code == 200
    bad = requests.post(url, data=b"x", headers={"Content-Type": "text/plain", "X-Priority": "urgent"}, timeout=30)
    assert bad.status_code == 400 and "X-Priority" in bad.json()["error"]
    bad = requests.post(url, data=b"x", headers={"Content-Type": "text/plain", "X-Deadline-Ms": "soon"}, timeout=30)
    assert bad.status_code == 400 and "X-Deadline-Ms" in bad.json()["error"]
