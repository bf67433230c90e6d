"""The archive `tsbatch archive` builds, with out of memory injected at batches over 2 and warmup on
as shipped: the worker learns its caps at warmup, becomes READY and serves every request."""
from __future__ import annotations

import json
import time

import pytest
import requests
import yaml

from tsbatch.archiver import server
from tsbatch.handlers.edge.config import HandlerConfig
from bench.loadtest.load import Load
from tests.e2e.conftest import NAME, serve_built
from tests.e2e.test_metrics import value
from tests.support import cosine

TEXTS = [f"request {i}: " + " ".join(["a fairly ordinary sentence"] * (1 + 8 * (i % 3))) for i in range(8)]


@pytest.fixture(scope="module")
def oom_served(tmp_path_factory):
    root = tmp_path_factory.mktemp("oom")
    handler_config = root / "fault.yaml"
    handler_config.write_text(yaml.safe_dump({"fault_injection": {"oom_above_batch": 2}}))
    return root, str(handler_config)


@pytest.fixture(scope="module")
def reference(minilm_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_dir, device="cpu")
    return [v.tolist() for v in model.encode(TEXTS)]


def test_out_of_memory_at_warmup_caps_buckets_and_the_worker_serves(oom_served, built_profile, reference):
    root, handler_config = oom_served
    served = serve_built(root, built_profile, "--handler-config", handler_config)
    try:
        with open(f"{served.store}/config.properties") as f:
            assert "load_models=minilm.mar" in f.read()
        startup = yaml.safe_load(_model_config(served))["startupTimeout"]
        server.wait_ready(served.management, NAME, startup + 30, log_hint=f"; see {served.paths.logs}")
        load = Load()
        try:
            shots = [f.result(120) for f in [load.send(f"{served.inference}/predictions/{NAME}", t.encode(),
                                                       timeout=120) for t in TEXTS]]
        finally:
            load.close(1)
        assert [s.status for s in shots] == [200] * 8, [s.body[:200] for s in shots]
        for shot, ref in zip(shots, reference):
            assert cosine(json.loads(shot.body)["embedding"], ref) >= 0.999
        log = served.log()
        assert "Load model" not in log or "OOM" not in log
        assert "batch caps learned from out of memory" in log
        deadline = time.monotonic() + 20
        while True:
            metrics = requests.get(f"{served.metrics}/metrics", timeout=30).text
            caps = {bucket: value(metrics, "tsbatch_batch_cap", bucket=str(bucket)) for bucket in (8, 16, 256)}
            if all(caps.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        # the archive's own limit per bucket: its tuned batch_caps, or the template's when the
        # simulator chose a candidate without them (which one wins depends on the measured profile)
        handler = yaml.safe_load(_model_config(served))["handler"]
        shipped = HandlerConfig.from_yaml({k: v for k, v in handler.items() if k != "model_dir"})
        assert caps == {b: min(2, shipped.batch_limit(b)) for b in (8, 16, 256)}, (caps, handler.get("batch_caps"))
    finally:
        server.stop(served.paths)


def _model_config(served) -> str:
    import zipfile

    with zipfile.ZipFile(f"{served.store}/{NAME}.mar") as mar:
        return mar.read("model-config.yaml").decode()
