"""Fuzzing handlers.edge.parse: whatever a client sends, parsing returns text or raises BadInput.

TorchServe hands a row's payload over as bytes, as a str (text/*), or already parsed (JSON), with
any content type a client chose. For every such shape parse_text must return a non-blank str or
raise handlers.core.errors.BadInput (a 400 whose message says what to send) — never anything else,
because anything else escapes the parse stage and fails the whole TorchServe batch.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tsbatch.handlers.core.errors import BadInput
from tsbatch.handlers.edge.parse import EXAMPLE, parse_text, row_value

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_REQUEST = 1 << 20  # the generated max_request_size: nothing bigger reaches a worker

JSON_TYPES = ["application/json", "application/json; charset=utf-8", "Application/JSON", "application/ld+json",
              "application/vnd.api+json", " application/json ;x=y"]
OTHER_TYPES = ["text/plain", "text/plain; charset=utf-8", "text/html", "application/octet-stream",
               "multipart/form-data; boundary=x", "application/x-www-form-urlencoded", "", ";", "json",
               "application/jsonx", "*/*"]
content_types = st.one_of(st.none(), st.sampled_from(JSON_TYPES + OTHER_TYPES), st.text(max_size=40))

# Text a client might send: every script, control characters, emoji, combining marks, odd spaces.
SCRIPTS = st.sampled_from([
    "A man is eating food.", "Ünïcödé", "中文字符", "日本語のテキスト", "한국어", "العربية", "עברית",
    "русский текст", "ελληνικά", "हिन्दी", "ไทย", "🚀🔥👍🏽", "e\u0301\u0302", "\u200b\u200d\ufeff",
    "\x00\x01\x07\x1b[31m", "\t\n\r\x0b\x0c", "\u2028\u2029\u00a0\u3000", "\ufffd", "\U0010ffff",
])
any_text = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(SCRIPTS, st.text(max_size=20)), max_size=12).map("".join),
)


def outcome(value, content_type=None):
    """("text", str) or ("bad", message): the only two results parse_text may have."""
    try:
        text = parse_text(value, content_type)
    except BadInput as error:
        return "bad", error.message
    return "text", text


def assert_contract(value, content_type=None):
    kind, result = outcome(value, content_type)
    if kind == "text":
        assert isinstance(result, str) and result.strip(), f"blank text accepted: {result!r}"
    else:
        assert result and (EXAMPLE in result or "UTF-8" in result), f"message does not say what to send: {result}"
        assert BadInput(result).to_body() == {"error": result, "code": 400}
    return kind, result


# JSON documents as TorchServe's own decoder hands them over (a parsed object for application/json).
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30),
                         st.floats(allow_nan=True, allow_infinity=True), any_text)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.dictionaries(st.one_of(st.just("text"), any_text), inner, max_size=5)),
    max_leaves=20,
)


# -- raw bytes, any content type -----------------------------------------------------------------

@FUZZ
@given(st.binary(max_size=2048), content_types)
@example(b"", "application/json")
@example(b"\xff\xfe\x00", "text/plain")
@example(b"\xed\xa0\x80", None)  # an encoded surrogate is not UTF-8
@example(b"{", "application/json")
@example(b"[]", "application/json")
@example(b"null", "application/json")
@example(b'"   "', "application/json")
@example(b"NaN", "application/json")
@example(b"\xef\xbb\xbf{\"text\": \"bom\"}", "application/json")
def test_arbitrary_bytes_give_text_or_bad_input(raw, content_type):
    assert_contract(raw, content_type)
    assert_contract(bytearray(raw), content_type)


@FUZZ
@given(any_text, st.sampled_from(OTHER_TYPES + [None]))
def test_utf8_text_comes_back_unchanged_unless_blank(text, content_type):
    kind, result = assert_contract(text.encode("utf-8"), content_type)
    if text.strip():
        assert (kind, result) == ("text", text)
        assert outcome(text, content_type) == ("text", text)  # TorchServe already decoded it to str
    else:
        assert kind == "bad" and "empty" in result


@FUZZ
@given(any_text, st.sampled_from(JSON_TYPES))
def test_text_in_a_json_object_comes_back_unchanged(text, content_type):
    raw = json.dumps({"text": text}, ensure_ascii=False).encode("utf-8")
    ascii_raw = json.dumps({"text": text}).encode("ascii")
    for value in (raw, ascii_raw, {"text": text}):
        kind, result = assert_contract(value, content_type)
        if text.strip():
            assert (kind, result) == ("text", text)
        else:
            assert kind == "bad" and "empty" in result


# -- JSON documents: parsed by TorchServe, or raw bytes parsed by us: the same answer -----------

@FUZZ
@given(json_values, st.sampled_from(JSON_TYPES))
def test_any_json_document_gives_text_or_bad_input(document, content_type):
    decoded = assert_contract(document, content_type)
    if isinstance(document, dict) and isinstance(document.get("text"), str) and document["text"].strip():
        assert decoded == ("text", document["text"])
    elif not isinstance(document, str):
        assert decoded[0] == "bad"
    # the same document as raw bytes (TorchServe forwards bytes when its own decoding fails,
    # and for JSON types with parameters) must get the same verdict
    raw = json.dumps(document).encode()
    assert assert_contract(raw, content_type)[0] == decoded[0]


@FUZZ
@given(st.text(alphabet='{}[]":,\\ tenxul0123456789.-+eE', max_size=200), st.sampled_from(JSON_TYPES))
def test_json_shaped_garbage_gives_text_or_bad_input(text, content_type):
    assert_contract(text.encode(), content_type)


# -- rows: every shape a TorchServe row can take --------------------------------------------------

row_payloads = st.one_of(st.binary(max_size=200), any_text, json_values)
rows = st.one_of(
    row_payloads,
    st.dictionaries(st.sampled_from(["body", "data", "other", ""]), row_payloads, max_size=3),
    st.dictionaries(any_text, row_payloads, max_size=3),
)


@FUZZ
@given(rows, content_types)
def test_any_row_gives_text_or_bad_input(row, content_type):
    assert_contract(row_value(row), content_type)


@given(row_payloads, row_payloads)
@settings(max_examples=100, deadline=None)
def test_row_value_prefers_body_then_data(body, data):
    assert row_value({"body": body, "data": data}) is body
    assert row_value({"data": data, "other": 1}) is data
    assert row_value({"only": body}) is body
    assert row_value({"a": body, "b": data}) is None  # ambiguous: an empty request, not a guess
    assert row_value({}) is None


# -- huge, empty and hostile inputs within the request size limit --------------------------------

@pytest.mark.parametrize("content_type", [None, "text/plain", "application/json"])
def test_a_request_of_the_maximum_size_parses(content_type):
    text = ("Ünïcödé 中文 🚀 word " * 60000)[: MAX_REQUEST // 4]
    raw = (json.dumps({"text": text}) if content_type == "application/json" else text).encode()
    assert len(raw) <= MAX_REQUEST
    assert parse_text(raw, content_type) == text


@pytest.mark.parametrize("raw, content_type, words", [
    (b"\xff" * MAX_REQUEST, None, "offset 0"),
    (b"a" * (MAX_REQUEST - 1) + b"\xff", "text/plain", f"offset {MAX_REQUEST - 1}"),
    (b" " * MAX_REQUEST, None, "empty"),
    (b'{"text": "' + b"x" * (MAX_REQUEST - 20), "application/json", "malformed JSON"),
    (b'{"text": ' + b"1" * 4000 + b"}", "application/json", "must be a string"),
    (b"[" * 300 + b"]" * 300, "application/json", "must be an object"),
])
def test_huge_bad_inputs_are_bad_input(raw, content_type, words):
    with pytest.raises(BadInput, match=words):
        parse_text(raw, content_type)


# -- known bugs: JSON the decoder refuses with something other than JSONDecodeError --------------

def test_deeply_nested_json_is_bad_input():
    raw = b"[" * 100_000  # 100 KB, well under max_request_size
    with pytest.raises(BadInput):
        parse_text(raw, "application/json")


def test_json_with_a_huge_integer_is_bad_input():
    raw = b'{"text": "hello", "n": ' + b"9" * 5000 + b"}"
    with pytest.raises(BadInput):
        parse_text(raw, "application/json")
