"""`python -m tsbatch.archiver` as a user runs it: profile, tune, archive, export --kserve, and clear refusals."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import yaml

from tsbatch.archiver.properties import read_properties
from tsbatch.warmup.profile import PROFILE_FILE, LatencyProfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = {"buckets": [16, 64, 256], "max_batch_size": 4}  # 9 shapes: a profile in seconds
QUIET_PROFILE = os.path.join(REPO, "bench", "results", "simulator-profile-lanes.json")
CONV = os.path.join(REPO, "examples", "conv1d")  # a team's own handler and model (tests/e2e/test_own_model.py)
CONV_HANDLER = ("--handler", os.path.join(CONV, "conv_handler.py"), "--extra-files", os.path.join(CONV, "conv_model.py"))


def tsbatch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tsbatch.archiver", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": REPO})


def refused(done: subprocess.CompletedProcess, *words: str) -> str:
    assert done.returncode != 0, done.stdout
    for word in words:
        assert word in done.stderr, (word, done.stderr)
    return done.stderr


def mar_member(mar: str, name: str) -> str:
    with zipfile.ZipFile(mar) as archive:
        return archive.read(name).decode()


@pytest.fixture(scope="module")
def small_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cfg") / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return str(path)


@pytest.fixture(scope="module")
def profile(tmp_path_factory, minilm_dir, small_config) -> str:
    """One real profile of the default model with a small shape set, taken by the CLI."""
    out = str(tmp_path_factory.mktemp("profile") / "p.json")
    done = tsbatch("profile", "--model-dir", minilm_dir, "--handler-config", small_config, "--out", out)
    assert done.returncode == 0, done.stderr
    assert "warmup shape 9 of 9" in done.stdout  # progress on stdout
    return out


@pytest.fixture(scope="module")
def steady_profile(tmp_path_factory, profile) -> str:
    """The real profile with each shape's pass times from a quiet run of the same model on this kind of
    machine (bench/results/simulator-profile-lanes.json): what tuning decides then does not depend on how
    loaded the machine was while the fixture profiled."""
    quiet = {(s["bucket"], s["batch"]): s for s in json.load(open(QUIET_PROFILE))["shapes"]}
    measured = json.load(open(profile))
    for shape in measured["shapes"]:
        shape["median_ms"], shape["p90_ms"] = (quiet[shape["bucket"], shape["batch"]][key] for key in ("median_ms", "p90_ms"))
    out = tmp_path_factory.mktemp("steady") / "p.json"
    out.write_text(json.dumps(measured))
    return str(out)


def model_copy(tmp_path, minilm_dir, skip=()) -> str:
    """The default model's files in a folder of our own, to break on purpose."""
    path = tmp_path / "model"
    path.mkdir()
    for name in os.listdir(minilm_dir):
        if name not in skip and os.path.isfile(os.path.join(minilm_dir, name)):
            shutil.copy(os.path.join(minilm_dir, name), path / name)
    return str(path)


# -- refusals: non-zero exit and a message that says what is wrong -----------------------------------

def test_a_missing_model_directory_is_refused_before_profiling(tmp_path):
    refused(tsbatch("archive", "--model-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "s")), "does not exist")
    assert not (tmp_path / "s").exists()


def test_a_model_without_tokenizer_is_refused(tmp_path, minilm_dir):
    model = model_copy(tmp_path, minilm_dir, skip={"tokenizer.json", "vocab.txt"})
    refused(tsbatch("profile", "--model-dir", model, "--out", str(tmp_path / "p.json")), "has no tokenizer")


def test_a_model_without_weights_is_refused(tmp_path, minilm_dir):
    model = model_copy(tmp_path, minilm_dir, skip={"model.safetensors"})
    refused(tsbatch("archive", "--no-tune", "--model-dir", model, "--out", str(tmp_path / "s")), "no .safetensors")


def test_an_unknown_task_is_refused(tmp_path):
    refused(tsbatch("archive", "--task", "translation", "--out", str(tmp_path / "s")), "invalid choice", "translation")


@pytest.mark.parametrize("breakage, message", [
    ("config", "is not valid JSON"),
    ("weights", "not a safetensors file"),
    ("truncated", "is truncated"),
])
def test_garbage_model_files_are_refused_without_loading(tmp_path, minilm_dir, profile, breakage, message):
    model = model_copy(tmp_path, minilm_dir)
    if breakage == "config":
        with open(os.path.join(model, "config.json"), "w") as f:
            f.write("{this is not json")
    elif breakage == "weights":
        with open(os.path.join(model, "model.safetensors"), "wb") as f:
            f.write(b"\x00garbage" * 100)
    else:
        path = os.path.join(model, "model.safetensors")
        os.truncate(path, os.path.getsize(path) // 2)
    refused(tsbatch("archive", "--model-dir", model, "--profile", profile, "--out", str(tmp_path / "s")), message)
    assert not os.path.exists(tmp_path / "s" / "minilm.mar")


def test_a_model_that_fails_to_load_is_refused_by_profile(tmp_path, minilm_dir):
    model = model_copy(tmp_path, minilm_dir)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"model_type": "no-such-architecture"}, f)
    refused(tsbatch("profile", "--model-dir", model, "--out", str(tmp_path / "p.json")), "failed to load in the handler")
    assert not (tmp_path / "p.json").exists()


def test_a_target_below_what_the_model_can_do_is_refused(tmp_path, profile):
    stderr = refused(tsbatch("tune", "--profile", profile, "--target-ms", "5", "--out", str(tmp_path / "t")),
                     "below what this model can do", "bucket 256", "batch 1", "--target-ms")
    assert "Traceback" not in stderr
    assert not (tmp_path / "t" / "model-config.yaml").exists()


def test_a_file_that_is_not_a_profile_is_refused(tmp_path, minilm_dir):
    bad = tmp_path / "p.json"
    bad.write_text('{"not": "a profile"}')
    refused(tsbatch("archive", "--profile", str(bad), "--out", str(tmp_path / "s")), "is not a latency profile")


def test_a_bad_handler_config_is_refused(tmp_path):
    config = tmp_path / "h.yaml"
    config.write_text("max_batch_size: 0\n")
    refused(tsbatch("profile", "--handler-config", str(config)), "handler.max_batch_size")


def test_profile_and_no_tune_exclude_each_other(tmp_path, profile):
    refused(tsbatch("archive", "--no-tune", "--profile", profile), "not allowed with")


# -- what gets built --------------------------------------------------------------------------------

def test_the_profile_lists_every_shape_and_this_machine(profile):
    loaded = LatencyProfile.load(profile)
    assert {(s.batch, s.bucket) for s in loaded.shapes} == {(b, e) for e in (16, 64, 256) for b in (1, 2, 4)}
    env = loaded.environment
    assert env["cpu_count"] == len(os.sched_getaffinity(0)) and env["gpu_count"] >= 0
    assert env["load_seconds"] > 0 and env["peak_rss_mb"] > 0 and loaded.warmup_seconds > 0
    assert env["task"] == "embedding" and env["worker_torch_threads"] >= 1


def test_archive_with_a_profile_builds_a_tuned_mar(tmp_path, minilm_dir, steady_profile, small_config):
    store = tmp_path / "store"
    # the mix, where buckets pay even with these few shapes and caps of 4: on search the simulator puts
    # them within a req/s or two of first-come batching, and tuning refuses when it predicts a loss
    profile = steady_profile
    done = tsbatch("archive", "--model-dir", minilm_dir, "--profile", profile, "--handler-config", small_config,
                   "--target-ms", "400", "--workload", "two-cluster", "--out", str(store))
    assert done.returncode == 0, done.stderr
    assert "simulated on workload 'two-cluster'" in done.stdout
    mar = str(store / "minilm.mar")
    text = mar_member(mar, "model-config.yaml")
    config = yaml.safe_load(text)
    assert config["continuousBatching"] is True and config["asyncCommunication"] is False
    handler = config["handler"]
    assert config["batchSize"] == 2 * handler.get("queue_cap", 64) + 32  # queue_cap for each of its two lanes, plus 32
    assert handler["buckets"] == [16, 64, 256]
    if "batch_caps" in handler:  # the simulator chose a candidate with the analytic caps
        assert set(handler["batch_caps"]) == {16, 64, 256}
        assert all(cap in (1, 2, 4) for cap in handler["batch_caps"].values())
    assert "Candidates simulated on workload 'two-cluster'" in text and "first-come batching" in text
    assert config["minWorkers"] * handler["torch_threads"] <= len(os.sched_getaffinity(0))
    assert config["startupTimeout"] >= 120
    for key in ("batchSize", "minWorkers", "startupTimeout", "jobQueueSize"):  # each with its reason above it
        lines = text.splitlines()
        assert lines[lines.index(next(l for l in lines if l.startswith(f"{key}:"))) - 1].startswith("# ")
    shipped = json.loads(mar_member(mar, PROFILE_FILE))
    assert shipped["shapes"] == json.loads(open(profile).read())["shapes"]
    with open(store / "config.properties") as f:
        values = read_properties(f.read())
    assert values["inference_address"] == "http://127.0.0.1:8080" and values["load_models"] == "minilm.mar"
    assert values["default_workers_per_model"] == str(config["minWorkers"])
    assert values["metrics_config"] == str(store / "metrics.yaml") and os.path.isfile(values["metrics_config"])
    assert values["job_queue_size"] == str(config["jobQueueSize"])


def test_archive_no_tune_keeps_the_template(tmp_path, minilm_dir, small_config):
    store = tmp_path / "store"
    done = tsbatch("archive", "--no-tune", "--model-dir", minilm_dir, "--handler-config", small_config,
                   "--name", "plain", "--out", str(store))
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(mar_member(str(store / "plain.mar"), "model-config.yaml"))
    with open(os.path.join(REPO, "configs", "model-config.yaml")) as f:
        template = yaml.safe_load(f)
    assert {k: v for k, v in config.items() if k != "handler"} == {k: v for k, v in template.items() if k != "handler"}
    assert "batch_caps" not in config["handler"] and config["handler"]["max_batch_size"] == 4
    with zipfile.ZipFile(store / "plain.mar") as archive:
        assert PROFILE_FILE not in archive.namelist()
    with open(store / "config.properties") as f:
        values = read_properties(f.read())
    assert "default_workers_per_model" not in values and values["load_models"] == "plain.mar"


def test_export_kserve_writes_the_layout_and_manifest(tmp_path, minilm_dir, profile, small_config):
    out = tmp_path / "kserve"
    done = tsbatch("export", "--kserve", "--out", str(out), "--model-dir", minilm_dir, "--profile", profile,
                   "--handler-config", small_config, "--storage-uri", "s3://models/minilm")
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(out / "model-store")) == ["minilm.mar"]
    with open(out / "config" / "config.properties") as f:
        values = read_properties(f.read())
    entry = json.loads(values["model_snapshot"])["models"]["minilm"]["1.0"]
    config = yaml.safe_load(mar_member(str(out / "model-store" / "minilm.mar"), "model-config.yaml"))
    # batched like the shipped archive: tsbatch reads KServe's shapes itself, TorchServe's envelope stays off
    assert config["continuousBatching"] is True and config["batchSize"] > 1
    assert entry["minWorkers"] == config["minWorkers"] and entry["batchSize"] == config["batchSize"]
    assert values["model_store"] == "/mnt/models/model-store" and values["enable_envvars_config"] == "false"
    assert values["metrics_config"] == "/mnt/models/config/metrics.yaml"
    assert (out / "config" / "metrics.yaml").is_file()
    with open(out / "inferenceservice.yaml") as f:
        manifest = yaml.safe_load(f)
    assert (manifest["apiVersion"], manifest["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    model = manifest["spec"]["predictor"]["model"]
    assert model["storageUri"] == "s3://models/minilm" and model["modelFormat"]["name"] == "pytorch"
    assert model["resources"]["limits"]["cpu"] == str(config["minWorkers"] * config["handler"]["torch_threads"])


def test_export_needs_kserve(tmp_path):
    refused(tsbatch("export", "--out", str(tmp_path / "k")), "--kserve")
    assert not (tmp_path / "k").exists()


@pytest.mark.parametrize("command", ["archive", "profile", "tune", "export", "config-docs"])
def test_every_subcommand_explains_itself(command):
    done = tsbatch(command, "--help")
    assert done.returncode == 0 and "usage: tsbatch " + command in done.stdout
    if command in ("archive", "tune", "export"):
        assert "--target-ms" in done.stdout


def test_export_help_says_how_the_pod_batches():
    """What export_kserve builds: continuous mode, KServe's shapes read by tsbatch, several instances a request."""
    text = " ".join(tsbatch("export", "--help").stdout.split())
    assert "continuous mode" in text and "batchSize = handler.queue_cap per lane + 32" in text
    assert "several per request" in text and "--handler" in text
    assert "batchSize 1" not in text and "one instance per request" not in text


# -- export --kserve with a team's own handler ---------------------------------------------------

@pytest.fixture(scope="module")
def conv_dir(tmp_path_factory) -> str:
    from tests.support import example_maker

    return example_maker(CONV)(str(tmp_path_factory.mktemp("conv") / "model"), max_length=32)


@pytest.fixture(scope="module")
def conv_sections(tmp_path_factory) -> str:
    """A --handler-config in model-config.yaml's shape: tsbatch's handler: keys and the model's own model: section."""
    path = tmp_path_factory.mktemp("conv-cfg") / "conv.yaml"
    path.write_text(yaml.safe_dump({"handler": {"buckets": [8, 32], "max_batch_size": 2},
                                    "model": {"team_key": 7, "anything": ["the model's"]}}))
    return str(path)


def exported(out) -> tuple[set[str], dict, dict, dict]:
    """The export's .mar: its names, its manifest, its model-config.yaml; and the snapshot entry."""
    with zipfile.ZipFile(out / "model-store" / "conv.mar") as archive:
        names = set(archive.namelist())
        manifest = json.loads(archive.read("MAR-INF/MANIFEST.json"))
        config = yaml.safe_load(archive.read("model-config.yaml"))
    with open(out / "config" / "config.properties") as f:
        entry = json.loads(read_properties(f.read())["model_snapshot"])["models"]["conv"]["1.0"]
    return names, manifest, config, entry


def test_export_kserve_with_a_handler_ships_that_handler_and_loads_it_from_the_exported_config(
        tmp_path, conv_dir, conv_sections):
    out = tmp_path / "kserve"
    done = tsbatch("export", "--kserve", "--out", str(out), "--model-dir", conv_dir, "--name", "conv", *CONV_HANDLER,
                   "--handler-config", conv_sections, "--target-ms", "2000")
    assert done.returncode == 0, done.stderr
    names, manifest, config, entry = exported(out)
    assert manifest["model"]["handler"] == "conv_handler.py"  # what TorchServe imports
    assert {"conv_handler.py", "conv_model.py", PROFILE_FILE, "model/model.safetensors", "model/config.json",
            "tsbatch/handlers/edge/tsbatch_handler.py"} <= names
    assert "encoder_handler.py" not in names  # the built-in encoder's entry is not what it ships
    shipped = json.loads(mar_member(str(out / "model-store" / "conv.mar"), PROFILE_FILE))
    assert shipped["environment"]["model"] == "ConvNet"  # it profiled what it ships
    assert "task" not in config["handler"] and config["handler"]["buckets"] == [8, 32]
    assert config["model"] == {"team_key": 7, "anything": ["the model's"]}
    assert entry["marName"] == "conv.mar" and entry["batchSize"] == config["batchSize"]
    # the handler class TorchServe would instantiate, from the extracted archive and its model-config.yaml
    from ts.context import Context
    from ts.metrics.metrics_store import MetricsStore

    from tsbatch.archiver.measure import handler_class
    from tests.support import ContinuousFrontend, make_context

    root = tmp_path / "extracted"
    with zipfile.ZipFile(out / "model-store" / "conv.mar") as archive:
        archive.extractall(root)
    sys.path.insert(0, str(root))  # TorchServe puts the extracted archive first on sys.path
    try:
        handler = handler_class(str(root / manifest["model"]["handler"]))()
        handler.initialize(Context("conv", str(root), manifest, entry["batchSize"], None, "0.12.0",
                                   metrics=MetricsStore("conv-test", "conv"), model_yaml_config=config))
    finally:
        sys.path.remove(str(root))
    try:
        assert type(handler).__name__ == "ConvHandler" and type(handler.model).__name__ == "ConvModel"
        assert handler.config.model == config["model"]
        assert handler.profile is not None and handler.profile.shapes  # warmed as the archive says
        frontend = ContinuousFrontend(handler, make_context(str(root), {}))
        frontend.submit("one", json.dumps({"values": [0.1, 0.2, 0.3]}).encode(), "application/json")
        frontend.submit("two", json.dumps({"instances": [{"values": [1.0] * 5}, {"values": [0.5] * 20}]}).encode(),
                        "application/json")
        frontend.submit("bad", b'{"values": "none"}', "application/json")
        replies = frontend.drain()
    finally:
        handler.close()
    assert replies["one"].status == 200 and set(replies["one"].body["scores"]) == {"calm", "noisy", "spiky"}
    assert replies["two"].status == 200 and len(replies["two"].body["predictions"]) == 2
    assert replies["bad"].status == 400


def test_export_kserve_no_tune_with_a_handler_ships_that_handler_too(tmp_path, conv_dir, conv_sections):
    out = tmp_path / "kserve"
    done = tsbatch("export", "--kserve", "--no-tune", "--out", str(out), "--model-dir", conv_dir, "--name", "conv",
                   *CONV_HANDLER, "--handler-config", conv_sections)
    assert done.returncode == 0, done.stderr
    names, manifest, config, _entry = exported(out)
    assert manifest["model"]["handler"] == "conv_handler.py"
    assert {"conv_handler.py", "conv_model.py", "model/model.safetensors"} <= names and PROFILE_FILE not in names
    assert config["model"]["team_key"] == 7 and config["continuousBatching"] is True


@pytest.mark.parametrize("content, words", [
    ({"handler": {"max_batch_size": 2}, "max_wait_ms": 3}, "keys outside them ['max_wait_ms']"),
    ({"model": [1]}, "model: must be a mapping"),
    ({"handler": {"model": {"team_key": 7}}}, "unknown key(s) ['model']"),
])
def test_a_handler_config_with_misplaced_sections_is_refused(tmp_path, conv_dir, content, words):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(content))
    refused(tsbatch("export", "--kserve", "--no-tune", "--out", str(tmp_path / "k"), "--model-dir", conv_dir,
                    *CONV_HANDLER, "--handler-config", str(config)), words)
    assert not (tmp_path / "k" / "model-store").exists()
