"""tsbatch's scheduler modes through a real torchserve: continuous (shipped) and async."""
from __future__ import annotations

import pytest
import requests

from tsbatch.archiver import server
from tsbatch.handlers.edge.stages import BATCH_SIZE_HEADER
from tests.e2e.client import GrpcInference, post, post_together
from tests.e2e.conftest import NAME, serve_built
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


@pytest.fixture(scope="module")
def shipped_async(tmp_path_factory, built_profile):
    """The archive `tsbatch archive --mode async` builds, served as built (its own ports, gRPC too)."""
    served = serve_built(tmp_path_factory.mktemp("async"), built_profile, "--mode", "async")
    try:
        server.wait_ready(served.management, NAME, 600)
        yield served
    finally:
        server.stop(served.paths)


def test_async_mode_answers_grpc_predictions_again_and_again_and_keeps_its_worker(shipped_async, tmp_path):
    """TorchServe 0.12 completes a gRPC Predictions call at its first reply and kills an async
    worker that sends a second: a gRPC request gets its answer as the one final reply."""
    def worker_pids() -> list:
        workers = requests.get(f"{shipped_async.management}/models/{NAME}", timeout=10).json()[0]["workers"]
        assert [w["status"] for w in workers] == ["READY"] * len(workers)
        return [w["pid"] for w in workers]

    before = worker_pids()
    grpc = GrpcInference(shipped_async.properties, NAME, str(tmp_path))
    try:
        http = f"{shipped_async.inference}/predictions/{NAME}"
        for text in TEXTS[:3]:
            answer = grpc.predict(text.encode())
            assert cosine(answer["embedding"], post(http, text).body["embedding"]) >= 0.9999
        failed = grpc.predict(b"\xff\xfe not utf-8")
        assert failed["code"] == 400 and "UTF-8" in failed["error"]
        assert "embedding" in grpc.predict(TEXTS[4].encode())  # the worker that answered is still there
    finally:
        grpc.close()
    assert worker_pids() == before  # no worker died on the way
    assert post(f"{shipped_async.inference}/predictions/{NAME}", TEXTS[5]).status == 200
