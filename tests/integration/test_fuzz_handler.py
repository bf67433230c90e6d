"""Fuzzing the handler's whole request path with TorchServe-shaped batches of arbitrary rows.

EncoderHandler (warmup off) gets batches of 1-6 rows in every shape TorchServe can hand over:
str, bytes, parsed JSON, under "body" or "data", with any content type. Whatever the mix:
handle() never raises, returns one body per row, every malformed row gets its own 4xx JSON error
{"error", "code"} and every valid row a 200 with its own result, whatever its neighbours are.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tsbatch.handlers.core.errors import ConfigError, ServingError
from tsbatch.handlers.edge.config import HandlerConfig
from tsbatch.handlers.edge.parse import many, parse_text, row_value
from tsbatch.handlers.edge.stages import BATCH_SIZE_HEADER, WORKER_HEADER
from tsbatch.handlers.models.encoder_handler import EncoderHandler
from tests.support import make_context

FUZZ = settings(max_examples=50, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

JSON_TYPES = ["application/json", "application/json; charset=utf-8"]
TEXT_TYPES = ["text/plain", "text/plain; charset=utf-8", None, "application/octet-stream"]
MIXED = st.sampled_from([
    "A man is eating food.", "Ünïcödé", "中文字符", "日本語", "العربية", "русский", "🚀👍🏽", "e\u0301",
    "\x00\x07\x1b[0m", "\t\n", "\u200b\ufeff", "\U0010ffff", " word", "POISON-free text",
])
texts = st.one_of(st.text(min_size=1, max_size=80), st.lists(MIXED, min_size=1, max_size=12).map("".join)) \
    .filter(lambda t: t.strip())


@dataclass
class Row:
    """One request as TorchServe hands it to handle(), and what the client deserves."""

    row: dict
    content_type: str | None
    expect: str  # "ok", "bad", or "either" (an arbitrary payload: parse decides)
    text: str | None = None


def _valid(text: str, shape: int, key: str, content_type: str | None) -> Row:
    if shape == 0:
        return Row({key: text}, content_type or "text/plain", "ok", text)
    if shape == 1:
        return Row({key: text.encode("utf-8")}, content_type, "ok", text)
    if shape == 2:
        return Row({key: {"text": text, "extra": [1, None]}}, "application/json", "ok", text)
    return Row({key: json.dumps({"text": text}).encode()}, JSON_TYPES[shape % 2], "ok", text)


valid_rows = st.builds(_valid, texts, st.integers(0, 4), st.sampled_from(["body", "data"]), st.sampled_from(TEXT_TYPES))

MALFORMED = [
    ({"body": b""}, "text/plain"), ({"body": b"   \n\t"}, None), ({"body": "  "}, "text/plain"),
    ({"body": b"\xff\xfe\xfd"}, "text/plain"), ({"body": b"ok then \xc3\x28"}, None),
    ({"body": b'{"text": '}, "application/json"), ({"body": b"{'text': 'single'}"}, "application/json"),
    ({"body": b'{"txt": "x"}'}, "application/json"), ({"body": {"text": 7}}, "application/json"),
    ({"body": {"text": None}}, "application/json"), ({"body": {"text": []}}, "application/json"),
    ({"body": {"text": ["a", 7]}}, "application/json"), ({"body": {"inputs": ["ok", "  "]}}, "application/json"),
    ({"body": ["a", "b"]}, "application/json"), ({"body": 42}, "application/json"), ({"body": True}, "application/json"),
    ({"body": None}, None), ({}, None), ({"data": {"text": "  "}}, "application/json"),
    ({"body": b"[1, 2]"}, "application/json"), ({"body": b"null"}, "application/json"),
    ({"a": "x", "b": "y"}, None),
]
malformed_rows = st.sampled_from(MALFORMED).map(lambda r: Row(r[0], r[1], "bad"))
arbitrary_rows = st.builds(
    lambda key, payload, ct: Row({key: payload}, ct, "either"),
    st.sampled_from(["body", "data"]),
    st.one_of(st.binary(max_size=120), st.text(max_size=120),
              st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=30)),
                           lambda c: st.one_of(st.lists(c, max_size=3),
                                               st.dictionaries(st.sampled_from(["text", "x"]), c, max_size=2)),
                           max_leaves=6)),
    st.one_of(st.none(), st.sampled_from(JSON_TYPES + TEXT_TYPES + ["text/html", "image/png"]), st.text(max_size=20)),
)
batches = st.lists(st.one_of(valid_rows, malformed_rows, arbitrary_rows), min_size=1, max_size=6)


def load(model_dir: str, **handler) -> tuple[EncoderHandler, Any]:
    context = make_context(model_dir, {"task": "embedding", "model_dir": model_dir, "warmup": False, **handler})
    obj = EncoderHandler()
    obj.initialize(context)
    return obj, context


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return load(minilm_dir)


@pytest.fixture(scope="module")
def strict_tiny(tiny_models):
    """A classifier that refuses long inputs (413) instead of truncating them."""
    model_dir = tiny_models["sequence_classification"]
    return load(model_dir, task="sequence_classification", truncation=False, max_length=24)


def handle(handler, context, rows: list[Row]):
    """Run one TorchServe batch through handle() exactly as the worker's service does."""
    from ts.context import RequestProcessor

    context.request_processor = [
        RequestProcessor({key: {"content-type": r.content_type} for key in (r.row or {"body": None})}
                         if r.content_type is not None else {}) for r in rows]
    context.request_ids = {i: f"fuzz-{i}" for i in range(len(rows))}
    bodies = handler.handle([r.row for r in rows], context)  # must not raise, whatever the rows
    return bodies


def texts_of(row: Row) -> str | list[str] | None:
    """What the row asks for as the handler's parse reads it: one text, a list of texts (a request
    of several, answered with a list), or None for a row that deserves 400."""
    try:
        value = row_value(row.row, row.content_type)
        found = many(value, row.content_type)
        if found is not None:
            return [parse_text(body, row.content_type) for body in found[0]]
        return parse_text(value, row.content_type)
    except ServingError:
        return None


def check_batch(handler, context, rows: list[Row], tokens_limit: int | None = None) -> list[int]:
    bodies = handle(handler, context, rows)
    assert isinstance(bodies, list) and len(bodies) == len(rows), f"{len(bodies)} bodies for {len(rows)} rows"
    statuses = []
    for i, (row, raw) in enumerate(zip(rows, bodies)):
        status, _ = context.get_response_status(i)
        headers = context.get_response_headers(i)
        body = json.loads(raw)
        # the frontend's batch, once per text for a request of several
        assert set(headers[BATCH_SIZE_HEADER].split(",")) == {str(len(rows))} and headers[WORKER_HEADER].isdigit()
        assert context.get_response_content_type(i) == "application/json"
        asked = row.text if row.text is not None else texts_of(row)
        expect = row.expect if row.expect != "either" else ("ok" if asked is not None else "bad")
        if expect == "ok":
            listed = isinstance(asked, list)
            texts = asked if listed else [asked]
            tokens = [len(handler.model.tokenizer(t, verbose=False)["input_ids"]) for t in texts]
            if tokens_limit is not None and max(tokens) > tokens_limit:
                assert status == 413, (row, status, body)
                assert body["code"] == 413 and "tokens" in body["error"] and set(body) <= {"error", "code", "index"}
            else:
                assert status == 200, (row, status, body)
                results = body if listed else [body]
                assert isinstance(results, list) and len(results) == len(texts), (row, body)
                for result, count in zip(results, tokens):
                    if "tokens" in result:  # embeddings say how many tokens they saw: this text's own result
                        assert result["tokens"] == min(count, handler.model.max_length), (row, result)
                        assert len(result["embedding"]) == 384
                    else:
                        assert set(result) == {"label", "score", "scores"}, result
        else:
            assert status == 400, (row, status, body)
            assert set(body) <= {"error", "code", "index"} and body["code"] == 400 and body["error"], body
        statuses.append(status)
    return statuses


@FUZZ
@given(batches)
def test_any_batch_gets_one_answer_per_row_and_errors_only_where_due(minilm, rows):
    handler, context = minilm
    check_batch(handler, context, rows)


@FUZZ
@given(batches)
def test_a_strict_classifier_answers_413_only_for_long_rows(strict_tiny, rows):
    handler, context = strict_tiny
    check_batch(handler, context, rows, tokens_limit=handler.model.max_length)


def test_huge_rows_in_one_batch_fail_alone(minilm):
    handler, context = minilm
    big = ("Ünïcödé 中文 🚀 word " * 60000)[: (1 << 20) // 4]
    rows = [
        Row({"body": "a normal request"}, "text/plain", "ok", "a normal request"),
        Row({"body": big.encode()}, "text/plain", "ok", big),
        Row({"body": b"\xff" * (1 << 20)}, "text/plain", "bad"),
        Row({"body": b'{"text": "' + b"x" * ((1 << 20) - 20)}, "application/json", "bad"),
        Row({"body": b" " * (1 << 20)}, None, "bad"),
        Row({"body": json.dumps({"text": big}).encode()}, "application/json", "ok", big),
    ]
    assert check_batch(handler, context, rows) == [200, 200, 400, 400, 400, 200]


def test_lone_surrogates_never_escape(minilm):
    """JSON may carry lone surrogates; the tokenizer may refuse them: a 400 or a 200, never a crash."""
    handler, context = minilm
    rows = [Row({"body": {"text": "lone \ud800 surrogate"}}, "application/json", "either"),
            Row({"body": b'{"text": "\\udfff\\ud800"}'}, "application/json", "either"),
            Row({"body": "fine"}, "text/plain", "ok", "fine")]
    bodies = handle(handler, context, rows)
    assert [context.get_response_status(i)[0] for i in range(3)][2] == 200
    for i in range(2):
        assert context.get_response_status(i)[0] in (200, 400), json.loads(bodies[i])


# -- known bug: hostile JSON fails the whole batch -----------------------------------------------

@pytest.mark.parametrize("hostile", [b"[" * 50_000, b'{"n": ' + b"1" * 5000 + b"}"], ids=["deep-nesting", "huge-int"])
def test_hostile_json_fails_alone(minilm, hostile):
    handler, context = minilm
    rows = [Row({"body": "good one"}, "text/plain", "ok", "good one"),
            Row({"body": hostile}, "application/json", "bad"),
            Row({"body": "another good one"}, "text/plain", "ok", "another good one")]
    assert check_batch(handler, context, rows) == [200, 400, 200]


# -- the handler: section: any YAML value is a config or a ConfigError -----------------------------

yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70000), st.floats(allow_nan=True),
                         st.text(max_size=10), st.sampled_from(["embedding", "cpu", "cuda:1", "16", "true"]))
yaml_values = st.recursive(yaml_scalars, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-1, 300)), c, max_size=3)),
    max_leaves=8)
FIELDS = sorted(f for f in HandlerConfig.__dataclass_fields__) + ["unknown_key"]


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), yaml_values, max_size=6), st.booleans())
def test_any_handler_section_is_a_config_or_a_config_error(section, with_task):
    if with_task:
        section.setdefault("task", "embedding")
    try:
        config = HandlerConfig.from_yaml(section)
    except ConfigError as error:
        assert str(error).startswith("handler"), error  # names the section or the field
        return
    assert (config.task.value if config.task else None) == section.get("task")  # optional: a team's own model has none


# -- a bad handler: section fails the load, with one line that names the field -------------------

BAD_SECTIONS = [
    ({"task": "summarize"}, "handler.task"),
    ({"task": 5}, "handler.task"),
    ({"task": "Embedding"}, "handler.task"),
    ({"buckets": [64, 32]}, "handler.buckets"),
    ({"buckets": [16, 16]}, "handler.buckets"),
    ({"buckets": "16,64"}, "handler.buckets"),
    ({"buckets": [16, "64"]}, "handler.buckets[1]"),
    ({"buckets": [0, 16]}, "handler.buckets[0]"),
    ({"buckets": [16, 64], "max_batch_tokens": 32}, "handler.max_batch_tokens"),
    ({"max_batch_tokens": 100}, "handler.max_batch_tokens"),  # below the model's own 512 tokens
    ({"max_length": 64, "max_batch_tokens": 32}, "handler.max_batch_tokens"),
    ({"max_batch_tokens": "many"}, "handler.max_batch_tokens"),
    ({"truncation": "false"}, "handler.truncation"),
    ({"max_batch_size": 8.0}, "handler.max_batch_size"),
    ({"queue_cap": True}, "handler.queue_cap"),
    ({"deadline_ms": -1}, "handler.deadline_ms"),
    ({"device": "gpu"}, "handler.device"),
    ({"fault_injection": "POISON"}, "handler.fault_injection"),
    ({"fault_injection": {"substring": ""}}, "handler.fault_injection.substring"),
    ({"fault_injection": {"oom_above": 2}}, "handler.fault_injection"),
    ({"warmup_repeats": 5, "warmup_max_repeats": 2}, "handler.warmup_max_repeats"),
    ({"batch_caps": {"sixteen": 2}}, "handler.batch_caps key"),
    ({"batch_caps": {16: 0}}, "handler.batch_caps[16]"),
    ({"batch_caps": [16, 2]}, "handler.batch_caps"),
    ({"buckets_typo": [16]}, "unknown key"),
    ({"model_dir": "no/such/dir"}, "does not exist"),
]


@pytest.mark.parametrize("section, field", BAD_SECTIONS, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD_SECTIONS)])
def test_a_bad_handler_section_fails_the_load_naming_the_field(tiny_models, section, field):
    model_dir = tiny_models["sequence_classification"]
    handler = {"task": "sequence_classification", "model_dir": model_dir, "warmup": False, **section}
    obj = EncoderHandler()
    with pytest.raises(ConfigError) as caught:
        obj.initialize(make_context(model_dir, handler))
    message = str(caught.value)
    assert field in message, message
    assert "\n" not in message and len(message) < 400, "one clear log line"
    assert not obj.initialized and obj.mode is None  # no lane was started


def test_a_handler_section_that_is_not_a_mapping_fails_the_load(tiny_models):
    model_dir = tiny_models["sequence_classification"]
    context = make_context(model_dir, {})
    context.model_yaml_config = {"handler": ["task", "embedding"]}
    with pytest.raises(ConfigError, match="handler: must be a mapping"):
        EncoderHandler().initialize(context)
