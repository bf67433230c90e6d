"""The generation example (examples/generate): a causal LM bucketed by prompt length and by
max_new_tokens, in the handler and the packaging pipeline, with a tiny random GPT-2."""
from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest

from tsbatch.archiver.measure import handler_class
from tsbatch.archiver.pipeline import profile_here
from tsbatch.handlers.stages import PADDED_HEADER
from tests.support import ContinuousFrontend, call, example_maker, make_context

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "generate")
HANDLER = os.path.join(EXAMPLE, "gen_handler.py")
SECTION = {"buckets": [[8, 32], [8, 64]], "max_batch_size": 4, "long_lane_from": 64}


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory):
    return example_maker(EXAMPLE)(str(tmp_path_factory.mktemp("gen") / "model"))


@pytest.fixture(scope="module")
def handler(gen_dir):
    sys.path.insert(0, EXAMPLE)  # the archive's root, where gen_model.py ships
    try:
        loaded = handler_class(HANDLER)()
        archive = tempfile.mkdtemp(prefix="tsbatch-gen-")  # this worker's own archive: no siblings
        loaded.initialize(make_context(archive, {"model_dir": gen_dir, **SECTION, "warmup": False}))
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
                               extra_files={"gen_model.py": os.path.join(EXAMPLE, "gen_model.py")})
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
        archive = tempfile.mkdtemp(prefix="tsbatch-gen-")  # the model's only worker
        loaded.initialize(make_context(archive, {"model_dir": gen_dir, **SECTION, "warmup": False, "poll_ms": 1},
                                       frontend={"continuousBatching": True}))
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
