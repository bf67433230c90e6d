"""The generation archive's settings (archiver/tune_generation.py) and the pipeline around them:
async mode with its frontend keys, a handler: section with every generation key and its reason,
token_budget and max_running tuned from a (synthetic) generation profile for a TTFT and a TPOT
target, and what is refused before anything is built."""
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
from tsbatch.warmup.generation_profile import GenerationProfile, decode_shapes, prefill_edges, prefill_shapes
from tsbatch.warmup.profile import ShapeTiming

pytestmark = pytest.mark.unit


def request(section: dict | None = None, **given) -> pipeline.Request:
    values = dict(cores=2, gpus=0, mode="async")
    values.update(given)
    return pipeline.Request("/models/lm", "gen", {"task": "generation", **(section or {})}, 500.0, **values)


def synthetic(max_running=16, token_budget=512, positions=512, decode=lambda rows, context: 2 + 3 * rows + context / 256,
              prefill=lambda rows, edge: 1 + 0.05 * rows * edge, load=4.0, warmup=30.0, **environment):
    """A generation profile as warmup writes one, every planned shape timed by the given cost (p90, ms)."""
    profile = GenerationProfile("lm", {"task": "generation", "device": "cpu", "token_budget": token_budget,
                                       "max_running": max_running, "max_positions": positions, "load_seconds": load,
                                       "cpu_count": 2, "gpu_count": 0, "torch_threads": 2, **environment},
                                warmup_seconds=warmup)
    for kind, shapes, cost in (("prefill", prefill_shapes(prefill_edges(positions), max_running, token_budget), prefill),
                               ("decode", decode_shapes(max_running, positions), decode)):
        for shape in shapes:
            ms = cost(shape.batch, shape.bucket)
            getattr(profile, kind).append(ShapeTiming(shape.batch, shape.bucket, ms * 0.9, ms, 3, ms * 2, ms * 5))
    return profile


def test_a_generation_archive_serves_in_async_mode_with_every_key_and_its_reason():
    req = request({"max_running": 8})
    tuning, _ = pipeline.generation_plan(req)
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
    (["archive", "--target-ms", "300"], "--target-ms is the encoder's p99 target"),
    (["profile", "--mode", "continuous"], "async mode only"),
    (["export", "--kserve", "--out", "x"], "tsbatch export does not serve --task generation"),
])
def test_what_does_not_apply_to_generation_is_refused_before_anything_is_built(tmp_path, capsys, argv, message):
    model_dir = _model_dir(tmp_path, {"architectures": ["GPT2LMHeadModel"]})
    out = tmp_path / "store"
    assert cli.main([*argv, "--task", "generation", "--model-dir", model_dir] + (
        ["--out", str(out)] if argv[0] == "archive" else [])) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_tune_refuses_an_encoder_profile_for_generation_and_a_generation_profile_for_an_encoder(tmp_path, capsys):
    encoder = tmp_path / "p.json"
    encoder.write_text('{"model": "x", "environment": {}, "shapes": []}')
    assert cli.main(["tune", "--profile", str(encoder), "--task", "generation", "--out", str(tmp_path / "t")]) == 2
    assert "is not a generation profile" in capsys.readouterr().err
    generation = tmp_path / "g.json"
    synthetic().save(str(generation))
    assert cli.main(["tune", "--profile", str(generation), "--task", "embedding", "--out", str(tmp_path / "t")]) == 2
    assert "is a generation profile" in capsys.readouterr().err
    assert cli.main(["tune", "--profile", str(generation), "--ttft-ms", "0", "--out", str(tmp_path / "t")]) == 2
    assert "--ttft-ms must be a positive number" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_tune_error_is_what_a_bad_machine_gets():
    with pytest.raises(TuneError, match="at least one CPU core"):
        plan_generation(Machine(0, 0), GenerationConfig())


def tuned(profile=None, section=None, ttft_ms=300.0, tpot_ms=40.0, machine=Machine(2, 0)):
    config = GenerationConfig.from_section({"task": "generation", **(section or {})})
    return plan_generation(machine, config, fixed=set(section or ()), ttft_ms=ttft_ms, tpot_ms=tpot_ms,
                           profile=profile or synthetic())


def test_max_running_is_the_largest_decode_batch_within_the_tpot_target_and_says_its_figures():
    # decode p90 at 511 tokens: 2 + 3 x rows + 511/256 ms, so 12 rows take 40.0 ms and 13 take 43.0
    choice = tuned(tpot_ms=40.0).handler["max_running"]
    assert choice.value == 12
    assert ("decode of 12 sequences at 511 tokens of context each: p90 40.0 ms <= 40 ms TPOT target" in choice.reason
            and "13 takes 43.0 ms" in choice.reason)
    assert tuned(tpot_ms=43.0).handler["max_running"].value == 13
    everything = tuned(tpot_ms=1000.0).handler["max_running"]
    assert everything.value == 16 and "16 is the most the profile measured" in everything.reason


def test_max_running_comes_down_when_the_shortest_prompt_beside_the_decodes_would_miss_the_ttft_target():
    # a step's first prefill joins whatever the budget: 11 decodes (38.0 ms) + 1x8 (1.4 ms) > 30 ms
    choice = tuned(ttft_ms=30.0, tpot_ms=40.0).handler["max_running"]
    assert choice.value == 9  # 8 decodes (28.0 ms) + 1x8 (1.4 ms) = 29.4 ms: the most within it
    assert choice.reason.startswith("9, not the 12 the TPOT target allows")
    assert "prefill 1x8 (p90 1.4 ms) = 29.4 ms within it" in choice.reason


def _brute_worst(profile, running, budget):
    """The costliest step a budget admits, by enumerating every step (independent of the tuner's knapsack)."""
    import itertools

    long = max(t.bucket for t in profile.decode)
    decode = {t.batch: t.p90_ms for t in profile.decode if t.bucket == long}
    groups = {}
    for t in profile.prefill:
        if t.batch <= running:
            groups.setdefault(t.bucket, [None]).append(t)
    worst = 0.0
    for d in range(running):
        for pick in itertools.product(*groups.values()):
            chosen = [t for t in pick if t is not None]
            rows, tokens = sum(t.batch for t in chosen), sum(t.batch * t.bucket for t in chosen)
            if chosen and rows <= running - d and d + tokens <= budget:
                worst = max(worst, (decode[d] if d else 0.0) + sum(t.p90_ms for t in chosen))
    return worst


@pytest.mark.parametrize("ttft_ms", [30.0, 40.0, 60.0])
def test_token_budget_is_the_largest_whose_costliest_prefilling_step_meets_the_ttft_target(ttft_ms):
    profile = synthetic(max_running=4, token_budget=64, positions=64, prefill=lambda rows, edge: 2 + 0.4 * rows * edge)
    tuning = tuned(profile, ttft_ms=ttft_ms, tpot_ms=100.0)
    running, budget = tuning.handler["max_running"].value, tuning.handler["token_budget"].value
    assert running == 4
    assert _brute_worst(profile, running, budget) <= ttft_ms
    assert budget == 64 or _brute_worst(profile, running, budget + 1) > ttft_ms
    reason = tuning.handler["token_budget"].reason
    assert f"the costliest step that prefills a joining request within {budget} tokens" in reason
    assert f"<= {ttft_ms:g} ms TTFT target" in reason
    assert (f"{budget + 1} would admit" in reason) if budget < 64 else ("64 is the most the profile measured" in reason)


def test_token_budget_never_passes_what_the_profile_measured_nor_what_out_of_memory_lowered():
    assert tuned(ttft_ms=10000.0).handler["token_budget"].value == 512
    lowered = synthetic(serving={"token_budget": 200, "max_running": 10, "kv_bound": 9000})
    tuning = tuned(lowered, ttft_ms=10000.0, tpot_ms=1000.0)
    assert tuning.handler["token_budget"].value == 200 and tuning.handler["max_running"].value == 10


def test_keys_the_handler_configuration_set_keep_their_values():
    tuning = tuned(section={"max_running": 4, "token_budget": 100}, ttft_ms=30.0)
    assert tuning.handler["max_running"].value == 4 and tuning.handler["token_budget"].value == 100
    assert tuning.handler["max_running"].reason.startswith("set in the handler configuration (decode of 4")
    assert tuning.handler["token_budget"].reason.startswith("set in the handler configuration")
    wide = synthetic(max_running=24, token_budget=256, positions=256)
    only_budget = tuned(wide, section={"token_budget": 20}, tpot_ms=1000.0)  # max_running may not pass it
    assert only_budget.handler["max_running"].value == 20
    assert only_budget.handler["max_running"].reason.startswith("handler.token_budget (20)")
    with pytest.raises(TuneError, match="max_running is 32 but the generation profile measured decode batches up to 16"):
        tuned(section={"max_running": 32, "token_budget": 512})


@pytest.mark.parametrize("targets, message", [
    (dict(tpot_ms=5.0), "decoding one sequence at 511 tokens of context takes p90 7.0 ms; it needs --tpot-ms 7"),
    (dict(ttft_ms=8.0, tpot_ms=100.0), "(1x8, p90 1.4 ms) beside one decode (p90 7.0 ms) takes 8.4 ms; it needs "
                                       "--ttft-ms 9"),
])
def test_a_target_the_profile_cannot_meet_is_refused_with_what_it_needs(targets, message):
    with pytest.raises(TuneError) as caught:
        tuned(**targets)
    assert message in str(caught.value)


def test_startup_timeout_is_twice_load_and_warmup_at_least_the_templates():
    short = tuned().frontend["startupTimeout"]
    assert short.value == 300 and "model load 4.0 s + warmup" in short.reason and "30.0 s = 34.0 s" in short.reason
    long = tuned(synthetic(load=100.0, warmup=200.5)).frontend["startupTimeout"]
    assert long.value == 601 and "= 300.5 s, x2" in long.reason


def test_a_profile_taken_on_cuda_serves_on_gpus_and_cannot_tune_a_machine_without_one():
    cuda = synthetic(device="cuda:0", gpu_count=1)
    assert tuned(cuda, machine=Machine(4, 1)).frontend_values()["deviceType"] == "gpu"
    assert tuned(machine=Machine(4, 1)).frontend_values()["deviceType"] == "cpu"  # measured on the CPU
    with pytest.raises(TuneError, match="ran on CUDA but the target machine has no GPU"):
        tuned(cuda, machine=Machine(4, 0))


def test_tsbatch_tune_writes_the_tuned_budgets_from_a_generation_profile_recognised_by_its_kind(tmp_path, capsys):
    path = tmp_path / "g.json"
    synthetic().save(str(path))
    out = tmp_path / "tuned"
    assert cli.main(["tune", "--profile", str(path), "--ttft-ms", "30", "--tpot-ms", "40", "--out", str(out)]) == 0
    text = (out / "model-config.yaml").read_text()
    config = yaml.safe_load(text)
    assert config["handler"]["task"] == "generation" and config["asyncCommunication"] is True
    assert (config["handler"]["max_running"], config["handler"]["token_budget"]) == (9, 31)
    assert GenerationConfig.from_section(config["handler"]).settings()  # what the worker will read
    assert f"time to first token of 30 ms and a time per output token of 40 ms from the generation profile of 'lm'" \
        in text and f"read from {path}" in text
    lines = text.splitlines()
    assert lines[lines.index("  max_running: 9") - 1].startswith("  # 9, not the 12 the TPOT target allows")
    assert "default_workers_per_model=1" in (out / "config.properties").read_text()
    printed = capsys.readouterr().out
    assert "tuned for time to first token <= 30 ms and per output token <= 40 ms on 2 cores" in printed
    assert "  token_budget 31: the costliest step that prefills a joining request within 31 tokens" in printed
