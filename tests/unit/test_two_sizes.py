"""A model with two sizes (prompt tokens, max_new_tokens): buckets of one edge per size, through
the whole handler with a fake model (no torch), the configuration, the profile and tuning."""
from __future__ import annotations

import json

import pytest

from tests.unit.test_api import FakeContext, serve
from tsbatch.handlers.api import BadInput, Batch, Model, Request
from tsbatch.handlers.core.buckets import (bucket_for, bucket_grid, bucket_label, config_key, edges_per_size, holds,
                                           longest, parse_bucket, plan_batches, Item)
from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.core.policy import split_lanes
from tsbatch.handlers.edge.config import HandlerConfig
from tsbatch.handlers.edge.stages import PADDED_HEADER
from tsbatch.handlers.edge.tsbatch_handler import TsbatchHandler
from tsbatch.warmup.profile import LatencyProfile

pytestmark = pytest.mark.unit

GRID = bucket_grid([(8, 32), (8, 64)])


def test_a_grid_holds_every_pair_of_edges_cheapest_first():
    assert GRID == ((8, 8), (32, 8), (8, 64), (32, 64))  # a row of 8x64 costs 72 tokens, of 32x8 40
    assert bucket_for((5, 8), GRID) == (8, 8)
    assert bucket_for((9, 2), GRID) == (32, 8)  # each size takes its own smallest edge
    assert bucket_for((3, 9), GRID) == (8, 64)
    with pytest.raises(ValueError, match="33x1 exceeds the largest bucket 32x64"):
        bucket_for((33, 1), GRID)
    assert longest(GRID) == (32, 64) and longest((8, 16)) == 16


def test_labels_keys_and_written_edges_round_trip():
    assert bucket_label((32, 8)) == "32x8" and bucket_label(16) == "16"
    assert parse_bucket("32x8") == (32, 8) and parse_bucket([32, 8]) == (32, 8) and parse_bucket("16") == 16
    assert config_key((32, 8)) == "32x8" and config_key(16) == 16
    assert edges_per_size(GRID) == [[8, 32], [8, 64]] and edges_per_size((8, 16)) == [8, 16]
    assert holds((32, 64), (8, 64)) and not holds((32, 8), (8, 64))


def test_batches_never_mix_new_token_edges():
    items = [Item(i, "", length, bucket_for(length, GRID)) for i, length in enumerate([(4, 8), (4, 60), (5, 7), (6, 50)])]
    planned = plan_batches(items, lambda bucket: 8)
    assert [(b.bucket, [i.index for i in b.items]) for b in planned] == [((8, 8), [0, 2]), ((8, 64), [1, 3])]


def test_lanes_split_on_what_a_row_costs():
    assert split_lanes(GRID, 64) == [((8, 8), (32, 8)), ((8, 64), (32, 64))]


def test_the_configuration_takes_one_list_of_edges_per_size():
    config = HandlerConfig.from_yaml({"buckets": [[8, 32], [8, 64]], "batch_caps": {"8x8": 4, "32x64": 2}})
    assert config.edges_for((32, 64)) == GRID
    assert config.batch_limit((8, 8)) == 4 and config.batch_limit((32, 64)) == 2
    assert HandlerConfig().edges_for((16, 32)) == bucket_grid([(8, 16), (8, 16, 32)])  # default: powers of two
    with pytest.raises(ConfigError, match="one list of edges per size: this model has 2 sizes"):
        HandlerConfig.from_yaml({"buckets": [8, 32]}).edges_for((32, 64))
    with pytest.raises(ConfigError, match="this model has one size"):
        HandlerConfig.from_yaml({"buckets": [[8], [8]]}).edges_for(32)
    with pytest.raises(ConfigError, match="batch_caps key"):
        HandlerConfig.from_yaml({"batch_caps": {"8x0": 2}})


def test_a_profile_with_pairs_round_trips_through_json():
    profile = LatencyProfile(model="gen", environment={})
    profile.add(1, (8, 64), 5.0, [1.0, 1.2])
    profile.oom_caps[(32, 64)] = 2
    again = LatencyProfile.from_json(profile.to_json())
    assert again.lookup(batch=1, bucket=(8, 64)).median_ms == 1.1 and again.oom_caps == {(32, 64): 2}
    assert json.loads(profile.to_json())["oom_caps"] == {"32x64": 2}


class PromptModel(Model):
    """Length (words, new tokens): answers the words echoed `new` times; "poison" fails."""

    max_length = (32, 64)

    def __init__(self):
        self.passes: list[tuple[int, tuple[int, int]]] = []

    def prepare(self, request: Request):
        body = json.loads(request.body)
        new = body.get("new", 8)
        if not isinstance(new, int) or new < 1:
            raise BadInput("new must be a positive whole number")
        words = body["text"].split()
        return (len(words), new), (words, new)

    def forward(self, batch: Batch) -> list:
        self.passes.append((batch.size, batch.bucket))
        for item in batch.items:
            words, new = item.input
            assert len(words) <= batch.bucket[0] and new <= batch.bucket[1]
            if "poison" in words:
                raise RuntimeError("the model broke on this input")
        return [{"out": " ".join(item.input[0]), "new": item.input[1]} for item in batch.items]

    def example(self, length):
        words, new = length
        return ["w"] * words, new


class PromptHandler(TsbatchHandler):
    def load_model(self, model_path, config, gpu_id):
        return PromptModel()


def load(**section):
    context = FakeContext({"buckets": [[8, 32], [8, 64]], "max_batch_size": 2, "warmup_repeats": 1,
                           "warmup_max_repeats": 1, **section})
    handler = PromptHandler()
    handler.initialize(context)
    return handler, context


def test_warmup_runs_every_batch_size_of_every_pair_and_the_profile_names_them():
    handler, _ = load()
    expected = {(b, bucket) for bucket in GRID for b in (1, 2)}
    assert {(s.batch, s.bucket) for s in handler.profile.shapes} == expected
    assert set(handler.model.passes) >= expected
    handler.close()


def test_requests_are_bucketed_by_both_sizes_and_a_bad_one_fails_alone():
    handler, context = load(warmup=False)
    bodies = [{"text": "a b", "new": 8}, {"text": "c", "new": 64}, {"text": "d e f", "new": 5},
              {"text": "poison", "new": 8}, {"text": "g", "new": 0}, {"text": "h", "new": 65},
              {"text": " ".join(["x"] * 20), "new": 8}]
    answers = serve(handler, context, [json.dumps(b) for b in bodies])
    assert [status for status, _, _ in answers] == [200, 200, 200, 500, 400, 413, 200]
    assert [h.get(PADDED_HEADER) for _, _, h in answers] == ["8x8", "8x64", "8x8", "8x8", None, None, "32x8"]
    assert answers[0][1] == {"out": "a b", "new": 8} and answers[2][1] == {"out": "d e f", "new": 5}
    assert "at most 32x64" in answers[5][1]["error"]
    # cheapest bucket first; the ask for 64 new tokens ran in a pass of its own, after the asks for 8
    assert handler.model.passes == [(2, (8, 8)), (1, (8, 8)), (1, (32, 8)), (1, (8, 64))]


def test_tuning_a_two_size_profile_writes_edges_per_size_and_caps_by_label():
    from tsbatch.archiver.properties import render_yaml
    from tsbatch.archiver.tune import Machine, tune
    from tsbatch.warmup.profile import ShapeTiming

    shapes = [ShapeTiming(n, bucket, ms := 2.0 + 0.01 * n * (bucket[0] + 4 * bucket[1]), ms * 1.1, 3, ms)
              for bucket in GRID for n in (1, 2, 4)]
    profile = LatencyProfile("gen", {"device": "cpu", "torch_threads": 2, "load_seconds": 1.0}, shapes, 5.0)
    config = HandlerConfig.from_yaml({"buckets": [[8, 32], [8, 64]], "long_lane_from": 64})
    tuning = tune(profile, 500, Machine(cores=2), config, fixed=["buckets", "long_lane_from"])
    handler = tuning.handler_values()
    assert handler["buckets"] == [[8, 32], [8, 64]]
    assert set(handler["batch_caps"]) == {"8x8", "32x8", "8x64", "32x64"}
    text = render_yaml({"handler": handler}, tuning.comments())
    assert "8x64: " in text and "bucket 8x64 tokens" in text  # each cap with its reason
    again = HandlerConfig.from_yaml(__import__("yaml").safe_load(text)["handler"])
    assert again.edges_for((32, 64)) == GRID and again.batch_limit((8, 64)) == handler["batch_caps"]["8x64"]
