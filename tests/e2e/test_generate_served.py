"""The generation example (examples/generate) as a team runs it: copied outside the project,
archived by the `tsbatch` CLI of the wheel in a fresh venv (profiled and tuned here) and served by a
real torchserve with what that command wrote. Asks for few tokens are bucketed apart from asks for
many and get the answer they get alone; bad asks fail alone."""
from __future__ import annotations

import json
import os
import zipfile

import pytest
import requests
import yaml

from bench.loadtest.load import Load
from tests.e2e.conftest import REPO, serve_example
from tsbatch.handlers.edge.stages import PADDED_HEADER

EXAMPLE = os.path.join(REPO, "examples", "generate")
NAME = "gen"
HANDLER_YAML = ("handler: {buckets: [[16, 64], [8, 64]], max_batch_size: 4, long_lane_from: 80}\n"
                "model: {max_prompt_tokens: 64, max_new_tokens: 64}\n")  # the model's limits: its own section


@pytest.fixture(scope="module")
def gen(tmp_path_factory, wheel_venv):
    with serve_example(tmp_path_factory.mktemp("gen"), wheel_venv, EXAMPLE, NAME, [],
                       ["--handler", "gen_handler.py", "--extra-files", "gen_model.py", "--target-ms", "2000"],
                       HANDLER_YAML) as served:  # the target docs/writing-a-model.md archives it with
        yield served


def ask(text: str, new: int) -> bytes:
    return json.dumps({"text": text, "max_new_tokens": new}).encode()


def post(served, body: bytes):
    return requests.post(f"{served.inference}/predictions/{NAME}", data=body,
                         headers={"Content-Type": "application/json"}, timeout=120)


def test_the_archive_warms_every_prompt_and_new_token_bucket(gen):
    with zipfile.ZipFile(os.path.join(gen.store, f"{NAME}.mar")) as mar:
        names = set(mar.namelist())
        handler = yaml.safe_load(mar.read("model-config.yaml"))["handler"]
        profile = json.loads(mar.read("latency_profile.json"))
    assert {"gen_handler.py", "gen_model.py", "tsbatch/__init__.py", "tsbatch/handlers/api.py"} <= names
    assert handler["buckets"] == [[16, 64], [8, 64]]
    assert set(handler["batch_caps"]) == {"16x8", "64x8", "16x64", "64x64"}
    warmed = {(s["batch"], tuple(s["bucket"])) for s in profile["shapes"]}
    for label, cap in handler["batch_caps"].items():
        bucket = tuple(int(edge) for edge in label.split("x"))
        assert {(b, bucket) for b in (1, 2, 4) if b <= cap} <= warmed


def test_short_asks_in_a_mixed_load_get_their_own_buckets_and_their_answer_alone(gen):
    shorts = {f"short-{i}": ask(f"question {i}: what is the capital of the country?", 8) for i in range(6)}
    longs = {f"long-{i}": ask(f"tell a long story number {i} about the sea and the ships", 64) for i in range(4)}
    alone = {rid: post(gen, body) for rid, body in {**shorts, **longs}.items()}
    assert all(r.status_code == 200 for r in alone.values())
    load = Load()
    try:
        futures = {rid: load.send(f"{gen.inference}/predictions/{NAME}", body, "application/json", timeout=120)
                   for rid, body in {**longs, **shorts}.items()}  # the long asks go first
        shots = {rid: f.result(timeout=300) for rid, f in futures.items()}
    finally:
        load.close(1)
    for rid, shot in shots.items():
        assert shot.status == 200, shot.body[:200]
        assert json.loads(shot.body) == alone[rid].json()
    assert {shots[rid].headers[PADDED_HEADER] for rid in shorts} == {"16x8"}
    assert {shots[rid].headers[PADDED_HEADER] for rid in longs} == {"16x64"}
    assert all(json.loads(shots[rid].body)["new_tokens"] <= 8 for rid in shorts)


def test_bad_asks_fail_alone_with_a_clear_json_error(gen):
    zero = post(gen, ask("hello", 0))
    assert zero.status_code == 400 and "max_new_tokens" in zero.json()["error"]
    long_prompt = post(gen, ask(" ".join(["word"] * 70), 8))
    assert long_prompt.status_code == 413 and "at most 64x64" in long_prompt.json()["error"]
    not_json = post(gen, b"{oops")
    assert not_json.status_code == 400 and "send JSON" in not_json.json()["error"]
    assert post(gen, ask("still fine", 4)).status_code == 200
