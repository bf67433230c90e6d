"""archiver/simulate.py: the same policy the lanes run, in simulated time: deterministic, and its
figures move the way a worker's do (more load, longer queues; first-come pads, tsbatch does not)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest

from tsbatch.archiver.simulate import (Arm, Arrival, Overheads, PassTimes, Simulation, at_rate, capacity, outside_cores, poisson,
                                      shares_of, simulate, workload_tokens)
from tsbatch.handlers.core.buckets import default_edges
from tsbatch.handlers.edge.config import HandlerConfig
from tsbatch.warmup.profile import LatencyProfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.unit

MAX_LENGTH = 256


def cpu_like(threads: int = 1) -> LatencyProfile:
    """A profile shaped like MiniLM's on this machine: a fixed cost per pass, then per token."""
    profile = LatencyProfile(model="synthetic", environment={"torch_threads": threads})
    for edge in default_edges(MAX_LENGTH):
        size = 1
        while size <= max(1, 4096 // edge):
            ms = 1000 * (0.006 + 0.00018 * edge * size * (1 + edge / 1024)) / threads ** 0.8
            profile.add(size, edge, ms * 1.3, [ms * 0.95, ms, ms * 1.05, ms * 1.2])
            size *= 2
    return profile


PROFILES = {1: cpu_like(1), 2: cpu_like(2)}
NO_OUTSIDE = Overheads(outside=((1.0, 0.0),), outside_first_come=((1.0, 0.0),), beside=1.0)
TEMPLATE = Arm("template", config=HandlerConfig.from_yaml({"task": "embedding"}), batch_size=96)
FIRST_COME = Arm("first-come", kind="first-come")


def test_the_same_workload_and_seed_give_identical_figures():
    tokens = workload_tokens("search")
    first = at_rate(TEMPLATE, 40, tokens, PROFILES, MAX_LENGTH, duration=20, seed=3)
    again = at_rate(TEMPLATE, 40, tokens, PROFILES, MAX_LENGTH, duration=20, seed=3)
    assert first == again
    assert first.sent > 600 and first.ok == first.sent
    other = at_rate(TEMPLATE, 40, tokens, PROFILES, MAX_LENGTH, duration=20, seed=4)
    assert other != first  # the seed is what makes it repeatable, not a constant


def test_capacity_is_deterministic_and_tsbatch_beats_first_come_on_the_mix():
    tokens = workload_tokens("two-cluster")
    ours = capacity(TEMPLATE, tokens, PROFILES, MAX_LENGTH, 500.0, duration=20, resolution=4)
    assert ours == capacity(TEMPLATE, tokens, PROFILES, MAX_LENGTH, 500.0, duration=20, resolution=4)
    theirs = capacity(FIRST_COME, tokens, PROFILES, MAX_LENGTH, 500.0, duration=20, resolution=4)
    assert ours > theirs > 0


def test_latency_grows_with_load_and_past_capacity_requests_fail_or_queue():
    tokens = workload_tokens("two-cluster")
    light = at_rate(TEMPLATE, 10, tokens, PROFILES, MAX_LENGTH, duration=20)
    heavy = at_rate(TEMPLATE, 200, tokens, PROFILES, MAX_LENGTH, duration=20)
    assert light.latency["short"]["p99"] < heavy.latency["short"]["p99"]
    assert not heavy.passes(500.0) and light.passes(500.0)
    assert heavy.status.get("503", 0) + heavy.status.get("504", 0) > 0  # refused at once or answered 504, never lost
    assert "lost" not in heavy.status


def test_a_504_whose_pass_ran_is_counted_late_apart_from_one_that_expired_waiting():
    tokens = workload_tokens("two-cluster")
    tight = Arm("tight", config=HandlerConfig.from_yaml({"task": "embedding", "deadline_ms": 1000}), batch_size=96)
    calm = at_rate(tight, 30, tokens, PROFILES, MAX_LENGTH, duration=20)
    assert calm.ok == calm.sent and calm.late == 0
    past = at_rate(tight, 120, tokens, PROFILES, MAX_LENGTH, duration=20)
    # past capacity some requests expire in the queue and some passes end after their deadline
    assert 0 < past.late < past.status.get("504", 0)


def test_first_come_pads_to_the_longest_and_tsbatch_to_its_bucket():
    tokens = workload_tokens("two-cluster")
    ours = at_rate(TEMPLATE, 30, tokens, PROFILES, MAX_LENGTH, duration=20)
    theirs = at_rate(FIRST_COME, 30, tokens, PROFILES, MAX_LENGTH, duration=20)
    padded_to_max = at_rate(Arm("max", kind="first-come", pad="max"), 30, tokens, PROFILES, MAX_LENGTH, duration=20)
    assert ours.padding_waste < theirs.padding_waste < padded_to_max.padding_waste


def test_two_workers_share_the_cores_and_answer_everything():
    tokens = workload_tokens("search")
    two = Arm("two", config=HandlerConfig.from_yaml({"task": "embedding", "torch_threads": 1}), workers=2, batch_size=96)
    point = at_rate(two, 30, tokens, PROFILES, MAX_LENGTH, duration=20)
    assert point.ok == point.sent


def test_passes_slow_down_when_their_threads_outnumber_the_cores():
    sim = Simulation(cores=2, overheads=NO_OUTSIDE)
    ends = {}
    sim.at(0.0, lambda: sim.start(1.0, 1, lambda: ends.setdefault("a", sim.now)))
    sim.at(0.0, lambda: sim.start(1.0, 1, lambda: ends.setdefault("b", sim.now)))
    sim.at(0.0, lambda: sim.start(1.0, 1, lambda: ends.setdefault("c", sim.now)))
    sim.run(100)
    # 3 threads on 2 cores: each pass runs at 2/3 speed until they end together
    assert ends["a"] == ends["b"] == ends["c"] == pytest.approx(1.5)
    lone = Simulation(cores=2, overheads=NO_OUTSIDE)
    lone.at(0.0, lambda: lone.start(1.0, 2, lambda: ends.setdefault("lone", lone.now)))
    lone.run(100)
    assert ends["lone"] == pytest.approx(1.0)


def test_a_team_of_threads_waits_for_its_slowest_and_a_background_pass_yields():
    sim = Simulation(cores=2, overheads=NO_OUTSIDE)
    ends = {}
    sim.at(0.0, lambda: sim.start(1.0, 2, lambda: ends.setdefault("team", sim.now)))
    sim.at(0.0, lambda: sim.start(1.0, 1, lambda: ends.setdefault("one", sim.now)))
    sim.run(100)
    # 3 threads on 2 cores get 2/3 of a core each; the team of two needs both at once: (2/3)^2
    assert ends["one"] == pytest.approx(1.5)
    assert ends["team"] > ends["one"]
    nice = Simulation(cores=1, overheads=NO_OUTSIDE)
    nice.at(0.0, lambda: nice.start(1.0, 1, lambda: ends.setdefault("long", nice.now), background=True))
    nice.at(0.0, lambda: nice.start(1.0, 1, lambda: ends.setdefault("short", nice.now)))
    nice.run(100)
    # one core: the nice-10 pass gets 110/1134 of it while the other runs, then all of it
    assert ends["short"] == pytest.approx(1134 / 1024)
    assert ends["long"] == pytest.approx(2.0)


def test_a_pass_beside_a_long_one_runs_slower_by_the_measured_factor():
    ends = {}
    sim = Simulation(cores=2, overheads=Overheads(outside=((1.0, 0.0),), beside=1.5))
    sim.at(0.0, lambda: sim.start(1.0, 1, lambda: ends.setdefault("short", sim.now), length=32))
    sim.at(0.0, lambda: sim.start(3.0, 1, lambda: ends.setdefault("long", sim.now), length=256))
    sim.run(100)
    # the short pass at 1/1.5 beside the long one until it ends at 1.5; the long one beside a short
    # pass runs as if alone: 3 s
    assert ends["short"] == pytest.approx(1.5) and ends["long"] == pytest.approx(3.0)


def test_two_short_passes_side_by_side_run_as_if_alone_and_two_long_ones_slow_each_other():
    ends = {}
    sim = Simulation(cores=2, overheads=Overheads(outside=((1.0, 0.0),), beside=1.5))
    sim.at(0.0, lambda: sim.start(1.0, 1, lambda: ends.setdefault("a", sim.now), length=16))
    sim.at(0.0, lambda: sim.start(1.0, 1, lambda: ends.setdefault("b", sim.now), length=64))
    sim.at(2.0, lambda: sim.start(1.0, 1, lambda: ends.setdefault("c", sim.now), length=128))
    sim.at(2.0, lambda: sim.start(3.0, 1, lambda: ends.setdefault("d", sim.now), length=128))
    sim.run(100)
    assert ends["a"] == pytest.approx(1.0) and ends["b"] == pytest.approx(1.0)
    # both at 1/1.5 until c ends at 3.5; then d alone: 2 s of its work left
    assert ends["c"] == pytest.approx(3.5) and ends["d"] == pytest.approx(5.5)


def test_a_measured_long_beside_long_factor_slows_long_passes_and_leaves_short_ones_to_beside():
    ends = {}
    sim = Simulation(cores=2, overheads=Overheads(outside=((1.0, 0.0),), beside=1.5, beside_long=1.25))
    sim.at(0.0, lambda: sim.start(1.0, 1, lambda: ends.setdefault("c", sim.now), length=128))
    sim.at(0.0, lambda: sim.start(3.0, 1, lambda: ends.setdefault("d", sim.now), length=128))
    sim.at(5.0, lambda: sim.start(1.0, 1, lambda: ends.setdefault("short", sim.now), length=32))
    sim.at(5.0, lambda: sim.start(3.0, 1, lambda: ends.setdefault("long", sim.now), length=256))
    sim.run(100)
    # two long passes at 1/1.25 until c ends at 1.25; d then alone: 2 s left
    assert ends["c"] == pytest.approx(1.25) and ends["d"] == pytest.approx(3.25)
    # a short pass beside a long one still pays `beside`
    assert ends["short"] == pytest.approx(6.5) and ends["long"] == pytest.approx(8.0)


def test_a_pass_runs_slower_by_intake_per_request_per_second_taken_in():
    ends = {}
    sim = Simulation(cores=2, overheads=Overheads(outside=((1.0, 0.0),), beside=1.0, intake=0.01))
    for _ in range(10):
        sim.at(0.0, sim.arrived)
    sim.at(0.0, lambda: sim.start(1.0, 1, lambda: ends.setdefault("pass", sim.now), length=16))
    sim.run(100)
    # 10 req/s in the window: 1.1x slower until the arrivals leave it at 1 s, then alone
    assert ends["pass"] == pytest.approx(1.0 + (1 - 1 / 1.1))


def test_intake_slows_tsbatch_passes_and_not_first_comes_which_take_requests_in_on_their_own_thread():
    tokens = workload_tokens("short")
    slowed = replace(NO_OUTSIDE, intake=0.005)
    plain = at_rate(TEMPLATE, 60, tokens, PROFILES, MAX_LENGTH, duration=10, overheads=NO_OUTSIDE)
    busy = at_rate(TEMPLATE, 60, tokens, PROFILES, MAX_LENGTH, duration=10, overheads=slowed)
    assert busy.latency["short"]["pass_p50"] > plain.latency["short"]["pass_p50"] * 1.2
    assert (at_rate(FIRST_COME, 60, tokens, PROFILES, MAX_LENGTH, duration=10, overheads=slowed)
            == at_rate(FIRST_COME, 60, tokens, PROFILES, MAX_LENGTH, duration=10, overheads=NO_OUTSIDE))


def test_a_team_that_waited_pays_the_measured_cold_cost_for_its_next_pass():
    cold = Overheads(outside=((1.0, 0.0),), beside=1.0, cold=((1, 16, 0.4), (1, 256, 0.1), (2, 16, 0.8)), cold_tau=0.5)
    assert cold.cold_after(math.inf, threads=1, length=16) == pytest.approx(0.4)
    assert cold.cold_after(math.inf, threads=1, length=136) == pytest.approx(0.25)  # between the measured lengths
    assert cold.cold_after(math.inf, threads=1, length=512) == pytest.approx(0.1)  # past them: the nearest
    assert cold.cold_after(math.inf, threads=4, length=16) == pytest.approx(0.8)  # the nearest thread count
    assert cold.cold_after(0.5, threads=1, length=16) == pytest.approx(0.4 * (1 - math.exp(-1)))
    assert Overheads(outside=((1.0, 0.0),)).cold_after(10.0, threads=1, length=16) == 0.0  # not measured: none
    ends = {}
    sim = Simulation(cores=2, overheads=cold)
    sim.at(0.0, lambda: sim.start(1.0, 1, lambda: ends.setdefault("first", sim.now), length=16, team="lane"))
    sim.at(1.5, lambda: sim.start(1.0, 1, lambda: ends.setdefault("soon", sim.now), length=16, team="lane"))
    sim.at(1.5, lambda: sim.start(1.0, 1, lambda: ends.setdefault("other", sim.now), length=16, team="other"))
    sim.run(100)
    assert ends["first"] == pytest.approx(1.4)  # never ran before: the whole cost
    assert ends["soon"] == pytest.approx(2.5 + 0.4 * (1 - math.exp(-0.1 / 0.5)))  # 0.1 s after its last: a little
    assert ends["other"] == pytest.approx(2.9)  # another team's pause is its own: it never ran


def test_a_stall_holds_up_only_the_passes_named_and_only_while_they_run():
    ends = {}
    sim = Simulation(cores=2, overheads=NO_OUTSIDE)
    ids = {}
    sim.at(0.0, lambda: ids.setdefault("a", sim.start(1.0, 1, lambda: ends.setdefault("a", sim.now))))
    sim.at(0.0, lambda: ids.setdefault("b", sim.start(1.0, 1, lambda: ends.setdefault("b", sim.now))))
    sim.at(0.5, lambda: sim.stall({ids["a"]}, 0.25))
    sim.at(2.0, lambda: sim.stall({ids["a"]}, 0.25))  # ended by then: nothing to hold up
    sim.run(100)
    assert ends == {"a": pytest.approx(1.25), "b": pytest.approx(1.0)}


def test_each_return_of_a_call_holds_up_the_running_pass_so_a_faster_poll_slows_a_lone_long_one():
    """A lone long request on the template: while its pass runs the short lane is idle, so the call
    goes back to the frontend every poll_ms; with a measured cost per return, the pass runs longer
    the faster the poll, by about that cost per poll it spans."""
    arrivals = [Arrival(0.0, 256)]
    figures = {}
    for poll in (5, 50):
        arm = Arm(f"poll {poll}", config=HandlerConfig.from_yaml({"task": "embedding", "poll_ms": poll}), batch_size=96)
        for call in (0.0, 0.0005):
            point = simulate(arm, arrivals, PROFILES, MAX_LENGTH, overheads=replace(NO_OUTSIDE, call=call))
            assert point.ok == 1
            figures[poll, call] = point.latency["long"]["pass_p50"]
    assert figures[5, 0.0] == figures[50, 0.0]  # not measured: the poll costs nothing
    alone = figures[5, 0.0]
    polls_spanned = alone / 5
    assert figures[5, 0.0005] - alone == pytest.approx(0.5 * polls_spanned, rel=0.35)
    assert figures[50, 0.0005] - alone < 0.5 * (alone / 50 + 1) + 0.05


def test_outside_cores_follow_the_measured_curve():
    curve = ((10.0, 0.1), (20.0, 0.3), (40.0, 0.4))
    assert outside_cores(curve, 0) == 0.0
    assert outside_cores(curve, 5.0) == pytest.approx(0.05)  # proportional below the first point
    assert outside_cores(curve, 15.0) == pytest.approx(0.2)
    assert outside_cores(curve, 60.0) == pytest.approx(0.5)  # the last segment's slope past the end


def test_shares_follow_the_fair_scheduler():
    assert shares_of([(1, 1.0), (1, 1.0)], 2) == [1.0, 1.0]
    assert shares_of([(2, 1.0), (2, 1.0)], 2) == [0.5, 0.5]
    # a small claim is served whole; what it leaves is split by weight, no thread above one core
    low, high, small = shares_of([(1, 0.1), (1, 1.0), (0.2, 1.0)], 2)
    assert small == 1.0 and high == 1.0 and low == pytest.approx(0.8)
    a, b = shares_of([(2, 0.1), (2, 1.0)], 2)
    assert b == pytest.approx(2 / 2.2) and a == pytest.approx(0.1 * 2 / 2.2)


def test_work_outside_the_passes_takes_cores_from_them():
    ends = {}
    for name, cores in (("free", 0.0), ("busy", 2.0)):
        sim = Simulation(cores=2, overheads=Overheads(outside=((4.0, cores),)))
        for k in range(4):  # 4 requests in the last second: the measured curve says `cores` busy outside
            sim.at(0.0, sim.arrived)
        sim.at(0.0, lambda sim=sim, name=name: sim.start(1.0, 2, lambda: ends.setdefault(name, sim.now)))
        sim.run(100)
    # the first second: 2 cores asked beside the team's 2, so a quarter of its work; the rest after
    assert ends["free"] == pytest.approx(1.0) and ends["busy"] == pytest.approx(1.75)


def test_pass_times_interpolate_unmeasured_shapes_and_keep_measured_ones():
    times = PassTimes(PROFILES)
    exact = PROFILES[1].lookup(batch=4, bucket=32)
    assert times.median_p90(length=32, size=4, threads=1) == (exact.median_ms / 1000, exact.p90_ms / 1000)
    low = times.median_p90(length=32, size=4, threads=1)[0]
    high = times.median_p90(length=40, size=4, threads=1)[0]
    between = times.median_p90(length=36, size=4, threads=1)[0]
    assert low < between < high
    three = times.median_p90(length=32, size=3, threads=1)[0]
    assert times.median_p90(length=32, size=2, threads=1)[0] < three < low
    only_one = PassTimes({1: PROFILES[1]})
    assert only_one.median_p90(length=32, size=4, threads=2)[0] == pytest.approx(low / 2)  # optimistic for that arm


def test_a_measured_spread_replaces_the_profiles_and_its_quantiles_come_back_in_the_draws():
    from tsbatch.archiver.simulate import spread_ratio

    spread = ((0.0, 0.9), (0.5, 1.0), (0.9, 1.2), (0.99, 2.0), (1.0, 3.0))
    assert spread_ratio(spread, 0.0) == 0.9 and spread_ratio(spread, 0.5) == 1.0 and spread_ratio(spread, 1.0) == 3.0
    assert spread_ratio(spread, 0.7) == pytest.approx(1.1) and spread_ratio(spread, 0.995) == pytest.approx(2.5)
    median = PROFILES[1].lookup(batch=2, bucket=32).median_ms / 1000
    times = PassTimes(PROFILES, seed=5, spread=spread)
    draws = sorted(times.draw(length=32, size=2, threads=1) for _ in range(20000))
    quantile = lambda q: draws[int(q * (len(draws) - 1))] / median  # noqa: E731
    assert quantile(0.5) == pytest.approx(1.0, abs=0.01) and quantile(0.8) == pytest.approx(1.15, abs=0.01)
    assert quantile(0.95) == pytest.approx(1.56, abs=0.1) and max(draws) / median <= 3.0
    profiles_own = PassTimes(PROFILES, seed=5)
    plain = sorted(profiles_own.draw(length=32, size=2, threads=1) for _ in range(20000))
    assert plain[int(0.99 * (len(plain) - 1))] / median < 1.5  # the profile's own spread: p90 1.3x, no 2x tail
    tokens = workload_tokens("short")  # a tail that only the slowest passes have still moves p99 more than p50
    wide = at_rate(TEMPLATE, 60, tokens, PROFILES, MAX_LENGTH, duration=20, overheads=replace(NO_OUTSIDE, spread=spread))
    narrow = at_rate(TEMPLATE, 60, tokens, PROFILES, MAX_LENGTH, duration=20, overheads=NO_OUTSIDE)
    assert wide.latency["short"]["pass_p99"] > narrow.latency["short"]["pass_p99"] * 1.2
    assert wide == at_rate(TEMPLATE, 60, tokens, PROFILES, MAX_LENGTH, duration=20,
                           overheads=replace(NO_OUTSIDE, spread=spread))  # still deterministic


def test_a_workload_file_of_lengths_is_read_and_a_bad_one_refused(tmp_path):
    plain = tmp_path / "lengths.txt"
    plain.write_text("12\n40\n300\n")
    assert workload_tokens(str(plain)) == [12, 40, 300]
    as_json = tmp_path / "lengths.json"
    as_json.write_text('{"tokens": [5, 6]}')
    assert workload_tokens(str(as_json)) == [5, 6]
    bad = tmp_path / "bad.txt"
    bad.write_text("twelve\n")
    with pytest.raises(ValueError, match="token lengths"):
        workload_tokens(str(bad))
    with pytest.raises(ValueError, match="unknown workload"):
        workload_tokens("no-such-workload")


def test_poisson_arrivals_have_the_asked_rate():
    arrivals = poisson(50, 100, [10], seed=1)
    assert 4700 < len(arrivals) < 5300 and all(a.at < 100 for a in arrivals)


def test_tuning_by_simulation_ships_a_candidate_no_worse_than_the_template_or_first_come():
    from tsbatch.archiver.tune import Machine, tune
    from tsbatch.archiver.tune_sim import search

    profile = cpu_like(1)
    profile.environment.update({"task": "embedding", "threads_per_bucket": {"8": 1}})
    section = {"task": "embedding"}
    analytic = tune(profile, 500.0, Machine(2), HandlerConfig.from_yaml(section))
    chosen = search(analytic, profile, section, "two-cluster")
    by_name = {c.name: c for c in chosen.simulated}
    best = by_name[chosen.chosen]
    assert best.capacity >= by_name["template"].capacity
    assert best.capacity >= next(c for c in chosen.simulated if c.name.startswith("first-come")).capacity
    assert best.capacity == max(c.capacity for c in chosen.simulated)
    assert "chosen by simulation" in chosen.handler["max_wait_ms"].reason
    # a key the user's section sets keeps the user's value in every candidate
    fixed = {"task": "embedding", "max_wait_ms": 7}
    kept = search(tune(profile, 500.0, Machine(2), HandlerConfig.from_yaml(fixed), fixed=fixed.keys()), profile, fixed,
                  "two-cluster")
    assert all(c.handler.get("max_wait_ms", 7) == 7 for c in kept.simulated)
    assert "max_wait_ms" not in {k for k, c in kept.handler.items() if "chosen by simulation" in c.reason}


@pytest.mark.parametrize("lead", [2.0, 3.0])
def test_tuning_refuses_only_when_first_come_leads_by_a_capacity_step_or_more(monkeypatch, lead):
    """A smaller lead is within the capacity search's resolution: the archive ships, and says so."""
    from tsbatch.archiver import tune_sim
    from tsbatch.archiver.tune import Machine, TuneError, tune

    assert tune_sim.RESOLUTION == 3.0
    monkeypatch.setattr(tune_sim, "capacity", lambda arm, *args, **kw: 16.0 - (0 if arm.kind == "first-come" else lead))
    profile = cpu_like(1)
    profile.environment.update({"task": "embedding", "threads_per_bucket": {"8": 1}})
    section = {"task": "embedding"}
    analytic = tune(profile, 500.0, Machine(2), HandlerConfig.from_yaml(section))
    if lead >= tune_sim.RESOLUTION:
        with pytest.raises(TuneError, match="first-come batching serves 16 req/s"):
            tune_sim.search(analytic, profile, section, "two-cluster")
        return
    chosen = tune_sim.search(analytic, profile, section, "two-cluster")
    assert chosen.chosen and "first-come's lead of 2 req/s is within" in chosen.handler["max_wait_ms"].reason


def test_the_simulate_command_prints_each_rate_and_each_arms_capacity(tmp_path, capsys):
    from tsbatch.archiver.cli import main

    profile = cpu_like(1)
    profile.environment.update({"task": "embedding", "cpu_count": 2, "threads_per_bucket": {"8": 1}})
    path = tmp_path / "profile.json"
    profile.save(str(path))
    assert main(["simulate", "--profile", str(path), "--workload", "two-cluster", "--rates", "20", "--duration", "10"]) == 0
    out = capsys.readouterr().out
    assert " 504 late " in out  # 504s whose pass ran, apart from those that expired waiting
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("tsbatch ", "first-come "))]
    assert [row[0] for row in rows] == ["tsbatch", "first-come"] and all(row[1] == "20" for row in rows)
    capacities = dict(line.split("capacity of ")[1].split(": ")[:2] for line in out.splitlines() if "capacity of" in line)
    assert float(capacities["tsbatch"].split()[0]) > float(capacities["first-come"].split()[0]) > 0
    assert main(["simulate", "--profile", str(path), "--workload", "no-such-workload"]) == 2


def test_a_profile_from_another_machine_or_other_threads_is_tuned_analytically():
    from tsbatch.archiver.tune import Machine, tune
    from tsbatch.archiver.tune_sim import search

    section = {"task": "embedding"}
    profile = cpu_like(1)
    profile.environment.update({"task": "embedding", "threads_per_bucket": {"8": 1}, "cpu_count": 2})
    for_eight = tune(profile, 500.0, Machine(8), HandlerConfig.from_yaml(section))
    assert search(for_eight, profile, section, "two-cluster") is for_eight  # tuned for 8 cores, measured on 2
    two_threads = cpu_like(2)
    two_threads.environment.update({"task": "embedding", "threads_per_bucket": {"8": 2}, "cpu_count": 2})
    here = tune(two_threads, 500.0, Machine(2), HandlerConfig.from_yaml(section))
    assert search(here, two_threads, section, "two-cluster") is here  # lanes of 1 thread were never measured


def test_overheads_measured_on_another_machine_come_from_its_report_and_change_the_figures(tmp_path, capsys):
    from tsbatch.archiver.cli import main

    shipped = Overheads.from_report(os.path.join(REPO, "bench", "results", "overheads.json"))
    assert shipped.outside == Overheads().outside and shipped.beside == Overheads().beside  # the defaults cite it
    busy = {"fit": {"outside": [[1.0, 0.05]], "outside_first_come": [[1.0, 0.05]], "latency": 0.02,
                    "cold": [[1, 16, 0.004]], "cold_tau": 0.03, "beside_long": 1.1, "intake": 0.001, "call": 0.0003},
            "passes": {"beside": 2.0}}
    path = tmp_path / "overheads.json"
    path.write_text(json.dumps(busy))
    loaded = Overheads.from_report(str(path))
    assert loaded.outside == ((1.0, 0.05),) and loaded.latency == 0.02 and loaded.beside == 2.0
    assert loaded.cold == ((1, 16, 0.004),) and loaded.cold_tau == 0.03 and loaded.beside_long == 1.1
    assert loaded.intake == 0.001 and loaded.call == 0.0003
    assert shipped.beside_long is None  # not measured where the defaults come from: `beside` stands
    assert shipped.intake == Overheads().intake == 0.0  # ... nor intake
    assert shipped.spread == Overheads().spread == ()  # ... nor the host's spread: the profile's stands
    assert shipped.call == Overheads().call == 0.0  # ... nor what a return to the frontend costs a pass
    (tmp_path / "bad.json").write_text(json.dumps({"fit": {"outside": []}}))
    with pytest.raises(ValueError, match="bad.json"):
        Overheads.from_report(str(tmp_path / "bad.json"))
    spread = [[0.0, 0.9], [0.5, 1.0], [1.0, 2.5]]
    assert Overheads.of({"fit": {**busy["fit"], "spread": spread}}).spread == ((0.0, 0.9), (0.5, 1.0), (1.0, 2.5))
    for bad in ([[0.0, 1.0]], [[0.1, 1.0], [1.0, 2.0]], [[0.0, 1.2], [1.0, 1.0]], [[0.0, 1.0], [0.5, "x"], [1.0, 2]]):
        with pytest.raises(ValueError, match="spread"):
            Overheads.of({"fit": {**busy["fit"], "spread": bad}})

    profile = cpu_like(1)
    profile.environment.update({"task": "embedding", "cpu_count": 2, "threads_per_bucket": {"8": 1}})
    profile_path = tmp_path / "profile.json"
    profile.save(str(profile_path))

    def capacities(*extra: str) -> dict:
        assert main(["simulate", "--profile", str(profile_path), "--workload", "short", "--duration", "10", *extra]) == 0
        out = capsys.readouterr().out
        found = [line.split("capacity of ")[1].split(": ") for line in out.splitlines() if "capacity of" in line]
        return {arm: float(rest.split()[0]) for arm, rest in found}

    # 0.05 cores per req/s outside: at 20 req/s a whole core is the frontend's
    assert capacities("--overheads", str(path))["tsbatch"] < capacities()["tsbatch"]
    assert main(["simulate", "--profile", str(profile_path), "--overheads", str(tmp_path / "bad.json")]) == 2


def test_with_borrow_cores_a_lone_long_request_runs_on_both_lanes_threads_in_the_simulator():
    """The template's two lanes of one thread each; the profile also timed every shape on two (as
    warmup does with borrow_cores): at light load the long class is answered sooner."""
    lanes = cpu_like(1)
    lanes.environment["threads_per_bucket"] = {str(edge): 1 for edge in default_edges(MAX_LENGTH)}
    for timing in cpu_like(2).shapes:
        lanes.add(timing.batch, timing.bucket, timing.first_ms, [timing.median_ms] * 3, threads=2)
    profiles = {1: lanes}
    assert set(PassTimes(profiles).tables) == {1, 2}
    tokens = workload_tokens("two-cluster")
    template = {"task": "embedding", "torch_threads": 2}
    plain = Arm("plain", config=HandlerConfig.from_yaml(template), batch_size=96)
    borrow = Arm("borrow", config=HandlerConfig.from_yaml({**template, "borrow_cores": True}), batch_size=96)
    off = at_rate(plain, 2, tokens, profiles, MAX_LENGTH, duration=60, overheads=NO_OUTSIDE)
    on = at_rate(borrow, 2, tokens, profiles, MAX_LENGTH, duration=60, overheads=NO_OUTSIDE)
    assert on.ok == on.sent and off.ok == off.sent
    assert on.latency["long"]["p50"] < 0.8 * off.latency["long"]["p50"]
