"""A real torchserve (Java frontend + Python workers) on loopback ports, in its own TMPDIR.

One server per test session serves the test models; it is always stopped, even when a test fails.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import pytest

from archiver import server
from archiver.package import ArchiveSpec, build_archive
from archiver.properties import ServerSettings, install_metrics_config, model_config, render_properties

# A long delay makes concurrent requests meet in one frontend batch; a full batch leaves at once.
TEST_FRONTEND = {"batchSize": 8, "maxBatchDelay": 500, "minWorkers": 1, "maxWorkers": 2,
                 "asyncCommunication": False}
# tsbatch's own scheduler: the frontend hands over each request at once, tsbatch batches.
ASYNC_FRONTEND = {"batchSize": 1, "maxBatchDelay": 1, "minWorkers": 1, "maxWorkers": 1,
                  "asyncCommunication": True}
MODELS = {
    # name -> (handler section, frontend keys); "minilm" also carries the POISON seam
    # a few buckets keep warmup short in tests; the shipped default has 16
    "minilm": ({"task": "embedding", "fault_injection": {"substring": "POISON"}, "max_batch_size": 8,
                "buckets": [16, 64, 256]}, TEST_FRONTEND),
    "minilm_oom": ({"task": "embedding", "fault_injection": {"oom_above_batch": 2}, "warmup": False},
                   TEST_FRONTEND),
    "minilm_async": ({"task": "embedding", "fault_injection": {"substring": "POISON"}, "warmup": False,
                      "max_wait_ms": 20, "queue_cap": 64}, ASYNC_FRONTEND),
}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class Served:
    inference: str
    management: str
    metrics: str
    paths: server.ServerPaths
    store: str

    def log(self, name: str = "model_log.log") -> str:
        path = os.path.join(self.paths.logs, name)
        with open(path, errors="replace") as f:
            return f.read()


@pytest.fixture(scope="session")
def torchserve(tmp_path_factory, minilm_dir):
    root = tmp_path_factory.mktemp("torchserve")
    store = str(root / "model_store")
    for name, (handler, frontend) in MODELS.items():
        build_archive(ArchiveSpec(minilm_dir, name, model_config(handler, frontend), store))
    ports = free_ports(5)
    settings = ServerSettings(model_store=store, load_models=tuple(f"{n}.mar" for n in MODELS),
                              inference_port=ports[0], management_port=ports[1], metrics_port=ports[2],
                              grpc_inference_port=ports[3], grpc_management_port=ports[4],
                              metrics_config=install_metrics_config(store))
    properties = str(root / "config.properties")
    with open(properties, "w") as f:
        f.write(render_properties(settings))
    paths = server.ServerPaths(tmpdir=str(root / "tmp"), logs=str(root / "logs"))
    served = Served(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}",
                    f"http://127.0.0.1:{ports[2]}", paths, store)
    server.start(properties, store, paths)
    try:
        for name in MODELS:
            server.wait_ready(served.management, name, timeout=300, log_hint=f"; see {paths.logs}")
        yield served
    finally:
        server.stop(paths)
