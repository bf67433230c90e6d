"""The generation example (examples/generate): a causal LM bucketed by prompt length and by
max_new_tokens, in the handler and the packaging pipeline, with a tiny random GPT-2."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tsbatch.archiver.measure import handler_class
from tsbatch.archiver.pipeline import profile_here
from tsbatch.handlers.edge.stages import PADDED_HEADER
from tests.support import ContinuousFrontend, call, example_maker, make_context, scratch_dir

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "generate")
HANDLER = os.path.join(EXAMPLE, "gen_handler.py")
SECTION = {"buckets": [[8, 32], [8, 64]], "max_batch_size": 4, "long_lane_from": 64}
MODEL = {"max_prompt_tokens": 32, "max_new_tokens": 64}  # model-config.yaml's model: section, the model's own


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory):
    return example_maker(EXAMPLE)(str(tmp_path_factory.mktemp("gen") / "model"))


@pytest.fixture(scope="module")
def handler(gen_dir):
    sys.path.insert(0, EXAMPLE)  # the archive's root, where gen_model.py ships
    try:
        loaded = handler_class(HANDLER)()
        archive = scratch_dir("tsbatch-gen-")  # this worker's own archive: no siblings
        loaded.initialize(make_context(archive, {"model_dir": gen_dir, **SECTION, "warmup": False},
                                       frontend={"model": MODEL}))
        yield loaded
        loaded.close()
    finally:
        sys.path.remove(EXAMPLE)


def ask(text: str, new: int) -> bytes:
    return json.dumps({"text": text, "max_new_tokens": new}).encode()


def test_profile_warms_every_batch_size_of_every_prompt_and_new_token_bucket(gen_dir):
    sys.path.insert(0, EXAMPLE)
    try:
        profile = profile_here(gen_dir, "gen", {**SECTION, "max_batch_size": 2}, "continuous", handler_file=HANDLER,
                               extra_files={"gen_model.py": os.path.join(EXAMPLE, "gen_model.py")}, model_section=MODEL)
    finally:
        sys.path.remove(EXAMPLE)
    buckets = {(p, n) for p in (8, 32) for n in (8, 64)}
    assert {(s.batch, s.bucket) for s in profile.shapes} == {(b, bucket) for bucket in buckets for b in (1, 2)}
    assert profile.environment["model"] == "GPT2LMHeadModel"


def test_each_request_gets_what_it_gets_alone_padded_to_its_own_buckets(gen_dir, handler):
    asks = [ask("A man is eating food.", 8), ask("The weather is nice in the park today and the children are playing by the lake", 20),
            ask("hello", 5), ask("one two three four five six seven eight nine ten", 64)]
    together = call(handler, make_context(gen_dir, {}), asks, "application/json")
    assert [r.status for r in together] == [200] * 4
    assert [r.headers[PADDED_HEADER] for r in together] == ["8x8", "32x64", "8x8", "32x64"]
    assert [r.body["new_tokens"] for r in together] == [8, 20, 5, 64]
    for payload, batched in zip(asks, together):
        [single] = call(handler, make_context(gen_dir, {}), [payload], "application/json")
        assert single.body == batched.body


def test_bad_asks_fail_alone_with_a_clear_error(gen_dir, handler):
    replies = call(handler, make_context(gen_dir, {}),
                   [ask("fine", 4), ask("fine", 0), ask("fine", 65), b'{"text": ""}', b"{not json",
                    ask(" ".join(["word"] * 40), 4)], "application/json")
    assert [r.status for r in replies] == [200, 400, 400, 400, 400, 413]
    assert "max_new_tokens must be a whole number from 1 to 64" in replies[1].body["error"]
    assert "at most 32x64" in replies[5].body["error"]


def test_an_ask_for_few_tokens_is_answered_while_long_generations_run(gen_dir):
    """Continuous mode, two lanes: four asks for 64 tokens (one pass of many decode steps on the
    long lane) are taken in first; an ask for 4 tokens sent next is answered in an earlier call."""
    sys.path.insert(0, EXAMPLE)
    try:
        loaded = handler_class(HANDLER)()
        archive = scratch_dir("tsbatch-gen-")  # the model's only worker
        loaded.initialize(make_context(archive, {"model_dir": gen_dir, **SECTION, "warmup": False, "poll_ms": 1},
                                       frontend={"continuousBatching": True, "model": MODEL}))
    finally:
        sys.path.remove(EXAMPLE)
    try:
        frontend = ContinuousFrontend(loaded, make_context(gen_dir, {}))
        for i in range(4):
            frontend.submit(f"long-{i}", ask(f"a story number {i} about the sea", 64), "application/json")
        frontend.step()  # the long asks are taken in and their pass starts
        frontend.submit("short", ask("hi", 4), "application/json")
        replies = frontend.drain()
    finally:
        loaded.close()
    assert all(r.status == 200 for r in replies.values())
    assert replies["short"].headers[PADDED_HEADER] == "8x8"
    assert frontend.answered_in["short"] < min(frontend.answered_in[f"long-{i}"] for i in range(4))


def load(gen_dir, model: dict | None, handler: dict | None = None):
    sys.path.insert(0, EXAMPLE)
    try:
        loaded = handler_class(HANDLER)()
        frontend = {"model": model} if model is not None else {}
        loaded.initialize(make_context(scratch_dir("tsbatch-gen-"),
                                       {"model_dir": gen_dir, "warmup": False, **(handler or {})}, frontend=frontend))
        return loaded
    finally:
        sys.path.remove(EXAMPLE)


def test_the_models_limits_come_from_its_own_section_not_from_the_buckets(gen_dir):
    """model: sets the limits; the handler's edges are cut at them and topped by them."""
    loaded = load(gen_dir, {"max_prompt_tokens": 16, "max_new_tokens": 8}, {"buckets": [[8, 64], [4, 32]]})
    try:
        assert loaded.model.max_length == (16, 8)
        assert loaded.config.model == {"max_prompt_tokens": 16, "max_new_tokens": 8}
        assert sorted(loaded.edges) == [(8, 4), (8, 8), (16, 4), (16, 8)]
    finally:
        loaded.close()
    loaded = load(gen_dir, None)  # no model: section: the example's defaults
    try:
        assert loaded.model.max_length == (128, 256)
    finally:
        loaded.close()


@pytest.mark.parametrize("model, words", [
    ({"max_new_token": 8}, "model: unknown key(s) ['max_new_token']"),
    ({"max_new_tokens": 0}, "model.max_new_tokens must be a positive integer, got 0"),
    ({"max_prompt_tokens": "64"}, "model.max_prompt_tokens must be a positive integer, got '64'"),
    ([64], "model must be a mapping of your model's own settings, got [64]"),
])
def test_a_bad_model_section_fails_the_load_naming_the_key(gen_dir, model, words):
    from tsbatch.handlers.core.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        load(gen_dir, model)
    assert words in str(caught.value)


def test_the_config_the_example_ships_builds_the_models_limits_from_its_model_section():
    from tsbatch.archiver.pipeline import config_sections

    handler, model = config_sections(None, handler_config=os.path.join(EXAMPLE, "handler.yaml"))
    assert model == {"max_prompt_tokens": 128, "max_new_tokens": 256}
    assert [edges[-1] for edges in handler["buckets"]] == [model["max_prompt_tokens"], model["max_new_tokens"]]
