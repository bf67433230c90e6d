"""`tsbatch profile --task generation`'s measurement: archiver/measure.profile_model initializes the
built-in generation handler in this process, as a TorchServe worker would, and returns the
GenerationProfile its warmup measured, with this machine's facts added."""
from __future__ import annotations

import pytest
import torch

from tsbatch.archiver.measure import ProfileError, profile_model
from tsbatch.warmup.generation_profile import GenerationProfile, decode_shapes, prefill_edges, prefill_shapes
from tests.integration.test_generation_engine import make_lm

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_lm(str(tmp_path_factory.mktemp("gen") / "model"))


def test_profile_model_on_a_causal_lm_returns_its_generation_profile_with_every_planned_shape(lm_dir):
    lines: list[str] = []
    section = {"task": "generation", "token_budget": 48, "max_running": 2, "warmup_repeats": 1, "warmup_max_repeats": 2}
    profile = profile_model(lm_dir, "gen", {"asyncCommunication": True, "handler": section}, lines.append)
    assert isinstance(profile, GenerationProfile) and profile.model == "gen"
    edges = prefill_edges(512)
    assert [(t.batch, t.bucket) for t in profile.prefill] == [(s.batch, s.bucket) for s in prefill_shapes(edges, 2, 48)]
    assert [(t.batch, t.bucket) for t in profile.decode] == [(s.batch, s.bucket) for s in decode_shapes(2, 512)]
    env = profile.environment
    assert env["task"] == "generation" and env["profiled_by"] == "tsbatch profile" and env["gpu_count"] >= 0
    assert env["cpu_count"] >= 1 and env["peak_rss_mb"] > 0 and env["load_seconds"] > 0
    assert (env["token_budget"], env["max_running"], env["max_positions"]) == (48, 2, 512)
    assert GenerationProfile.from_json(profile.to_json()) == profile  # what the pipeline keeps, whole
    shape_lines = [line for line in lines if line.startswith("warmup shape ")]
    assert len(shape_lines) == len(profile.prefill) + len(profile.decode)
    assert "prefill batch 1 x 8 tokens" in shape_lines[0] and "decode batch 2 x 511 tokens" in shape_lines[-1]
    assert lines[0].startswith("warmup: ") and lines[-1].startswith("warmup done in ")


def test_profile_model_refuses_a_generation_section_with_warmup_off(lm_dir):
    with pytest.raises(ProfileError, match="warmup is false"):
        profile_model(lm_dir, "gen", {"handler": {"task": "generation", "warmup": False}})
