"""CUDA graphs per shape, the decisions (handlers/runtime/graphs.py): which shapes are captured, what a
failed or differing capture becomes, and the graphs' memory against their share of the budget."""
from __future__ import annotations

import logging

import pytest

from tsbatch.handlers.runtime.graphs import GRAPH_MEMORY_SHARE, GraphBook, graph_limit, shape_label
from tsbatch.warmup.plan import Shape
from tests.unit.test_pure_imports import imported_heavy_modules

pytestmark = pytest.mark.unit

MIB = 2**20


def test_each_shape_is_captured_once_and_only_before_ready():
    book = GraphBook()
    small, large = Shape(1, 16), Shape(4, 64)
    assert book.should_capture(small)
    book.record(small, 3 * MIB)
    assert not book.should_capture(small), "a captured shape is captured again"
    assert book.has_graph(small) and not book.has_graph(large)
    book.mark_ready()
    assert not book.should_capture(large), "a shape is captured after READY"
    assert book.summary()["captured"] == 1 and book.held_bytes == 3 * MIB


def test_a_refused_shape_stays_eager_and_the_others_are_still_captured(caplog):
    book = GraphBook()
    with caplog.at_level(logging.WARNING, logger="tsbatch.handlers.runtime.graphs"):
        book.refuse(Shape(2, 32), "its replay answered differently from the eager pass")
    assert not book.should_capture(Shape(2, 32))
    assert book.should_capture(Shape(4, 32))
    assert "shape 2x32 runs eager: its replay answered differently" in caplog.text
    assert book.summary()["eager"] == {"2x32": "its replay answered differently from the eager pass"}


def test_a_forward_that_cannot_be_captured_turns_graphs_off_for_every_shape(caplog):
    book = GraphBook()
    book.record(Shape(1, 16), MIB)
    with caplog.at_level(logging.WARNING, logger="tsbatch.handlers.runtime.graphs"):
        book.turn_off(Shape(2, 16), "RuntimeError: operation not permitted when stream is capturing")
    assert not any(book.should_capture(Shape(b, e)) for b in (1, 2, 4) for e in (16, 64))
    assert "off for this model" in caplog.text and "capturing shape 2x16 failed" in caplog.text
    assert book.summary()["off"].startswith("capturing shape 2x16 failed: RuntimeError")


def test_graphs_hold_no_more_than_their_share_of_the_budget(caplog):
    budget = 400 * MIB
    book = GraphBook(graph_limit(budget))
    assert book.limit_bytes == int(budget * GRAPH_MEMORY_SHARE) == 100 * MIB
    shapes = [Shape(b, e) for e in (16, 64, 256) for b in (1, 2, 4)]  # warmup's order: small first
    captured = []
    with caplog.at_level(logging.WARNING, logger="tsbatch.handlers.runtime.graphs"):
        for shape in shapes:
            if book.should_capture(shape):
                book.record(shape, shape.tokens * MIB // 16)  # memory that grows with the shape
                captured.append(shape)
    # 1+2+4 (16) + 4+8+16 (64) = 35 MiB, then 256: 16 -> 51, 32 -> 83, 64 -> 147 (past 100, kept:
    # it was measured after it was made); nothing more would be captured
    assert captured == shapes
    assert book.held_bytes == 147 * MIB
    assert not book.should_capture(Shape(8, 256))
    assert "graphs already hold 147.0 MiB of the 100.0 MiB they may" in caplog.text
    assert graph_limit(None) is None and GraphBook(None).should_capture(Shape(64, 512))


def test_a_pass_after_ready_with_no_graph_is_said_once_per_shape(caplog):
    book = GraphBook()
    book.record(Shape(1, 16), MIB)
    book.refuse(Shape(2, 16), "out of memory at capture")
    with caplog.at_level(logging.INFO, logger="tsbatch.handlers.runtime.graphs"):
        book.met_eager(Shape(8, 16))  # before READY: warmup's eager passes say nothing
        book.mark_ready()
        for _ in range(3):
            book.met_eager(Shape(8, 16))
            book.met_eager(Shape(2, 16))  # refused already: said when it was refused
    assert caplog.text.count("shape 8x16 met after READY has no graph") == 1
    assert "2x16 met after READY" not in caplog.text
    assert "1 shapes captured, holding 1.0 MiB; 1 run eager" in caplog.text
    assert book.missed == {Shape(8, 16)}


def test_no_shape_before_ready_says_graphs_never_ran(caplog):
    with caplog.at_level(logging.WARNING, logger="tsbatch.handlers.runtime.graphs"):
        GraphBook().mark_ready()
    assert "no shape ran before READY" in caplog.text


def test_labels_match_the_profile_and_metrics_bucket_labels():
    assert shape_label(Shape(4, 32)) == "4x32"
    assert shape_label(Shape(2, (32, 16))) == "2x32x16"


def test_graphs_module_imports_neither_torch_nor_torchserve():
    assert imported_heavy_modules("tsbatch.handlers.runtime.graphs") == []
