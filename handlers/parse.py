"""Parse one TorchServe request row into the text to encode, or a BadInput saying what to fix.

TorchServe hands the handler `row["body"]` (or `row["data"]`) already decoded for some content
types: a str for text/*, a parsed object for application/json, and raw bytes when its own decoding
failed or the type is anything else. Every shape of that ends here as text or as a 400.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from tsbatch.handlers.errors import BadInput

EXAMPLE = 'send a text/plain UTF-8 body, or JSON {"text": "..."}'


def row_value(row: Any) -> Any:
    """The payload of a row: TorchServe names it "body" for a raw POST, "data" for some clients."""
    if not isinstance(row, Mapping):
        return row
    for key in ("body", "data"):
        if key in row:
            return row[key]
    return next(iter(row.values()), None) if len(row) == 1 else None


def parse_text(value: Any, content_type: str | None = None) -> str:
    """Return the request's text or raise BadInput with a message a client can act on."""
    if isinstance(value, (bytes, bytearray)):
        value = _decode(bytes(value))
        if _is_json(content_type):
            value = _load_json(value)
    if isinstance(value, str):
        text = value
    elif isinstance(value, Mapping):
        if "text" not in value:
            raise BadInput(f'JSON body has no "text" field: {EXAMPLE}')
        text = value["text"]
        if not isinstance(text, str):
            raise BadInput(
                f'"text" must be a string, got {type(text).__name__}: {EXAMPLE}'
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


def _decode(raw: bytes) -> str:
    if not raw:
        raise BadInput(f"empty request body: {EXAMPLE}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(
            f"body is not valid UTF-8 (invalid byte at offset {e.start}): encode the text as UTF-8"
        ) from None


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
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
