"""One vocabulary: every metric the handler emits is declared, and the dashboard uses only those."""
from __future__ import annotations

import json
import os
import re

import pytest
import yaml

from tsbatch.handlers.edge.metrics import BASE_LABELS, SPECS, metrics_yaml_section

pytestmark = pytest.mark.unit
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def declared() -> dict:
    with open(os.path.join(CONFIGS, "metrics.yaml")) as f:
        return yaml.safe_load(f)


def test_every_tsbatch_metric_is_declared_with_its_labels():
    model = declared()["model_metrics"]
    entries = {e["name"]: (kind, e) for kind, group in model.items() for e in group}
    for name, spec in SPECS.items():
        assert name in entries, f"{name} is emitted but not declared in configs/metrics.yaml"
        kind, entry = entries[name]
        assert kind == spec.kind
        assert entry["dimensions"] == list(BASE_LABELS + spec.labels)
    assert metrics_yaml_section() == {k: [e for e in v if e["name"] in SPECS] for k, v in model.items()
                                      if any(e["name"] in SPECS for e in v)}


def test_torchserves_own_metrics_are_kept():
    ts = declared()["ts_metrics"]
    names = {e["name"] for group in ts.values() for e in group}
    assert {"ts_inference_requests_total", "ts_inference_latency_microseconds", "ts_queue_latency_microseconds",
            "Requests2XX", "Requests5XX"} <= names


def test_names_follow_prometheus_conventions():
    for name, spec in SPECS.items():
        assert re.fullmatch(r"tsbatch_[a-z0-9_]+", name)
        assert name.endswith("_total") == (spec.kind == "counter"), name
        if spec.unit == "seconds":
            assert name.endswith("_seconds"), name


def test_dashboard_references_only_metrics_that_exist():
    with open(os.path.join(CONFIGS, "grafana-dashboard.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v.get("type") == "query"]
    ts_names = {e["name"] for group in declared()["ts_metrics"].values() for e in group}
    used = set()
    for expr in exprs:
        for name in re.findall(r"\b((?:tsbatch|ts)_[a-z0-9_]+)", expr):
            used.add(name)
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            spec = SPECS.get(base) or SPECS.get(name)
            if spec is None:
                assert name in ts_names, f"dashboard uses {name}, which nothing emits"
            elif name != base:
                assert spec.kind == "histogram", f"{name}: only histograms have _bucket/_sum/_count"
    assert {s for s in SPECS} <= {re.sub(r"_(bucket|sum|count)$", "", u) for u in used}, \
        "every tsbatch metric has a panel"
