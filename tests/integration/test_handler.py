"""The handler with a TorchServe-shaped context and real models: contract, bad input, tasks."""
from __future__ import annotations

import re

import pytest

from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.edge.stages import BATCH_SIZE_HEADER
from tsbatch.handlers.models.encoder_handler import EncoderHandler
from tests.support import call, cosine, load_handler, make_context

TEXTS = [
    "A man is eating food.",
    "The new movie is awesome!",
    "hello world",
    "Ünïcödé, emoji 🚀 and 中文 mixed scripts",
    " ".join(["longer input"] * 60),
]


def load(model_dir: str, **handler):
    return load_handler(model_dir, **handler)


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return load(minilm_dir)


@pytest.fixture(scope="module")
def st_model(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_dir, device="cpu")


def test_embeddings_match_sentence_transformers(minilm, st_model):
    handler, context = minilm
    replies = call(handler, context, TEXTS)
    expected = st_model.encode(TEXTS)
    for text, reply, ref in zip(TEXTS, replies, expected):
        assert reply.status == 200, reply.body
        assert len(reply.body["embedding"]) == 384
        assert cosine(reply.body["embedding"], ref.tolist()) >= 0.999, text
        assert reply.body["tokens"] == len(st_model.tokenizer(text)["input_ids"])


def test_text_longer_than_the_model_is_truncated_like_sentence_transformers(minilm, st_model):
    handler, context = minilm
    text = "word " * 400  # 400+ tokens; the default model's limit is 256
    (reply,) = call(handler, context, [text])
    assert reply.status == 200
    assert reply.body["tokens"] == 256
    assert cosine(reply.body["embedding"], st_model.encode([text])[0].tolist()) >= 0.999


def test_json_and_plain_bodies_give_the_same_answer(minilm):
    handler, context = minilm
    plain, as_json = call(handler, context, ["hello world", ({"text": "hello world"}, "application/json")])
    assert plain.status == as_json.status == 200
    assert cosine(plain.body["embedding"], as_json.body["embedding"]) > 0.99999


def test_batched_answers_equal_single_answers(minilm):
    handler, context = minilm
    together = call(handler, context, TEXTS)
    for text, reply in zip(TEXTS, together):
        (alone,) = call(handler, context, [text])
        assert cosine(alone.body["embedding"], reply.body["embedding"]) >= 0.9999
        assert reply.headers[BATCH_SIZE_HEADER] == str(len(TEXTS))


BAD_INPUTS = [
    pytest.param(b"", "text/plain", "empty", id="empty-body"),
    pytest.param(b"\xff\xfe\xfa", "text/plain", "UTF-8", id="invalid-utf8"),
    pytest.param(b'{"text": ', "application/json", "JSON", id="malformed-json"),
    pytest.param({"txt": "hi"}, "application/json", '"text"', id="missing-text"),
    pytest.param({"text": 42}, "application/json", "string", id="non-string-text"),
    pytest.param(["a", "b"], "application/json", "object", id="json-list"),
    pytest.param("   \n\t", "text/plain", "empty", id="blank-text"),
]


@pytest.mark.parametrize("payload, content_type, words", BAD_INPUTS)
def test_bad_input_fails_alone_with_400(minilm, payload, content_type, words):
    handler, context = minilm
    replies = call(handler, context, ["good one", (payload, content_type), "another good one"])
    assert [r.status for r in replies] == [200, 400, 200]
    bad = replies[1].body
    assert set(bad) == {"error", "code"} and bad["code"] == 400
    assert words in bad["error"]
    assert len(replies[0].body["embedding"]) == len(replies[2].body["embedding"]) == 384


def test_unencodable_text_is_a_400_not_a_crash(minilm):
    handler, context = minilm
    replies = call(handler, context, [({"text": "lone surrogate \ud800 here"}, "application/json"), "fine"])
    assert replies[1].status == 200
    assert replies[0].status in (200, 400)
    if replies[0].status == 400:
        assert replies[0].body["code"] == 400


def test_too_long_with_truncation_off_is_413_alone(minilm_dir):
    handler, context = load(minilm_dir, truncation=False)
    replies = call(handler, context, ["short", "word " * 300, "also short"])
    assert [r.status for r in replies] == [200, 413, 200]
    assert replies[1].body["code"] == 413
    assert "256" in replies[1].body["error"] and "tokens" in replies[1].body["error"]


def test_sequence_classification_labels_come_from_id2label(tiny_models):
    model_dir = tiny_models["sequence_classification"]
    handler, context = load(model_dir, task="sequence_classification")
    replies = call(handler, context, TEXTS[:3])
    for reply in replies:
        assert reply.status == 200
        body = reply.body
        assert set(body) == {"label", "score", "scores"}
        assert set(body["scores"]) == {"NEGATIVE", "POSITIVE"}
        assert body["label"] == max(body["scores"], key=body["scores"].get)
        assert body["score"] == pytest.approx(body["scores"][body["label"]])
        assert sum(body["scores"].values()) == pytest.approx(1.0, abs=1e-5)


def test_token_classification_entities_point_into_the_text(tiny_models):
    model_dir = tiny_models["token_classification"]
    handler, context = load(model_dir, task="token_classification")
    texts = ["Angela Merkel visited Paris and Berlin last week", "nothing"]
    replies = call(handler, context, texts)
    found = 0
    for text, reply in zip(texts, replies):
        assert reply.status == 200
        for entity in reply.body["entities"]:
            assert set(entity) == {"word", "label", "score", "start", "end"}
            assert entity["word"] == text[entity["start"] : entity["end"]]
            assert entity["label"] in {"PER", "LOC"}
            assert 0.0 < entity["score"] <= 1.0
            found += 1
    assert found > 0, "a random 5-label head labels some tokens as entities"


@pytest.mark.parametrize("handler_section, words", [
    ({"task": "summarize"}, "handler.task"),
    ({"model_dir": "model"}, "handler.task is required: one of ['embedding', 'sequence_classification', 'token_classification']"),
    ({"task": "embedding", "buckets": [64, 32]}, "strictly increasing"),
    ({"task": "embedding", "max_batch_tokens": "many"}, "max_batch_tokens"),
    ({"task": "embedding", "model_dir": "/nonexistent/model"}, "does not exist"),
])
def test_bad_config_fails_at_load_with_a_clear_message(minilm_dir, handler_section, words):
    context = make_context(minilm_dir, handler_section)
    with pytest.raises(ConfigError, match=re.escape(words)):
        EncoderHandler().initialize(context)


def test_async_and_continuous_together_fail_at_load(minilm_dir):
    context = make_context(minilm_dir, {"task": "embedding", "model_dir": minilm_dir, "warmup": False},
                           frontend={"asyncCommunication": True, "continuousBatching": True})
    with pytest.raises(ConfigError, match="both asyncCommunication and continuousBatching"):
        EncoderHandler().initialize(context)


def test_token_budget_below_one_request_of_the_largest_bucket_fails_at_load(minilm_dir):
    context = make_context(minilm_dir, {"task": "embedding", "model_dir": minilm_dir, "max_batch_tokens": 100,
                                        "warmup": False})
    with pytest.raises(ConfigError, match=r"max_batch_tokens \(100\) must hold one request of the largest bucket \(256"):
        EncoderHandler().initialize(context)


def test_rows_beyond_the_contexts_requests_still_get_bodies(minilm):
    """KServe's envelope hands one request's instances to handle() as several rows."""
    from ts.context import RequestProcessor

    handler, context = minilm
    context.request_processor = [RequestProcessor({"body": {"content-type": "application/json"}})]
    context.request_ids = {0: "req-0"}
    bodies = handler.handle([{"body": {"text": "one"}}, {"body": {"text": "two"}}, {"body": {"txt": 3}}], context)
    assert len(bodies) == 3
    import json as _json

    parsed = [_json.loads(b) for b in bodies]
    assert len(parsed[0]["embedding"]) == len(parsed[1]["embedding"]) == 384
    assert parsed[2]["code"] == 400


# -- huge inputs: tokenized from a prefix, with the same tokens as the whole text ------------------

HUGE_INPUTS = {
    "plain words": " ".join(f"word{i % 97} and more" for i in range(60_000)),
    "newlines only": "\n".join(["Zürich naïve café résumé"] * 20_000),
    "punctuation, no whitespace": "unbroken-request," + "word," * 180_000,  # cut mid-word, twice
    "no whitespace": "x" * 50_000,  # one giant word: [UNK] however much of it is read
}


@pytest.mark.parametrize("name", sorted(HUGE_INPUTS))
def test_a_huge_input_gets_the_tokens_of_the_whole_text_from_a_prefix(minilm, name):
    import time

    handler, _context = minilm
    text = HUGE_INPUTS[name]
    started = time.perf_counter()
    tokens, encoding = handler.model.tokenize(text)
    elapsed = time.perf_counter() - started
    whole = handler.model._encode(text, True)
    assert encoding.features["input_ids"] == list(whole["input_ids"])
    assert tokens == len(whole["input_ids"])
    assert handler.model._tokenize_prefix(text) is not None  # never read whole
    print(f"{name}: {len(text)} chars -> {tokens} tokens in {elapsed * 1000:.1f} ms")


def test_no_input_has_more_than_its_bound_of_characters_read(minilm, monkeypatch):
    """Issue #38: a gap of whitespace longer than the bound: the model gets the tokens of the first
    max_length x READ_CHARS_PER_TOKEN characters (not the whole text's), and the tokenizer never
    sees more than that."""
    from tsbatch.handlers.models.encoder import READ_CHARS_PER_TOKEN

    handler, _context = minilm
    model = handler.model
    bound = model.max_length * READ_CHARS_PER_TOKEN
    text = "hello " + " " * (2 * bound) + " ".join(["world"] * 5_000)
    read = []
    encode = model._encode
    monkeypatch.setattr(model, "_encode", lambda t, truncate: read.append(len(t)) or encode(t, truncate))
    tokens, encoding = model.tokenize(text)
    assert max(read) <= bound
    assert encoding.features["input_ids"] == list(encode(text[:bound], True)["input_ids"])
    assert tokens < len(encode(text, True)["input_ids"])  # the bound cost this contrived text its tail
    short = "a short text " * 10
    read.clear()
    assert model.tokenize(short)[1].features["input_ids"] == list(encode(short, True)["input_ids"])
    assert read == [len(short)]


def test_a_huge_input_keeps_character_offsets_for_token_classification(tiny_models):
    handler, _context = load(tiny_models["token_classification"], task="token_classification")
    text = " ".join(["Alice met Bob in Paris."] * 5_000)
    _tokens, encoding = handler.model.tokenize(text)
    whole = handler.model._encode(text, True)
    assert encoding.offsets == [tuple(o) for o in whole["offset_mapping"]]
