"""`tsbatch profile|tune|archive --task generation` as a user runs them, on the tiny random causal
LM the engine's tests build: the profile is the handler's own warmup, tune reads it by its kind,
and the archive ships it as generation_profile.json beside a model-config.yaml tuned from it."""
from __future__ import annotations

import zipfile

import pytest
import yaml

from tsbatch.handlers.edge.generation_api import GenerationConfig
from tsbatch.warmup.generation_profile import GENERATION_PROFILE_FILE, GenerationProfile
from tests.integration.test_archiver_cli import mar_member, tsbatch
from tests.integration.test_generation_engine import make_lm

pytestmark = pytest.mark.integration

# few shapes, one timed pass each: the profile takes seconds
SMALL = {"token_budget": 48, "max_running": 3, "warmup_repeats": 1, "warmup_max_repeats": 2}


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    return make_lm(str(tmp_path_factory.mktemp("gen") / "model"))


def config_file(tmp_path_factory, section: dict) -> str:
    path = tmp_path_factory.mktemp("cfg") / "handler.yaml"
    path.write_text(yaml.safe_dump(section))
    return str(path)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    return config_file(tmp_path_factory, SMALL)


def test_archive_profiles_here_tunes_and_ships_the_generation_profile(tmp_path, tmp_path_factory, lm_dir):
    """The engine's default ranges (16 sequences, 512 tokens) profiled with one timed pass a shape."""
    quick = config_file(tmp_path_factory, {"warmup_repeats": 1, "warmup_max_repeats": 2})
    store = tmp_path / "store"
    done = tsbatch("archive", "--task", "generation", "--model-dir", lm_dir, "--name", "lm", "--handler-config", quick,
                   "--ttft-ms", "60000", "--tpot-ms", "30000", "--out", str(store))
    assert done.returncode == 0, done.stderr
    mar = str(store / "lm.mar")
    with zipfile.ZipFile(mar) as archive:
        assert GENERATION_PROFILE_FILE in archive.namelist()
    shipped = GenerationProfile.from_json(mar_member(mar, GENERATION_PROFILE_FILE))
    assert shipped.prefill and shipped.decode and shipped.environment["load_seconds"] > 0
    text = mar_member(mar, "model-config.yaml")
    config = yaml.safe_load(text)
    handler = config["handler"]
    GenerationConfig.from_section(handler)  # what the worker will read
    assert "time to first token of 60000 ms and a time per output token of 30000 ms" in text
    assert f"shipped as {GENERATION_PROFILE_FILE}" in text and "bucket tuning" in text
    # targets no step of this tiny model comes near: the most the profile measured, said so
    assert (handler["token_budget"], handler["max_running"]) == (512, 16)
    lines = text.splitlines()
    assert lines[lines.index("  max_running: 16") - 1].startswith("  # decode of 16 sequences at 511 tokens")
    assert "512 is the most the profile measured" in lines[lines.index("  token_budget: 512") - 1]
    assert config["startupTimeout"] >= 300 and "# model load" in text
    assert "tuned for time to first token <= 60000 ms and per output token <= 30000 ms" in done.stdout
    assert (store / f"lm.{GENERATION_PROFILE_FILE}").exists()


def test_profile_then_tune_chooses_the_budgets_within_what_was_measured(tmp_path, lm_dir, small):
    path = str(tmp_path / "g.json")
    done = tsbatch("profile", "--task", "generation", "--model-dir", lm_dir, "--handler-config", small, "--out", path)
    assert done.returncode == 0, done.stderr
    assert "prefill shapes and 6 decode batch sizes" in done.stdout and "warmup shape 1 of" in done.stdout
    profile = GenerationProfile.load(path)
    out = tmp_path / "tuned"
    done = tsbatch("tune", "--profile", path, "--ttft-ms", "60000", "--tpot-ms", "60000", "--out", str(out))
    assert done.returncode == 0, done.stderr
    handler = yaml.safe_load((out / "model-config.yaml").read_text())["handler"]
    # targets no step here comes near: the most the profile measured
    assert (handler["max_running"], handler["token_budget"]) == (3, 48)
    assert profile.environment["max_running"] == 3
    done = tsbatch("tune", "--profile", path, "--tpot-ms", "0.0001", "--out", str(tmp_path / "never"))
    assert done.returncode == 2 and "it needs --tpot-ms" in done.stderr
