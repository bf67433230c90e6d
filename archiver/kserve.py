"""`tsbatch export --kserve`: the storage layout KServe's TorchServe runtime loads, and its InferenceService.

What this follows, and where it comes from:
- KServe's TorchServe docs ("Deploy a PyTorch Model with TorchServe InferenceService",
  kserve.github.io/website/0.12/modelserving/v1beta1/torchserve/; kserve/website
  docs/modelserving/v1beta1/torchserve/README.md): storageUri holds `config/config.properties`
  and `model-store/NAME.mar`; TorchServe's inference and management APIs on port 8085, metrics on
  8082; the runtime sets the KServe request envelope through an environment variable
  (TS_SERVICE_ENVELOPE), which TorchServe reads only with `enable_envvars_config=true`: tsbatch
  turns it off and reads KServe's v1 and v2 request shapes itself (handlers/edge/envelopes.py), because
  TorchServe's envelopes answer only the first request of a frontend batch; `model_snapshot` names
  the model and its workers and batching.
- KServe's runtime (kserve/kserve config/runtimes/kserve-torchserve.yaml) runs `torchserve --start
  --model-store=/mnt/models/model-store --ts-config=/mnt/models/config/config.properties` with
  TS_SERVICE_ENVELOPE from the protocol, and annotates Prometheus scraping on 8082 /metrics.
- The runtime's wrapper (pytorch/serve kubernetes/kserve/kserve_wrapper) serves KServe's protocol on
  8080 in the same container, reads `model_snapshot`, `inference_address`, `management_address`
  and `model_store` from this file (plain key=value, no Java unescaping), forwards to port 8085
  of inference_address's host, and refuses a model store with more than one .mar.
Pure: text in, text out, plus writing the two files next to the archive.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from tsbatch.archiver.properties import allowed_urls_pattern, render_tuned, render_yaml

MOUNT = "/mnt/models"
MODEL_STORE = f"{MOUNT}/model-store"
METRICS_CONFIG = f"{MOUNT}/config/metrics.yaml"  # config/metrics.yaml of the export, as mounted
TS_PORT = 8085  # the wrapper forwards here whatever port inference_address names
METRICS_PORT = 8082  # the runtime's prometheus.kserve.io/port
GRPC_PORTS = (7070, 7071)
JVM_MIB = 512  # the Java frontend's share of the pod's memory
MEMORY_MARGIN = 1.25
MEMORY_STEP_MIB = 256
DEFAULT_MEMORY_MIB = 2048  # KServe's runtime default request, for builds without a profile
STORAGE_SCHEMES = ("pvc", "s3", "gs", "hdfs", "webhdfs", "https", "http", "oci")
SNAPSHOT_KEYS = ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout", "startupTimeout")
K8S_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


class KServeError(Exception):
    """The export cannot produce a layout KServe would load; the message says what to change."""


@dataclass(frozen=True)
class Resources:
    """What the predictor pod requests (and is limited to: Guaranteed QoS keeps the tuned cores)."""

    cpu: int
    memory_mib: int
    gpus: int
    reason: str


@dataclass(frozen=True)
class Layout:
    root: str
    properties: str
    mar: str
    manifest: str


def layout(root: str, name: str) -> Layout:
    """Where each file goes under the export folder (the folder storageUri will hold)."""
    return Layout(root, os.path.join(root, "config", "config.properties"),
                  os.path.join(root, "model-store", f"{name}.mar"), os.path.join(root, "inferenceservice.yaml"))


def k8s_name(name: str) -> str:
    """The model name as a Kubernetes object name (lower case, '-' for '_' and '.')."""
    candidate = name.lower().replace("_", "-").replace(".", "-")
    if len(candidate) > 63 or not K8S_NAME.fullmatch(candidate):
        raise KServeError(f"model name {name!r} cannot name an InferenceService: use letters, digits, '-' or '_', "
                          "starting with a letter, at most 63 characters")
    return candidate


def check_storage_uri(uri: str) -> str:
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in STORAGE_SCHEMES or not rest.strip("/"):
        raise KServeError(f"--storage-uri {uri!r} is not a storage URI KServe reads: use one of "
                          f"{', '.join(s + '://...' for s in STORAGE_SCHEMES)}")
    return uri


def model_snapshot(name: str, config: Mapping[str, Any]) -> dict:
    """TorchServe's model_snapshot for the one model: its values win over the archive's
    model-config.yaml (Model.setModelState in 0.12), so they are copied from it."""
    missing = [key for key in SNAPSHOT_KEYS[:4] if not isinstance(config.get(key), int)]
    if missing:
        raise KServeError(f"model-config.yaml lacks {missing}: TorchServe's snapshot loader needs them")
    entry = {"defaultVersion": True, "marName": f"{name}.mar"}
    entry.update({key: config[key] for key in SNAPSHOT_KEYS if isinstance(config.get(key), int)})
    return {"name": "startup.cfg", "modelCount": 1, "models": {name: {"1.0": entry}}}


def render_properties(name: str, config: Mapping[str, Any], tuned: tuple[tuple[str, str, str], ...] = (),
                      bind: str = "127.0.0.1", max_request_size: int = 1 << 20, metrics_config: bool = False) -> str:
    """config.properties for KServe's TorchServe runtime."""
    snapshot = json.dumps(model_snapshot(name, config), separators=(",", ":"))
    allowed = allowed_urls_pattern(MODEL_STORE)
    lines = [
        "# TorchServe config.properties for KServe's TorchServe runtime, written by `tsbatch export --kserve`.",
        "# Layout and keys as KServe's TorchServe docs give them (kserve.github.io/website/0.12/modelserving/",
        f"# v1beta1/torchserve/): the runtime starts torchserve --model-store={MODEL_STORE} --ts-config={MOUNT}/config/config.properties.",
        f"# Inference and management on port {TS_PORT}: the runtime's KServe wrapper serves :8080 in the same container and",
        f"# forwards to port {TS_PORT} of this host (pytorch/serve kubernetes/kserve/kserve_wrapper), so loopback is enough.",
        f"inference_address=http://{bind}:{TS_PORT}",
        f"management_address=http://{bind}:{TS_PORT}",
        f"# Prometheus scrapes the pod on {METRICS_PORT} /metrics (the runtime's prometheus.kserve.io annotations).",
        f"metrics_address=http://0.0.0.0:{METRICS_PORT}",
        "metrics_mode=prometheus",
        "enable_metrics_api=true",
        *(["# tsbatch's batching metrics are declared here, with TorchServe's own kept (configs/metrics.yaml).",
           f"metrics_config={METRICS_CONFIG}"] if metrics_config else []),
        "# TorchServe's own gRPC listeners (ports as KServe's docs give them) stay inside the pod too.",
        f"grpc_inference_address={bind}",
        f"grpc_inference_port={GRPC_PORTS[0]}",
        f"grpc_management_address={bind}",
        f"grpc_management_port={GRPC_PORTS[1]}",
        "# KServe's runtime sets TS_SERVICE_ENVELOPE (kserve, kservev2); TorchServe's envelopes answer only the first",
        "# request of a frontend batch. tsbatch reads KServe's v1 and v2 request shapes itself and batches them, so",
        "# environment variables stay unread: no envelope wraps the handler.",
        "enable_envvars_config=false",
        f"model_store={MODEL_STORE}",
        "# Models load only from the mounted model store: no registration from URLs (ShellTorch, CVE-2023-43654).",
        f"allowed_urls={_escape(allowed)}",
        "# The model-registration API stays off; scaling workers (PUT /models/NAME) still works.",
        "enable_model_api=false",
        "# Token authorization is off: the KServe wrapper in the same container calls TorchServe without a key.",
        ("# Inference and management listen only on the pod's loopback and registration is off." if _loopback(bind)
         else f"# WARNING: inference and management listen on {bind}: restrict port {TS_PORT} with a NetworkPolicy."),
        "disable_token_authorization=true",
        "# Bodies over this many bytes get 413 from the frontend and never reach a worker.",
        f"max_request_size={max_request_size}",
        "max_response_size=6553500",
        "install_py_dep_per_model=false",
        "# The wrapper takes the model's name from model_snapshot and TorchServe loads it from there; the",
        "# snapshot's workers, batching and timeouts win over model-config.yaml's, so they are the same values.",
        f"model_snapshot={snapshot}",
    ]
    return "\n".join(lines) + "\n" + render_tuned(tuned)


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def _escape(value: str) -> str:
    """java.util.Properties eats one backslash (TorchServe reads this file with it)."""
    return value.replace("\\", "\\\\")


def resources_for(workers: int, threads: int, gpus: int, peak_rss_mb: float | None, tuned: bool = True) -> Resources:
    """CPU = the cores the workers' threads use; memory = the frontend plus each worker's measured
    peak (the profile's process held the same model), with a margin."""
    cpu = max(1, workers * threads)
    if isinstance(peak_rss_mb, (int, float)) and peak_rss_mb > 0:
        per_worker = math.ceil(peak_rss_mb * MEMORY_MARGIN)
        total = JVM_MIB + workers * per_worker
        memory_reason = (f"memory: Java frontend {JVM_MIB} MiB + {workers} worker(s) x {per_worker} MiB "
                         f"(peak RSS while profiling {peak_rss_mb:.0f} MiB, x{MEMORY_MARGIN:g})")
    else:
        total = DEFAULT_MEMORY_MIB
        memory_reason = f"memory: {DEFAULT_MEMORY_MIB} MiB, KServe's runtime default (no profile measured it)"
    total = math.ceil(total / MEMORY_STEP_MIB) * MEMORY_STEP_MIB
    cpu_reason = (f"cpu {cpu} = {workers} worker(s) x {threads} torch threads, as tuned" if tuned
                  else f"cpu {cpu}: not tuned (--no-tune), one core per worker")
    reason = (f"requests = limits (Guaranteed QoS, so the cores tuned for stay the pod's): {cpu_reason}; "
              f"{memory_reason}" + (f"; {gpus} GPU(s), one per worker" if gpus else ""))
    return Resources(cpu, total, gpus, reason)


def inference_service(name: str, storage_uri: str, resources: Resources) -> str:
    """The InferenceService manifest (serving.kserve.io/v1beta1) for KServe's TorchServe runtime."""
    amounts: dict[str, Any] = {"cpu": str(resources.cpu), "memory": f"{resources.memory_mib}Mi"}
    if resources.gpus:
        amounts["nvidia.com/gpu"] = str(resources.gpus)
    manifest = {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": k8s_name(name)},
        "spec": {"predictor": {"model": {
            "modelFormat": {"name": "pytorch"},
            "protocolVersion": "v1",
            "storageUri": check_storage_uri(storage_uri),
            "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        }}},
    }
    model = ("spec", "predictor", "model")
    comments = {
        model + ("modelFormat",): "pytorch selects KServe's TorchServe runtime (kserve-torchserve)",
        model + ("protocolVersion",): f"v1: POST /v1/models/{name}:predict with {{\"instances\": [...]}}; v2 (POST "
                                      f"/v2/models/{name}/infer, a BYTES tensor of texts) is answered too: tsbatch "
                                      "reads both shapes itself and batches them",
        model + ("storageUri",): "holds config/config.properties and model-store/ of this export: copy them there",
        model + ("resources",): resources.reason,
    }
    header = (f"InferenceService for {name!r} on KServe's TorchServe runtime, written by `tsbatch export --kserve`.\n"
              "Copy config/ and model-store/ to storageUri, then: kubectl apply -f inferenceservice.yaml")
    return render_yaml(manifest, comments, header)


def check_store(paths: Layout) -> None:
    """The model store may hold no other archive: KServe's wrapper refuses a store with two."""
    store = os.path.dirname(paths.mar)
    if not os.path.isdir(store):
        return
    others = sorted(f for f in os.listdir(store) if f.endswith(".mar") and f != os.path.basename(paths.mar))
    if others:
        raise KServeError(f"{store} also holds {others}: KServe's TorchServe wrapper loads exactly one .mar "
                          "per model store; export into an empty folder")


def write_layout(root: str, name: str, properties_text: str, manifest_text: str) -> Layout:
    """Write config/config.properties and inferenceservice.yaml next to model-store/NAME.mar."""
    paths = layout(root, name)
    if not os.path.isfile(paths.mar):
        raise KServeError(f"{paths.mar} is missing: build the archive into {os.path.dirname(paths.mar)} first")
    check_store(paths)
    os.makedirs(os.path.dirname(paths.properties), exist_ok=True)
    with open(paths.properties, "w") as f:
        f.write(properties_text)
    with open(paths.manifest, "w") as f:
        f.write(manifest_text)
    return paths
