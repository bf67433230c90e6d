"""Isolation with a real model: only failing requests fail, everyone else gets the lone answer."""
from __future__ import annotations

import logging

import pytest

from tests.support import call, cosine, load_handler

TEXTS = [f"text number {i} about {w}" for i, w in enumerate(
    ["apples", "trains", "oceans", "poems", "chess", "clouds", "violins", "deserts"])]


def load(model_dir: str, **handler):
    return load_handler(model_dir, **handler)


@pytest.fixture(scope="module")
def poisoned(minilm_dir):
    return load(minilm_dir, fault_injection={"substring": "POISON"})


@pytest.fixture(scope="module")
def alone(poisoned):
    handler, context = poisoned
    return {t: call(handler, context, [t])[0].body["embedding"] for t in TEXTS}


@pytest.mark.parametrize("bad", [[2], [1, 6], list(range(8))], ids=["one", "two", "all"])
def test_only_the_failing_requests_fail(poisoned, alone, bad):
    handler, context = poisoned
    payloads = [f"POISON {t}" if i in bad else t for i, t in enumerate(TEXTS)]
    replies = call(handler, context, payloads)
    for i, reply in enumerate(replies):
        if i in bad:
            assert reply.status == 500, reply.body
            assert reply.body["code"] == 500
            assert reply.body["error"].startswith("model failed on this input: InjectedFault")
        else:
            assert reply.status == 200
            assert cosine(reply.body["embedding"], alone[TEXTS[i]]) >= 0.9999


def test_a_broken_model_fails_fast_after_the_budget(minilm_dir, caplog):
    handler, context = load(minilm_dir, fault_injection={"substring": " "}, isolation_budget=4)
    calls = []
    original = handler.isolator._run  # the handler's pass, fault injection included
    handler.isolator._run = lambda batch: (calls.append(batch.size), original(batch))[1]
    with caplog.at_level(logging.ERROR):
        replies = call(handler, context, TEXTS)
    assert len(calls) <= 1 + 4
    statuses = [r.status for r in replies]
    assert set(statuses) <= {500, 503} and 503 in statuses
    unavailable = [r.body for r in replies if r.status == 503]
    assert all("model is failing for every input" in b["error"] for b in unavailable)
    assert "isolation budget" in caplog.text


def test_out_of_memory_halves_and_learns_a_cap(minilm_dir, caplog):
    handler, context = load(minilm_dir, fault_injection={"oom_above_batch": 3})
    with caplog.at_level(logging.WARNING):
        replies = call(handler, context, TEXTS)
    assert [r.status for r in replies] == [200] * 8
    bucket = handler.edges[0]
    assert handler.cap_for(bucket) == 2  # 8 -> 4 failed, 4 -> 2 worked: the largest that worked
    assert caplog.text.count("capped at 2") == 1
    sizes = []
    original = handler.isolator._run  # the handler's pass, fault injection included
    handler.isolator._run = lambda batch: (sizes.append(batch.size), original(batch))[1]
    replies = call(handler, context, TEXTS)
    assert [r.status for r in replies] == [200] * 8
    assert sizes == [2, 2, 2, 2], "a learned cap means no batch above it is ever formed again"


def test_input_that_does_not_fit_alone_gets_507(minilm_dir):
    handler, context = load(minilm_dir)
    original = handler.isolator._run  # the handler's pass, fault injection included

    def run(batch):
        if any("HUGE" in item.input.text for item in batch.items):
            raise MemoryError("simulated: out of memory")
        return original(batch)

    handler.isolator._run = run
    replies = call(handler, context, ["fine", "HUGE input", "also fine"])
    assert [r.status for r in replies] == [200, 507, 200]
    assert replies[1].body["code"] == 507 and "does not fit in memory" in replies[1].body["error"]
