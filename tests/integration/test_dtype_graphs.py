"""The built-in encoder in float16/bfloat16 (`handler.dtype`), and CUDA graphs per shape
(`handler.cuda_graphs`) through the real handler on the CPU: a fake of the CUDA calls takes the
place of torch.cuda.CUDAGraph, so capture at warmup, replay, and every fallback to eager run here."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tsbatch.handlers.core.buckets import Batch, Item
from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.edge.config import Dtype, HandlerConfig, Task
from tsbatch.handlers.models import encoder
from tsbatch.handlers.models.encoder_handler import EncoderHandler
from tsbatch.handlers.runtime.warming import example_batch
from tsbatch.warmup.profile import PROFILE_FILE
from tests.support import call, cosine, load_handler, make_context

pytestmark = pytest.mark.integration

TEXTS = ["A man is eating food.", "Angela Merkel visited Paris and Berlin last week", "hi",
         "Ünïcödé, emoji 🚀 and 中文 mixed scripts", " ".join(["longer input"] * 60)]
# cosine to the float32 answer, at least (measured on the default model, these texts, CPU:
# bfloat16 0.99992 at worst, float16 0.999999)
TOLERANCE = {"bfloat16": 0.999, "float16": 0.9999}
SMALL = {"buckets": [16, 64, 256], "max_batch_size": 2}
CLASSIFIER = {**SMALL, "max_length": 256}  # the tiny classifier's own is 512


@pytest.fixture(scope="module")
def float32_answers(minilm_dir):
    handler, context = load_handler(minilm_dir, **SMALL)
    answers = [r.body["embedding"] for r in call(handler, context, TEXTS)]
    handler.close()
    return answers


# -- dtype

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_answers_stay_within_tolerance_of_float32(minilm_dir, float32_answers, dtype, caplog):
    with caplog.at_level(logging.WARNING, logger=encoder.logger.name):
        handler, context = load_handler(minilm_dir, dtype=dtype, **SMALL)
    assert handler.model.model.dtype == encoder.DTYPES[Dtype(dtype)]
    assert f"handler.dtype is {dtype} on the CPU" in caplog.text, "the CPU's slow half precision is not said"
    replies = call(handler, context, TEXTS)
    assert [r.status for r in replies] == [200] * len(TEXTS)
    similarity = [cosine(r.body["embedding"], ref) for r, ref in zip(replies, float32_answers)]
    assert min(similarity) >= TOLERANCE[dtype], similarity
    assert min(similarity) < 1.0, "the model did not run in half precision"
    assert all(isinstance(x, float) for x in replies[0].body["embedding"])
    handler.close()


def test_a_classifier_in_bfloat16_answers_float32_scores_and_its_profile_records_the_dtype(tiny_models, tmp_path):
    shutil.copytree(tiny_models["sequence_classification"], tmp_path / "model")
    handler, context = load_handler("model", archive_dir=str(tmp_path), task="sequence_classification",
                                    dtype="bfloat16", warmup=True, warmup_repeats=1, warmup_max_repeats=1, **SMALL)
    assert json.load(open(tmp_path / PROFILE_FILE))["environment"]["dtype"] == "bfloat16"
    (reply,) = call(handler, context, ["a fine day"])
    assert reply.status == 200 and abs(sum(reply.body["scores"].values()) - 1.0) < 1e-5
    handler.close()


def test_an_unknown_dtype_fails_at_load_naming_the_choices():
    with pytest.raises(ConfigError, match=r"handler.dtype must be one of \['float32', 'float16', 'bfloat16'\], got 'half'"):
        HandlerConfig.from_yaml({"dtype": "half"})


# -- CUDA graphs, with the CUDA calls faked

class FakeGraph:
    """What torch.cuda.CUDAGraph does for us: replay() rewrites the static output from the static
    inputs. `wrong` makes a replay answer otherwise, as a miscaptured graph would."""

    def __init__(self, run, static_inputs, wrong: bool):
        self.run, self.static_inputs, self.wrong = run, static_inputs, wrong
        self.output = run(static_inputs)
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.output.copy_(self.run(self.static_inputs) + (1 if self.wrong else 0))


class FakeCapture:
    """The CUDA calls of encoder.CudaGraphCapture: each capture holds `bytes_per_graph` more; `fail`
    (a shape's padded tokens -> exception) makes a capture raise."""

    def __init__(self, bytes_per_graph: int = 2**20, wrong: bool = False, fail=None, total: int = 2**34):
        self.bytes_per_graph, self.wrong, self.fail, self.total = bytes_per_graph, wrong, fail, total
        self.held, self.graphs, self.released = 0, [], 0

    def total_bytes(self) -> int:
        return self.total

    def held_bytes(self) -> int:
        return self.held

    def capture(self, run, static_inputs):
        error = self.fail(static_inputs["input_ids"].numel()) if self.fail else None
        if error is not None:
            raise error
        graph = FakeGraph(run, static_inputs, self.wrong)
        self.graphs.append(graph)
        self.held += self.bytes_per_graph
        return graph, graph.output

    def release(self) -> None:
        self.released += 1

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.graphs)


@pytest.fixture(scope="module")
def classifier(tiny_models):
    return tiny_models["sequence_classification"]


@pytest.fixture(scope="module")
def eager_answers(classifier):
    """The tiny classifier's answers to TEXTS without graphs: what every graphed pass must equal."""
    handler, context = load_handler(classifier, task="sequence_classification", **CLASSIFIER)
    answers = [r.body for r in call(handler, context, TEXTS)]
    handler.close()
    return answers


def graphed_handler(model_dir, archive_dir, capture: FakeCapture, **handler):
    """The real EncoderHandler, its model built with the fake CUDA calls, warmed before READY."""

    class Graphed(EncoderHandler):
        def load_model(self, model_path, config, gpu_id):
            return encoder.EncoderModel(config, model_path, gpu_id, graph_capture=capture)

    section = {"task": "sequence_classification", "model_dir": model_dir, "cuda_graphs": True, "warmup_repeats": 1,
               "warmup_max_repeats": 1, **CLASSIFIER, **handler}
    context = make_context(str(archive_dir), section)
    loaded = Graphed()
    loaded.initialize(context)
    return loaded, context


def warmed_shapes(handler):
    return {(s.batch, s.bucket) for s in handler.profile.shapes}


def graph_shapes(book):
    return {(s.batch, s.bucket) for s in book.captured}


def test_every_warmed_shape_is_captured_before_ready_and_replayed_after(classifier, tmp_path, eager_answers):
    capture = FakeCapture()
    handler, context = graphed_handler(classifier, tmp_path, capture)
    book = handler.model.graphs.book
    assert graph_shapes(book) == warmed_shapes(handler) == {(b, e) for e in (16, 64, 256) for b in (1, 2)}
    assert book.ready and book.held_bytes == 6 * 2**20 and not book.refused
    before = capture.replays
    replies = call(handler, context, TEXTS)  # bucket 16 x 2, 16 x 1, 64 x 1, 256 x 1 (max_batch_size 2)
    assert capture.replays > before, "served passes did not replay the graphs"
    assert [r.body for r in replies] == eager_answers
    assert handler.model.describe()["cuda_graphs"] is True and book.summary()["captured"] == 6
    handler.close()


def test_a_shape_met_after_ready_without_a_graph_runs_eager(classifier, tmp_path, caplog, eager_answers):
    handler, context = graphed_handler(classifier, tmp_path, FakeCapture())
    model = handler.model
    tokens, encoding = model.tokenize(TEXTS[0])
    batch = Batch(16, tuple(Item(i, TEXTS[0], tokens, 16, encoding) for i in range(3)))  # 3: never planned
    with caplog.at_level(logging.WARNING):
        results = model.forward(batch)
    for result in results:  # another batch size than the reference's pass: within float noise
        assert result["label"] == eager_answers[0]["label"]
        assert result["scores"] == pytest.approx(eager_answers[0]["scores"], abs=1e-5)
    assert "shape 3x16 met after READY has no graph" in caplog.text
    assert not model.graphs.book.has_graph(encoder.Shape(3, 16))
    handler.close()


def test_a_graph_that_answers_otherwise_is_dropped_and_its_shape_runs_eager(classifier, tmp_path, caplog,
                                                                            eager_answers):
    capture = FakeCapture(wrong=True)
    with caplog.at_level(logging.WARNING):
        handler, context = graphed_handler(classifier, tmp_path, capture)
    book = handler.model.graphs.book
    assert not book.captured and set(book.refused) == {encoder.Shape(*s) for s in warmed_shapes(handler)}
    assert "runs eager: its replay answered differently from the eager pass" in caplog.text
    assert capture.released == 6, "a dropped graph's memory was not given back"
    replays = capture.replays
    assert [r.body for r in call(handler, context, TEXTS)] == eager_answers
    assert capture.replays == replays, "a dropped graph was replayed"
    handler.close()


def test_out_of_memory_at_capture_leaves_that_shape_eager_and_the_others_graphed(classifier, tmp_path,
                                                                                 eager_answers):
    oom = lambda tokens: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB") \
        if tokens > 100 else None  # noqa: E731
    handler, context = graphed_handler(classifier, tmp_path, FakeCapture(fail=oom))
    book = handler.model.graphs.book
    assert graph_shapes(book) == {(1, 16), (2, 16), (1, 64)}
    assert {(s.batch, s.bucket) for s in book.refused} == {(2, 64), (1, 256), (2, 256)}
    assert all(why.startswith("out of memory at capture") for why in book.refused.values())
    assert book.off is None
    assert [r.body for r in call(handler, context, TEXTS)] == eager_answers
    handler.close()


def test_a_forward_that_cannot_be_captured_turns_graphs_off_with_the_reason(classifier, tmp_path, caplog,
                                                                           eager_answers):
    refuse = lambda tokens: RuntimeError("operation not permitted when stream is capturing")  # noqa: E731
    capture = FakeCapture(fail=refuse)
    with caplog.at_level(logging.WARNING):
        handler, context = graphed_handler(classifier, tmp_path, capture)
    book = handler.model.graphs.book
    assert not book.captured and "operation not permitted when stream is capturing" in book.off
    assert caplog.text.count("cuda graphs are off for this model") == 1
    assert capture.released == 1, "after the first failure no other shape should be tried"
    assert [r.body for r in call(handler, context, TEXTS)] == eager_answers
    handler.close()


def test_graphs_hold_at_most_their_share_of_the_memory_budget(classifier):
    # budget 8 MiB: graphs may hold 2 MiB; each fake graph holds 1 MiB
    config = HandlerConfig(task=Task.SEQUENCE_CLASSIFICATION, cuda_graphs=True, memory_budget=8 * 2**20)
    model = encoder.EncoderModel(config, classifier, graph_capture=FakeCapture(bytes_per_graph=2**20))
    assert model.graphs.book.limit_bytes == 2 * 2**20
    for size, bucket in ((1, 16), (2, 16), (1, 32), (2, 32)):
        model.forward(example_batch(model, size, bucket))
    assert graph_shapes(model.graphs.book) == {(1, 16), (2, 16)}
    assert "graphs already hold 2.0 MiB of the 2.0 MiB" in model.graphs.book.refused[encoder.Shape(1, 32)]


def test_cuda_graphs_on_the_cpu_are_off_with_one_log_line(classifier, caplog):
    with caplog.at_level(logging.INFO, logger=encoder.logger.name):
        model = encoder.EncoderModel(HandlerConfig(task=Task.SEQUENCE_CLASSIFICATION, cuda_graphs=True), classifier)
    assert model.graphs is None and model.describe()["cuda_graphs"] is False
    assert caplog.text.count("cuda_graphs is off on cpu: CUDA graphs need a CUDA device") == 1


def test_cuda_graphs_and_compile_together_fail_at_load(classifier):
    with pytest.raises(ConfigError, match="cuda_graphs and handler.compile are both on"):
        encoder.EncoderModel(HandlerConfig(task=Task.SEQUENCE_CLASSIFICATION, cuda_graphs=True, compile=True), classifier)


# -- make gpu-check, as CI can run it: the dry run on the CPU

GPU_CHECK = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "bench", "gpu_check.py")


def test_the_gpu_check_dry_run_runs_every_step_and_writes_nothing_into_bench_results(tmp_path):
    results = os.path.join(os.path.dirname(GPU_CHECK), "results")
    before = set(os.listdir(results))
    done = subprocess.run([sys.executable, GPU_CHECK, "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert set(os.listdir(results)) == before, "a dry run wrote into bench/results"
    (report_json,) = [p for p in os.listdir(tmp_path) if p.startswith("gpu-") and p.endswith(".json")]
    report = json.load(open(tmp_path / report_json))
    assert report["dry_run"] is True and report["gpu"].startswith("none")
    assert set(report["steps"]) == {"a_warmup_and_graphs", "b_out_of_memory", "c_nvml", "d_dtypes", "e_throughput",
                                    "f_control"}
    assert all(step["ok"] for step in report["steps"].values()), report["steps"]
    steps = report["steps"]
    assert steps["b_out_of_memory"]["learned_at_warmup"] == steps["b_out_of_memory"]["oom_caps_json"] == {"32": 1}
    assert {arm["graphs"] is None for arm in steps["a_warmup_and_graphs"]["arms"].values()} == {True}  # off on the CPU
    assert steps["e_throughput"]["scheduler_req_per_s"] > 0 and steps["f_control"]["control_req_per_s"] > 0
    markdown = open(tmp_path / report_json.replace(".json", ".md")).read()
    assert "DRY RUN on the CPU: no GPU figures" in markdown and "| bfloat16 |" in markdown


def test_a_dry_run_refuses_to_write_into_bench_results():
    results = os.path.join(os.path.dirname(GPU_CHECK), "results")
    done = subprocess.run([sys.executable, GPU_CHECK, "--dry-run", "--out", results], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "never writes into bench/results" in done.stderr
