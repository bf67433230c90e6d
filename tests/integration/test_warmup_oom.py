"""Out of memory at warmup never fails a load: it caps the bucket, and the caps outlive the worker.

The fault-injection seam raises MemoryError the way an allocator does: `oom_above_batch` for
batches over a size, `oom_above_tokens` for shapes over batch x bucket tokens (memory that grows
with the shape, so the largest bucket may not fit even alone).
"""
from __future__ import annotations

import json

import pytest

from tsbatch.handlers.runtime.memory import OOM_CAPS_FILE
from tests.support import call, cosine, load_handler
from tsbatch.warmup.profile import PROFILE_FILE, LatencyProfile

pytestmark = pytest.mark.integration

BUCKETS = [16, 64, 256]
SHORT, MIDDLE, LONG = "a short one", "word " * 40, "word " * 200


def warm(minilm_dir, archive_dir, fault, **handler):
    return load_handler(minilm_dir, archive_dir=str(archive_dir), warmup=True, warmup_repeats=1,
                        warmup_max_repeats=1, buckets=BUCKETS, max_batch_size=8, fault_injection=fault, **handler)


@pytest.fixture(scope="module")
def reference(minilm_dir):
    handler, context = load_handler(minilm_dir, buckets=BUCKETS)
    return {t: call(handler, context, [t])[0].body["embedding"] for t in (SHORT, MIDDLE, LONG)}


def test_a_batch_cap_learned_at_warmup_keeps_the_worker_loading_and_serving(minilm_dir, tmp_path, reference):
    handler, context = warm(minilm_dir, tmp_path, {"oom_above_batch": 2})
    assert handler.profile.oom_caps == {16: 2, 64: 2, 256: 2}
    assert {(s.batch, s.bucket) for s in handler.profile.shapes} == {(b, e) for e in BUCKETS for b in (1, 2)}
    assert all(handler.cap_for(b) == 2 for b in BUCKETS)
    texts = [SHORT, MIDDLE, LONG] * 3
    replies = call(handler, context, texts)
    assert [r.status for r in replies] == [200] * 9
    for text, reply in zip(texts, replies):
        assert cosine(reply.body["embedding"], reference[text]) >= 0.9999
    # kept next to the latency profile, in the directory every worker of the model shares
    kept = json.load(open(tmp_path / OOM_CAPS_FILE))
    assert kept["caps"] == {"16": 2, "64": 2, "256": 2}
    assert LatencyProfile.load(str(tmp_path / PROFILE_FILE)).oom_caps == {16: 2, 64: 2, 256: 2}


def test_a_restarted_worker_starts_from_the_kept_caps_and_meets_no_out_of_memory(minilm_dir, tmp_path):
    warm(minilm_dir, tmp_path, {"oom_above_batch": 2})
    again, _ = warm(minilm_dir, tmp_path, {"oom_above_batch": 2})
    assert again.profile.oom_caps == {}, "the restarted worker ran out of memory again"
    assert max(s.batch for s in again.profile.shapes) == 2


def test_a_bucket_that_does_not_fit_even_alone_answers_507_and_the_others_200(minilm_dir, tmp_path, reference):
    handler, context = warm(minilm_dir, tmp_path, {"oom_above_tokens": 200})
    # 256 x 1 > 200: nothing fits; 64 x 4 > 200: cap 2; 16 x 8 = 128 fits
    assert handler.profile.oom_caps == {256: 0, 64: 2}
    replies = call(handler, context, [SHORT, LONG, MIDDLE])
    assert [r.status for r in replies] == [200, 507, 200]
    assert "256 tokens" in replies[1].body["error"] and replies[1].body["code"] == 507
    assert cosine(replies[0].body["embedding"], reference[SHORT]) >= 0.9999
    again, again_context = warm(minilm_dir, tmp_path, {"oom_above_tokens": 200})
    assert again.profile.oom_caps == {} and 256 not in {s.bucket for s in again.profile.shapes}
    assert [r.status for r in call(again, again_context, [LONG, SHORT])] == [507, 200]


def test_a_cap_learned_while_serving_is_kept_for_the_next_worker(minilm_dir, tmp_path):
    handler, context = load_handler(minilm_dir, archive_dir=str(tmp_path), buckets=BUCKETS, max_batch_size=8,
                                    fault_injection={"oom_above_batch": 3})
    replies = call(handler, context, [f"request {i}" for i in range(8)])
    assert [r.status for r in replies] == [200] * 8
    assert handler.cap_for(16) <= 3
    assert json.load(open(tmp_path / OOM_CAPS_FILE))["caps"]["16"] == handler.cap_for(16)
    fresh, _ = load_handler(minilm_dir, archive_dir=str(tmp_path), buckets=BUCKETS, max_batch_size=8)
    assert fresh.cap_for(16) == handler.cap_for(16)
