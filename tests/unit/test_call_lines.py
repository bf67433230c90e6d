"""tsbatch.handlers.edge.call_lines against TorchServe's own code: its per-call INFO line is dropped
and its PredictionTime metric reaches the log at most once a second, other metrics every time."""
from __future__ import annotations

import logging
import os
import socket

import pytest

from tests.unit.test_backend_socket import call
from tsbatch.handlers.edge import call_lines

otf = pytest.importorskip("ts.protocol.otf_message_handler")
yaml_impl = pytest.importorskip("ts.metrics.metric_cache_yaml_impl")

pytestmark = pytest.mark.unit

METRICS_YAML = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "metrics.yaml")


@pytest.fixture
def quiet_root():
    """The root logger without call_lines' filter for the test (an earlier test's handler may have
    installed it in this process), as it was afterwards."""
    root = logging.getLogger()
    installed = [f for f in root.filters if isinstance(f, call_lines._DropReceived)]
    for f in installed:
        root.removeFilter(f)
    yield
    for f in [f for f in root.filters if isinstance(f, call_lines._DropReceived)]:
        root.removeFilter(f)
    for f in installed:
        root.addFilter(f)


def received_lines(caplog) -> int:
    """How many "Backend received inference" records TorchServe's reader logs for one call."""
    reader, writer = socket.socketpair()
    try:
        writer.sendall(call([(b"a" * 36, [(b"host", b"127.0.0.1")], b"a text")]))  # as the frontend encodes it
        caplog.clear()
        with caplog.at_level(logging.INFO):
            cmd, message = otf.retrieve_msg(reader)
        assert cmd == b"I" and message[0]["requestId"] == b"a" * 36
        return sum("Backend received inference" in r.getMessage() for r in caplog.records)
    finally:
        reader.close()
        writer.close()


def test_torchserves_per_call_info_line_is_dropped(caplog, quiet_root):
    assert received_lines(caplog) == 1  # TorchServe's reader logs it on every call
    call_lines.quiet_calls(None)
    assert received_lines(caplog) == 0
    with caplog.at_level(logging.INFO):
        logging.info("Torch worker started.")  # the worker's other lines still pass
    assert [r.getMessage() for r in caplog.records] == ["Torch worker started."]


def test_prediction_time_is_emitted_at_most_once_a_second_and_other_metrics_always(caplog, quiet_root):
    metrics = yaml_impl.MetricsCacheYamlImpl(config_file_path=METRICS_YAML)
    metrics.initialize_cache()
    metrics.model_name = "m"
    metrics.set_request_ids({0: "r" * 36})
    now = [100.0]
    call_lines.quiet_calls(metrics, clock=lambda: now[0])
    call_lines.quiet_calls(metrics, clock=lambda: now[0])  # a second install wraps nothing twice

    def lines(name: str) -> int:
        return sum(f"[METRICS]{name}." in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.INFO):
        for step in range(5):  # five calls within 0.4 s
            now[0] += 0.1
            metrics.add_time(call_lines.PREDICTION_TIME, 3.5)
            metrics.add_time("HandlerTime", 2.0)
        assert lines("PredictionTime") == 1 and lines("HandlerTime") == 5
        now[0] += call_lines.EVERY_S
        metrics.add_time(call_lines.PREDICTION_TIME, 4.0)
    assert lines("PredictionTime") == 2
    assert any("PredictionTime.Milliseconds:4.0" in r.getMessage() for r in caplog.records)
