"""bench/saturation.py's reading of py-spy samples: which category a worker thread's stack is in."""
from __future__ import annotations

import pytest

from bench.saturation import classify, gil_shares, per_core, read_samples

pytestmark = pytest.mark.unit

LANE = ("_bootstrap (threading.py:1002);_lane (tsbatch/handlers/runtime/lanes.py:96);"
        "_step (tsbatch/handlers/runtime/lanes.py:104)")
MAIN = ("<module> (ts/model_service_worker.py:301);handle_connection (ts/model_service_worker.py:185);"
        "predict (ts/service.py:135);handle (tsbatch/handlers/edge/modes/continuous_mode.py:85)")


def test_a_pass_is_a_forward_pass_and_a_wait_is_named_by_its_waiter():
    forward = f"{LANE};forward (tsbatch/handlers/models/encoder.py:214);_call_impl (torch/nn/modules/module.py:1750)"
    assert classify(forward.split(";")) == "forward pass"
    waiting = f"{MAIN};_wait_for_one (tsbatch/handlers/edge/modes/continuous_mode.py:110);wait (threading.py:327)"
    assert classify(waiting.split(";")) == "waiting (handlers/edge/modes/continuous_mode.py:_wait_for_one)"
    encode = f"{MAIN};answer (tsbatch/handlers/edge/stages.py:200);dumps (json/__init__.py:231);encode (json/encoder.py:200)"
    assert classify(encode.split(";")) == "response encoding (JSON)"
    read = "<module> (ts/model_service_worker.py:301);retrieve_msg (ts/protocol/otf_message_handler.py:40);recv (socket.py:1)"
    assert classify(read.split(";")) == "TorchServe protocol: reading calls (recv per field, parsing)"
    assert classify(f"{LANE};expire (tsbatch/handlers/core/policy.py:245)".split(";")) == "other: policy.py:expire"


def test_read_samples_gives_each_thread_its_shares(tmp_path):
    raw = tmp_path / "worker.stacks"
    raw.write_text(
        f"thread (11): tsbatch-lane-0;{LANE};forward (tsbatch/handlers/models/encoder.py:214) 3\n"
        f"thread (11): tsbatch-lane-0;{LANE};_collate (tsbatch/handlers/models/encoder.py:230) 1\n"
        f"thread (10): MainThread;{MAIN};tokenize (tsbatch/handlers/models/encoder.py:170) 2\n")
    assert read_samples(str(raw)) == {"tsbatch-lane-0": {"forward pass": 0.75, "collate": 0.25},
                                      "MainThread": {"tokenize": 1.0}}


def test_gil_shares_divide_each_threads_gil_samples_by_all_of_its_samples(tmp_path):
    every, held = tmp_path / "all", tmp_path / "gil"
    every.write_text(f"thread (11): tsbatch-lane-0;{LANE} 6\nthread (11): tsbatch-lane-0;{LANE};x (a.py:1) 2\n"
                     f"thread (10): MainThread;{MAIN} 4\n")
    held.write_text(f"thread (11): tsbatch-lane-0;{LANE} 2\n")
    assert gil_shares(str(every), str(held)) == {"tsbatch-lane-0": 0.25, "MainThread": 0.0}


def test_per_core_divides_the_served_answers_by_the_lanes_cores_and_the_ceiling_by_its_threads():
    report = {"handler": {"torch_threads": 2}, "ceilings": {"sorted": {"req_per_s": 177.0}},
              "overload": {"answered_per_s": 120.0, "worker_threads_cores": {
                  "tsbatch-lane-0": 0.7, "tsbatch-lane-1": 0.5, "MainThread": 0.25}}}
    assert per_core(report) == {"lanes_cores": 1.2, "served_per_lane_core": 100.0, "ceiling_per_core": 88.5}


def test_a_frame_that_spans_lines_stays_in_its_record(tmp_path):
    path = tmp_path / "raw.stacks"
    path.write_text("thread (1): MainThread;mod.py:<module>;a docstring.\n\nMore of it\n;json/encoder.py:encode 3\n"
                    "thread (2): tsbatch-lane-0;models/encoder.py:forward 5\n")
    assert read_samples(str(path)) == {"MainThread": {"response encoding (JSON)": 1.0}, "tsbatch-lane-0": {"forward pass": 1.0}}
