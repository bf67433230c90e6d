"""The generation archive's settings (archiver/tune_generation.py) and the pipeline around them:
async mode with its frontend keys, a handler: section with every generation key and its reason,
the encoder's bucket tuning skipped with why, and what is refused before anything is built."""
from __future__ import annotations

import json

import pytest
import yaml

from tsbatch.archiver import cli, pipeline
from tsbatch.archiver.package import GENERATION_ENTRY, ArchiveError, check_model_dir, entry_for
from tsbatch.archiver.tune import Machine, TuneError
from tsbatch.archiver.tune_generation import SKIPPED, plan_generation
from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.edge.config import FrontendConfig, check_handler
from tsbatch.handlers.edge.generation_api import GenerationConfig

pytestmark = pytest.mark.unit


def request(section: dict | None = None, **given) -> pipeline.Request:
    values = dict(cores=2, gpus=0, mode="async")
    values.update(given)
    return pipeline.Request("/models/lm", "gen", {"task": "generation", **(section or {})}, 500.0, **values)


def test_a_generation_archive_serves_in_async_mode_with_every_key_and_its_reason():
    req = request({"max_running": 8})
    tuning = pipeline.generation_plan(req)
    config, text = pipeline.tuned_config(req, tuning, pipeline.generation_header(tuning))
    assert yaml.safe_load(text) == config
    assert {k: config[k] for k in ("asyncCommunication", "continuousBatching", "batchSize", "minWorkers",
                                   "maxWorkers", "deviceType")} == {
        "asyncCommunication": True, "continuousBatching": False, "batchSize": 1, "minWorkers": 1, "maxWorkers": 1,
        "deviceType": "cpu"}
    handler = config["handler"]
    assert handler["task"] == "generation" and handler["max_running"] == 8 and handler["torch_threads"] == 2
    assert GenerationConfig.from_section(handler).max_running == 8  # what the worker will read
    assert set(handler) == {f for f in GenerationConfig.__dataclass_fields__}  # every key, written out
    assert isinstance(FrontendConfig.from_yaml(config), FrontendConfig)
    lines = text.splitlines()
    assert lines[lines.index("  max_running: 8") - 1] == "  # set in the handler configuration"
    assert "# default: KV-cache tokens live at once" in text and "bucket tuning" in text.splitlines()[1]
    assert "batch_caps" not in handler and "buckets" not in handler
    assert pipeline._spec(req, config, "/tmp/store", text).handler == GENERATION_ENTRY
    assert dict((k, v) for k, v, _ in tuning.property_entries()) == {
        "default_workers_per_model": "1", "job_queue_size": "100", "number_of_gpu": "0"}


def test_on_gpus_one_worker_per_gpu_unless_the_device_is_cpu():
    tuning = plan_generation(Machine(8, 2), GenerationConfig())
    assert tuning.frontend_values()["minWorkers"] == 2 and tuning.frontend_values()["deviceType"] == "gpu"
    assert tuning.handler_values()["torch_threads"] == 4 and tuning.properties["number_of_gpu"].value == 2
    cpu = plan_generation(Machine(8, 2), GenerationConfig(device="cpu"))
    assert cpu.frontend_values()["minWorkers"] == 1 and cpu.frontend_values()["deviceType"] == "cpu"
    assert tuning.skipped == cpu.skipped == SKIPPED and tuning.buckets == ()


def test_the_generation_handler_section_is_checked_by_its_own_class_and_only_in_async_mode():
    assert isinstance(check_handler({"task": "generation", "kv_bound": 99}), GenerationConfig)
    with pytest.raises(ConfigError, match="did you mean max_running"):
        check_handler({"task": "generation", "max_runing": 2})
    with pytest.raises(ConfigError, match="reads no model: section"):
        check_handler({"task": "generation"}, {"max_prompt_tokens": 3})
    with pytest.raises(ConfigError, match="async mode only"):
        FrontendConfig.from_yaml({"handler": {"task": "generation"}})  # the template's continuous mode
    with pytest.raises(ConfigError, match="unknown key"):
        check_handler({"task": "embedding", "kv_bound": 4})  # an encoder has no such key


def _model_dir(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "vocab.txt").write_text("[PAD]\n")
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    return str(tmp_path)


@pytest.mark.parametrize("config, found", [({"architectures": ["BertModel"]}, "architectures ['BertModel']"),
                                           ({"model_type": "gpt2"}, "no architectures"),
                                           ({"architectures": ["BartForCausalLM"], "is_encoder_decoder": True},
                                            "an encoder-decoder")])
def test_a_directory_that_is_no_causal_lm_is_refused_saying_why(tmp_path, config, found):
    model_dir = _model_dir(tmp_path, config)
    check_model_dir(model_dir)  # an encoder's archive takes it
    with pytest.raises(ArchiveError, match="serves a causal language model") as caught:
        check_model_dir(model_dir, causal_lm=True)
    assert found in str(caught.value)


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "LlamaForCausalLM"])
def test_a_causal_lm_directory_is_taken(tmp_path, name):
    assert "model.safetensors" in check_model_dir(_model_dir(tmp_path, {"architectures": [name]}), causal_lm=True)
    assert entry_for("generation") == GENERATION_ENTRY and entry_for("embedding") != GENERATION_ENTRY


@pytest.mark.parametrize("argv, message", [
    (["archive", "--mode", "continuous"], "async mode only"),
    (["archive", "--workload", "search"], "--workload"),
    (["archive", "--profile", "p.json"], "no generation profile"),
    (["profile"], "tsbatch profile does not serve --task generation"),
    (["export", "--kserve", "--out", "x"], "tsbatch export does not serve --task generation"),
])
def test_what_does_not_apply_to_generation_is_refused_before_anything_is_built(tmp_path, capsys, argv, message):
    model_dir = _model_dir(tmp_path, {"architectures": ["GPT2LMHeadModel"]})
    out = tmp_path / "store"
    assert cli.main([*argv, "--task", "generation", "--model-dir", model_dir] + (
        ["--out", str(out)] if argv[0] == "archive" else [])) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_tune_refuses_generation(tmp_path, capsys):
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    assert cli.main(["tune", "--profile", str(profile), "--task", "generation", "--out", str(tmp_path / "t")]) == 2
    assert "tsbatch tune does not serve --task generation" in capsys.readouterr().err


def test_tune_error_is_what_a_bad_machine_gets():
    with pytest.raises(TuneError, match="at least one CPU core"):
        plan_generation(Machine(0, 0), GenerationConfig())
