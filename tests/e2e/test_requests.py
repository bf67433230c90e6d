"""Requests the way users send them (issue #20), through a real torchserve: `curl --data`, many
texts in one request (and the Open Inference Protocol's tensor of texts), and TorchServe's gRPC
inference API with a client built from the protos TorchServe publishes in its own jar.

Served: the archive exactly as `tsbatch archive` builds it (continuous mode, its own
config.properties and model-config.yaml), and the session server's default-mode and async-mode
models, so every mode tsbatch ships answers these shapes.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tsbatch.archiver import server
from tsbatch.handlers.edge.stages import PADDED_HEADER
from tests.e2e.client import GrpcInference, post, post_together
from tests.e2e.conftest import NAME, tsbatch
from tests.support import cosine

SHORT = ["A man is eating food.", "Cats sleep a lot.", "It rained all day in the city.", "Jazz at noon."]
LONG = " ".join(["A far longer passage about serving language models, bucketing requests by their length"
                 " and warming every shape before a worker says it is ready."] * 5)
MIXED = [SHORT[i % 4] + f" ({i})" for i in range(31)] + [LONG]  # 32 texts, one of them long


@pytest.fixture(scope="module", params=["shipped", "default", "async"])
def url(request, torchserve):
    """Each serving mode: the shipped archive (continuous), default and async mode models."""
    if request.param == "shipped":
        return f"{request.getfixturevalue('shipped').inference}/predictions/{NAME}"
    model = {"default": "minilm", "async": "minilm_async"}[request.param]
    return f"{torchserve.inference}/predictions/{model}"


def embedding(url: str, text: str) -> list[float]:
    answer = post(url, text)
    assert answer.status == 200, answer.body
    return answer.body["embedding"]


def curl(*args: str) -> tuple[int, dict]:
    done = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *args], capture_output=True, text=True, timeout=60)
    body, _, status = done.stdout.rpartition("\n")
    return int(status), json.loads(body)


def test_curl_data_urlencode_text_gets_the_embedding_text_plain_gets(url):
    text = "1 + 1 = 2 & more"
    status, body = curl("-X", "POST", url, "--data-urlencode", f"text={text}")
    assert status == 200, body
    assert cosine(body["embedding"], embedding(url, text)) >= 0.9999


@pytest.mark.parametrize("data", ["A man is eating food.", "x = 1 + 2"])
def test_curl_data_without_a_content_type_gets_415_saying_what_arrived_and_what_to_send(url, data):
    # TorchServe's frontend parses curl's default form body before any handler sees it: a text
    # without '=' arrives as no field at all, one with '=' split and '+' read as a space
    status, body = curl("-X", "POST", url, "--data", data)
    assert status == 415 and body["code"] == 415, body
    assert "application/x-www-form-urlencoded" in body["error"]
    assert "-H 'Content-Type: text/plain'" in body["error"] and "--data-urlencode" in body["error"]
    status, body = curl("-X", "POST", url, "-H", "Content-Type: text/plain", "--data", data)
    assert status == 200 and cosine(body["embedding"], embedding(url, data)) >= 0.9999  # the fix it names


def test_32_mixed_texts_in_one_request_equal_32_requests_and_keep_their_own_padding(url):
    answer = post(url, {"text": MIXED}, "application/json", timeout=120)
    assert answer.status == 200, answer.body
    assert len(answer.body) == 32
    alone = [a.body["embedding"] for a in post_together(url, MIXED, timeout=120)]
    for listed, single in zip(answer.body, alone):
        assert cosine(listed["embedding"], single) >= 0.999
    padded = [int(p) for p in answer.headers[PADDED_HEADER].split(",")]
    assert len(padded) == 32 and padded[-1] >= 128 and max(padded[:-1]) <= 32  # the long one padded nobody


def test_the_aliases_and_the_kserve_shapes_answer_alike(url):
    texts = SHORT[:3]
    expected = [embedding(url, t) for t in texts]
    for payload in ({"inputs": texts}, {"input": texts}, {"instances": texts}):
        answer = post(url, payload, "application/json")
        assert answer.status == 200, answer.body
        results = answer.body["predictions"] if "instances" in payload else answer.body
        assert all(cosine(a["embedding"], e) >= 0.9999 for a, e in zip(results, expected))
    tensor = {"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": texts}]}
    answer = post(url, tensor, "application/json")
    assert answer.status == 200, answer.body
    [vectors] = [o for o in answer.body["outputs"] if o["name"] == "embedding"]
    assert vectors["shape"] == [3, 384]
    assert all(cosine(vectors["data"][i * 384:(i + 1) * 384], e) >= 0.9999 for i, e in enumerate(expected))


def test_a_bad_text_fails_its_request_naming_it_while_a_request_beside_it_is_answered(url):
    bad, good = post_together(url, [(json.dumps({"text": [SHORT[0], ""]}), "application/json"), SHORT[1]])
    assert bad.status == 400 and bad.body["index"] == 1 and bad.body["error"].startswith("text 1:")
    assert good.status == 200 and len(good.body["embedding"]) == 384
    too_many = post(url, {"text": ["x"] * 33}, "application/json")
    assert too_many.status == 413 and "at most 32" in too_many.body["error"]


# -- gRPC ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grpc_inference(tmp_path_factory, shipped):
    """Predictions on the shipped archive's gRPC port (its config.properties)."""
    client = GrpcInference(shipped.properties, NAME, str(tmp_path_factory.mktemp("grpc")))
    yield client.predict
    client.close()


def test_grpc_answers_what_http_answers_and_fails_a_malformed_request_alone(grpc_inference, shipped):
    predict = grpc_inference
    http = f"{shipped.inference}/predictions/{NAME}"
    text = "A man is eating food."
    assert cosine(predict(text.encode())["embedding"], embedding(http, text)) >= 0.9999
    listed = predict(json.dumps({"text": SHORT}).encode())  # gRPC sends no content type: JSON by its shape
    assert [round(cosine(a["embedding"], embedding(http, t)), 4) for a, t in zip(listed, SHORT)] == [1.0] * 4
    # TorchServe 0.12's GRPCJob drops the handler's status code: a request that fails arrives as an
    # OK reply whose prediction is tsbatch's JSON error, for that request alone
    failed = predict(b"\xff\xfe not utf-8")
    assert failed["code"] == 400 and "UTF-8" in failed["error"]
    bad_item = predict(json.dumps({"text": ["fine", ""]}).encode())
    assert bad_item["code"] == 400 and bad_item["index"] == 1
    assert cosine(predict(SHORT[2].encode())["embedding"], embedding(http, SHORT[2])) >= 0.9999  # still serving


# -- KServe ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kserve_pod(tmp_path_factory, built_profile):
    """`tsbatch export --kserve` started as KServe's TorchServe runtime starts it: `torchserve
    --start --model-store --ts-config` with the export's own config.properties (the model loads
    from its model_snapshot) and TS_SERVICE_ENVELOPE set as the runtime sets it. Only /mnt/models
    becomes this folder and the pod's ports free loopback ones."""
    root = tmp_path_factory.mktemp("kserve")
    out = root / "export"
    tsbatch("export", "--kserve", "--out", str(out), "--name", NAME, "--profile", built_profile)
    properties = out / "config" / "config.properties"
    text = properties.read_text()
    assert "enable_envvars_config=false" in text
    ports = server.free_ports(4)
    for old, new in (("/mnt/models", str(out)), (":8085", f":{ports[0]}"), ("0.0.0.0:8082", f"127.0.0.1:{ports[1]}"),
                     ("grpc_inference_port=7070", f"grpc_inference_port={ports[2]}"),
                     ("grpc_management_port=7071", f"grpc_management_port={ports[3]}")):
        assert old in text, old
        text = text.replace(old, new)
    properties.write_text(text)
    paths = server.ServerPaths(str(root / "tmp"), str(root / "logs"))
    os.makedirs(paths.tmpdir)
    os.makedirs(paths.logs)
    env = {**paths.env(), "TS_SERVICE_ENVELOPE": "kservev2"}  # what the runtime sets for protocol v2
    subprocess.run([server.torchserve_bin(), "--start", f"--model-store={out}/model-store", f"--ts-config={properties}"],
                   env=env, cwd=paths.tmpdir, check=True, timeout=120, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{ports[0]}"
    try:
        server.wait_ready(url, NAME, 600, log_hint=f"; see {paths.logs}")
        yield url
    finally:
        server.stop(paths)


def test_kserve_v1_instances_are_batched_and_answered_as_predictions(kserve_pod):
    texts = SHORT + [LONG]
    alone = [a.body["embedding"] for a in post_together(f"{kserve_pod}/predictions/{NAME}", texts)]
    calls = post_together(f"{kserve_pod}/v1/models/{NAME}:predict",
                          [(json.dumps({"instances": texts}), "application/json")] * 3)
    for answer in calls:
        assert answer.status == 200, answer.body
        predictions = answer.body["predictions"]
        assert [round(cosine(p["embedding"], a), 3) for p, a in zip(predictions, alone)] == [1.0] * 5
        assert answer.headers[PADDED_HEADER].split(",")[-1] != answer.headers[PADDED_HEADER].split(",")[0]
    objects = post(f"{kserve_pod}/v1/models/{NAME}:predict", {"instances": [{"text": t} for t in SHORT]},
                   "application/json")
    assert objects.status == 200 and len(objects.body["predictions"]) == 4


def test_kserve_v2_tensor_of_texts_is_answered_in_the_open_inference_protocol(kserve_pod):
    alone = [a.body["embedding"] for a in post_together(f"{kserve_pod}/predictions/{NAME}", SHORT)]
    tensor = {"id": "r1", "inputs": [{"name": "text", "shape": [4], "datatype": "BYTES", "data": SHORT}]}
    answer = post(f"{kserve_pod}/v2/models/{NAME}/infer", tensor, "application/json")
    assert answer.status == 200, answer.body
    assert answer.body["model_name"] == NAME
    embedding = next(o for o in answer.body["outputs"] if o["name"] == "embedding")
    assert embedding["shape"] == [4, 384] and embedding["datatype"] == "FP32"
    rows = [embedding["data"][i * 384:(i + 1) * 384] for i in range(4)]
    assert all(cosine(row, a) >= 0.999 for row, a in zip(rows, alone))
    bad = post(f"{kserve_pod}/v2/models/{NAME}/infer",
               {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, "application/json")
    assert bad.status == 400 and "BYTES" in bad.body["error"]


def test_the_shipped_worker_warms_the_frontend_through_its_inference_address(shipped):
    """tsbatch archive sets handler.frontend_warmup to config.properties' inference address: as the
    worker goes READY it sends itself three requests through the frontend, and all are answered."""
    url = f"{shipped.inference}/predictions/{NAME}"
    deadline = time.monotonic() + 60
    while "tsbatch frontend warmup" not in shipped.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = [line for line in shipped.log().splitlines() if "tsbatch frontend warmup" in line]
    assert len(lines) == 1 and f"{url} answered [200, 200, 200]" in lines[0], lines
