"""The generation policy's rules, one step at a time, with time passed in (a fake clock)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tsbatch.handlers.core.errors import (BadInput, ConfigError, DeadlineExceeded, ModelFailed, OutOfMemory,
                                          Overloaded)
from tsbatch.handlers.core.generation_policy import (GenerationSettings, GenerationRequest, GenerationPolicy,
                                                     Priority, Seq, Status, StepOutcome, StepPlan)

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Clock:
    """A fake clock the tests move by hand."""

    def __init__(self):
        self.now = 0.0

    def tick(self, seconds: float = 0.01) -> float:
        self.now += seconds
        return self.now


def policy(**overrides) -> GenerationSettings:
    """The rules of one step are tested with prefills in the running sequences' decode step; the
    alternation that ships (prefill_apart) has tests of its own below."""
    values = dict(token_budget=64, kv_bound=1000, max_running=8, queue_cap=16, prefill_apart=False)
    values.update(overrides)
    return GenerationSettings(**values)


def ask(rid: str, prompt: int = 4, new: int = 8, at: float = 0.0, priority: Priority = Priority.NORMAL,
        deadline: float | None = None) -> GenerationRequest:
    return GenerationRequest(rid, tuple(range(1, prompt + 1)), new, at, priority, deadline)


def ran(plan: StepPlan, token: int = 7, eos=(), failed=None) -> StepOutcome:
    """Every sequence of the plan made `token`, except those in `eos` (ended) and `failed`."""
    failed = failed or {}
    return StepOutcome(tokens={s: token for s in plan.runs if s not in failed}, eos=frozenset(eos), failed=failed)


def rids(seqs) -> list[str]:
    return [s.rid for s in seqs]


def step(scheduler: GenerationPolicy, clock: Clock, **outcome) -> tuple[StepPlan, list[Seq]]:
    plan = scheduler.schedule(clock.tick())
    return plan, scheduler.finished(plan, ran(plan, **outcome), clock.tick())


def test_the_module_imports_neither_torch_nor_torchserve():
    probe = ("import json, sys; import tsbatch.handlers.core.generation_policy, tsbatch.handlers.edge.generation_api; "
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'ts'))))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_waiting_requests_join_in_turn_and_running_ones_decode_every_step():
    clock, s = Clock(), GenerationPolicy(policy())
    s.submit(ask("a", prompt=3, at=0.0))
    plan = s.schedule(clock.tick())
    assert rids(plan.prefill) == ["a"] and plan.decode == () and plan.tokens == 3 and plan.kv_tokens == 3
    s.finished(plan, ran(plan), clock.tick())
    assert s.kv_in_use == 3  # its prompt is cached; its first token is fed next step
    s.submit(ask("b", prompt=5, at=clock.now))
    plan = s.schedule(clock.tick())
    assert rids(plan.decode) == ["a"] and rids(plan.prefill) == ["b"]
    assert plan.tokens == 1 + 5  # a decode feeds one token, a prefill its whole prompt
    assert plan.kv_tokens == (3 + 1) + 5


def test_joining_requests_prefill_in_a_step_of_their_own_and_the_next_step_decodes_every_running_one():
    clock, s = Clock(), GenerationPolicy(policy(prefill_apart=True))
    s.submit(ask("a", prompt=3, at=0.0))
    plan, _ = step(s, clock)
    assert rids(plan.prefill) == ["a"] and plan.decode == ()  # nothing ran before: a prefill, as ever
    s.submit(ask("b", prompt=5, at=clock.now))
    plan = s.schedule(clock.tick())
    assert rids(plan.prefill) == ["b"] and plan.decode == ()  # "a" waits out b's prefill, not b for a's decode
    assert plan.tokens == 5 and plan.kv_tokens == (3 + 1) + 5  # a still holds its cache
    s.finished(plan, ran(plan), clock.tick())
    a, b = s.running
    assert len(a.tokens) == 1 and len(b.tokens) == 1 and a.status is b.status is Status.RUNNING
    s.submit(ask("c", prompt=2, at=clock.now))
    plan, _ = step(s, clock)
    assert rids(plan.decode) == ["a", "b"] and plan.prefill == ()  # after a prefill step: a decode, c waits one
    plan, _ = step(s, clock)
    assert rids(plan.prefill) == ["c"] and plan.decode == ()
    plan, _ = step(s, clock)
    assert rids(plan.decode) == ["a", "b", "c"] and [len(q.tokens) for q in plan.decode] == [3, 3, 2]


def test_a_prefill_step_of_its_own_still_preempts_for_priority():
    clock, s = Clock(), GenerationPolicy(policy(prefill_apart=True, max_running=2))
    s.submit(ask("low", at=0.0, priority=Priority.LOW))
    s.submit(ask("other", at=0.001, priority=Priority.LOW))  # the younger
    step(s, clock)
    s.submit(ask("high", at=clock.now, priority=Priority.HIGH))
    plan = s.schedule(clock.tick())
    assert rids(plan.preempted) == ["other"] and rids(plan.prefill) == ["high"] and plan.decode == ()
    s.finished(plan, ran(plan), clock.tick())
    plan, _ = step(s, clock)
    assert rids(plan.decode) == ["low", "high"] and plan.prefill == ()  # "other" waits for a seat


def test_prefills_stop_at_the_token_budget_but_one_prefill_may_exceed_it():
    clock, s = Clock(), GenerationPolicy(policy(token_budget=8, max_running=4))
    for i, prompt in enumerate((20, 3)):
        s.submit(ask(f"r{i}", prompt=prompt, at=i * 0.001))
    plan = s.schedule(clock.tick())
    assert rids(plan.prefill) == ["r0"]  # alone past the budget, else it could never run
    s.finished(plan, ran(plan), clock.tick())
    s.submit(ask("r2", prompt=5, at=clock.now))
    plan = s.schedule(clock.tick())
    assert rids(plan.decode) == ["r0"] and rids(plan.prefill) == ["r1"]  # 1 + 3 fits, + 5 would not
    assert plan.tokens == 4


def test_joining_stops_at_the_kv_bound_and_a_smaller_later_request_does_not_pass():
    clock, s = Clock(), GenerationPolicy(policy(kv_bound=30))
    s.submit(ask("big", prompt=12, new=8, at=0.0))
    s.submit(ask("next", prompt=20, new=8, at=0.001))
    s.submit(ask("small", prompt=2, new=2, at=0.002))
    plan = s.schedule(clock.tick())
    assert rids(plan.prefill) == ["big"] and plan.kv_tokens == 12  # next would make 32; small may not pass it
    s.finished(plan, ran(plan, eos=plan.prefill), clock.tick())
    plan = s.schedule(clock.tick())
    assert rids(plan.prefill) == ["next", "small"] and plan.kv_tokens == 22


def test_seats_are_bounded_by_max_running():
    clock, s = Clock(), GenerationPolicy(policy(max_running=2))
    for i in range(3):
        s.submit(ask(f"r{i}", at=i * 0.001))
    plan = s.schedule(clock.tick())
    assert rids(plan.prefill) == ["r0", "r1"]
    assert rids(s.waiting) == ["r2"]


def test_a_sequence_leaves_at_end_of_sequence_or_max_new_tokens_and_the_rest_go_on():
    clock, s = Clock(), GenerationPolicy(policy())
    s.submit(ask("stops", new=5, at=0.0))
    s.submit(ask("short", new=2, at=0.001))
    s.submit(ask("long", new=5, at=0.002))
    plan, ended = step(s, clock)
    assert ended == [] and all(x.first_token_at == clock.now for x in plan.runs)
    stops = plan.prefill[0]
    plan, ended = step(s, clock, eos=[stops])
    assert rids(ended) == ["stops", "short"]
    assert stops.stop == "eos" and stops.tokens == [7]  # the end-of-sequence token is not part of the answer
    assert ended[1].stop == "length" and ended[1].tokens == [7, 7]
    assert all(x.status is Status.FINISHED and x.ended_at == clock.now for x in ended)
    plan = s.schedule(clock.tick())
    assert rids(plan.decode) == ["long"]  # their seats and KV are free at once
    assert plan.kv_tokens == 4 + 2


def test_a_sequence_whose_step_failed_ends_alone():
    clock, s = Clock(), GenerationPolicy(policy())
    for rid in ("a", "b", "c"):
        s.submit(ask(rid))
    plan = s.schedule(clock.tick())
    b = plan.prefill[1]
    ended = s.finished(plan, ran(plan, failed={b: ModelFailed("boom")}), clock.tick())
    assert ended == [b] and b.status is Status.FAILED and b.error.status == 500 and b.tokens == []
    plan = s.schedule(clock.tick())
    assert rids(plan.decode) == ["a", "c"]


def test_an_outcome_that_forgets_a_sequence_is_an_error_that_names_it():
    clock, s = Clock(), GenerationPolicy(policy())
    s.submit(ask("a"))
    s.submit(ask("b"))
    plan = s.schedule(clock.tick())
    with pytest.raises(RuntimeError, match="1 of its 2 sequences .first: b"):
        s.finished(plan, StepOutcome(tokens={plan.prefill[0]: 1}), clock.tick())


def test_growth_past_the_bound_preempts_the_lowest_class_then_the_youngest_and_recomputes_it_later():
    clock, s = Clock(), GenerationPolicy(policy(kv_bound=40))
    s.submit(ask("old-low", prompt=6, new=20, at=0.0, priority=Priority.LOW))
    s.submit(ask("normal", prompt=6, new=20, at=0.001))
    s.submit(ask("young-low", prompt=6, new=20, at=0.002, priority=Priority.LOW))
    plan, _ = step(s, clock)  # 18 live
    for _ in range(7):  # each step adds 3: the 9th would need 42
        plan, _ = step(s, clock)
    plan = s.schedule(clock.tick())
    assert rids(plan.preempted) == ["young-low"] and rids(plan.decode) == ["normal", "old-low"]
    assert plan.kv_tokens <= 40
    young = plan.preempted[0]
    assert young.status is Status.WAITING and young.preemptions == 1 and s.preemptions == 1
    assert len(young.tokens) == 8  # what it made is kept: it is recomputed, not restarted
    s.finished(plan, ran(plan), clock.tick())
    # once a seat's worth of KV is free it is prefilled again over its prompt and its tokens
    s.cancel(next(x for x in s.running if x.rid == "normal"), clock.tick())
    plan = s.schedule(clock.tick())
    assert rids(plan.prefill) == ["young-low"] and young.context == 6 + 8
    assert plan.tokens == 1 + 14


def test_out_of_memory_learns_a_lower_bound_sends_joiners_back_and_the_next_plan_preempts():
    clock, s = Clock(), GenerationPolicy(policy(kv_bound=1000))
    s.submit(ask("a", prompt=10, new=50, at=0.0))
    s.submit(ask("b", prompt=10, new=50, at=0.001))
    step(s, clock)
    s.submit(ask("c", prompt=10, new=50, at=clock.now))
    plan = s.schedule(clock.tick())
    assert rids(plan.decode) == ["a", "b"] and rids(plan.prefill) == ["c"] and plan.kv_tokens == 32
    assert s.finished(plan, StepOutcome(out_of_memory=True), clock.tick()) == []
    assert s.kv_bound == 28 and s.out_of_memory_steps == 1  # 0.9 of the failed step's 32
    c = plan.prefill[0]
    assert c.status is Status.WAITING and c.preemptions == 0 and c.tokens == []
    assert [len(x.tokens) for x in plan.decode] == [1, 1]  # nothing advanced
    plan = s.schedule(clock.tick())
    assert rids(plan.decode) == ["a", "b"] and plan.prefill == ()  # 22 live; c (10) waits
    s.finished(plan, StepOutcome(out_of_memory=True), clock.tick())
    assert s.kv_bound == 19  # only ever down
    plan = s.schedule(clock.tick())
    assert rids(plan.preempted) == ["b"] and rids(plan.decode) == ["a"]  # the youngest goes
    s.finished(plan, ran(plan), clock.tick())
    assert s.kv_bound == 19


def test_a_sequence_preempted_in_a_step_does_not_rejoin_in_that_same_step():
    clock, s = Clock(), GenerationPolicy(policy(kv_bound=37, oom_backoff=0.5, priority_aging=1.0))
    s.submit(ask("small", prompt=4, new=5, at=0.0, priority=Priority.LOW))
    s.submit(ask("big", prompt=20, new=5, at=0.001))
    s.submit(ask("keep", prompt=10, new=5, at=0.002, priority=Priority.HIGH))
    clock.now = 2.0  # all have aged to the best class: waiting order is by arrival, small first
    step(s, clock)
    plan = s.schedule(clock.tick())
    assert plan.kv_tokens == 37
    s.finished(plan, StepOutcome(out_of_memory=True), clock.tick())
    assert s.kv_bound == 18
    plan = s.schedule(clock.tick())
    assert rids(plan.preempted) == ["small", "big"] and rids(plan.decode) == ["keep"]
    assert plan.prefill == ()  # small would fit again (11 + 5), but is not recomputed at once
    s.finished(plan, ran(plan), clock.tick())
    plan = s.schedule(clock.tick())
    assert rids(plan.refused) == ["big"] and rids(plan.prefill) == ["small"]  # big (25 at most) never fits 18


def test_out_of_memory_alone_fails_that_sequence_and_what_can_no_longer_fit_is_refused():
    clock, s = Clock(), GenerationPolicy(policy(kv_bound=100, max_running=1))
    s.submit(ask("a", prompt=10, new=50))
    s.submit(ask("waits", prompt=30, new=50, at=0.001))
    s.submit(ask("small", prompt=2, new=3, at=0.002))
    step(s, clock)
    plan = s.schedule(clock.tick())
    assert rids(plan.decode) == ["a"] and plan.kv_tokens == 11
    s.finished(plan, StepOutcome(out_of_memory=True), clock.tick())
    assert s.kv_bound == 9
    plan = s.schedule(clock.tick())
    assert rids(plan.refused) == ["waits", "a"]  # a does not fit even alone; waits could never
    assert all(isinstance(x.error, OutOfMemory) and x.status is Status.FAILED for x in plan.refused)
    assert rids(plan.prefill) == ["small"]  # what still fits goes on
    with pytest.raises(OutOfMemory, match="this worker holds 9"):
        s.submit(ask("new", prompt=5, new=5))


def test_submit_refuses_a_full_queue_and_an_ask_that_cannot_fit_even_alone():
    s = GenerationPolicy(policy(queue_cap=2, kv_bound=50))
    s.submit(ask("a"))
    s.submit(ask("b"))
    with pytest.raises(Overloaded, match="2 generation requests waiting .cap 2") as full:
        s.submit(ask("c"))
    assert full.value.status == 503
    with pytest.raises(OutOfMemory, match="needs up to 51 KV-cache tokens") as big:
        GenerationPolicy(policy(kv_bound=50)).submit(ask("big", prompt=41, new=10))
    assert big.value.status == 507
    GenerationPolicy(policy(kv_bound=50)).submit(ask("just", prompt=40, new=10))
    with pytest.raises(BadInput):
        s.submit(GenerationRequest("empty", (), 4, 0.0))


def test_preempted_sequences_do_not_count_against_the_queue_cap():
    clock, s = Clock(), GenerationPolicy(policy(queue_cap=1, kv_bound=20, max_running=2))
    s.submit(ask("a", prompt=8, new=10))
    step(s, clock)
    s.submit(ask("b", prompt=8, new=10, at=clock.now))
    plan, _ = step(s, clock)
    assert rids(plan.prefill) == ["b"]
    step(s, clock)  # 10 + 9 live
    plan = s.schedule(clock.tick())
    assert rids(plan.preempted) == ["b"]  # 11 + 10 > 20
    s.submit(ask("c", at=clock.now))  # b waits again, but the queue holds no new request
    with pytest.raises(Overloaded):
        s.submit(ask("d", at=clock.now))


def test_a_high_priority_request_preempts_lower_classes_but_not_its_own():
    clock, s = Clock(), GenerationPolicy(policy(max_running=2))
    s.submit(ask("low", priority=Priority.LOW))
    s.submit(ask("normal", at=0.001))
    step(s, clock)
    s.submit(ask("high", at=clock.now, priority=Priority.HIGH))
    s.submit(ask("normal-2", at=clock.now))
    plan = s.schedule(clock.tick())
    assert rids(plan.prefill) == ["high"] and rids(plan.preempted) == ["low"] and rids(plan.decode) == ["normal"]
    assert plan.tokens == 1 + 4
    s.finished(plan, ran(plan), clock.tick())
    plan = s.schedule(clock.tick())
    assert plan.prefill == () and plan.preempted == ()  # normal-2 does not preempt normal; low waits too


def test_preemption_for_priority_can_be_turned_off_and_never_evicts_for_nothing():
    clock, s = Clock(), GenerationPolicy(policy(max_running=2, preempt_for_priority=False))
    s.submit(ask("low", priority=Priority.LOW))
    s.submit(ask("low-2", priority=Priority.LOW, at=0.001))
    step(s, clock)
    s.submit(ask("high", at=clock.now, priority=Priority.HIGH))
    plan = s.schedule(clock.tick())
    assert plan.prefill == () and plan.preempted == ()
    # on, but the lower classes hold too little room for the request: nobody is evicted in vain
    clock, s = Clock(), GenerationPolicy(policy(kv_bound=40))
    s.submit(ask("normal", prompt=20, new=10))
    s.submit(ask("low", prompt=5, new=5, at=0.001, priority=Priority.LOW))
    step(s, clock)
    s.submit(ask("normal-2", prompt=20, new=10, at=clock.now))
    plan = s.schedule(clock.tick())
    assert plan.prefill == () and plan.preempted == () and rids(plan.decode) == ["normal", "low"]


def test_deadlines_expire_waiting_and_running_sequences():
    clock, s = Clock(), GenerationPolicy(policy(max_running=1))
    s.submit(ask("runs", deadline=0.05))
    s.submit(ask("waits", at=0.001, deadline=0.03))
    plan, _ = step(s, clock)
    assert rids(plan.prefill) == ["runs"]
    clock.now = 0.03
    plan = s.schedule(clock.now)
    assert rids(plan.expired) == ["waits"] and rids(plan.decode) == ["runs"]
    assert isinstance(plan.expired[0].error, DeadlineExceeded) and plan.expired[0].error.status == 504
    s.finished(plan, ran(plan), clock.tick())
    clock.now = 0.05
    plan = s.schedule(clock.now)
    assert rids(plan.expired) == ["runs"] and plan.runs == () and plan.ended == plan.expired
    assert plan.expired[0].status is Status.FAILED and s.running == []


def test_a_waiting_low_request_climbs_a_class_per_aging_period():
    for now, first in ((0.9, "normal"), (1.2, "low")):
        s = GenerationPolicy(policy(max_running=1, priority_aging=1.0))
        s.submit(ask("normal", at=0.5))
        s.submit(ask("low", at=0.0, priority=Priority.LOW))
        # at 1.2 low has waited a whole period: it counts as normal, and it came first
        assert rids(s.schedule(now).prefill) == [first]


def test_a_sequence_cancelled_while_its_step_runs_is_ignored_when_the_step_settles():
    clock, s = Clock(), GenerationPolicy(policy())
    s.submit(ask("gone"))
    s.submit(ask("stays"))
    plan = s.schedule(clock.tick())
    gone = plan.prefill[0]
    assert s.cancel(gone, clock.tick()) and not s.cancel(gone, clock.tick())
    assert s.finished(plan, ran(plan), clock.tick()) == []
    assert gone.status is Status.CANCELLED and gone.tokens == [] and rids(s.running) == ["stays"]


def test_priority_is_read_from_the_header_as_the_encoder_reads_it():
    assert Priority.parse(None) is Priority.NORMAL and Priority.parse(" High ") is Priority.HIGH
    with pytest.raises(BadInput, match="high, normal or low, got 'urgent'"):
        Priority.parse("urgent")


@pytest.mark.parametrize("field, value, message", [
    ("token_budget", 0, "token_budget must be a whole number"),
    ("kv_bound", 1.5, "kv_bound must be a whole number"),
    ("token_budget", 4, "token_budget .4. must be at least max_running .8."),
    ("oom_backoff", 1.0, "oom_backoff must be between 0 and 1"),
])
def test_a_bad_policy_fails_at_load_with_the_field_named(field, value, message):
    with pytest.raises(ConfigError, match=message):
        policy(**{field: value})


# -- the handler's contract (handlers/edge/generation_api.py): pure as well

def test_an_ask_is_json_or_plain_text_and_a_deadline_header_may_only_shorten_the_deadline():
    from tsbatch.handlers.edge.generation_api import Ask, GenerationConfig, deadline_of, parse_ask

    config = GenerationConfig(max_new_tokens=32, default_new_tokens=8, deadline_ms=5000)
    assert parse_ask(b'{"text": "hi", "max_new_tokens": 3, "stream": true}', config) == Ask("hi", 3, True)
    assert parse_ask("plain words", config) == Ask("plain words", 8, False)
    assert parse_ask({"text": "parsed by TorchServe"}, config).max_new_tokens == 8
    for body, message in ((b"\xff", "not UTF-8"), ('{"text": "x", "stream": "yes"}', "stream must be true or false"),
                          ({"text": "x", "max_new_tokens": True}, "from 1 to 32, got True"), ({"text": " "}, "empty")):
        with pytest.raises(BadInput, match=message):
            parse_ask(body, config)
    assert deadline_of({}, config, 10.0) == 15.0
    assert deadline_of({"x-deadline-ms": "200"}, config, 10.0) == pytest.approx(10.2)
    assert deadline_of({"x-deadline-ms": "90000"}, config, 10.0) == 15.0
    with pytest.raises(BadInput, match="whole number of milliseconds"):
        deadline_of({"x-deadline-ms": "soon"}, config, 10.0)


def test_generation_reads_x_deadline_at_by_the_encoder_modes_rule():
    """One home for the deadline rule (stages.client_deadline): an absolute X-Deadline-At counts
    against the wall clock, the earlier of both headers wins, the config's deadline_ms caps all."""
    from tsbatch.handlers.edge.generation_api import GenerationConfig, deadline_of

    config = GenerationConfig(deadline_ms=5000)
    assert deadline_of({"x-deadline-at": "1000.5"}, config, 10.0, wall=1000.0) == pytest.approx(10.5)
    assert deadline_of({"x-deadline-at": "1003", "x-deadline-ms": "1000"}, config, 10.0,
                       wall=1000.0) == pytest.approx(11.0)
    assert deadline_of({"x-deadline-at": "2000"}, config, 10.0, wall=1000.0) == 15.0  # never past deadline_ms
    assert deadline_of({"x-deadline-at": "999"}, config, 10.0, wall=1000.0) == pytest.approx(9.0)  # past: 504
    for bad in ("tomorrow", "-1", "inf"):
        with pytest.raises(BadInput, match="X-Deadline-At must be a wall-clock instant"):
            deadline_of({"x-deadline-at": bad}, config, 10.0, wall=1000.0)


def test_the_out_of_memory_fault_is_off_by_default_and_checked_at_load():
    from tsbatch.handlers.edge.generation_api import GenerationConfig

    assert GenerationConfig().fault_oom_substring is None
    assert GenerationConfig.from_section({"fault_oom_substring": "OOM"}).fault_oom_substring == "OOM"
    with pytest.raises(ConfigError, match="fault_oom_substring must not be empty"):
        GenerationConfig.from_section({"fault_oom_substring": ""})


def test_a_stream_hands_out_text_pieces_that_join_to_the_whole_text():
    from tsbatch.handlers.edge.generation_api import TextStream

    words = {1: "he", 2: "##llo", 3: "world"}

    def decode(tokens):  # WordPiece-like: "##" joins a piece to the word before
        return " ".join(words[t] for t in tokens).replace(" ##", "")

    stream = TextStream(decode)
    pieces = [stream.add(t) for t in (1, 2, 3)]
    assert pieces == ["he", "llo", " world"] and "".join(pieces) == decode([1, 2, 3])
    long_answer = [1, 2, 3] * 100  # past the window many times: it slides, and the pieces still join
    stream = TextStream(decode)
    assert "".join(stream.add(t) for t in long_answer) == decode(long_answer)


def test_a_stream_decodes_a_window_of_tokens_not_the_whole_answer_at_each_token():
    from tsbatch.handlers.edge.generation_api import TextStream

    decoded = []

    def decode(tokens):
        decoded.append(len(tokens))
        return "".join(f" w{t}" for t in tokens)

    stream = TextStream(decode)
    pieces = [stream.add(t) for t in range(1000)]
    assert "".join(pieces) == decode(list(range(1000)))
    assert max(decoded[:-1]) <= 2 * TextStream.WINDOW  # the whole answer once, above: not at each token
    assert sum(decoded[:-1]) < 30 * 1000  # linear in the answer's length (all of it each time: 500,500)


def test_a_stream_holds_an_incomplete_character_and_goes_on_after_a_change():
    from tsbatch.handlers.edge.generation_api import TextStream

    def utf8(tokens):  # byte-level: token 0xC3 alone is half of "é"
        return bytes(tokens).decode("utf-8", errors="replace")

    stream = TextStream(utf8)
    assert [stream.add(t) for t in (ord("a"), 0xC3, 0xA9, ord("b"))] == ["a", "", "é", "b"]

    words = {1: "it", 2: "'", 3: "s", 4: "fine"}

    def cleaned(tokens):  # a clean-up across tokens: "it ' s" -> "it's"
        return " ".join(words[t] for t in tokens).replace(" ' ", "'")

    stream = TextStream(cleaned)
    pieces = [stream.add(t) for t in (1, 2, 3, 4)]
    assert pieces == ["it", " '", "", " fine"]  # the change is not handed out; the stream does not go silent


def test_the_generation_settings_name_a_misspelt_key_and_check_the_policy_at_load():
    from tsbatch.handlers.edge.generation_api import GenerationConfig

    assert GenerationConfig.from_section({"kv_bound": 4096}).settings().kv_bound == 4096
    with pytest.raises(ConfigError, match="did you mean max_new_tokens"):
        GenerationConfig.from_section({"max_new_token": 8})
    with pytest.raises(ConfigError, match="default_new_tokens .64. must be at most max_new_tokens .32."):
        GenerationConfig.from_section({"max_new_tokens": 32, "default_new_tokens": 64})
    with pytest.raises(ConfigError, match="preempt_for_priority must be true or false"):
        GenerationConfig.from_section({"preempt_for_priority": "yes"})


def test_on_a_device_the_kv_bound_is_what_a_share_of_its_free_memory_holds_or_the_configured_one_if_smaller():
    from tsbatch.handlers.edge.generation_api import GenerationConfig, kv_bound_for

    assert kv_bound_for(free_bytes=10_000, bytes_per_token=512, share=0.8) == 15
    assert kv_bound_for(free_bytes=100, bytes_per_token=512, share=0.8) == 1
    config = GenerationConfig.from_section({"kv_bound": 100, "kv_memory_share": 0.5})
    assert config.settings(kv_bound=40).kv_bound == 40 and config.settings(kv_bound=4000).kv_bound == 100
    assert config.settings().kv_bound == 100
    with pytest.raises(ConfigError, match="kv_memory_share must be a fraction above 0 and at most 1, got 1.5"):
        GenerationConfig.from_section({"kv_memory_share": 1.5})


def test_prefills_cost_their_padded_edge_in_the_token_budget():
    clock, s = Clock(), GenerationPolicy(policy(token_budget=32, prefill_edges=(8, 12, 16, 24, 32)))
    for rid, prompt in (("a", 3), ("b", 9), ("c", 5), ("d", 2)):  # edges 8, 12, 8, 8
        s.submit(ask(rid, prompt=prompt))
    plan = s.schedule(clock.tick())
    assert rids(plan.prefill) == ["a", "b", "c"] and plan.tokens == 8 + 12 + 8  # d's 8 more would pass 32
    unpadded = GenerationPolicy(policy(token_budget=32))  # no edges: a context costs itself
    for rid, prompt in (("a", 3), ("b", 9), ("c", 5), ("d", 2)):
        unpadded.submit(ask(rid, prompt=prompt))
    assert unpadded.schedule(clock.tick()).tokens == 19


def test_past_the_last_edge_a_context_costs_itself_and_edges_must_ascend():
    assert policy(prefill_edges=(8, 16)).padded(20) == 20 and policy(prefill_edges=(8, 16)).padded(9) == 16
    for edges in ((16, 8), (8, 8), (0, 8)):
        with pytest.raises(ConfigError, match="prefill_edges must ascend"):
            policy(prefill_edges=edges)


@pytest.mark.parametrize("apart", [True, False], ids=["apart", "mixed"])
@pytest.mark.parametrize("seed", range(6))
def test_no_step_forms_a_prefill_warmup_did_not_plan(seed, apart):
    """Random arrivals, prompt lengths, priorities, lengths and out-of-memory steps: every prefill
    of every plan, grouped by edge as the engine runs it, is a shape of prefill_shapes."""
    import random

    from tsbatch.warmup.generation_profile import prefill_edges, prefill_shapes

    rng = random.Random(seed)
    edges = prefill_edges(256)
    budget, running = rng.choice((16, 40, 64, 128)), rng.choice((1, 3, 8)) if seed else 1
    budget = max(budget, running)
    planned = {(shape.batch, shape.bucket) for shape in prefill_shapes(edges, running, budget)}
    clock = Clock()
    s = GenerationPolicy(policy(token_budget=budget, max_running=running, kv_bound=rng.choice((600, 4000)),
                                queue_cap=64, prefill_edges=edges, prefill_apart=apart))
    formed, grouped = set(), 0
    for step in range(300):
        for _ in range(rng.choice((0, 0, 0, 0, 0, 1, 3))):
            try:
                s.submit(ask(f"r{step}-{rng.random()}", prompt=rng.randint(1, rng.choice((12, 12, 40, 200))), new=rng.randint(1, 12),
                             at=clock.now, priority=rng.choice(list(Priority))))
            except (Overloaded, OutOfMemory):
                pass
        plan = s.schedule(clock.tick())
        groups: dict[int, int] = {}
        for seq in plan.prefill:
            groups[s.settings.padded(seq.context)] = groups.get(s.settings.padded(seq.context), 0) + 1
        formed |= {(rows, edge) for edge, rows in groups.items()}
        grouped += any(rows > 1 for rows in groups.values())
        assert plan.tokens == len(plan.decode) + sum(rows * edge for edge, rows in groups.items())
        oom = step < 150 and rng.random() < 0.02  # a few, early: the bound only goes down
        s.finished(plan, StepOutcome(out_of_memory=True) if oom else ran(plan), clock.now)
    assert formed <= planned, formed - planned
    assert len(formed) >= 4 and (grouped if running > 1 else not grouped)  # real groups where seats allow
