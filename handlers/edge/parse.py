"""Parse one TorchServe request row into the text to encode, or a BadInput saying what to fix.

TorchServe hands the handler `row["body"]` (or `row["data"]`) already decoded for some content
types: a str for text/*, a parsed object for application/json, and raw bytes when its own decoding
failed or the type is anything else. Every shape of that ends here as text or as a 400.

Two shapes need more than that:
- A form body (`application/x-www-form-urlencoded`, what `curl --data TEXT` sends): TorchServe's
  frontend parses it into name=value fields before the handler sees it, and drops a body with no
  `=`: `--data 'A man is eating food.'` arrives with no fields at all. A field named `text`
  (`curl --data-urlencode 'text=...'`) is the text; any other form is answered 415 with the two
  ways to send the text whole (`form_text`).
- Several texts in one request (HTTP, or gRPC whose inference API sends no content type: a body
  that is a JSON object with a text field is read as JSON there): JSON `{"text": [...]}` and the
  other shapes of handlers/edge/envelopes.py; `many` gives one body per text, each parsed like a
  request of its own.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from tsbatch.handlers.core.errors import BadInput, UnsupportedMediaType
from tsbatch.handlers.edge.envelopes import TEXT_KEYS, unwrap

EXAMPLE = 'send a text/plain UTF-8 body, or JSON {"text": "..."}'
FORM = "application/x-www-form-urlencoded"


def row_value(row: Any, content_type: str | None = None) -> Any:
    """The payload of a row: TorchServe names it "body" for a raw POST, "data" for some clients;
    a form's fields give its text (`form_text`)."""
    if not isinstance(row, Mapping):
        return row
    if _media(content_type) == FORM:
        return form_text(row)
    for key in ("body", "data"):
        if key in row:
            return row[key]
    return next(iter(row.values()), None) if len(row) == 1 else None


def form_text(fields: Mapping) -> str:
    """The text of a form body as TorchServe parsed it into fields: its field named text (or an
    alias, or body/data). TorchServe's form decoder drops a body with no `=` before any handler
    sees it (`curl --data 'A man is eating food.'` arrives with no fields at all) and splits or
    changes one with `&`, `=` or `+`, so any other form is answered 415, saying how to send it."""
    for key in ("body", "data") + TEXT_KEYS:
        if key in fields:
            return _form_value(fields[key])
    found = (f"fields {', '.join(repr(str(name))[:40] for name in list(fields)[:4])}" if fields
             else "no field (a text without '=' is dropped by TorchServe's form decoder)")
    raise UnsupportedMediaType(f"the body arrived as a form (Content-Type: {FORM}, what curl --data sends by default) "
                               f"with {found} and no \"text\" field: TorchServe parses a form into name=value "
                               f"fields before tsbatch sees it. Send the text whole with -H 'Content-Type: text/plain', "
                               f"or as --data-urlencode 'text=...'")


def _form_value(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return _decode(bytes(value)) if value else ""
    return "" if value is None else str(value)


def many(value: Any, content_type: str | None = None) -> tuple[list, str] | None:
    """(one body per text, its envelope) of a request of several texts (handlers/edge/envelopes.py:
    a JSON list, KServe v1 instances, a KServe v2 tensor of texts), or None for a request of one.
    A body that does not read as JSON is a request of one: its model's prepare says what is wrong
    with it, in its own words."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value = _body(bytes(value), content_type)
        except BadInput:
            return None
    return unwrap(value) if isinstance(value, Mapping) else None


def parse_text(value: Any, content_type: str | None = None) -> str:
    """Return the request's text or raise BadInput with a message a client can act on."""
    if isinstance(value, (bytes, bytearray)):
        value = _body(bytes(value), content_type)
    if isinstance(value, str):
        text = value
    elif isinstance(value, Mapping):
        key = next((k for k in TEXT_KEYS if k in value), None)
        if key is None:
            raise BadInput(f'JSON body has no "text" field: {EXAMPLE}')
        text = value[key]
        if isinstance(text, list):
            raise BadInput(f'"{key}" is a list, and this model takes one text per request: {EXAMPLE}')
        if not isinstance(text, str):
            raise BadInput(
                f'"{key}" must be a string, got {type(text).__name__}: {EXAMPLE}'
            )
    elif value is None:
        raise BadInput(f"empty request body: {EXAMPLE}")
    else:
        raise BadInput(
            f"JSON body must be an object, got {type(value).__name__}: {EXAMPLE}"
        )
    if not text.strip():
        raise BadInput(f"empty text: {EXAMPLE}")
    return text


def _body(raw: bytes, content_type: str | None) -> Any:
    """Raw bytes as text, or as JSON when the content type says so. Without a content type (gRPC's
    inference API sends none) a body that is a JSON object with a text field is read as JSON."""
    text = _decode(raw)
    if _is_json(content_type):
        return _load_json(text)
    if not content_type and text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return text
        if isinstance(value, Mapping) and any(k in value for k in TEXT_KEYS):
            return value
    return text


def _decode(raw: bytes) -> str:
    if not raw:
        raise BadInput(f"empty request body: {EXAMPLE}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(
            f"body is not valid UTF-8 (invalid byte at offset {e.start}): encode the text as UTF-8"
        ) from None


def _media(content_type: str | None) -> str:
    return content_type.split(";", 1)[0].strip().lower() if content_type else ""


def _is_json(content_type: str | None) -> bool:
    media = _media(content_type)
    return media == "application/json" or media.endswith("+json")


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(
            f"malformed JSON at line {e.lineno} column {e.colno} ({e.msg}): {EXAMPLE}"
        ) from None
    except (RecursionError, ValueError) as e:  # nesting too deep, integers too long to convert
        raise BadInput(f"JSON body cannot be read ({type(e).__name__}: {str(e)[:120]}): {EXAMPLE}") from None
