"""Requests the way users send them (issue #20), through the handler with a fake model: several
texts in one request, their aliases and the Open Inference Protocol's tensor, and form bodies.

The fake (tests/unit/test_api.py) counts words as its length, answers the sum of its input's word
lengths and fails on the word "poison", so each text's answer and bucket can be told apart.
"""
from __future__ import annotations

import json

import pytest

from tsbatch.handlers.core.buckets import Item
from tsbatch.handlers.core.errors import BadInput, Overloaded
from tsbatch.handlers.core.policy import Policy, PolicySettings, Ticket
from tsbatch.handlers.core.reply import Answer, Reply
from tsbatch.handlers.edge.parse import FORM, many, row_value
from tsbatch.handlers.edge.stages import BATCH_SIZE_HEADER, PADDED_HEADER
from tests.unit.test_api import load

pytestmark = pytest.mark.unit

MIXED = ["a bb", " ".join(["w"] * 40), "ccc", " ".join(["x"] * 10), "dd eee f"]


def send(handler, context, payloads: list, content_type: str = "application/json") -> list[tuple[int, object, dict]]:
    """One frontend batch of rows; a dict payload arrives as TorchServe hands parsed JSON, and a
    form's fields as TorchServe hands a form: one row entry per field, no "body"."""
    rows = [p if content_type == FORM else {"body": p} for p in payloads]
    context.request_processor = [None] * len(rows)
    context.request_ids = {i: f"r{i}" for i in range(len(rows))}
    context.status, context.headers = {}, {}
    context.get_all_request_header = lambda i: {"content-type": content_type}
    bodies = handler.handle(rows, context)
    return [(context.status.get(i, 200), json.loads(b), context.headers.get(i, {})) for i, b in enumerate(bodies)]


@pytest.fixture
def words():
    handler, context = load(warmup=False)
    yield handler, context
    handler.close()


def test_a_list_of_texts_gets_a_list_of_answers_in_order_each_padded_to_its_own_bucket(words):
    handler, context = words
    [(status, body, headers)] = send(handler, context, [{"text": MIXED}])
    alone = [a[1] for a in send(handler, context, [{"text": t} for t in MIXED])]
    assert status == 200 and body == alone  # the same answers as five requests of one
    assert [r["sum"] for r in body] == [3, 40, 3, 10, 6]
    # each text in its own bucket: the 40-word text set nobody else's padding
    assert headers[PADDED_HEADER] == "4,64,4,16,4"
    assert len(headers[BATCH_SIZE_HEADER].split(",")) == 5


@pytest.mark.parametrize("payload", [
    {"inputs": ["a bb", "ccc"]},
    {"input": ["a bb", "ccc"]},
    json.dumps({"text": ["a bb", "ccc"]}).encode(),  # raw JSON bytes, as a client without a JSON type sends
])
def test_the_common_shapes_of_a_list_are_answered_alike(words, payload):
    handler, context = words
    [(status, body, _)] = send(handler, context, [payload])
    assert status == 200 and [r["sum"] for r in body] == [3, 3]


def test_kserve_v1_instances_get_predictions(words):
    handler, context = words
    [(status, body, headers)] = send(handler, context, [{"instances": ["a bb", {"text": "ccc dd"}]}])
    assert status == 200 and [r["sum"] for r in body["predictions"]] == [3, 5]
    assert headers[PADDED_HEADER] == "4,4"


def test_kserve_v2_tensor_of_texts_gets_one_output_tensor_per_result_field(words):
    handler, context = words
    tensor = {"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES",
                          "data": ["a bb", " ".join(["w"] * 10), "ccc"]}]}
    [(status, body, _)] = send(handler, context, [tensor])
    assert status == 200 and body["model_name"] == "words"
    outputs = {o["name"]: o for o in body["outputs"]}
    assert outputs["sum"] == {"name": "sum", "shape": [3], "datatype": "INT64", "data": [3, 10, 3]}
    assert outputs["length"]["data"] == [2, 10, 1]


def test_v2_tensors_of_vectors_and_of_anything_else():
    from tsbatch.handlers.edge.envelopes import KSERVE_V2, wrap

    body = wrap(KSERVE_V2, [{"embedding": [0.5, 1.0], "label": "x", "scores": {"a": 1}},
                            {"embedding": [0.25, 2.0], "label": "y", "scores": {"a": 0}}], "m")
    embedding, label, scores = body["outputs"]
    assert embedding == {"name": "embedding", "shape": [2, 2], "datatype": "FP32", "data": [0.5, 1.0, 0.25, 2.0]}
    assert label["datatype"] == "BYTES" and label["data"] == ["x", "y"]
    assert json.loads(scores["data"][0]) == {"a": 1}


@pytest.mark.parametrize("payload, message", [
    ({"inputs": [{"datatype": "FP32", "data": [1.0]}]}, "must be BYTES"),
    ({"inputs": [{"datatype": "BYTES", "data": ["a"]}, {"datatype": "BYTES", "data": ["b"]}]}, "one input tensor"),
    ({"instances": []}, "empty list"),
])
def test_kserve_shapes_tsbatch_cannot_serve_get_a_clear_400(words, payload, message):
    handler, context = words
    [(status, body, _)] = send(handler, context, [payload])
    assert status == 400 and message in body["error"]


def test_a_bad_text_fails_its_whole_request_naming_it_and_nothing_else(words):
    handler, context = words
    answers = send(handler, context, [{"text": ["a bb", "", "ccc"]}, {"text": "dd eee"}, {"text": ["one", 7]}])
    (s0, b0, _), (s1, b1, _), (s2, b2, _) = answers
    assert s0 == 400 and b0["index"] == 1 and b0["error"].startswith("text 1:") and b0["code"] == 400
    assert s1 == 200 and b1["sum"] == 5
    assert s2 == 400 and b2["index"] == 1 and "must be a string" in b2["error"]
    assert not any(bucket == 64 for _, bucket in handler.model.passes)  # nothing ran for the refused ones


def test_a_text_the_model_fails_on_fails_its_request_and_the_other_requests_get_answers(words):
    handler, context = words
    answers = send(handler, context, [{"text": ["one two", "poison", "three"]}, {"text": ["four", "five six"]}])
    (s0, b0, _), (s1, b1, _) = answers
    assert s0 == 500 and b0["index"] == 1 and "broke" in b0["error"]
    assert s1 == 200 and [r["sum"] for r in b1] == [4, 7]


def test_requests_past_the_text_and_token_limits_get_413(words):
    handler, context = words
    too_many = {"text": ["a"] * (handler.config.max_texts_per_request + 1)}
    [(status, body, _)] = send(handler, context, [too_many])
    assert status == 413 and f"at most {handler.config.max_texts_per_request}" in body["error"]
    handler.worker.config = handler.config.__class__(**{**handler.config.__dict__, "max_tokens_per_request": 50})
    [(status, body, _), (ok, _, _)] = send(handler, context, [{"text": [" ".join(["w"] * 40)] * 2}, {"text": ["a"]}])
    assert status == 413 and "80 tokens in all, at most 50" in body["error"]
    assert ok == 200


def test_an_empty_list_is_a_clear_400(words):
    handler, context = words
    [(status, body, _)] = send(handler, context, [{"inputs": []}])
    assert status == 400 and "empty list" in body["error"]


def test_a_model_that_takes_lists_whole_opts_out_of_splitting():
    from tsbatch.handlers.edge.stages import Call, prepare
    from tests.unit.test_api import WordModel

    class Whole(WordModel):
        def split(self, request):
            return None

        def prepare(self, request):
            return len(request.body["text"]), [1] * len(request.body["text"])

    call = Call.of(1)
    [item] = prepare(Whole(), (4, 16), (), [{"body": {"text": ["a", "b", "c"]}}], None, call)
    assert item.length == 3 and item.parts == 0


# -- form bodies: what TorchServe makes of curl --data ----------------------------------------------
# Rows as TorchServe 0.12's frontend hands them over (seen on a running server): `curl --data
# 'A man is eating food.'` arrives as a row with no field at all, `--data 'x = 1 + 2'` as
# {"x": " 1   2"}, `--data-urlencode 'text=...'` as {"text": "..."}.

def test_a_form_field_named_text_is_the_text():
    assert row_value({"text": "x = 1 & y"}, FORM) == "x = 1 & y"
    assert row_value({"text": b"caf\xc3\xa9"}, FORM + "; charset=utf-8") == "caf\u00e9"


@pytest.mark.parametrize("fields, found", [
    ({}, "no field"),  # curl --data TEXT: TorchServe's form decoder dropped the text
    ({"x": " 1   2"}, "fields 'x'"),  # curl --data 'x = 1 + 2'
    ({"A man is eating food.": ""}, "fields 'A man"),  # curl --data 'A man is eating food.&'
])
def test_any_other_form_gets_415_naming_what_arrived_and_how_to_send_the_text(fields, found):
    from tsbatch.handlers.core.errors import UnsupportedMediaType

    with pytest.raises(UnsupportedMediaType) as cut:
        row_value(fields, FORM)
    assert cut.value.status == 415 and found in cut.value.message
    assert FORM in cut.value.message and "-H 'Content-Type: text/plain'" in cut.value.message
    assert "--data-urlencode 'text=...'" in cut.value.message


def test_form_bodies_through_the_handler(words):
    handler, context = words
    answers = send(handler, context, [{"text": "A man is eating"}, {}, {"a": "1", "b": "2"}], FORM)
    assert answers[0][0] == 200 and answers[0][1]["sum"] == 1 + 3 + 2 + 6
    assert [a[0] for a in answers[1:]] == [415, 415] and "--data-urlencode" in answers[1][1]["error"]


def test_many_leaves_a_request_of_one_alone():
    assert many({"text": "one"}) is None
    assert many({"values": [1, 2]}) is None
    assert many(b"not json", "text/plain") is None
    # unreadable bodies are left to the model's prepare, whose own message then reaches the client
    assert many(b'{"text": ', "application/json") is None and many(b"\xff", "application/json") is None
    assert many({"text": ["a", "b"], "max_new_tokens": 8}) == ([{"max_new_tokens": 8, "text": "a"},
                                                              {"max_new_tokens": 8, "text": "b"}], "list")


# -- the pieces: gathering answers, the queue cap counting texts --------------------------------------

def _item(part: int, parts: int, bucket: int = 4) -> Item:
    return Item(0, "", 1, bucket, None, part, parts)


def test_a_reply_answers_once_every_text_is_in_and_names_the_first_failure():
    gather = Reply(3)
    assert not gather.settle(2, Answer({"r": 2}, 1, 16, 1.0, 2.0, 3.0))
    assert not gather.settle(0, Answer({"r": 0}, 2, 4, 1.0, 1.5, 2.0))
    assert gather.settle(1, Answer({"r": 1}, 2, 4, 1.0, 1.5, 2.0))
    answer = gather.answer()
    assert answer.outcome == [{"r": 0}, {"r": 1}, {"r": 2}] and answer.finished == 3.0 and answer.started == 1.5
    failing = Reply(2)
    failing.settle(0, Answer({"r": 0}))
    failing.settle(1, Answer(BadInput("nope")))
    assert failing.answer().outcome.index == 1 and failing.answer().outcome.status == 400
    assert Reply(0).settle(0, Answer({"r": 9})) and Reply(0)._answers == [None]


def test_the_queue_cap_counts_texts_and_takes_a_request_whole_or_not_at_all():
    policy = PolicySettings(edges=(4, 16), max_wait=0.0, queue_cap=5, age_bound=1.0, priority_aging=1.0)
    scheduler = Policy(policy, cap_for=lambda bucket: 4)
    scheduler.submit_all([Ticket(_item(i, 3), 0.0) for i in range(3)])
    with pytest.raises(Overloaded, match="this request has 3"):
        scheduler.submit_all([Ticket(_item(i, 3), 0.0) for i in range(3)])
    assert len(scheduler) == 3  # none of the refused request's texts stayed queued
    scheduler.submit_all([Ticket(_item(i, 2), 0.0) for i in range(2)])
    assert len(scheduler) == 5
