"""Continuous mode with several workers of one model, under a frontend that locks like TorchServe's.

tests.support.SharedQueueFrontend plays TorchServe 0.12's continuous batching for N workers: one
queue, one model-wide lock that an idle worker keeps while it waits for the next request. The
first test shows the fake strands requests the way the real frontend did (a worker that went back
with a request unfinished waits until another request arrives); the others show that tsbatch's
workers, which know their siblings, never do. tests/e2e/test_workers.py checks the same through
a real torchserve.
"""
from __future__ import annotations

import os
import time

import pytest

from tsbatch.handlers.core.cost import CostModel
from tsbatch.handlers.edge.siblings import Siblings
from tests.support import ContinuousFrontend, SharedQueueFrontend, cosine, load_handler, scratch_dir

pytestmark = pytest.mark.integration

CONTINUOUS = {"continuousBatching": True, "batchSize": 96, "maxBatchDelay": 1}
LONG = " ".join(["a rather long sentence about nothing in particular"] * 60)


def workers(minilm_dir: str, count: int, **handler):
    archive = scratch_dir("tsbatch-shared-archive-")
    return [load_handler(minilm_dir, frontend=CONTINUOUS, archive_dir=archive, **handler) for _ in range(count)]


@pytest.fixture(scope="module")
def reference(minilm_dir):
    from tests.support import call

    handler, context = load_handler(minilm_dir)
    return lambda text: call(handler, context, [text])[0].body["embedding"]


def test_the_fake_frontend_strands_a_request_left_with_it_while_a_sibling_idles(minilm_dir):
    """Without sibling awareness (both workers told they are alone), a lone request that waits for
    company goes back to the frontend unfinished, and its worker's re-poll waits for the lock the
    idle sibling holds: no answer until the next request arrives. This is TorchServe's behaviour
    the fake must show, or the tests below prove nothing."""
    pair = workers(minilm_dir, 2, max_wait_ms=300, poll_ms=5)
    for handler, _ in pair:
        handler.siblings.alone = lambda: True
    frontend = SharedQueueFrontend(pair)
    try:
        frontend.submit("lone", "a lone request")
        assert not frontend.wait(["lone"], timeout=2.0), "answered: the fake does not lock like TorchServe"
        frontend.submit("next", "the next request")  # frees the lock: "lone" goes on (and "next" strands)
        assert frontend.wait(["lone"], timeout=30)
        assert frontend.replies["lone"].status == 200
    finally:
        frontend.close()


@pytest.mark.parametrize("count", [2, 3])
def test_lone_requests_are_answered_without_waiting_for_the_next_one(minilm_dir, reference, count):
    pool = workers(minilm_dir, count, max_wait_ms=300, poll_ms=5)
    assert all(handler.siblings.others() == count - 1 for handler, _ in pool)
    frontend = SharedQueueFrontend(pool)
    try:
        for i, text in enumerate(["a short one", LONG, "another short request", LONG + " again"]):
            frontend.submit(f"r{i}", text)
            assert frontend.wait([f"r{i}"], timeout=30), f"request {i} was not answered while alone"
            reply = frontend.replies[f"r{i}"]
            assert reply.status == 200 and cosine(reply.body["embedding"], reference(text)) >= 0.9999
    finally:
        frontend.close()


def test_a_mixed_burst_over_three_workers_is_answered_in_full(minilm_dir, reference):
    pool = workers(minilm_dir, 3, poll_ms=5, fault_injection={"substring": "POISON"})
    frontend = SharedQueueFrontend(pool)
    texts = [LONG + f" {i}" if i % 4 == 0 else f"burst request {i}" for i in range(24)]
    texts[5] = "POISON here"
    try:
        for i, text in enumerate(texts):
            frontend.submit(f"b{i}", text)
        assert frontend.wait([f"b{i}" for i in range(24)], timeout=120)
        statuses = [frontend.replies[f"b{i}"].status for i in range(24)]
        assert statuses == [500 if i == 5 else 200 for i in range(24)]
        for i in (0, 1, 7):
            assert cosine(frontend.replies[f"b{i}"].body["embedding"], reference(texts[i])) >= 0.9999
        for handler, _ in pool:
            assert handler.mode.running == {}
    finally:
        frontend.close()


def test_a_worker_alone_still_answers_a_short_request_during_a_long_pass(minilm_dir):
    """One worker keeps continuous mode's early answers: the short request is answered while the
    long pass it arrived behind still runs."""
    (handler, context), = workers(minilm_dir, 1, poll_ms=5)
    assert handler.siblings.alone()
    frontend = SharedQueueFrontend([(handler, context)])
    try:
        assert short_answered_before_long_passes(handler, frontend, "alone")
    finally:
        frontend.close()


def short_answered_before_long_passes(handler, frontend: SharedQueueFrontend, tag: str) -> bool:
    """Eight long requests, then a short one once the long lane's pass has started: whether the
    short one was answered before every long one (all answered 200)."""
    for i in range(8):
        frontend.submit(f"{tag}-long{i}", LONG + f" {tag} {i}")
    started = time.monotonic()
    while not handler.mode.engine.busy[-1]:  # the long lane has started its pass
        assert time.monotonic() - started < 30, "the long pass never started"
        time.sleep(0.001)
    frontend.submit(f"{tag}-short", f"a short request {tag}")
    ids = [f"{tag}-short"] + [f"{tag}-long{i}" for i in range(8)]
    assert frontend.wait(ids, timeout=60)
    assert all(frontend.replies[i].status == 200 for i in ids)
    return frontend.answered_at[f"{tag}-short"] < min(frontend.answered_at[i] for i in ids[1:])


def test_a_worker_whose_only_sibling_is_still_loading_answers_as_the_only_worker(minilm_dir):
    """A scale-up: the new worker has joined but loads and warms for seconds, unable to poll. The
    serving worker keeps answering each request when its own pass ends (a short one during a long
    pass), not each call whole; once the sibling is ready it answers calls whole again."""
    (handler, context), = workers(minilm_dir, 1, poll_ms=5)
    sibling = Siblings(os.path.dirname(handler.siblings.folder)).join()
    frontend = SharedQueueFrontend([(handler, context)])
    try:
        assert handler.siblings.others(fresh=True) == 1
        assert short_answered_before_long_passes(handler, frontend, "loading"), \
            "a loading sibling made the worker answer calls whole"
        sibling.ready()
        time.sleep(2 * handler.siblings.ttl)
        assert not short_answered_before_long_passes(handler, frontend, "ready"), \
            "with a serving sibling a call is answered whole"
    finally:
        frontend.close()
        sibling.leave()


def test_a_call_with_siblings_takes_in_only_what_fits_its_budget_and_sheds_the_rest(minilm_dir):
    """A call is answered whole when the worker has siblings, and new requests wait in TorchServe's
    queue meanwhile, so a call that found a backlog takes in at most max_call_ms of work: the rest
    get 503 at once."""
    pool = workers(minilm_dir, 2, poll_ms=5, max_call_ms=1, max_batch_size=1)
    for handler, _ in pool:
        _flat(handler)  # every pass 50 ms, one request each: one per lane fits a call
    frontend = SharedQueueFrontend(pool, batch_size=pool[0][1].system_properties["batch_size"])
    try:
        for handler, _ in pool:  # every worker inside a call: what queued is a backlog
            handler.siblings.in_call = lambda busy, real=handler.siblings.in_call: real(True)
            handler.siblings.in_call(True)
        for i in range(12):
            frontend.submit(f"c{i}", f"call budget request {i}")
        assert frontend.wait([f"c{i}" for i in range(12)], timeout=60)
        statuses = [frontend.replies[f"c{i}"].status for i in range(12)]
        assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
        assert set(statuses) == {200, 503}
        refused = next(r for r in frontend.replies.values() if r.status == 503)
        assert refused.headers.get("Retry-After") == "1" and "retry" in refused.body["error"]
        # a call with under a quarter of the frontend's batchSize (8 here: under 2) found no backlog
        # in TorchServe's queue, so nothing is shed, whatever its work
        for i in range(3):
            frontend.submit(f"small{i}", LONG + f" {i}")
            assert frontend.wait([f"small{i}"], timeout=60)
        assert [frontend.replies[f"small{i}"].status for i in range(3)] == [200] * 3
    finally:
        frontend.close()


def test_a_big_call_while_a_sibling_idles_is_a_burst_and_is_served_whole(minilm_dir):
    """An idle sibling polls TorchServe's queue, so that queue holds no backlog: a big call is a
    burst (TorchServe handed it all to one worker) and shedding it would only refuse work."""
    (first, context), (second, _) = workers(minilm_dir, 2, poll_ms=5, max_call_ms=1, max_batch_size=1)
    _flat(first)  # by the call budget, one request per lane fits a call
    frontend = ContinuousFrontend(first, context)
    for i in range(12):
        frontend.submit(f"burst{i}", f"burst request {i}")
    replies = frontend.drain()
    assert [replies[f"burst{i}"].status for i in range(12)] == [200] * 12
    assert frontend.calls == 1  # answered whole, in the call that brought it
    second.siblings.in_call(True)  # now every worker is inside a call: the same call is a backlog
    frontend = ContinuousFrontend(first, context)
    for i in range(12):
        frontend.submit(f"backlog{i}", f"backlog request {i}")
    statuses = [r.status for r in frontend.drain().values()]
    assert 503 in statuses and 200 in statuses, statuses


def _flat(handler) -> None:
    """Every pass 40 ms typical, 50 ms slow, per text: the worker's cost model, which its policy asks."""
    cost = CostModel(median=lambda *, bucket, size: 0.040 * size, p90=lambda *, bucket, size: 0.050 * size)
    handler.worker.cost = handler.mode.engine.policy.cost = cost
