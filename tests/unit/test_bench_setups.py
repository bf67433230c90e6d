"""What the bench scripts set up before they measure: where the load generator runs, the tuning
benchmark's grid points, the shapes and texts the served warmup benchmark sends, and the command a
report names."""
from __future__ import annotations

import json
import os
import zipfile

import pytest
import yaml

from bench.loadtest import proc
from bench.loadtest.workload import token_counter
from bench.run import command_of, keep_profile
from bench.tune_bench import grid_point
from bench.warmup_served import shapes_of, texts


def test_the_load_generator_gets_a_core_of_its_own_only_where_there_are_enough(monkeypatch):
    set_to = []
    monkeypatch.setattr(proc.os, "sched_setaffinity", lambda pid, cores: set_to.append(list(cores)))
    monkeypatch.setattr(proc.os, "sched_getaffinity", lambda pid: {0, 1})
    small = proc.split_cores()
    assert small == {"shared": [0, 1]} and "shares all 2 cores" in proc.cores_note(small)
    proc.use_cores(small, "client")
    proc.use_cores(small, "server")
    assert set_to == []  # a shared machine is left as it is
    monkeypatch.setattr(proc.os, "sched_getaffinity", lambda pid: set(range(8)))
    big = proc.split_cores()
    assert big == {"server": list(range(7)), "client": [7]}
    proc.use_cores(big, "server")
    proc.use_cores(big, "client")
    assert set_to == [list(range(7)), [7]] and "core 7" in proc.cores_note(big)


def test_no_grid_point_oversubscribes_and_each_mode_sets_its_own_knobs():
    for mode in ("default", "continuous"):
        for workers in (1, 2, 3):
            handler, frontend, config = grid_point([16, 256], mode, 16, 50, workers, cores=2)
            assert workers * handler["torch_threads"] <= 2 or handler["torch_threads"] == 1
            assert frontend["minWorkers"] == frontend["maxWorkers"] == workers == config["workers"]
    handler, frontend, _ = grid_point([16, 256], "default", 4, 5, 2, cores=2)
    assert (frontend["batchSize"], frontend["maxBatchDelay"], handler["torch_threads"]) == (4, 5, 1)
    assert not frontend["continuousBatching"] and "max_wait_ms" not in handler
    handler, frontend, config = grid_point([16, 256], "continuous", 4, 50, 1, cores=2)
    assert frontend["continuousBatching"] and handler["max_wait_ms"] == 50 and handler["max_batch_size"] == 4
    assert handler["torch_threads"] == 2 and config["mode"] == "continuous"


def test_warmup_served_sends_every_warmed_shape_with_texts_of_exactly_the_buckets_tokens(tmp_path):
    mar = tmp_path / "m.mar"
    with zipfile.ZipFile(mar, "w") as archive:
        archive.writestr("model-config.yaml", yaml.safe_dump({"handler": {"batch_caps": {"8": 4, "64": 1, "256": 2}}}))
    assert shapes_of(str(mar)) == [(1, 8), (2, 8), (4, 8), (1, 64), (1, 256), (2, 256)]
    tokens = token_counter()
    for batch, bucket in ((3, 8), (2, 64), (2, 256)):
        sent = texts(batch, bucket)
        assert len(sent) == batch and len(set(sent)) == batch
        assert [tokens(t) for t in sent] == [bucket] * batch


def test_a_report_names_every_argument_its_run_was_given():
    assert command_of([]) == "make bench"
    assert command_of(["--workload", "long", "--no-light"]) == "make bench BENCH_ARGS='--workload long --no-light'"


def test_frontend_variants_keep_tsbatchs_log_config_and_turn_only_the_access_log_off(tmp_path):
    """bench/frontend.py: a variant that sets vmargs replaces the shipped line (the last key wins),
    so it must carry tsbatch's log4j2.xml itself; the quiet copy differs only in ACCESS_LOG."""
    from bench.frontend import LOG4J, access_log_off, variants
    from tsbatch.archiver.properties import FRONTEND_JIT

    named = variants(str(tmp_path))
    assert named["shipped"] == ()
    for name, lines in named.items():
        for key, value, _ in lines:
            if key == "vmargs":
                path = value.split("-Dlog4j.configurationFile=file://")[1].split()[0]
                assert os.path.exists(path), name
                # each differs from the shipped JVM in one thing: only the JIT variant drops C1-only
                assert (" ".join(FRONTEND_JIT) in value) == ("JIT" not in name), name
    with open(LOG4J) as f:
        shipped = f.read()
    quiet = access_log_off(shipped)
    assert '<Logger name="ACCESS_LOG" level="off"' in quiet
    assert quiet.replace('name="ACCESS_LOG" level="off"', 'name="ACCESS_LOG" level="info"') == shipped
    with pytest.raises(ValueError):
        access_log_off("<Configuration/>")


def test_first_request_control_is_the_shipped_file_without_the_jit_flag():
    """bench/first_request.py's control differs from the shipped config.properties in the JIT flag alone."""
    from bench.first_request import without_jit
    from tsbatch.archiver.properties import ServerSettings, render_properties

    shipped = render_properties(ServerSettings(model_store="/tmp/store", load_models=("m.mar",), log_config="/tmp/l.xml"))
    control = without_jit(shipped)
    changed = [(a, b) for a, b in zip(shipped.splitlines(), control.splitlines()) if a != b]
    assert changed == [("vmargs=-Dlog4j.configurationFile=file:///tmp/l.xml -XX:TieredStopAtLevel=1",
                        "vmargs=-Dlog4j.configurationFile=file:///tmp/l.xml")]
    with pytest.raises(ValueError):
        without_jit(control)


def test_overload_sums_each_class_s_statuses_over_rounds_and_names_every_arm_in_its_table():
    from bench.overload import markdown, pooled

    def window(answered, short, long):
        return {"answered_per_s": answered, "short_p50": 100.0, "short_p99": 400.0, "long_p50": 900.0,
                "long_p99": None, "cores": {"worker": 1.7}, "status_by_kind": {"short": short, "long": long}}

    rounds = [window(70.0, {"200": 10, "503": 5}, {"200": 2}), window(80.0, {"200": 12}, {"200": 1, "504": 3})]
    p = pooled(rounds)
    assert p["status"] == {"short": {"200": 22, "503": 5}, "long": {"200": 3, "504": 3}}
    assert p["per_round"] == [70.0, 80.0] and p["long_p99"] is None
    report = {"when": "w", "machine": "m", "command": "c", "seconds": 20.0, "rounds": 2,
              "arms": {"this checkout": "abc one", "before": "def two"},
              "rates": {"130": {"this checkout": p, "before": p}}}
    text = markdown(report)
    assert "| 130 | before |" in text and "| 22 / 5 / 0 | 3 / 0 / 3 |" in text
    assert "**before**: def two" in text


def test_a_run_keeps_the_profile_its_tuned_arm_was_built_from_beside_its_report(tmp_path):
    store, out = tmp_path / "store", tmp_path / "out"
    store.mkdir(), out.mkdir()
    (store / "arm_t.latency_profile.json").write_text('{"shapes": [{"bucket": 8, "batch": 1}]}')
    kept = keep_profile(str(store), str(out), "two-cluster")
    assert kept == str(out / "profile-two-cluster.json")
    assert json.loads((out / "profile-two-cluster.json").read_text()) == {"shapes": [{"bucket": 8, "batch": 1}]}
