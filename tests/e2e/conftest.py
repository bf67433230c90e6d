"""A real torchserve (Java frontend + Python workers) on loopback ports, in its own TMPDIR.

One server per test session serves the test models; it is always stopped, even when a test fails.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from archiver import server
from archiver.package import ArchiveSpec, build_archive
from archiver.properties import model_config
from archiver.tune import frontend_keys

# A long delay makes concurrent requests meet in one frontend batch; a full batch leaves at once.
TEST_FRONTEND = {"batchSize": 8, "maxBatchDelay": 500, "minWorkers": 1, "maxWorkers": 2, **frontend_keys("default")}
# tsbatch's own scheduler, as shipped: the frontend hands the worker every request it holds plus
# new ones on each call (continuous batching), tsbatch batches and answers the finished ones.
CONTINUOUS_FRONTEND = {"minWorkers": 1, "maxWorkers": 1, **frontend_keys("continuous")}
# tsbatch's own scheduler in async mode: the frontend hands over each request at once.
ASYNC_FRONTEND = {"minWorkers": 1, "maxWorkers": 1, **frontend_keys("async")}
MODELS = {
    # name -> (handler section, frontend keys); "minilm" also carries the POISON seam
    # a few buckets keep warmup short in tests; the shipped default has 16
    "minilm": ({"task": "embedding", "fault_injection": {"substring": "POISON"}, "max_batch_size": 8,
                "buckets": [16, 64, 256]}, TEST_FRONTEND),
    "minilm_oom": ({"task": "embedding", "fault_injection": {"oom_above_batch": 2}, "warmup": False},
                   TEST_FRONTEND),
    "minilm_async": ({"task": "embedding", "fault_injection": {"substring": "POISON"}, "warmup": False,
                      "max_wait_ms": 20, "queue_cap": 64}, ASYNC_FRONTEND),
    "minilm_cont": ({"task": "embedding", "fault_injection": {"substring": "POISON"}, "max_batch_size": 8,
                     "buckets": [16, 64, 256], "max_wait_ms": 20, "queue_cap": 64}, CONTINUOUS_FRONTEND),
}


@pytest.fixture(scope="session")
def torchserve(tmp_path_factory, minilm_dir):
    root = tmp_path_factory.mktemp("torchserve")
    store = str(root / "model_store")
    for name, (handler, frontend) in MODELS.items():
        build_archive(ArchiveSpec(minilm_dir, name, model_config(handler, frontend), store))
    with server.local_server(str(root), store, list(MODELS), timeout=300) as served:
        yield served


# -- the archive exactly as `tsbatch archive` builds it -------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "minilm"


def tsbatch(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "archiver", *args], check=True, cwd=REPO, timeout=900,
                   stdout=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def built_profile(tmp_path_factory) -> str:
    """`tsbatch profile` of the default model on this machine, taken once: each built archive
    below is `tsbatch archive --profile` of it, which is what `make archive` runs minus profiling."""
    path = str(tmp_path_factory.mktemp("profile") / "profile.json")
    tsbatch("profile", "--name", NAME, "--out", path)
    return path


def serve_built(root, profile: str, *extra: str) -> server.Served:
    """`tsbatch archive` into root/store on free ports, then torchserve with the config.properties
    and model-config.yaml it wrote (not waited for: the caller waits for what it expects)."""
    ports = server.free_ports(5)
    store = str(root / "store")
    tsbatch("archive", "--name", NAME, "--out", store, "--profile", profile, *extra,
            "--inference-port", str(ports[0]), "--management-port", str(ports[1]), "--metrics-port", str(ports[2]),
            "--grpc-inference-port", str(ports[3]), "--grpc-management-port", str(ports[4]))
    paths = server.ServerPaths(str(root / "tmp"), str(root / "logs"))
    properties = os.path.join(store, "config.properties")
    served = server.Served(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}",
                           f"http://127.0.0.1:{ports[2]}", paths, store, properties)
    server.start(properties, store, paths)
    return served
