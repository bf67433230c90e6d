"""The benchmark's own rules (bench/loadtest/sweep.py): capacity, saturation, pooling and turn-taking."""
import json
import math
import os

import pytest

from bench.beside_bench import fit as fit_beside, slowdowns
from bench.idle_bench import fit_cold, slowdown
from bench.loadtest.load import Result, RunResult
from bench.loadtest.stats import summarize
from bench.loadtest import sweep as sweeps
from bench.loadtest.sweep import capacity, confirm, knee, passes, pooled, refine, rotated, saturated

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def point(rate, p99, sent=100, ok=None, lost=0, throughput=None):
    ok = sent if ok is None else ok
    return {"offered_rate": rate, "all": {"p99": p99}, "sent": sent, "ok": ok, "lost": lost,
            "throughput": rate if throughput is None else throughput, "sent_rate": rate}


def test_capacity_is_the_rate_before_the_first_miss():
    sweep = [point(8, 100), point(16, 200), point(24, 600), point(32, 450)]  # 32: a lucky window past the knee
    assert capacity(sweep, 500) == 16


def test_capacity_counts_failed_answers_as_a_miss():
    assert capacity([point(8, 100), point(16, 100, ok=99)], 500) == 8
    assert capacity([point(8, 100, lost=1)], 500) == 0.0


def test_capacity_with_every_rate_passing_is_the_top_rate():
    assert capacity([point(16, 100), point(8, 90)], 500) == 16  # order of points does not matter


def test_knee_is_the_capacity_and_the_first_miss_above_it():
    sweep = [point(8, 100), point(16, 200), point(24, 600), point(32, 450)]
    assert knee(sweep, 500) == (16, 24)
    assert knee([point(8, 100), point(16, 200)], 500) is None  # nothing missed: no knee to bisect
    assert knee([point(8, 900)], 500) == (0.0, 8)


def fake_windows(monkeypatch, serves: dict) -> list:
    """Live windows replaced: the arm at URL `u` meets the target up to `serves[u]` req/s (p99 100
    ms) and misses above it (900 ms); returns the (url, rate) of each window sent, in order."""
    sent = []

    def fake_window(url, rate, duration, seed, requests=None):
        sent.append((url, rate))
        return url, rate

    monkeypatch.setattr(sweeps, "window", fake_window)
    monkeypatch.setattr(sweeps, "summarize", lambda run: {**point(run[1], 100 if run[1] <= serves[run[0]] else 900),
                                                          "short": {"p99": 50}, "status": {}})
    return sent


def test_refine_bisects_each_arms_knee_and_the_capacity_follows(monkeypatch):
    """Arm x serves up to 52 req/s, arm y up to 61: sweeps 8 apart say 48 and 56; two bisections
    find 52 and 58 (a quarter step), each window at the arm's own midpoint, arms in turns."""
    limits = {"x": 52, "y": 61}
    sent = fake_windows(monkeypatch, limits)
    found = {arm: [point(r, 100 if r <= limits[arm] else 900) for r in (40, 48, 56, 64)] for arm in limits}
    refine({"x": "x", "y": "y"}, found, 1.0, 500, steps=2)
    assert sent == [("x", 52.0), ("y", 60.0), ("y", 62.0), ("x", 54.0)]
    assert capacity(found["x"], 500) == 52 and capacity(found["y"], 500) == 60
    assert [p["offered_rate"] for p in found["x"]] == sorted(p["offered_rate"] for p in found["x"])


def test_a_first_miss_with_a_pass_above_it_is_measured_again_and_stands_only_if_missed_twice(monkeypatch):
    """Arm x stalled once at 16 (it serves 40); arm y really misses 24 and passes 32 by luck; arm z's
    first miss has nothing passing above it: not measured again."""
    sent = fake_windows(monkeypatch, {"x": 40, "y": 20, "z": 20})
    found = {"x": [point(8, 100), point(16, 700), point(24, 200), point(32, 300), point(48, 900)],
             "y": [point(8, 100), point(16, 200), point(24, 600), point(32, 450), point(40, 900)],
             "z": [point(8, 100), point(16, 200), point(24, 900)]}
    confirm({"x": "x", "y": "y", "z": "z"}, found, 1.0, 500)
    assert sorted(sent) == [("x", 16), ("y", 24)]
    assert capacity(found["x"], 500) == 32  # 16 passed its second window; 48 is the miss that stands
    assert capacity(found["y"], 500) == 16  # missed twice: the lucky 32 does not count
    assert capacity(found["z"], 500) == 16
    assert knee(found["x"], 500) == (32, 48)


def test_saturation_needs_more_than_a_missed_target():
    assert not saturated(point(24, 600), 500)  # past the target, still keeping up: one more rate
    assert saturated(point(24, 2500), 500)
    assert saturated(point(24, 400, lost=1), 500)
    assert saturated(point(24, 400, throughput=18), 500)
    assert passes(point(24, 400), 500) and not passes(point(24, 501), 500)


def test_rotated_gives_each_arm_a_turn_first():
    arms = ["a", "b", "c"]
    assert [rotated(arms, t)[0] for t in range(4)] == ["a", "b", "c", "a"]
    assert sorted(rotated(arms, 5)) == arms
    assert rotated([], 3) == []


def test_pooled_windows_summarize_as_one_sample():
    def run(latencies, rate=10.0):
        return RunResult(rate, 10.0, [Result("short", 0.0, lat, 200, tokens=5, padded_to=8) for lat in latencies], 10.0)

    both = summarize(pooled([run([0.01] * 98), run([1.0] * 2)]))
    assert both["sent"] == 100 and both["ok"] == 100
    assert both["short"]["p50"] == 10.0 and both["short"]["p99"] == 1000.0
    assert both["throughput"] == 5.0  # 100 answers over 20 s of windows
    assert both["padding_waste"] == round(1 - 5 / 8, 4)


def test_idle_slowdown_is_against_the_shortest_pause_of_the_same_shape_and_threads():
    rows = [{"bucket": 16, "threads": 1, "pause_ms": 100, "p50_ms": 80.0},
            {"bucket": 16, "threads": 1, "pause_ms": 1, "p50_ms": 20.0},
            {"bucket": 16, "threads": 2, "pause_ms": 1, "p50_ms": 10.0},
            {"bucket": 16, "threads": 2, "pause_ms": 100, "p50_ms": 40.0},
            {"bucket": 256, "threads": 1, "pause_ms": 1, "p50_ms": 90.0},
            {"bucket": 256, "threads": 1, "pause_ms": 50, "p50_ms": 99.0}]
    got = {(r["bucket"], r["threads"], r["pause_ms"]): r["vs_back_to_back"] for r in slowdown(rows)}
    assert got == {(16, 1, 100): 4.0, (16, 1, 1): 1.0, (16, 2, 1): 1.0, (16, 2, 100): 4.0,
                   (256, 1, 1): 1.0, (256, 1, 50): 1.1}


def test_the_cold_cost_is_what_long_pauses_add_and_its_time_constant_follows_the_pauses_between():
    tau = 30.0  # ms: rows made from 1 - exp(-pause / tau), a full cost of 4 ms (16 tokens) and 2 ms (256)
    rows = [{"bucket": b, "threads": 1, "pause_ms": p, "p50_ms": base + full * (1 - math.exp(-p / tau))}
            for b, base, full in ((16, 6.0, 4.0), (256, 48.0, 2.0)) for p in (1, 10, 50, 100, 200)]
    fit = fit_cold(rows)
    cold = {(t, b): s for t, b, s in fit["cold"]}
    # the longest pauses' median (100 ms) over the 1 ms one: within a few % of the full cost
    assert cold[(1, 16)] == pytest.approx(0.004 * (math.exp(-1 / tau) - math.exp(-100 / tau)), abs=1e-5)
    assert cold[(1, 256)] == pytest.approx(0.002 * (math.exp(-1 / tau) - math.exp(-100 / tau)), abs=1e-5)
    assert fit["cold_tau"] == pytest.approx(tau / 1000, rel=0.1)
    flat = [{**row, "p50_ms": 6.0} for row in rows]  # nothing goes cold: no cost, whatever tau
    assert all(s == 0.0 for _, _, s in fit_cold(flat)["cold"])


def test_a_return_costs_the_pass_growth_over_the_growth_in_calls_and_too_few_more_calls_tell_nothing():
    from bench.poll_live import call_cost

    slow = {"pass_p50_ms": 80.0, "calls_per_request": 2.0}
    assert call_cost(slow, {"pass_p50_ms": 86.0, "calls_per_request": 14.0}) == pytest.approx(0.0005)
    assert call_cost(slow, {"pass_p50_ms": 79.0, "calls_per_request": 12.0}) == pytest.approx(-0.0001)  # kept: noise
    assert call_cost(slow, {"pass_p50_ms": 90.0, "calls_per_request": 2.4}) is None


def test_spread_pools_every_pass_over_its_own_shapes_median_and_needs_enough_passes_for_a_p99():
    from bench.spread_bench import fit_spread, rows_and_ratios

    fast = [10.0] * 170 + [12.0] * 26 + [30.0] * 4  # a 2% tail of 3x
    slow = [40.0] * 170 + [48.0] * 26 + [120.0] * 4  # four times slower, the same shape of spread
    rows, ratios = rows_and_ratios({"1x16": fast, "4x32": slow})
    assert [(r["shape"], r["p50_ms"], r["p90_ms"], r["p99_ms"], r["max_ms"]) for r in rows] == [
        ("1x16", 10.0, 12.0, 30.0, 30.0), ("4x32", 40.0, 48.0, 120.0, 120.0)]
    spread = dict(fit_spread(ratios))
    assert spread[0.0] == 1.0 and spread[0.5] == 1.0 and spread[0.9] == 1.2 and spread[0.99] == 3.0 and spread[1.0] == 3.0
    assert list(spread) == [0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0]
    with pytest.raises(ValueError, match="p99"):
        fit_spread(ratios[:99])


def test_a_refit_keeps_what_was_measured_elsewhere_and_takes_the_hosts_spread(tmp_path, capsys):
    from bench.overheads import main
    from tsbatch.archiver.simulate import Overheads

    source = os.path.join(REPO, "bench", "results", "fc-v1252", "overheads-intake.json")
    with open(source) as f:
        before = json.load(f)
    spread = tmp_path / "spread.json"
    spread.write_text(json.dumps({"fit": {"spread": [[0.0, 0.9], [0.5, 1.0], [1.0, 2.5]]}}))
    poll = tmp_path / "poll.json"
    poll.write_text(json.dumps({"fit": {"call_per_round": [0.0002, 0.0004], "call": 0.0003}}))
    out = str(tmp_path / "overheads")
    assert main(["--refit", source, "--spread", str(spread), "--poll", str(poll), "--out", out]) == 0
    with open(out + ".json") as f:
        after = json.load(f)
    for key in ("outside", "outside_first_come", "latency", "cold", "cold_tau", "beside_long", "intake"):
        assert after["fit"][key] == before["fit"][key], key
    assert after["passes"] == before["passes"]
    assert Overheads.from_report(out + ".json").spread == ((0.0, 0.9), (0.5, 1.0), (1.0, 2.5))
    assert Overheads.from_report(out + ".json").call == 0.0003
    printed = capsys.readouterr().out
    assert "`spread` [[0.0, 0.9], [0.5, 1.0], [1.0, 2.5]]" in printed and "`call` 0.0003 s" in printed
    spread.write_text(json.dumps({"fit": {}}))
    with pytest.raises(SystemExit):
        main(["--refit", source, "--spread", str(spread), "--out", out])


def test_beside_ratios_are_each_subjects_median_against_its_own_alone_and_feed_the_simulator():
    times = {("short", "alone"): [10.0, 11.0, 12.0], ("short", "short"): [10.0, 10.0, 11.0],
             ("short", "long"): [13.0, 13.2, 20.0], ("long", "alone"): [50.0, 49.0, 51.0],
             ("long", "short"): [52.0, 52.0, 90.0], ("long", "long"): [60.0, 61.0, 59.0]}
    rows = slowdowns(times)
    assert [(r["subject"], r["beside"]) for r in rows] == [(s, b) for s in ("long", "short")
                                                           for b in ("alone", "short", "long")]
    ratio = {(r["subject"], r["beside"]): r["vs_alone"] for r in rows}
    assert ratio[("short", "alone")] == 1.0 and ratio[("short", "long")] == 1.2 and ratio[("long", "long")] == 1.2
    assert ratio[("long", "short")] == 1.04  # a median: the one slow pass does not count
    assert fit_beside(rows) == {"beside": 1.2, "beside_long": 1.2, "short_beside_short": 0.909}
    times[("short", "python 50%")] = [12.1] * 8
    times[("short", "python 20%")] = [11.55] * 8
    rows = slowdowns(times)
    assert [r["beside"] for r in rows if r["subject"] == "short"] == ["alone", "short", "long", "python 20%",
                                                                       "python 50%"]
    assert fit_beside(rows)["short_beside_python"] == {"python 20%": 1.05, "python 50%": 1.1}


def _counting_server():
    """A loopback HTTP server that answers after 30 ms and records the most requests it held at once."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    state = {"now": 0, "most": 0, "lock": threading.Lock()}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            with state["lock"]:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            time.sleep(0.03)
            with state["lock"]:
                state["now"] -= 1
            body = b'{"tokens": 3}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, state


def test_one_in_flight_never_sends_a_request_before_the_last_is_answered():
    from bench.loadtest.load import run_one_in_flight, run_open_loop
    from bench.loadtest.workload import make_requests

    server, state = _counting_server()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/predictions/x"
        requests = make_requests(8, seed=3)
        arrivals = [0.001 * i for i in range(8)]  # all due at once
        run = run_one_in_flight(url, requests, arrivals, rate=1000, duration=0.01)
        assert [r.status for r in run.results] == [200] * 8 and state["most"] == 1
        assert all(r.latency < 0.5 for r in run.results)  # each timed from its own send, not from its arrival
        run_open_loop(url, requests, arrivals, rate=1000, duration=0.01)
        assert state["most"] > 1  # the contrast: open loop does overlap them
    finally:
        server.shutdown()


def test_compare_pools_every_status_but_200_across_rounds():
    """bench/compare.py's rows say which statuses the not-200s were: 503 (refused at once) reads
    differently from 504 (accepted, then past its deadline)."""
    from bench.compare import markdown, pooled as pooled_rounds
    window = {"sent": 10, "ok": 7, "status": {"200": 7, "503": 2, "504": 1}, "short": {"p50": 1.0, "p99": 2.0},
              "long": {"p50": None, "p99": None}, "all": {"p99": 3.0}}
    both = pooled_rounds([window, dict(window, status={"200": 7, "503": 3})])
    assert both["not_200"] == 6 and both["statuses"] == {"503": 5, "504": 1}
    report = {"started": "now", "machine": "here", "seconds": 20, "rounds": 2, "arms": {"after": "main"},
              "points": {"14": {"after": both}}}
    assert "| 14 | after | 20 | 6 (503: 5, 504: 1) |" in markdown(report)


def test_lone_summary_counts_the_passes_that_ran_on_more_than_one_thread():
    from bench.borrow_live import lone_summary

    row = lone_summary([(90.0, 80.0, 1), (70.0, 60.0, 2), (72.0, 62.0, 2), (95.0, 85.0, 0)])
    assert row == {"requests": 4, "end_to_end_p50_ms": 81.0, "pass_p50_ms": 71.0, "pass_max_ms": 85.0, "wide": 2}
