"""tsbatch.handlers.core.errors: every serving error carries its status and renders one body shape."""
from __future__ import annotations

import json

import pytest

from tsbatch.handlers.core import errors
from tsbatch.handlers.core.errors import (
    BadInput,
    ConfigError,
    DeadlineExceeded,
    InputTooLong,
    ModelFailed,
    ModelUnavailable,
    OutOfMemory,
    Overloaded,
    ServingError,
    UnsupportedMediaType,
)

pytestmark = pytest.mark.unit

STATUSES = [
    (ServingError, 500),
    (BadInput, 400),
    (InputTooLong, 413),
    (UnsupportedMediaType, 415),
    (ModelFailed, 500),
    (ModelUnavailable, 503),
    (Overloaded, 503),
    (DeadlineExceeded, 504),
    (OutOfMemory, 507),
]


@pytest.mark.parametrize("cls, status", STATUSES, ids=[c.__name__ for c, _ in STATUSES])
def test_to_body_shape(cls, status):
    error = cls("what went wrong: what to do")
    assert error.status == status
    assert error.message == "what went wrong: what to do"
    assert str(error) == "what went wrong: what to do"
    body = error.to_body()
    assert body == {"error": "what went wrong: what to do", "code": status}
    assert list(body) == ["error", "code"]
    assert json.loads(json.dumps(body)) == body


@pytest.mark.parametrize("cls, status", STATUSES, ids=[c.__name__ for c, _ in STATUSES])
def test_every_serving_error_is_an_exception_with_an_http_error_status(cls, status):
    assert issubclass(cls, ServingError)
    assert issubclass(cls, Exception)
    assert 400 <= status < 600
    with pytest.raises(ServingError) as caught:
        raise cls("boom")
    assert caught.value.to_body()["code"] == status


def test_status_table_covers_every_serving_error():
    defined = {
        obj for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, ServingError)
    }
    assert defined == {cls for cls, _ in STATUSES}


def test_message_is_kept_verbatim():
    message = 'unicode \u00e9 and "quotes" and\nnewlines'
    assert BadInput(message).to_body()["error"] == message


def test_config_error_is_not_a_serving_error():
    """A bad configuration fails the load; it is never turned into a response."""
    assert issubclass(ConfigError, ValueError)
    assert not issubclass(ConfigError, ServingError)


def test_an_error_at_one_text_of_several_names_it_and_leaves_the_original_alone():
    error = InputTooLong("input is 300 long")
    at = error.at(4)
    assert at.to_body() == {"error": "text 4: input is 300 long", "code": 413, "index": 4}
    assert str(at) == "text 4: input is 300 long" and type(at) is InputTooLong
    assert error.to_body() == {"error": "input is 300 long", "code": 413}
