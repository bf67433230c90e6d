"""bench/generate_mix.py and generate_report.py: the mix of asks, reading an answer, a window's figures and the
issue's criteria."""
import json

from bench import generate_mix as mix
from bench.generate_report import criteria
from bench.loadtest.workload import WORDS


def answer(ask, body, stream=False, status=200, first=0.05, done=0.2):
    return mix.Answer(ask, stream, status, first, done, body if isinstance(body, bytes) else body.encode())


def whole(text, n):
    return json.dumps({"generated_text": text, "new_tokens": n})


def streamed(ids, text):
    return "".join(json.dumps({"token": t, "text": "x"}) + "\n" for t in ids) + whole(text, len(ids)) + "\n"


ASK = mix.Ask(0, "the a", 2, 3)
ALONE = mix.Alone((5, 6, 7), "a b c")


def test_the_pool_follows_the_mix():
    pool = mix.make_pool(2000, long_share=0.15, seed=1)
    assert [a.index for a in pool] == list(range(2000))
    assert all(8 <= a.prompt_tokens <= 400 and len(a.text.split()) == a.prompt_tokens for a in pool)
    assert all(w in WORDS for a in pool[:20] for w in a.text.split())
    longs = [a for a in pool if a.kind == "long"]
    assert all(a.new_tokens == 256 for a in longs) and 0.11 < len(longs) / 2000 < 0.19
    assert all(8 <= a.new_tokens <= 32 for a in pool if a.kind == "short")
    lengths = sorted(a.prompt_tokens for a in pool)
    assert lengths[1000] < 100 and lengths[-1] > 300  # log-uniform: most short, some near 400
    assert mix.make_pool(50, 0.15, seed=1) == pool[:50]


def test_draw_is_fixed_by_its_seed_and_draws_from_the_pool():
    pool = mix.make_pool(10, 0.2)
    assert mix.draw(pool, 30, 3) == mix.draw(pool, 30, 3) != mix.draw(pool, 30, 4)
    assert set(mix.draw(pool, 30, 3)) <= set(pool)


def test_an_ask_body_names_its_stream():
    assert json.loads(ASK.body(True)) == {"text": "the a", "max_new_tokens": 3, "stream": True}


def test_read_body_whole_and_streamed():
    assert mix.read_body(whole("a b c", 3).encode()) == mix.Reading("a b c", 3)
    reading = mix.read_body(streamed((5, 6, 7), "a b c").encode())
    assert (reading.text, reading.new_tokens, reading.token_ids, reading.problem) == ("a b c", 3, (5, 6, 7), "")
    assert mix.read_body(b"").problem == "empty body"
    assert "not JSON" in mix.read_body(b"{oops").problem
    assert "no answer" in mix.read_body(b'{"error": "x", "code": 500}').problem
    short_stream = json.dumps({"token": 5}) + "\n" + whole("a b", 2)
    assert "1 stream lines for 2 tokens" in mix.read_body(short_stream.encode()).problem


def test_verdict():
    assert mix.verdict(answer(ASK, whole("a b c", 3)), ALONE) == ""
    assert mix.verdict(answer(ASK, streamed((5, 6, 7), "a b c"), stream=True), ALONE) == ""
    assert mix.verdict(answer(ASK, streamed((5, 6, 8), "a b c"), stream=True), ALONE) == "differs: streamed token ids"
    assert mix.verdict(answer(ASK, whole("a b d", 3)), ALONE).startswith("differs")
    assert mix.verdict(answer(ASK, whole("a b", 2)), ALONE).startswith("differs")
    assert mix.verdict(answer(ASK, b"", done=None), ALONE) == "lost"
    assert mix.verdict(mix.Answer(ASK, False), ALONE) == "lost"
    assert mix.verdict(answer(ASK, '{"code": 503}', status=503), ALONE) == "status 503"
    assert mix.verdict(answer(ASK, ""), ALONE) == "bad: empty body"
    assert mix.verdict(answer(ASK, whole("zz", 9)), None) == ""  # nothing to compare with


def test_summarize_a_window():
    long = mix.Ask(1, "x", 1, 256)
    refs = {0: ALONE, 1: mix.Alone(tuple(range(256)), "l")}
    answers = [answer(ASK, streamed((5, 6, 7), "a b c"), True, first=0.01 * i, done=0.5) for i in range(1, 11)]
    answers += [answer(long, whole("l", 256), first=3.0, done=3.0),
                answer(ASK, '{"code": 503}', status=503),
                mix.Answer(ASK, True, error="TimeoutError"),
                answer(ASK, whole("a b d", 3), done=1.0)]
    point = mix.summarize(answers, rate=2.0, duration=2.0, references=refs)
    assert (point["sent"], point["ok"], point["lost"], point["refused"], point["differ"]) == (14, 12, 1, 1, 1)
    assert point["short"]["ttft_p99"] == 100.0 and point["short"]["ttft_p50"] == 50.0  # ms, first chunk
    assert point["long"]["ttft_p99"] == 3000.0 and point["long"]["n"] == 1
    assert point["busy_s"] == 3.0  # to the last answer, past the window's 2 s
    assert point["output_tokens"] == 10 * 3 + 256 + 3
    assert point["output_tokens_per_s"] == round(289 / 3.0, 1)
    assert point["sent_rate"] == 7.0 and point["throughput"] == 4.0
    assert not mix.passes(point, 4000)  # a refusal and a lost request fail a rate


def test_a_clean_window_passes_and_an_overloaded_one_is_saturated():
    fine = [answer(ASK, whole("a b c", 3), done=0.3) for _ in range(10)]
    point = mix.summarize(fine, 5.0, 2.0, {0: ALONE})
    assert mix.passes(point, 4000) and not mix.passes(point, 200)
    assert not mix.saturated(point, 4000)
    slow = [answer(ASK, whole("a b c", 3), done=1.0 + i) for i in range(10)]  # a queue that grows
    assert mix.saturated(mix.summarize(slow, 5.0, 2.0, {0: ALONE}), 4000)


def test_sweep_rates_and_bisection():
    assert mix.next_rates(1.0, 1.5, 4) == [1.0, 1.5, 2.2, 3.4]

    def point(rate, ok):
        return {"offered_rate": rate, "all": {"p99": 100 if ok else 9000}, "lost": 0, "ok": 10, "sent": 10}

    points = [point(1, True), point(1.5, True), point(2.2, False)]
    assert mix.capacity(points, 4000) == 1.5
    assert mix.bisect_rate(points, 4000) == 1.85
    assert mix.bisect_rate([point(1, True)], 4000) is None
    assert mix.bisect_rate([point(1, False)], 4000) is None


def test_criteria_read_the_figures():
    eq = {"tsbatch": {"compared": 40, "differ": 0, "stream_compared": 20, "whole_compared": 20}}
    checks = criteria({"tsbatch": 40.0, "fifo": 900.0, "bucketed": 400.0, "continuous": 100.0},
                      {"tsbatch": 1000.0, "fifo": 400.0}, {"tsbatch": 0}, eq)
    assert [c.passed for c in checks] == [False, True, True, True]  # 40 / 100 (continuous, the best) = 0.4 > 1/3
    assert "continuous" in checks[0].detail and "0.400" in checks[0].detail
    assert "2.50x" in checks[1].detail
    checks = criteria({"tsbatch": 30.0, "fifo": 900.0}, {"tsbatch": 700.0, "fifo": 400.0}, {"tsbatch": 2},
                      {"tsbatch": {**eq["tsbatch"], "differ": 1}})
    assert [c.passed for c in checks] == [True, False, False, False]
    assert [c.line().split("**")[1] for c in checks] == ["PASS", "MISS", "MISS", "MISS"]
    missing = criteria({}, {}, {}, {})
    assert [c.passed for c in missing] == [None] * 4 and missing[0].line().startswith("- **NOT MEASURED**")


def test_the_floor_is_each_short_asks_best_alone():
    short, other, long_ = mix.Ask(0, "a", 300, 8), mix.Ask(1, "b", 9, 20), mix.Ask(2, "c", 40, 256)
    answers = [answer(short, "x", True, first=0.040), answer(short, "x", True, first=0.030),  # best of two: 30 ms
               answer(other, "x", True, first=0.012), answer(other, "x", True, first=0.015),
               answer(long_, "x", True, first=0.500),  # a long ask is no short ask's floor
               answer(other, "{}", True, status=503, first=0.001)]  # nor is a refusal
    floor = mix.floor(answers)
    assert floor["asks"] == 2 and floor["slowest_prompt_tokens"] == 300
    assert floor["ttft_p50"] in (12.0, 30.0) and floor["ttft_p99"] == 30.0
    assert mix.floor([]) == {"asks": 0, "ttft_p50": None, "ttft_p99": None, "slowest_prompt_tokens": None}


def test_the_ttft_criterion_says_the_floor_beside_its_target():
    eq = {"tsbatch": {"compared": 4, "differ": 0, "stream_compared": 2, "whole_compared": 2}}
    figures = ({"tsbatch": 60.0, "continuous": 54.0}, {"tsbatch": 900.0, "fifo": 400.0}, {"tsbatch": 0}, eq)
    below = criteria(*figures, floors={"tsbatch": 30.0})[0]
    assert below.passed is False and "alone" in below.detail and "30 ms" in below.detail
    assert "target 18 ms is below what any scheduler can give here" in below.detail
    within = criteria(*figures, floors={"tsbatch": 10.0})[0]
    assert "within the target 18 ms" in within.detail
    assert "alone" not in criteria(*figures)[0].detail


def test_tally_counts_streamed_and_whole_comparisons_apart():
    tally = mix.Tally()
    tally.add([answer(ASK, streamed((5, 6, 7), "a b c"), True), answer(ASK, whole("a b c", 3)),
               answer(ASK, whole("nope", 3)), mix.Answer(ASK, False), answer(ASK, "{}", status=503),
               answer(mix.Ask(9, "z", 1, 8), whole("q", 8))], {0: ALONE})
    assert (tally.compared, tally.stream_compared, tally.whole_compared, tally.differ) == (3, 1, 2, 1)
    assert (tally.lost, tally.refused) == (1, 1) and tally.first_differ[0].startswith("differs")


def test_a_saturation_row_says_saturated_when_any_window_was_not_only_the_best():
    """The engine's best tokens/s came from a lighter window while a heavier one refused requests:
    the row must still say the sweep saturated it (the 12-03 report said 'no')."""
    fine = mix.summarize([answer(ASK, whole("a b c", 3), done=0.3) for _ in range(10)], 5.0, 2.0, {0: ALONE})
    slow = mix.summarize([answer(ASK, whole("a", 1), done=1.0 + i) for i in range(10)], 10.0, 2.0, {0: ALONE})
    assert fine["output_tokens_per_s"] > slow["output_tokens_per_s"] and mix.saturated(slow, 4000)
    row = mix.saturation_row([fine, slow], 4000)
    assert row["output_tokens_per_s"] == fine["output_tokens_per_s"] and row["saturated"]
    assert row["offered_rates"] == [5.0, 10.0]
    assert not mix.saturation_row([fine], 4000)["saturated"]
