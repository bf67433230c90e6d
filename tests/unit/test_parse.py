"""tsbatch.handlers.edge.parse: every shape TorchServe hands a handler ends as text or as a 400 that says what to send."""
from __future__ import annotations

import pytest

from tsbatch.handlers.core.errors import BadInput
from tsbatch.handlers.edge.parse import EXAMPLE, parse_text, row_value

pytestmark = pytest.mark.unit

JSON = "application/json"


# -- accepted inputs -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "value, content_type, expected",
    [
        # TorchServe already decoded a text/* body to str.
        ("A man is eating food.", "text/plain", "A man is eating food."),
        ("A man is eating food.", None, "A man is eating food."),
        # ... and parsed an application/json body to a dict.
        ({"text": "A man is eating food."}, JSON, "A man is eating food."),
        ({"text": "hello", "extra": 1}, None, "hello"),
        # Raw bytes: TorchServe's own decoding failed or the type was something else.
        (b"plain bytes", None, "plain bytes"),
        (b"plain bytes", "text/plain", "plain bytes"),
        (b"plain bytes", "application/octet-stream", "plain bytes"),
        (bytearray(b"a bytearray"), None, "a bytearray"),
        ("caf\u00e9 \u65e5\u672c".encode("utf-8"), None, "caf\u00e9 \u65e5\u672c"),
        # Bytes with a JSON content type are parsed as JSON, whatever the parameters and case.
        (b'{"text": "from json bytes"}', JSON, "from json bytes"),
        (b'{"text": "with charset"}', "application/json; charset=utf-8", "with charset"),
        (b'{"text": "upper case"}', "Application/JSON", "upper case"),
        (b'{"text": "vendor type"}', "application/vnd.api+json", "vendor type"),
        ('{"text": "caf\u00e9"}'.encode("utf-8"), JSON, "caf\u00e9"),
        # A JSON body that is a bare string is that string.
        (b'"a bare json string"', JSON, "a bare json string"),
        # A declared non-JSON type keeps JSON-looking bytes as text: nothing is guessed.
        (b'{"text": "not parsed"}', "text/plain", '{"text": "not parsed"}'),
        # No content type at all (gRPC's inference API sends none): a JSON object with a text
        # field is JSON, anything else is text
        (b'{"text": "parsed"}', None, "parsed"),
        (b'{"other": "kept as text"}', None, '{"other": "kept as text"}'),
        (b'{not json at all', None, '{not json at all'),
    ],
)
def test_parse_text_returns_the_text(value, content_type, expected):
    assert parse_text(value, content_type) == expected


@pytest.mark.parametrize("text", ["  padded  ", "\nline\n", "x", " . "])
def test_surrounding_whitespace_is_kept_when_there_is_text(text):
    assert parse_text(text) == text
    assert parse_text({"text": text}) == text


# -- rejected inputs: 400 with a message that tells the client what to send ------------------

TELLS_WHAT_TO_SEND = EXAMPLE  # 'send a text/plain UTF-8 body, or JSON {"text": "..."}'


@pytest.mark.parametrize(
    "case, value, content_type, must_mention",
    [
        ("empty bytes", b"", None, "empty"),
        ("empty bytes, json", b"", JSON, "empty"),
        ("empty bytearray", bytearray(), None, "empty"),
        ("no body at all", None, None, "empty"),
        ("json null", b"null", JSON, "empty"),
        ("empty str", "", "text/plain", "empty"),
        ("whitespace-only str", "   \t\n ", "text/plain", "empty"),
        ("whitespace-only bytes", b"  \r\n", None, "empty"),
        ("whitespace-only json text", {"text": "   "}, JSON, "empty"),
        ("whitespace-only json text, bytes", b'{"text": " \\n "}', JSON, "empty"),
        ("empty json text", {"text": ""}, JSON, "empty"),
        ("malformed json", b'{"text": "unterminated', JSON, "JSON"),
        ("malformed json, trailing comma", b'{"text": "x",}', JSON, "JSON"),
        ("not json at all", b"hello there", JSON, "JSON"),
        ("missing text", {"content": "hello"}, JSON, '"text"'),
        ("missing text, bytes", b'{"content": "hello"}', JSON, '"text"'),
        ("empty object", {}, JSON, '"text"'),
        ("text is a number", {"text": 42}, JSON, "int"),
        ("text is null", {"text": None}, JSON, "NoneType"),
        ("text is a list", {"text": ["a", "b"]}, JSON, "list"),
        ("text is an object", b'{"text": {"nested": "x"}}', JSON, "dict"),
        ("text is a bool", {"text": True}, JSON, "bool"),
        ("json list", ["hello"], JSON, "list"),
        ("json list, bytes", b'["hello"]', JSON, "list"),
        ("json number", 42, JSON, "int"),
        ("json number, bytes", b"42", JSON, "int"),
        ("json float, bytes", b"4.5", JSON, "float"),
        ("json bool, bytes", b"true", JSON, "bool"),
    ],
)
def test_bad_input_is_a_400_that_says_what_to_send(case, value, content_type, must_mention):
    with pytest.raises(BadInput) as caught:
        parse_text(value, content_type)
    error = caught.value
    assert error.status == 400, case
    assert error.to_body() == {"error": error.message, "code": 400}
    assert must_mention in error.message, f"{case}: {error.message!r}"
    assert TELLS_WHAT_TO_SEND in error.message, f"{case}: {error.message!r}"


@pytest.mark.parametrize(
    "raw, offset",
    [
        (b"\xff\xfe\x00", 0),
        (b"ok so far \xc3\x28", 10),  # invalid continuation byte
        (b"caf\xe9", 3),  # latin-1, not UTF-8
    ],
)
@pytest.mark.parametrize("content_type", [None, "text/plain", JSON])
def test_invalid_utf8_is_a_400_that_asks_for_utf8(raw, offset, content_type):
    with pytest.raises(BadInput) as caught:
        parse_text(raw, content_type)
    error = caught.value
    assert error.status == 400
    assert "UTF-8" in error.message
    assert "encode the text as UTF-8" in error.message
    assert f"offset {offset}" in error.message


def test_malformed_json_message_locates_the_error():
    with pytest.raises(BadInput) as caught:
        parse_text(b'{\n  "text": oops\n}', JSON)
    assert "line 2" in caught.value.message
    assert "malformed JSON" in caught.value.message


def test_bad_input_is_not_chained_to_the_decoder_error():
    """The client-facing error stands alone: no JSON/Unicode traceback rides along."""
    for value in (b"\xff", b"{bad"):
        with pytest.raises(BadInput) as caught:
            parse_text(value, JSON)
        assert caught.value.__cause__ is None
        assert caught.value.__suppress_context__ is True


# -- row_value -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "row, expected",
    [
        ({"body": b"raw"}, b"raw"),
        ({"data": "text"}, "text"),
        ({"body": "from body", "data": "from data"}, "from body"),  # body wins
        ({"body": None, "data": "x"}, None),  # a present body is the payload, even if empty
        ({"body": {"text": "t"}}, {"text": "t"}),
        ({"file": b"only key"}, b"only key"),  # a lone, oddly named parameter is the payload
        ({"a": 1, "b": 2}, None),  # ambiguous: no payload
        ({}, None),
        (b"not a mapping", b"not a mapping"),
        ("a str row", "a str row"),
        (None, None),
    ],
)
def test_row_value(row, expected):
    assert row_value(row) == expected


@pytest.mark.parametrize(
    "row, content_type, expected",
    [
        ({"body": bytearray(b"hello")}, None, "hello"),
        ({"data": b'{"text": "hi"}'}, JSON, "hi"),
        ({"body": {"text": "parsed"}}, JSON, "parsed"),
    ],
)
def test_row_value_then_parse_text(row, content_type, expected):
    assert parse_text(row_value(row), content_type) == expected


def test_row_without_payload_is_an_empty_body():
    with pytest.raises(BadInput, match="empty request body"):
        parse_text(row_value({"a": 1, "b": 2}))

