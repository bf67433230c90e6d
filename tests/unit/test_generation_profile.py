"""Generation's warmup plan and profile format (warmup/generation_profile.py)."""
import pytest

from tsbatch.warmup.generation_profile import (GenerationProfile, decode_shapes, prefill_edge, prefill_edges,
                                               prefill_shapes)
from tsbatch.warmup.plan import Shape, default_edges


def test_prefill_edges_are_the_encoders_bucket_edges_and_end_at_the_positions():
    edges = prefill_edges(1000)
    assert edges == default_edges(1000) and edges[0] == 8 and edges[-1] == 1000
    assert all(prefill_edge(n, edges) - n < 8 for n in range(1, 65))  # under 64: at most 7 tokens of padding
    assert all(prefill_edge(n, edges) < 1.25 * n for n in range(65, 1001))  # above: under a quarter
    assert all(prefill_edge(length, edges) >= length for length in range(1, 1001))
    with pytest.raises(ValueError):
        prefill_edge(1001, edges)


def test_prefill_shapes_are_within_the_budget_or_alone():
    shapes = prefill_shapes(prefill_edges(1024), max_running=16, token_budget=512)
    assert Shape(16, 8) in shapes and Shape(1, 1024) in shapes and Shape(2, 1024) not in shapes
    assert all(s.batch * s.bucket <= 512 or s.batch == 1 for s in shapes)
    assert all(s.batch <= 16 for s in shapes)


def test_decode_shapes_cover_every_batch_size_within_the_positions():
    shapes = decode_shapes(max_running=4, max_positions=128)
    assert {s.batch for s in shapes} == {1, 2, 3, 4}
    assert {s.bucket for s in shapes} == {64, 127}


def test_profile_round_trips_and_refuses_an_encoder_profile():
    profile = GenerationProfile("lm", {"cpu_count": 2})
    profile.add("prefill", Shape(2, 16), 9.0, [1.0, 1.4, 1.2])
    profile.add("decode", Shape(3, 64), 5.0, [0.5, 0.7])
    again = GenerationProfile.from_json(profile.to_json())
    assert again.prefill_timing(rows=2, edge=16).median_ms == 1.2
    assert again.decode_timing(rows=3, context=64).p90_ms == 0.7
    assert again.decode_timing(rows=2, context=64) is None
    with pytest.raises(ValueError, match="not a generation profile"):
        GenerationProfile.from_json('{"model": "x", "environment": {}, "shapes": []}')
