"""Continuous mode: the handler under TorchServe's continuous batching protocol, with the real model.

tests.support.ContinuousFrontend plays the frontend: each call carries every request not yet
answered plus new ones, and a request counts as answered when its index is still in
`context.request_ids` after the call. The end-to-end tests run the same mode in a real torchserve.
"""
from __future__ import annotations

import time

import pytest
import torch

from tsbatch.handlers.edge.modes.continuous_mode import reply_pace
from tsbatch.handlers.edge.stages import BATCH_SIZE_HEADER, TIMING_HEADER
from tests.support import ContinuousFrontend, call, cosine, load_handler

pytestmark = pytest.mark.integration

CONTINUOUS = {"continuousBatching": True, "batchSize": 32, "maxBatchDelay": 1}
TEXTS = [f"continuous request {i} about {w}" for i, w in enumerate(
    ["owls", "boats", "tea", "maps", "snow", "drums", "lamps", "kites"])]
LONG = " ".join(["a rather long sentence about nothing in particular"] * 60)  # past 256 tokens: truncated


@pytest.fixture(scope="module")
def reference(minilm_dir):
    """Answers of the default mode, one request per batch."""
    handler, context = load_handler(minilm_dir)
    return {text: call(handler, context, [text])[0].body["embedding"] for text in TEXTS + [LONG]}


@pytest.fixture(scope="module")
def continuous(minilm_dir):
    return load_handler(minilm_dir, frontend=CONTINUOUS, fault_injection={"substring": "POISON"},
                        max_wait_ms=20, poll_ms=5)


def test_each_request_is_answered_once_with_its_own_status_and_the_answer_it_gets_alone(continuous, reference):
    handler, context = continuous
    assert handler.mode.name == "continuous"
    frontend = ContinuousFrontend(handler, context)
    payloads = list(TEXTS)
    payloads[2] = "POISON in here"
    payloads[6] = (b"{broken", "application/json")
    for i, payload in enumerate(payloads):
        frontend.submit(f"r{i}", payload)
    replies = frontend.drain()

    assert [replies[f"r{i}"].status for i in range(8)] == [200, 200, 500, 200, 200, 200, 400, 200]
    assert "POISON" in replies["r2"].body["error"] and replies["r6"].body["code"] == 400
    for i in (0, 1, 3, 4, 5, 7):
        assert cosine(replies[f"r{i}"].body["embedding"], reference[TEXTS[i]]) >= 0.9999
    assert frontend.answered_in["r6"] == 1  # bad input is answered in the call that brought it
    # tsbatch's scheduler formed the batches: some requests shared a pass
    assert max(int(r.headers[BATCH_SIZE_HEADER]) for r in replies.values() if r.status == 200) > 1
    assert handler.mode.running == {}  # nothing left behind


def test_a_call_returns_after_poll_ms_while_its_requests_still_run(continuous):
    handler, context = continuous
    frontend = ContinuousFrontend(handler, context)
    for i in range(8):
        frontend.submit(f"long{i}", LONG + f" {i}")  # one pass of 8 x 256 tokens: far longer than poll_ms
    started = time.monotonic()
    answered = frontend.step()
    assert answered == [] and time.monotonic() - started < 0.5
    assert len(frontend.waiting) == 8  # unanswered requests stay with the frontend, to come back
    frontend.drain()
    assert all(r.status == 200 for r in frontend.replies.values())


def test_a_busy_worker_is_called_about_once_per_pass_not_every_poll_ms(minilm_dir):
    """TorchServe calls a worker that holds requests back to back; with every lane busy the call
    waits until shortly before the pass should end (by the warmed profile), not poll_ms."""
    handler, context = load_handler(minilm_dir, frontend=CONTINUOUS, buckets=[32, 256], max_batch_size=8,
                                    long_lane_from=None, warmup=True, warmup_repeats=1, poll_ms=1)
    assert handler.profile.lookup(batch=8, bucket=256) is not None
    frontend = ContinuousFrontend(handler, context)
    for i in range(8):
        frontend.submit(f"long{i}", LONG + f" {i}")  # one 8 x 256 pass in the only lane
    started = time.monotonic()
    frontend.drain()
    elapsed_ms = (time.monotonic() - started) * 1000
    assert all(r.status == 200 for r in frontend.replies.values())
    # paced by poll_ms alone the frontend would call once per millisecond of the pass
    assert frontend.calls * 5 <= elapsed_ms, f"{frontend.calls} calls in {elapsed_ms:.0f} ms"


def test_a_worker_holding_many_requests_paces_its_replies_by_how_many_the_next_call_resends(minilm_dir, reference):
    """TorchServe re-sends every held request with each call: while the worker holds N requests,
    its replies come at least reply_pace(N) apart (a lower bound the handler keeps; the
    tolerance covers the return itself on a busy machine). Unpaced, passes of two short texts
    end every few milliseconds and each would get its own call."""
    handler, context = load_handler(minilm_dir, frontend=CONTINUOUS, max_batch_size=2, max_wait_ms=1)
    frontend = ContinuousFrontend(handler, context)
    for i in range(48):
        frontend.submit(f"r{i}", TEXTS[i % 8])
    frontend.drain()
    assert all(r.status == 200 for r in frontend.replies.values())
    assert cosine(frontend.replies["r9"].body["embedding"], reference[TEXTS[1]]) >= 0.9999
    paced = [(later - earlier, reply_pace(held)) for (earlier, _), (later, held)
             in zip(frontend.returned, frontend.returned[1:]) if reply_pace(held) >= 0.02]
    assert paced, "the worker never held 20 requests after a reply"
    assert all(gap >= pace - 0.01 for gap, pace in paced), paced


def test_the_reply_pace_never_holds_a_finished_answer_past_its_deadline(minilm_dir, monkeypatch):
    """With a pace of 10 s the second reply still comes by the finished requests' own deadline
    (2 s, less the margin kept for the way out), answered 200, not after the pace."""
    from tsbatch.handlers.edge.modes import continuous_mode
    monkeypatch.setattr(continuous_mode, "reply_pace", lambda held: 10.0)
    handler, context = load_handler(minilm_dir, frontend=CONTINUOUS, max_batch_size=2, max_wait_ms=1,
                                    deadline_ms=2000, deadline_margin_ms=50)
    frontend = ContinuousFrontend(handler, context)
    for i in range(8):
        frontend.submit(f"r{i}", TEXTS[i])
    started = time.monotonic()
    frontend.drain()
    assert time.monotonic() - started < 5.0
    assert frontend.calls >= 2 and all(r.status == 200 for r in frontend.replies.values())


def test_a_short_request_is_answered_while_a_long_pass_runs(continuous, reference):
    handler, context = continuous
    frontend = ContinuousFrontend(handler, context)
    for i in range(8):
        frontend.submit(f"long{i}", LONG + f" {i}")  # the long lane: 8 x 256 tokens in one pass
    frontend.step()
    assert len(frontend.waiting) == 8
    frontend.submit("short", TEXTS[0])
    while "short" not in frontend.replies:
        frontend.step()
        assert frontend.calls < 10_000
    assert frontend.replies["short"].status == 200
    assert cosine(frontend.replies["short"].body["embedding"], reference[TEXTS[0]]) >= 0.9999
    assert not any(rid.startswith("long") for rid in frontend.replies), \
        "the short request waited for the long pass"
    frontend.drain()
    assert all(frontend.replies[f"long{i}"].status == 200 for i in range(8))


def test_a_full_queue_and_bad_headers_are_answered_at_once(minilm_dir):
    handler, context = load_handler(minilm_dir, frontend=CONTINUOUS, queue_cap=2, max_wait_ms=1000)
    frontend = ContinuousFrontend(handler, context)
    for i in range(4):
        frontend.submit(f"q{i}", f"queued {i}")  # cap 2: the 3rd and 4th are refused
    frontend.submit("bad", "x", headers={"X-Priority": "urgent"})
    answered = frontend.step()
    assert sorted(answered) == ["bad", "q2", "q3"]
    assert frontend.replies["q2"].status == 503 and frontend.replies["q2"].headers.get("Retry-After") == "1"
    assert frontend.replies["bad"].status == 400 and "X-Priority" in frontend.replies["bad"].body["error"]
    frontend.drain()
    assert frontend.replies["q0"].status == frontend.replies["q1"].status == 200


def test_requests_past_what_their_lane_can_do_by_their_deadline_are_refused_at_once(minilm_dir):
    """Admission by deadline, with the warmed profile's pass times: 30 long requests that each
    need a pass of their own, with a 300 ms deadline; the lane takes what it can finish in time,
    the rest are answered 503 with Retry-After in the call that brought them, not 504 later."""
    handler, context = load_handler(minilm_dir, frontend=CONTINUOUS, buckets=[32, 256], max_batch_size=1,
                                    warmup=True, warmup_repeats=1)
    frontend = ContinuousFrontend(handler, context)
    for i in range(30):
        frontend.submit(f"long{i}", LONG + f" {i}", headers={"X-Deadline-Ms": "300"})
    first = set(frontend.step())
    replies = frontend.drain()
    refused = {rid for rid, r in replies.items() if r.status == 503}
    assert refused and refused <= first  # refused in the first call, at once
    assert all("ms of work ahead" in replies[rid].body["error"] and replies[rid].headers.get("Retry-After") == "1"
               for rid in refused)
    admitted = set(replies) - refused
    assert "long0" in admitted  # an empty lane always takes one
    assert all(replies[rid].status in (200, 504) for rid in admitted)


def test_a_request_already_late_on_arrival_is_answered_504_in_its_call_and_the_others_are_served(continuous):
    """Issue #38: a client's X-Deadline-At (a wall-clock instant) counts the time a request spent in
    TorchServe's queue; one whose instant has passed is answered 504 at once, never computed."""
    handler, context = continuous
    frontend = ContinuousFrontend(handler, context)
    frontend.submit("late", TEXTS[0], headers={"X-Deadline-At": f"{time.time() - 2:.3f}"})
    frontend.submit("in time", TEXTS[1], headers={"X-Deadline-At": f"{time.time() + 60:.3f}"})
    frontend.submit("bad", TEXTS[2], headers={"X-Deadline-At": "tomorrow"})
    frontend.submit("plain", TEXTS[3])
    replies = frontend.drain()
    assert replies["late"].status == 504 and "deadline had passed" in replies["late"].body["error"]
    assert frontend.answered_in["late"] == 1  # in the call that brought it
    assert replies["bad"].status == 400 and "X-Deadline-At" in replies["bad"].body["error"]
    assert replies["in time"].status == replies["plain"].status == 200
    assert handler.mode.running == {}


def test_a_request_of_many_texts_gets_each_texts_own_answer_padded_to_its_own_bucket(continuous, reference):
    """Issue #20: 32 mixed-length texts in one request, alongside requests of one text, through
    the continuous frontend: each text answered as it is alone, none padded to the long one."""
    handler, context = continuous
    texts = [TEXTS[i % 8] for i in range(31)] + [LONG]
    frontend = ContinuousFrontend(handler, context)
    frontend.submit("many", ({"text": texts}, "application/json"))
    frontend.submit("one", TEXTS[3])
    frontend.submit("bad", ({"text": [TEXTS[0], " "]}, "application/json"))
    replies = frontend.drain()
    assert replies["one"].status == 200 and replies["bad"].status == 400
    assert replies["bad"].body["index"] == 1
    many = replies["many"]
    assert many.status == 200 and len(many.body) == 32
    for text, answer in zip(texts, many.body):
        assert cosine(answer["embedding"], reference[text]) >= 0.999
    padded = many.headers["x-tsbatch-padded-to"].split(",")
    assert len(padded) == 32 and padded[-1] == "256" and max(int(p) for p in padded[:-1]) <= 32
    assert handler.mode.running == {}


def test_with_borrow_cores_a_lone_long_request_runs_on_both_lanes_threads_and_answers_the_same(minilm_dir, reference):
    handler, context = load_handler(minilm_dir, frontend=CONTINUOUS, buckets=[32, 256], max_batch_size=2,
                                    long_lane_from=128, torch_threads=2, borrow_cores=True, warmup=True,
                                    warmup_repeats=1, poll_ms=5)
    profile = handler.profile
    assert profile.lookup(batch=1, bucket=256, threads=2) is not None  # warmup timed the wide shapes too
    assert profile.lookup(batch=1, bucket=256) is not None
    switched, ran_on = [], []  # ran_on: (bucket, the OpenMP threads of the lane running the pass)
    model = handler.worker.model
    own_use_threads, own_forward = model.use_threads, model.forward
    model.use_threads = lambda count, background=False: (switched.append(count), own_use_threads(count, background))
    model.forward = lambda batch: (ran_on.append((batch.bucket, torch.get_num_threads())), own_forward(batch))[1]
    try:
        frontend = ContinuousFrontend(handler, context)
        frontend.submit("short", TEXTS[0])
        short = frontend.drain()["short"]
        time.sleep(0.5)  # a long arrival gap: the policy expects the long pass over before the next request
        frontend.submit("long", LONG)
        replies = frontend.drain()
    finally:
        model.use_threads, model.forward = own_use_threads, own_forward
    assert replies["long"].status == 200
    assert cosine(replies["long"].body["embedding"], reference[LONG]) >= 0.9999
    wide = profile.lookup(batch=1, bucket=256, threads=2).median_ms
    own = profile.lookup(batch=1, bucket=256).median_ms
    # the policy lends the idle short lane's thread where warmup measured it 10 ms faster
    assert switched == ([2] if wide <= own - 10 else []), (own, wide, switched)
    # each lane runs on the threads the policy gave it: the short lane's one thread stayed one
    # although the long lane warmed on two after it set its own (handlers/models/threads.py)
    assert ran_on == [(32, 1), (256, 2 if switched else 1)], ran_on
    # and each reply says so (x-tsbatch-timing)
    assert "threads=1;" in short.headers[TIMING_HEADER], short.headers
    assert f"threads={2 if switched else 1};" in replies["long"].headers[TIMING_HEADER]
