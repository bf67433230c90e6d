"""`tsbatch profile` follows warmup by the records' `tsbatch_warmup` events, not by their prose."""
from __future__ import annotations

import logging

import pytest

from tsbatch.archiver.measure import _Forward, progress_line
from tsbatch.warmup.plan import Shape, WarmupPlan
from tsbatch.warmup.profile import LatencyProfile
from tests.support import FakeClock
from tsbatch.warmup.run import run_plan

pytestmark = pytest.mark.unit


def test_every_warmup_shape_reaches_the_progress_callback_as_an_event():
    seen = []
    forward = _Forward(seen.append)
    logger = logging.getLogger("tsbatch.warmup.run")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(forward)
    try:
        plan = WarmupPlan((Shape(1, 16), Shape(2, 16), Shape(1, 64)), repeats=2, max_repeats=2)
        run_plan(plan, lambda shape: None, LatencyProfile("m", {}), clock=FakeClock())
    finally:
        logger.removeHandler(forward)
        logger.setLevel(level)
    assert [line.split(":")[0] for line in seen] == [f"warmup shape {i} of 3" for i in (1, 2, 3)]
    assert "batch 2 x 16 tokens" in seen[1] and "(2 runs)" in seen[1]


def test_prose_without_an_event_is_not_progress_and_an_event_is_whatever_the_text():
    seen = []
    forward = _Forward(seen.append)
    plain = logging.LogRecord("tsbatch.warmup.run", logging.INFO, __file__, 1, "tsbatch warmup shape 1 of 1", None, None)
    forward.emit(plain)
    assert seen == []
    evented = logging.LogRecord("tsbatch.handlers.runtime.warming", logging.INFO, __file__, 1, "reworded", None, None)
    evented.tsbatch_warmup = {"event": "done", "seconds": 12.34}
    forward.emit(evented)
    assert seen == ["warmup done in 12.3s"]


def test_progress_lines():
    assert progress_line({"event": "estimate", "shapes": 9, "seconds": 4.2}) == "warmup: 9 shapes, estimated 4.2s"
    assert progress_line({"event": "something new"}).startswith("warmup: {")
