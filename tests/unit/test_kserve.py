"""tsbatch.archiver.kserve: the layout, config.properties and InferenceService KServe's TorchServe runtime loads."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from tsbatch.archiver import kserve
from tsbatch.archiver.kserve import KServeError
from tsbatch.archiver.properties import read_properties

pytestmark = pytest.mark.unit

CONFIG = {"asyncCommunication": False, "batchSize": 1, "maxBatchDelay": 1, "minWorkers": 2, "maxWorkers": 2,
          "responseTimeout": 30, "startupTimeout": 240, "handler": {"task": "embedding"}}


def properties(**kwargs) -> tuple[str, dict[str, str]]:
    text = kserve.render_properties("minilm", CONFIG, **kwargs)
    return text, read_properties(text)


def test_properties_follow_kserves_torchserve_layout():
    _text, values = properties()
    assert values["model_store"] == "/mnt/models/model-store"
    # KServe's runtime sets TS_SERVICE_ENVELOPE: unread, tsbatch reads KServe's shapes itself and batches them
    assert values["enable_envvars_config"] == "false"
    assert "service_envelope" not in values  # deprecated in favour of the environment variable
    port = lambda key: int(values[key].rsplit(":", 1)[1])  # noqa: E731
    assert port("inference_address") == port("management_address") == 8085  # where the wrapper forwards
    assert values["metrics_address"] == "http://0.0.0.0:8082"  # the runtime's Prometheus port
    assert values["metrics_mode"] == "prometheus"


def test_the_snapshot_names_the_model_and_carries_the_tuned_values():
    _text, values = properties()
    snapshot = json.loads(values["model_snapshot"])
    assert snapshot["modelCount"] == 1 and list(snapshot["models"]) == ["minilm"]
    entry = snapshot["models"]["minilm"]["1.0"]  # the archive's version
    assert entry["marName"] == "minilm.mar" and entry["defaultVersion"] is True
    for key in ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout", "startupTimeout"):
        assert entry[key] == CONFIG[key], key


def test_the_kserve_wrapper_reads_the_file_as_plain_key_value():
    """pytorch/serve's kserve_wrapper splits each line at the first '=' and json-loads model_snapshot."""
    text, _ = properties()
    keys = {}
    for line in text.splitlines():
        if "=" in line:
            name, value = line.split("=", 1)
            keys[name.strip()] = value.strip()
    assert json.loads(keys["model_snapshot"])["models"]["minilm"]
    assert keys["inference_address"].split("//")[1] == "127.0.0.1:8085"
    assert keys["model_store"] == "/mnt/models/model-store"


def test_properties_stay_safe_inside_the_pod():
    text, values = properties()
    assert values["inference_address"] == "http://127.0.0.1:8085"
    assert values["grpc_inference_address"] == values["grpc_management_address"] == "127.0.0.1"
    assert values["enable_model_api"] == "false"
    assert values["disable_token_authorization"] == "true"  # the wrapper sends no token
    assert values["install_py_dep_per_model"] == "false"
    allowed = re.compile(values["allowed_urls"])
    assert allowed.fullmatch("file:///mnt/models/model-store/minilm.mar")
    assert not allowed.fullmatch("https://example.com/evil.mar")
    assert not allowed.fullmatch("file:///mnt/models/model-store-evil/x.mar")
    assert "WARNING" not in text
    text, everywhere = properties(bind="0.0.0.0")
    assert everywhere["inference_address"] == "http://0.0.0.0:8085"
    assert "WARNING: inference and management listen on 0.0.0.0" in text


def test_metrics_config_points_at_the_mounted_config_folder():
    assert "metrics_config" not in properties()[1]
    assert properties(metrics_config=True)[1]["metrics_config"] == "/mnt/models/config/metrics.yaml"


def test_tuned_entries_are_appended_with_reasons():
    text, values = properties(tuned=(("job_queue_size", "300", "Little's law"),))
    assert values["job_queue_size"] == "300"
    assert "# Little's law\njob_queue_size=300" in text


def test_a_config_without_batching_keys_cannot_make_a_snapshot():
    with pytest.raises(KServeError, match="batchSize"):
        kserve.model_snapshot("m", {"minWorkers": 1, "maxWorkers": 1, "maxBatchDelay": 1})


def test_the_manifest_is_an_inference_service_for_the_torchserve_runtime():
    resources = kserve.resources_for(workers=2, threads=4, gpus=0, peak_rss_mb=700)
    manifest = yaml.safe_load(kserve.inference_service("minilm_v2", "s3://bucket/minilm", resources))
    assert manifest["apiVersion"] == "serving.kserve.io/v1beta1"
    assert manifest["kind"] == "InferenceService"
    assert manifest["metadata"]["name"] == "minilm-v2"
    model = manifest["spec"]["predictor"]["model"]
    assert model["modelFormat"] == {"name": "pytorch"}
    assert model["protocolVersion"] == "v1"
    assert model["storageUri"] == "s3://bucket/minilm"
    limits, requests = model["resources"]["limits"], model["resources"]["requests"]
    assert limits == requests  # Guaranteed QoS: the cores tune planned for
    assert limits["cpu"] == "8"
    assert limits["memory"] == f"{512 + 2 * 875 + (256 - (512 + 2 * 875) % 256) % 256}Mi"
    assert "nvidia.com/gpu" not in limits


def test_gpu_resources_and_a_fallback_memory_without_a_profile():
    resources = kserve.resources_for(workers=4, threads=1, gpus=4, peak_rss_mb=None, tuned=False)
    assert (resources.cpu, resources.memory_mib, resources.gpus) == (4, 2048, 4)
    assert "no profile" in resources.reason and "not tuned" in resources.reason
    limits = yaml.safe_load(kserve.inference_service("m", "pvc://claim/m", resources))["spec"]["predictor"]["model"][
        "resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "4"


def test_the_manifest_explains_its_values_in_comments():
    text = kserve.inference_service("minilm", "pvc://claim/minilm", kserve.resources_for(1, 2, 0, 500))
    lines = text.splitlines()
    for key in ("protocolVersion", "storageUri", "resources", "modelFormat"):
        index = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{key}:"))
        assert lines[index - 1].strip().startswith("#"), key


@pytest.mark.parametrize("uri", ["minilm", "/abs/path", "ftp://x/y", "s3://", "pvc:claim"])
def test_a_storage_uri_kserve_cannot_read_is_refused(uri):
    with pytest.raises(KServeError, match="storage URI"):
        kserve.check_storage_uri(uri)


@pytest.mark.parametrize("name", ["9lives", "-x", "x" * 64, "a b", "ü"])
def test_a_name_that_cannot_name_an_inference_service_is_refused(name):
    with pytest.raises(KServeError, match="cannot name an InferenceService"):
        kserve.k8s_name(name)


def test_layout_writes_config_and_manifest_next_to_the_archive(tmp_path):
    paths = kserve.layout(str(tmp_path), "minilm")
    with pytest.raises(KServeError, match="missing"):
        kserve.write_layout(str(tmp_path), "minilm", "p", "m")
    (tmp_path / "model-store").mkdir()
    (tmp_path / "model-store" / "minilm.mar").write_bytes(b"PK")
    written = kserve.write_layout(str(tmp_path), "minilm", "inference_address=x\n", "kind: InferenceService\n")
    assert written == paths
    assert (tmp_path / "config" / "config.properties").read_text() == "inference_address=x\n"
    assert (tmp_path / "inferenceservice.yaml").read_text() == "kind: InferenceService\n"
    assert paths.mar == str(tmp_path / "model-store" / "minilm.mar")


def test_layout_refuses_a_model_store_with_another_archive(tmp_path):
    store = tmp_path / "model-store"
    store.mkdir()
    (store / "minilm.mar").write_bytes(b"PK")
    (store / "other.mar").write_bytes(b"PK")
    with pytest.raises(KServeError, match="exactly one .mar"):
        kserve.write_layout(str(tmp_path), "minilm", "p", "m")
