"""tsbatch.archiver.tune: batch caps under a p99 target, workers and threads, timeouts, each with a reason."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tsbatch.archiver import pipeline
from tsbatch.archiver.properties import ServerSettings, read_properties, render_properties, render_yaml
from tsbatch.archiver.tune import (
    MAX_THREADS_PER_WORKER,
    Machine,
    TuneError,
    choose_cap,
    monotone,
    plan_workers,
    predicted_p99,
    tune,
)
from tsbatch.handlers.core.policy import split_lanes
from tsbatch.handlers.edge.config import HandlerConfig
from tsbatch.warmup.profile import LatencyProfile, ShapeTiming

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# explicit values, so the tests do not move with the handler's defaults
BASE = {"task": "embedding", "max_batch_size": 64, "max_batch_tokens": 65536, "isolation_budget": 16,
        "deadline_ms": 30000, "long_lane_from": 128}


def config_of(**section) -> HandlerConfig:
    return HandlerConfig.from_yaml({**BASE, **section})


EMBEDDING = config_of()
TWO_CORES = Machine(cores=2)


def profile_of(timings: dict[tuple[int, int], tuple[float, float]], warmup_seconds: float = 10.0,
               **environment) -> LatencyProfile:
    """A profile built by hand: (batch, bucket) -> (median ms, p90 ms)."""
    env = {"device": "cpu", "task": "embedding", "torch_threads": 2, "load_seconds": 4.0, **environment}
    shapes = [ShapeTiming(batch, bucket, median, p90, 3, median) for (batch, bucket), (median, p90) in timings.items()]
    return LatencyProfile("m", env, shapes, warmup_seconds)


def linear(buckets=(16, 64, 256), sizes=(1, 2, 4, 8, 16, 32), fixed_ms=5.0, per_token_ms=0.02, spread=1.1, **env):
    """Cost grows with tokens, a fixed cost per pass: bigger batches serve more requests/s."""
    return profile_of({(n, b): (fixed_ms + per_token_ms * n * b, (fixed_ms + per_token_ms * n * b) * spread)
                       for b in buckets for n in sizes}, **env)


# -- batch caps ---------------------------------------------------------------------------------

def test_cap_is_the_size_with_the_most_requests_per_second_within_the_budget():
    shapes = [ShapeTiming(1, 16, 10, 11, 3, 10), ShapeTiming(2, 16, 12, 13, 3, 12),
              ShapeTiming(4, 16, 16, 18, 3, 16), ShapeTiming(8, 16, 40, 44, 3, 40)]
    best, why = choose_cap(shapes, budget_ms=100)  # all fit: 100, 167, 250, 200 req/s
    assert (best.batch, why) == (4, "throughput")
    best, why = choose_cap(shapes, budget_ms=15)  # only 1 and 2 fit
    assert (best.batch, why) == (2, "target")
    best, why = choose_cap(shapes[:3], budget_ms=100)
    assert (best.batch, why) == (4, "largest measured")


def test_sizes_the_profile_cannot_tell_apart_take_the_larger_one():
    """fc-v1300's bucket 16: batch 8 in 34.694 ms and 16 in 69.427 serve the same requests/s (0.06%
    apart); a live pass also carries its lane's own work, which the larger batch spreads further."""
    shapes = [ShapeTiming(1, 16, 10.267, 11.046, 3, 10), ShapeTiming(8, 16, 34.694, 35.998, 3, 35),
              ShapeTiming(16, 16, 69.427, 72.132, 3, 69)]
    best, why = choose_cap(shapes, budget_ms=100)
    assert (best.batch, why) == (16, "largest measured")
    slower = shapes[:2] + [ShapeTiming(16, 16, 34.694 * 2 * 1.05, 80, 3, 73)]  # 5% fewer requests/s at 16
    best, why = choose_cap(slower, budget_ms=100)
    assert (best.batch, why) == (8, "throughput")


def test_cap_stops_at_the_first_size_over_the_budget():
    """The handler forms every power of two below its cap, so one slow size bounds the cap."""
    shapes = [ShapeTiming(1, 64, 10, 10, 3, 10), ShapeTiming(2, 64, 30, 90, 3, 30),
              ShapeTiming(4, 64, 20, 22, 3, 20)]
    best, _ = choose_cap(shapes, budget_ms=50)
    assert best.batch == 1


def test_a_hiccup_smaller_than_a_larger_shape_does_not_cap_the_bucket():
    """Measured on a busy machine: batch 2 x 64 once took longer than batch 4 x 64 and 2 x 256."""
    profile = profile_of({(1, 64): (10, 11), (2, 64): (30, 300), (4, 64): (20, 22),
                          (1, 256): (15, 16), (2, 256): (25, 27), (4, 256): (60, 70)})
    smooth = {(s.batch, s.bucket): (s.median_ms, s.p90_ms) for s in monotone(profile.shapes)}
    assert smooth[(2, 64)] == (20, 22)  # no more than the bigger shapes showed
    assert smooth[(1, 64)] == (10, 11) and smooth[(4, 256)] == (60, 70)  # the rest unchanged
    assert tune(profile, 200, TWO_CORES, EMBEDDING).handler["batch_caps"].value[64] == 4


def test_tuned_caps_are_measured_powers_of_two_and_the_fastest_that_fit():
    profile = linear(per_token_ms=0.04)
    tuning = tune(profile, 500, TWO_CORES, EMBEDDING)
    caps = tuning.handler["batch_caps"].value
    wait = tuning.handler["max_wait_ms"].value + EMBEDDING.poll_ms  # continuous mode: taken in within poll_ms
    budget = (500 - wait) / 2
    assert set(caps) == {16, 64, 256}
    for bucket, cap in caps.items():
        assert profile.lookup(batch=cap, bucket=bucket) is not None and cap & (cap - 1) == 0
        fitting = [s for s in profile.shapes if s.bucket == bucket and s.p90_ms <= budget]
        assert profile.lookup(batch=cap, bucket=bucket).p90_ms <= budget
        assert cap == max(fitting, key=lambda s: s.batch / s.median_ms).batch
    # with a fixed cost per pass, the biggest batch that fits wins: all of 16's, fewer of 256's
    assert caps == {16: 32, 64: 32, 256: 16}


def test_caps_respect_max_batch_size_and_the_token_budget():
    profile = linear(sizes=(1, 2, 4, 8, 16, 32, 64))
    config = config_of(max_batch_size=4, max_batch_tokens=512)
    caps = tune(profile, 10_000, TWO_CORES, config).handler["batch_caps"].value
    assert caps == {16: 4, 64: 4, 256: 2}


# -- the p99 model ------------------------------------------------------------------------------

def test_predicted_p99_is_wait_plus_one_pass_of_the_lane_ahead_plus_its_own():
    caps = {16: ShapeTiming(8, 16, 20, 25, 3, 20), 64: ShapeTiming(4, 64, 40, 50, 3, 40),
            256: ShapeTiming(2, 256, 90, 100, 3, 90)}
    two_lanes = split_lanes((16, 64, 256), 128)
    assert predicted_p99(caps, two_lanes, wait_ms=5) == {16: 5 + 50 + 25, 64: 5 + 50 + 50, 256: 5 + 100 + 100}
    one_lane = split_lanes((16, 64, 256), None)
    assert predicted_p99(caps, one_lane, wait_ms=0) == {16: 100 + 25, 64: 100 + 50, 256: 100 + 100}


def test_short_requests_do_not_wait_behind_the_long_lane():
    tuning = tune(linear(), 500, TWO_CORES, EMBEDDING)
    by_bucket = {p.bucket: p for p in tuning.buckets}
    assert by_bucket[16].lane == 0 and by_bucket[256].lane == 1
    wait = tuning.handler["max_wait_ms"].value + EMBEDDING.poll_ms  # continuous mode: taken in within poll_ms
    short_ahead = max(by_bucket[b].p90_ms for b in (16, 64))
    assert by_bucket[16].predicted_p99_ms == pytest.approx(wait + short_ahead + by_bucket[16].p90_ms, abs=0.1)
    assert by_bucket[16].predicted_p99_ms < wait + by_bucket[256].p90_ms + by_bucket[16].p90_ms


@settings(max_examples=150, deadline=None)
@given(
    fixed=st.floats(0.5, 50), per_token=st.floats(0.001, 0.5), spread=st.floats(1.0, 2.0),
    target=st.floats(5, 3000), lane_from=st.sampled_from([None, 32, 128, 512]),
    noise=st.lists(st.floats(0.7, 1.5), min_size=15, max_size=15),
)
def test_every_bucket_meets_the_target_or_tune_refuses(fixed, per_token, spread, target, lane_from, noise):
    buckets, sizes = (16, 64, 256), (1, 2, 4, 8, 16)
    timings, i = {}, 0
    for b in buckets:
        for n in sizes:
            median = (fixed + per_token * n * b) * noise[i]
            timings[(n, b)] = (median, median * spread)
            i += 1
    profile = profile_of(timings)
    smooth = {(t.batch, t.bucket): t for t in monotone(profile.shapes)}  # what tune predicts from
    config = config_of(long_lane_from=lane_from)
    try:
        tuning = tune(profile, target, TWO_CORES, config)
    except TuneError as error:
        wait = min(max(1, math.floor(0.1 * target)), max(1, math.ceil(timings[(1, 16)][0]))) + EMBEDDING.poll_ms
        worst = max(smooth[(1, b)].p90_ms for b in buckets)
        assert wait + 2 * worst > target, str(error)  # refused only when batch 1 cannot make it
        assert "below what this model can do" in str(error)
        return
    wait = tuning.handler["max_wait_ms"].value + EMBEDDING.poll_ms  # continuous mode: taken in within poll_ms
    caps = {p.bucket: smooth[(p.batch, p.bucket)] for p in tuning.buckets}
    expected = predicted_p99(caps, split_lanes(buckets, lane_from), wait)
    for plan in tuning.buckets:
        assert plan.predicted_p99_ms <= target + 0.05
        assert plan.predicted_p99_ms == pytest.approx(expected[plan.bucket], abs=0.05)


def test_an_impossible_target_is_refused_naming_the_shape_and_its_p90():
    profile = profile_of({(1, 16): (10, 12), (2, 16): (15, 16), (1, 256): (80, 95), (2, 256): (150, 170)})
    with pytest.raises(TuneError) as raised:
        tune(profile, 100, TWO_CORES, EMBEDDING)
    message = str(raised.value)
    assert "target of 100 ms" in message and "bucket 256" in message and "batch 1" in message
    assert "p90 95.0 ms" in message
    wait = 10 + EMBEDDING.poll_ms  # batch 1 x 16 takes 10 ms: the wait for company; then poll_ms to be taken in
    assert f"--target-ms {math.ceil(wait + 2 * 95)}" in message
    tune(profile, wait + 2 * 95 + 1, TWO_CORES, EMBEDDING)  # and that target is accepted


@pytest.mark.parametrize("target", [0, -5, float("nan"), float("inf"), "500"])
def test_a_target_that_is_not_a_positive_number_is_refused(target):
    with pytest.raises(TuneError, match="positive number"):
        tune(linear(), target, TWO_CORES, EMBEDDING)


# -- workers and threads ------------------------------------------------------------------------

@pytest.mark.parametrize("cores", [1, 2, 8])
@pytest.mark.parametrize("gpus", [0, 1, 4])
def test_workers_times_threads_never_exceed_the_cores(cores, gpus):
    for use_gpu in ([False, True] if gpus else [False]):
        workers, threads = plan_workers(Machine(cores, gpus), use_gpu)
        assert workers.value >= 1 and threads.value >= 1
        assert workers.value * threads.value <= cores, (cores, gpus, use_gpu)
        assert threads.value <= MAX_THREADS_PER_WORKER
        assert workers.reason and threads.reason
        if use_gpu:
            assert workers.value == min(gpus, cores)  # one worker per GPU, as long as each has a core
        else:
            assert workers.value * threads.value > cores - threads.value  # no idle worker's worth of cores


def test_two_cpu_cores_get_one_worker_with_both_cores():
    workers, threads = plan_workers(Machine(2, 0))
    assert (workers.value, threads.value) == (1, 2)
    workers, threads = plan_workers(Machine(8, 0))
    assert (workers.value, threads.value) == (2, 4)


def test_a_gpu_profile_needs_a_gpu_and_gets_one_worker_per_gpu():
    profile = linear(device="cuda:0")
    with pytest.raises(TuneError, match="no GPU"):
        tune(profile, 500, Machine(8, 0), EMBEDDING)
    tuning = tune(profile, 500, Machine(8, 4), EMBEDDING)
    assert tuning.frontend["minWorkers"].value == 4 and tuning.frontend["deviceType"].value == "gpu"
    assert tuning.properties["number_of_gpu"].value == 4


def test_torch_threads_from_the_handler_configuration_set_the_workers():
    config = config_of(torch_threads=3)
    tuning = tune(linear(), 500, Machine(8), config, fixed={"task", "torch_threads"})
    assert tuning.handler["torch_threads"].value == 3 and tuning.frontend["minWorkers"].value == 2
    with pytest.raises(TuneError, match="torch_threads is 3"):
        tune(linear(), 500, Machine(2), config, fixed={"torch_threads"})


@pytest.mark.parametrize("cores, gpus", [(0, 0), (2, -1)])
def test_an_impossible_machine_is_refused(cores, gpus):
    with pytest.raises(TuneError):
        plan_workers(Machine(cores, gpus))


# -- timeouts, queue, mode ------------------------------------------------------------------------

def test_startup_timeout_covers_load_and_warmup_twice_and_at_least_120():
    assert tune(linear(warmup_seconds=100.0), 500, TWO_CORES, EMBEDDING).frontend["startupTimeout"].value == 2 * 104
    assert tune(linear(warmup_seconds=3.0), 500, TWO_CORES, EMBEDDING).frontend["startupTimeout"].value == 120
    profile = linear(warmup_seconds=100.0)
    del profile.environment["load_seconds"]
    choice = tune(profile, 500, TWO_CORES, EMBEDDING).frontend["startupTimeout"]
    assert choice.value == 2 * 130 and "assumed 30 s" in choice.reason


def test_response_timeout_covers_isolation_and_the_handler_deadline():
    slow = profile_of({(1, 16): (5, 6), (1, 256): (900, 1000)})
    tuning = tune(slow, 5000, TWO_CORES, EMBEDDING)
    assert tuning.frontend["responseTimeout"].value == math.ceil(2 * 17 * 1.0)  # 17 passes of 1 s, x2
    fast = tune(linear(), 500, TWO_CORES, EMBEDDING)
    assert fast.frontend["responseTimeout"].value == 30  # the handler's 30 s deadline_ms


def test_job_queue_follows_littles_law_with_torchserves_default_as_floor():
    fast = profile_of({(1, 16): (1, 1.1), (32, 16): (10, 11), (1, 256): (5, 6)})
    tuning = tune(fast, 1000, Machine(8), EMBEDDING)  # 2 workers x 3200 req/s x 1 s
    assert tuning.frontend["jobQueueSize"].value == 6400
    assert tuning.properties["job_queue_size"].value == 6400
    slow = tune(linear(), 500, TWO_CORES, EMBEDDING)
    assert slow.frontend["jobQueueSize"].value >= 100


def test_continuous_mode_is_the_default_and_holds_each_lanes_queue_cap_plus_room_for_new_requests():
    tuning = tune(linear(), 500, TWO_CORES, EMBEDDING)
    values = tuning.frontend_values()
    assert tuning.mode == "continuous"
    assert (values["continuousBatching"], values["asyncCommunication"]) == (True, False)
    assert values["batchSize"] == 2 * EMBEDDING.queue_cap + 32 and values["maxBatchDelay"] == 1  # two lanes
    one_lane = tune(linear(), 500, TWO_CORES, config_of(long_lane_from=None))
    assert one_lane.frontend_values()["batchSize"] == EMBEDDING.queue_cap + 32
    assert "restarts a worker that dies" in tuning.frontend["continuousBatching"].reason
    with_cap = tune(linear(), 500, TWO_CORES, HandlerConfig.from_yaml({**BASE, "queue_cap": 10}))
    assert with_cap.frontend["batchSize"].value == 2 * 10 + 32
    assert {p.lane for p in tuning.buckets} == {0, 1}  # the scheduler's two lanes


def test_async_mode_on_request_has_batch_size_one():
    tuning = tune(linear(), 500, TWO_CORES, EMBEDDING, mode="async")
    values = tuning.frontend_values()
    assert (values["asyncCommunication"], values["continuousBatching"], values["batchSize"]) == (True, False, 1)
    assert "max_wait_ms" in tuning.handler and {p.lane for p in tuning.buckets} == {0, 1}


def test_unknown_mode_is_refused():
    with pytest.raises(TuneError, match="mode must be one of"):
        tune(linear(), 500, TWO_CORES, EMBEDDING, mode="turbo")


def test_max_wait_is_as_long_as_running_alone_capped_by_the_target():
    assert tune(linear(fixed_ms=3.2), 500, TWO_CORES, EMBEDDING).handler["max_wait_ms"].value == 4
    assert tune(linear(fixed_ms=30), 100, TWO_CORES, EMBEDDING).handler["max_wait_ms"].value == 10


# -- refusals -------------------------------------------------------------------------------------

def test_unusable_profiles_are_refused():
    with pytest.raises(TuneError, match="no timings"):
        tune(profile_of({}), 500, TWO_CORES, EMBEDDING)
    with pytest.raises(TuneError, match="no batch-1 timing for bucket 64"):
        tune(profile_of({(1, 16): (5, 6), (2, 64): (9, 10)}), 500, TWO_CORES, EMBEDDING)
    with pytest.raises(TuneError, match="task 'embedding'"):
        tune(linear(), 500, TWO_CORES, config_of(task="sequence_classification"))
    with pytest.raises(TuneError, match="buckets"):
        tune(linear(), 500, TWO_CORES, config_of(buckets=[32, 256]))
    with pytest.raises(TuneError, match="batch_caps is what tune chooses"):
        tune(linear(), 500, TWO_CORES, config_of(batch_caps={16: 2}),
             fixed={"batch_caps"})


def test_buckets_without_the_models_maximum_match_the_profile():
    config = config_of(buckets=[16, 64])  # the handler adds 256
    assert tune(linear(), 500, TWO_CORES, config).handler["buckets"].value == [16, 64, 256]


# -- reasons, and the files they end up in ----------------------------------------------------------

def test_every_tuned_value_has_a_one_line_reason():
    tuning = tune(linear(), 500, TWO_CORES, EMBEDDING)
    for section in (tuning.frontend, tuning.handler, tuning.properties):
        for key, choice in section.items():
            assert choice.reason.strip(), key
            assert "\n" not in choice.reason, key
    comments = tuning.comments()
    for key in tuning.frontend:
        assert (key,) in comments
    for key in tuning.handler:
        assert ("handler", key) in comments
    for plan in tuning.buckets:
        assert f"batch {plan.batch} serves" in comments[("handler", "batch_caps", plan.bucket)]


def test_the_commented_yaml_reads_back_and_each_reason_sits_above_its_key():
    tuning = tune(linear(), 500, TWO_CORES, EMBEDDING)
    config = {**tuning.frontend_values(), "handler": {"task": "embedding", **tuning.handler_values()}}
    text = render_yaml(config, tuning.comments(), "header line")
    assert yaml.safe_load(text) == config
    lines = text.splitlines()
    for key, choice in tuning.frontend.items():
        index = lines.index(f"{key}: {yaml.safe_dump([choice.value], default_flow_style=True).strip()[1:-1]}")
        assert lines[index - 1] == f"# {choice.reason}"
    for bucket, cap in tuning.handler["batch_caps"].value.items():
        index = lines.index(f"    {bucket}: {cap}")
        assert lines[index - 1].startswith(f"    # bucket {bucket} tokens")
    HandlerConfig.from_yaml(yaml.safe_load(text)["handler"])  # a handler section the worker accepts


def test_tuned_properties_carry_their_reasons(tmp_path):
    tuning = tune(linear(), 500, Machine(8), EMBEDDING)
    text = render_properties(ServerSettings(model_store=str(tmp_path), load_models=("m.mar",),
                                            tuned=tuning.property_entries()))
    values = read_properties(text)
    assert values["default_workers_per_model"] == "2" and values["number_of_gpu"] == "0"
    assert values["job_queue_size"] == str(tuning.frontend["jobQueueSize"].value)
    assert values["inference_address"] == "http://127.0.0.1:8080"  # the safe defaults stay
    lines = text.splitlines()
    for key, _value, reason in tuning.property_entries():
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{key}="))
        assert lines[index - 1] == f"# {reason}"


def test_tune_writes_files_that_read_back(tmp_path):
    profile_path = tmp_path / "profile.json"
    # as warmup records lanes; about as slow as MiniLM here (for a much faster model the simulator predicts
    # first-come batching wins: continuous mode's back-to-back calls cost the frontend more CPU)
    linear(fixed_ms=10.0, per_token_ms=0.3, threads_per_bucket={"16": 1, "64": 1, "256": 1}).save(str(profile_path))
    request = pipeline.Request("unused", "minilm", dict(BASE), 400.0, workload="search")
    built = pipeline.tune_to(request, str(profile_path), str(tmp_path / "out"), {})
    with open(built.config_path) as f:
        config = yaml.safe_load(f)
    for key, choice in built.tuning.handler.items():  # what the simulator chose is what the file ships
        assert config["handler"][key] == choice.value, key
    assert built.tuning.chosen in {c.name for c in built.tuning.simulated} and len(built.tuning.simulated) >= 2
    with open(built.config_path) as f:
        assert f"Candidates simulated on workload 'search'" in f.read()
    assert config["continuousBatching"] is True and config["asyncCommunication"] is False
    workers = built.tuning.frontend["minWorkers"].value
    assert config["minWorkers"] == config["maxWorkers"] == workers
    with open(built.properties) as f:
        values = read_properties(f.read())
    assert values["load_models"] == "minilm.mar" and values["default_workers_per_model"] == str(workers)


def test_a_file_that_is_not_a_profile_is_refused(tmp_path):
    path = tmp_path / "p.json"
    for content in ("not json", json.dumps([1, 2]), json.dumps({"model": "m"}), json.dumps({"shapes": [{"x": 1}]})):
        path.write_text(content)
        with pytest.raises(TuneError, match="is not a latency profile"):
            pipeline.load_profile(str(path))


def test_tune_and_kserve_stay_pure():
    probe = ("import importlib, json, sys\n"
             "for name in sys.argv[1:]: importlib.import_module(name)\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers', 'ts'})))")
    modules = ["tsbatch.archiver.tune", "tsbatch.archiver.kserve", "tsbatch.archiver.pipeline", "tsbatch.archiver.cli"]
    done = subprocess.run([sys.executable, "-c", probe, *modules], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_caps_learned_from_out_of_memory_while_profiling_bound_the_tuned_caps():
    """The profile stops a bucket at the batch that ran out of memory (and leaves out a bucket where
    not one request fit): tune keeps within it, says why, and still serves the bucket's edges."""
    shapes = {(n, b): (5 + 0.02 * n * b, 5.5 + 0.022 * n * b) for b in (16, 64) for n in (1, 2, 4, 8, 16)
              if not (b == 64 and n > 2)}
    profile = profile_of(shapes)
    profile.oom_caps = {64: 2, 256: 0}
    tuning = tune(profile, 500, TWO_CORES, EMBEDDING)
    assert tuning.handler["buckets"].value == [16, 64, 256]
    assert tuning.handler["batch_caps"].value == {16: 16, 64: 2}
    assert {p.bucket: p.limited_by for p in tuning.buckets}[64] == "out of memory"
    reason = tuning.handler["batch_caps"].reason
    assert "bucket 64 at 2" in reason and "bucket 256 entirely" in reason
    profile.oom_caps = {16: 0, 64: 0}
    profile.shapes = []
    with pytest.raises(TuneError):
        tune(profile, 500, TWO_CORES, EMBEDDING)
