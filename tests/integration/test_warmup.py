"""Warmup inside initialize(): every shape the handler can form, and the latency profile."""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading

import pytest

from tsbatch.handlers.core.buckets import plan_batches
from tsbatch.handlers.edge.stages import Call, prepare
from tsbatch.handlers.models.encoder_handler import EncoderHandler
from tests.support import call, make_context
from tsbatch.warmup.profile import PROFILE_FILE, LatencyProfile


@pytest.fixture(scope="module")
def warmed(tmp_path_factory, minilm_dir, request):
    archive_dir = tmp_path_factory.mktemp("archive")
    shutil.copytree(minilm_dir, archive_dir / "model")
    handler_section = {"task": "embedding", "buckets": [16, 64, 256], "max_batch_size": 4}
    context = make_context(str(archive_dir), handler_section)
    context.model_yaml_config["startupTimeout"] = 1  # so the estimate overruns and says so
    handler = EncoderHandler()
    caplog = logging.getLogger()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    keep = Keep()
    caplog.addHandler(keep)
    caplog.setLevel(logging.INFO)
    try:
        handler.initialize(context)
    finally:
        caplog.removeHandler(keep)
    return handler, context, str(archive_dir), records


def test_profile_lists_every_shape_the_handler_can_form(warmed):
    handler, _context, archive_dir, _records = warmed
    profile = LatencyProfile.load(os.path.join(archive_dir, PROFILE_FILE))
    warmed_shapes = {(s.batch, s.bucket) for s in profile.shapes}
    assert warmed_shapes == {(b, e) for e in (16, 64, 256) for b in (1, 2, 4)}
    for timing in profile.shapes:
        assert timing.median_ms > 0 and timing.p90_ms >= timing.median_ms and timing.runs >= 3
    env = profile.environment
    for key in ("device", "dtype", "torch_threads", "torch", "transformers"):
        assert key in env
    assert profile.model == "m" and profile.warmup_seconds > 0
    # whatever traffic arrives, the handler forms only warmed shapes
    rows = [("word " * n).encode() for n in [3, 3, 3, 3, 3, 3, 3, 40, 40, 40, 200]]
    items = prepare(handler.model, handler.edges, (), [{"body": row} for row in rows], None, Call.of(len(rows)))
    for batch in plan_batches(items, handler.cap_for):
        assert (batch.size, batch.bucket) in warmed_shapes


def test_warmup_logs_progress_estimate_and_profile(warmed):
    _handler, _context, _dir, records = warmed
    progress = [r for r in records if r.startswith("tsbatch warmup shape")]
    assert len(progress) == 9 and "shape 9 of 9" in progress[-1]
    assert any("more than startupTimeout=1s" in r for r in records), "the estimate must warn when it overruns"
    profile_line = next(r for r in records if "latency profile" in r)
    assert json.loads(profile_line.split(": ", 1)[1])["shapes"]


def test_serving_after_warmup_works(warmed):
    handler, context, _dir, _records = warmed
    replies = call(handler, context, ["a short one", "word " * 100])
    assert [r.status for r in replies] == [200, 200]


def test_each_lane_warms_its_buckets_on_its_own_thread_before_ready(minilm_dir, monkeypatch):
    """warmup runs every shape on the handler's thread; a lane thread's first passes would still
    pay for its own OpenMP team and allocator arena. So before initialize returns (READY), each
    lane has run each of its buckets at batch 1 on its own thread, and passes after READY add none."""
    from tsbatch.handlers.models.encoder import EncoderModel
    from tests.support import load_handler

    passes, examples = [], []
    own_forward, own_example = EncoderModel.forward, EncoderModel.example

    def recorded(self, batch):
        passes.append((threading.current_thread().name, batch.size, batch.bucket))
        return own_forward(self, batch)

    def example(self, length):
        examples.append(threading.current_thread().name)
        return own_example(self, length)

    monkeypatch.setattr(EncoderModel, "forward", recorded)
    monkeypatch.setattr(EncoderModel, "example", example)
    handler, _context = load_handler(minilm_dir, frontend={"continuousBatching": True, "batchSize": 8},
                                     buckets=[16, 64, 256], max_batch_size=2, long_lane_from=128, warmup=True,
                                     warmup_repeats=1, warmup_max_repeats=2)
    try:
        at_ready = list(passes)
        on_lanes = {(name, bucket) for name, size, bucket in at_ready if name.startswith("tsbatch-lane") and size == 1}
        assert on_lanes == {("tsbatch-lane-0", 16), ("tsbatch-lane-0", 64), ("tsbatch-lane-1", 256)}
        # inputs are made on the handler's thread: lanes start together, and a fast tokenizer
        # called from two threads at once raised "Already borrowed" (transformers 4.57, CI)
        assert examples and not any(name.startswith("tsbatch-lane") for name in examples)
        assert {bucket for name, _, bucket in at_ready if not name.startswith("tsbatch-lane")} == {16, 64, 256}
    finally:
        handler.close()
    assert passes == at_ready  # nothing ran on its own after READY
