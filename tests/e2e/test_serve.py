"""The default model through a real torchserve: correct answers, isolated bad input, scaling."""
from __future__ import annotations

import glob
import json
import os
import re
import time

import pytest

from tsbatch.archiver import server
from tsbatch.handlers.edge.stages import BATCH_SIZE_HEADER, WORKER_HEADER
from tests.e2e.client import post, post_together
from tests.support import cosine

TEXTS = [f"sentence number {i} about {topic}" for i, topic in
         enumerate(["cats", "the stock market", "rain in spring", "a red bicycle",
                    "quantum physics", "bread baking", "mountain hiking", "jazz music"])]


@pytest.fixture(scope="module")
def reference(minilm_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_dir, device="cpu")
    return lambda texts: [v.tolist() for v in model.encode(list(texts))]


def test_default_model_serves_correct_embeddings(torchserve, reference):
    text = "A man is eating food."
    answer = post(f"{torchserve.inference}/predictions/minilm", text)
    assert answer.status == 200, answer.body
    assert answer.headers["content-type"].startswith("application/json")
    assert len(answer.body["embedding"]) == 384
    assert cosine(answer.body["embedding"], reference([text])[0]) >= 0.999
    as_json = post(f"{torchserve.inference}/predictions/minilm", {"text": text}, "application/json")
    assert as_json.status == 200 and cosine(as_json.body["embedding"], answer.body["embedding"]) > 0.9999


def test_one_malformed_request_fails_alone_inside_one_batch(torchserve, reference):
    payloads = list(TEXTS)
    payloads[3] = (b'{"text": "unterminated', "application/json")
    answers = post_together(f"{torchserve.inference}/predictions/minilm", payloads)
    # proof that the eight met in one TorchServe batch: the handler reports the batch it got
    assert [a.headers.get(BATCH_SIZE_HEADER) for a in answers] == ["8"] * 8
    statuses = [a.status for a in answers]
    assert statuses.count(400) == 1 and statuses[3] == 400, statuses
    assert answers[3].body["code"] == 400 and "JSON" in answers[3].body["error"]
    good = [i for i in range(8) if i != 3]
    expected = reference([TEXTS[i] for i in good])
    for i, ref in zip(good, expected):
        assert answers[i].status == 200
        assert cosine(answers[i].body["embedding"], ref) >= 0.999


def test_oversized_body_is_refused_by_the_frontend_and_the_worker_lives(torchserve):
    huge = "x" * (2 << 20)  # over the generated max_request_size of 1 MiB
    answer = post(f"{torchserve.inference}/predictions/minilm", huge)
    assert answer.status == 413
    assert post(f"{torchserve.inference}/predictions/minilm", "still alive").status == 200


def test_scaling_to_two_workers_through_the_management_api(torchserve):
    try:
        workers = server.scale(torchserve.management, "minilm", 2, 2, timeout=300)
        assert len(workers) == 2 and {w["status"] for w in workers} == {"READY"}
        pids = set()
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            for answer in post_together(f"{torchserve.inference}/predictions/minilm", TEXTS[:4]):
                assert answer.status == 200
                pids.add(answer.headers[WORKER_HEADER])
        assert len(pids) == 2, f"only worker(s) {pids} answered"
        # every worker that answered had finished warmup inside initialize(), i.e. before READY
        warmed = set(re.findall(r"tsbatch warmup done in [\d.]+s by worker pid (\d+)", torchserve.log()))
        assert pids <= warmed, f"workers {pids - warmed} served without warmup"
    finally:
        server.scale(torchserve.management, "minilm", 1, 2, timeout=300)


def test_latency_profile_is_in_the_archives_model_directory(torchserve):
    found = glob.glob(os.path.join(torchserve.paths.tmpdir, "models", "*", "latency_profile.json"))
    profiles = [json.load(open(p)) for p in found]
    minilm = [p for p in profiles if p["model"] == "minilm"]
    assert minilm, f"no profile for minilm among {found}"
    shapes = {(s["batch"], s["bucket"]) for s in minilm[0]["shapes"]}
    buckets = {b for _, b in shapes}
    assert {1, 2, 4, 8} == {b for b, _ in shapes} and buckets == {16, 64, 256}
