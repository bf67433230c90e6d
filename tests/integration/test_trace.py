"""The built-in encoder runs a TorchScript trace of the model: the same answers, bit for bit, as
eager, for every task; a model the trace does not reproduce runs eager."""
from __future__ import annotations

import logging

import pytest
import torch

from tsbatch.handlers.edge.config import HandlerConfig, Task
from tsbatch.handlers.models import encoder
from tests.support import call, load_handler

TEXTS = [
    "A man is eating food.",
    "Angela Merkel visited Paris and Berlin last week",
    "hi",
    "Ünïcödé, emoji 🚀 and 中文 mixed scripts",
    " ".join(["longer input"] * 60),
]


def _model_dir(task: str, minilm_dir: str, tiny_models: dict[str, str]) -> str:
    return minilm_dir if task == "embedding" else tiny_models[task]


@pytest.mark.parametrize("task", ["embedding", "sequence_classification", "token_classification"])
def test_traced_answers_are_eagers_bit_for_bit(task, minilm_dir, tiny_models):
    model_dir = _model_dir(task, minilm_dir, tiny_models)
    answers = {}
    for trace in (True, False):
        handler, context = load_handler(model_dir, task=task, trace=trace)
        assert (handler.model.traced is not None) is trace
        assert handler.model.describe()["trace"] is trace
        replies = call(handler, context, TEXTS)  # one padded pass of mixed lengths, then each alone
        alone = [call(handler, context, [text])[0] for text in TEXTS]
        assert all(r.status == 200 for r in replies + alone), [r.body for r in replies + alone]
        answers[trace] = ([r.body for r in replies], [r.body for r in alone])
        handler.close()
    assert answers[True] == answers[False]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_trace_holds_within_a_dtype(minilm_dir, dtype):
    """Traced answers are eager's bit for bit in half precision too: the trace is checked in the
    model's own dtype."""
    answers = {}
    for trace in (True, False):
        handler, context = load_handler(minilm_dir, dtype=dtype, trace=trace, buckets=[16, 64, 256])
        assert (handler.model.traced is not None) is trace
        assert handler.model.model.dtype == encoder.DTYPES[encoder.Dtype(dtype)]
        replies = call(handler, context, TEXTS)
        assert all(r.status == 200 for r in replies), [r.body for r in replies]
        answers[trace] = [r.body for r in replies]
        handler.close()
    assert answers[True] == answers[False]


def test_compile_takes_the_place_of_the_trace(minilm_dir):
    model = encoder.EncoderModel(HandlerConfig(task=Task.EMBEDDING, compile=True), minilm_dir)
    assert model.traced is None and model.describe()["trace"] is False


def test_a_trace_that_answers_otherwise_is_dropped(minilm_dir, monkeypatch, caplog):
    monkeypatch.setattr(encoder._Traced, "__call__", lambda self, inputs: torch.zeros(1))
    with caplog.at_level(logging.INFO, logger=encoder.logger.name):
        model = encoder.EncoderModel(HandlerConfig(task=Task.EMBEDDING), minilm_dir)
    assert model.traced is None
    assert "answered differently" in caplog.text


def test_a_model_the_tracer_cannot_follow_runs_eager(minilm_dir, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise RuntimeError("data-dependent control flow")

    monkeypatch.setattr(torch.jit, "trace", refuse)
    with caplog.at_level(logging.INFO, logger=encoder.logger.name):
        model = encoder.EncoderModel(HandlerConfig(task=Task.EMBEDDING), minilm_dir)
    assert model.traced is None
    assert "tracing failed: data-dependent control flow" in caplog.text
    from tsbatch.handlers.core.buckets import Batch, Item

    example = model.example(8)
    (result,) = model.forward(Batch(8, (Item(0, "", 8, 8, example),)))
    assert len(result["embedding"]) == 384


def test_a_model_that_branches_on_length_runs_eager(minilm_dir, monkeypatch, caplog):
    """A trace keeps the branch its short example took; the check at the longest input finds it."""
    from transformers.models.bert import modeling_bert

    plain = modeling_bert.BertModel.forward

    def branching(self, *args, **kwargs):
        out = plain(self, *args, **kwargs)
        if kwargs["input_ids"].shape[1] > 64:
            out.last_hidden_state = out.last_hidden_state + 1
        return out

    monkeypatch.setattr(modeling_bert.BertModel, "forward", branching)
    with caplog.at_level(logging.INFO, logger=encoder.logger.name):
        model = encoder.EncoderModel(HandlerConfig(task=Task.EMBEDDING), minilm_dir)
    assert model.traced is None
    assert "answered differently" in caplog.text
