"""The public model API (handlers/api.py) with a fake model: no torch, no TorchServe.

A team's model is three methods; everything else (buckets, warmup before READY, isolation,
error JSON, the modes) must come from tsbatch. The fake counts words as its length, answers the
sum of its input, and fails on the word "poison".
"""
from __future__ import annotations

import json

import pytest

from tsbatch.handlers.api import BadInput, Batch, Model, Request
from tsbatch.handlers.edge.stages import BATCH_SIZE_HEADER, PADDED_HEADER
from tsbatch.handlers.edge.tsbatch_handler import TsbatchHandler
from tests.support import scratch_dir

pytestmark = pytest.mark.unit


class WordModel(Model):
    max_length = 64
    device = "cpu"

    def __init__(self):
        self.passes: list[tuple[int, int]] = []  # (batch size, bucket) of every forward

    def prepare(self, request: Request) -> tuple[int, list[int]]:
        words = request.text().split()
        if not words:
            raise BadInput("send at least one word")
        return len(words), [len(w) for w in words]

    def forward(self, batch: Batch) -> list:
        self.passes.append((batch.size, batch.bucket))
        for item in batch.items:
            assert len(item.input) <= batch.bucket  # every input fits the bucket it was put in
            if item.input == [6]:  # "poison" alone fails, whatever batch it is in
                raise RuntimeError("the model broke on this input")
        return [{"sum": sum(item.input), "length": item.length} for item in batch.items]

    def example(self, length: int) -> list[int]:
        return [1] * length


class WordHandler(TsbatchHandler):
    def load_model(self, model_path, config, gpu_id):
        return WordModel()


class FakeContext:
    """What TorchServe's Context offers the handler, for default mode."""

    def __init__(self, handler_section: dict, frontend: dict | None = None):
        self.model_name = "words"
        self.system_properties = {"model_dir": scratch_dir("tsbatch-api-"), "batch_size": 8}
        self.model_yaml_config = {**(frontend or {}), "handler": handler_section}
        self.metrics = None
        self.request_processor: list = []
        self.request_ids: dict = {}
        self.status: dict = {}
        self.headers: dict = {}

    def set_response_content_type(self, index, value):
        self.headers.setdefault(index, {})["Content-Type"] = value

    def set_response_header(self, index, key, value):
        self.headers.setdefault(index, {})[key] = value

    def set_response_status(self, code, phrase, idx=0):
        self.status[idx] = code

    def get_all_request_header(self, index):
        return {}


def load(**section) -> tuple[WordHandler, FakeContext]:
    context = FakeContext({"buckets": [4, 16, 64], "max_batch_size": 4, "warmup_repeats": 1,
                           "warmup_max_repeats": 1, **section})
    handler = WordHandler()
    handler.initialize(context)
    return handler, context


def serve(handler, context, texts: list[str]) -> list[tuple[int, dict, dict]]:
    rows = [{"body": t.encode()} for t in texts]
    context.request_processor = [None] * len(rows)
    context.request_ids = {i: f"r{i}" for i in range(len(rows))}
    context.status, context.headers = {}, {}
    bodies = handler.handle(rows, context)
    return [(context.status.get(i, 200), json.loads(b), context.headers.get(i, {})) for i, b in enumerate(bodies)]


def test_warmup_runs_every_batch_size_of_every_bucket_before_ready():
    handler, _ = load()
    assert set(handler.model.passes) >= {(b, e) for e in (4, 16, 64) for b in (1, 2, 4)}
    assert {(s.batch, s.bucket) for s in handler.profile.shapes} == {(b, e) for e in (4, 16, 64) for b in (1, 2, 4)}
    handler.close()


def test_requests_are_bucketed_by_the_models_length_and_answered_in_order():
    handler, context = load(warmup=False)
    texts = ["a bb", "ccc", " ".join(["w"] * 10), "dd eee f", " ".join(["x"] * 40)]
    answers = serve(handler, context, texts)
    assert [status for status, _, _ in answers] == [200] * 5
    assert [body["sum"] for _, body, _ in answers] == [3, 3, 10, 6, 40]
    assert [headers[PADDED_HEADER] for _, _, headers in answers] == ["4", "4", "16", "4", "64"]
    # one pass per bucket, shortest first: the long input set the padding of nobody else
    assert handler.model.passes == [(2, 4), (1, 4), (1, 16), (1, 64)]  # 3 of bucket 4: a pass of 2 and of 1
    assert all(headers[BATCH_SIZE_HEADER] == "5" for _, _, headers in answers)


def test_a_failing_input_fails_alone_and_the_others_get_their_answer():
    handler, context = load(warmup=False)
    answers = serve(handler, context, ["one two", "poison", "three", "", " ".join(["y"] * 65)])
    statuses = [status for status, _, _ in answers]
    assert statuses == [200, 500, 200, 400, 413]
    assert answers[0][1]["sum"] == 6 and answers[2][1]["sum"] == 5
    assert "broke" in answers[1][1]["error"] and answers[3][1]["code"] == 400
    assert "at most 64" in answers[4][1]["error"]


def test_a_model_that_returns_a_bad_length_fails_that_request_with_a_clear_error():
    class Sloppy(WordModel):
        def prepare(self, request):
            return "long", [1]

    class SloppyHandler(TsbatchHandler):
        def load_model(self, model_path, config, gpu_id):
            return Sloppy()

    context = FakeContext({"buckets": [4], "warmup": False})
    handler = SloppyHandler()
    handler.initialize(context)
    [(status, body, _)] = serve(handler, context, ["anything"])
    assert status == 500 and "length 'long'" in body["error"]


def test_a_handler_without_a_model_says_what_to_write():
    with pytest.raises(NotImplementedError, match="load_model"):
        TsbatchHandler().initialize(FakeContext({"warmup": False}))


def test_every_answer_that_ran_says_where_its_time_in_the_handler_went():
    from tsbatch.handlers.edge.stages import TIMING_HEADER

    handler, context = load(warmup=False)
    answers = serve(handler, context, ["a bb", " ".join(["w"] * 40), ""])
    timings = []
    for status, _, headers in answers[:2]:
        fields = dict(part.strip().split("=") for part in headers[TIMING_HEADER].split(";"))
        timings.append({k: float(v) for k, v in fields.items()})
    assert all(set(t) == {"wait", "pass", "handler"} for t in timings)
    assert all(t["wait"] >= 0 and t["pass"] >= 0 and t["handler"] >= t["wait"] + t["pass"] - 0.1 for t in timings)
    assert timings[1]["wait"] >= timings[0]["wait"]  # the long bucket ran after the short one
    assert TIMING_HEADER not in answers[2][2]  # refused before any pass: nothing to say


def test_only_a_worker_with_lanes_hands_the_gil_over_sooner():
    """Lanes release the GIL at every torch op and need it back for the next one: in the scheduler
    modes the worker shortens Python's switch interval; default mode (no lanes) leaves it alone."""
    import sys

    from tsbatch.handlers.edge.tsbatch_handler import LANE_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()  # earlier tests' workers with lanes may have set it already
    python_default = 0.005
    sys.setswitchinterval(python_default)
    try:
        handler, _ = load(warmup=False)
        assert sys.getswitchinterval() == pytest.approx(python_default)
        handler.close()
        context = FakeContext({"buckets": [4, 16, 64], "warmup": False}, {"continuousBatching": True})
        handler = WordHandler()
        handler.initialize(context)
        assert handler.mode is not None and sys.getswitchinterval() == pytest.approx(LANE_SWITCH_INTERVAL_S)
        assert LANE_SWITCH_INTERVAL_S < python_default
        handler.close()
    finally:
        sys.setswitchinterval(before)


def test_with_lanes_the_model_loads_and_warms_on_a_thread_that_ends_and_its_errors_still_reach_torchserve():
    """Lanes run every pass in the scheduler modes; a multi-threaded warmup pass on TorchServe's
    thread would leave that thread an OpenMP team for good, and a second team (a lane borrowing
    the cores) makes GNU OpenMP's workers sleep between regions (bench/results/omp-pools.md).
    Default mode runs its passes on TorchServe's thread, so it loads there."""
    import threading

    loaded_on: list = []

    class Where(WordHandler):
        def load_model(self, model_path, config, gpu_id):
            loaded_on.append(threading.current_thread())
            return super().load_model(model_path, config, gpu_id)

    for frontend, on_this_thread in (({}, True), ({"continuousBatching": True}, False), ({"asyncCommunication": True}, False)):
        handler = Where()
        handler.initialize(FakeContext({"buckets": [4, 16], "warmup": False}, frontend))
        assert (loaded_on.pop() is threading.current_thread()) == on_this_thread, frontend
        handler.close()

    class Broken(TsbatchHandler):
        def load_model(self, model_path, config, gpu_id):
            raise ValueError("no weights in this directory")

    with pytest.raises(ValueError, match="no weights"):
        Broken().initialize(FakeContext({"warmup": False}, {"continuousBatching": True}))
