"""handler.frontend_warmup: the worker's own requests through the frontend as it goes READY
(handlers/edge/frontend_warmup.py), and the address `tsbatch archive` writes for it."""
from __future__ import annotations

import http.server
import json
import logging
import threading

import pytest

from tsbatch.archiver.pipeline import Request, warming_the_frontend
from tsbatch.archiver.server import free_ports
from tsbatch.handlers.core.errors import ConfigError
from tsbatch.handlers.edge import frontend_warmup
from tsbatch.handlers.edge.config import HandlerConfig

pytestmark = pytest.mark.unit


class Frontend(http.server.ThreadingHTTPServer):
    """A loopback stand-in for TorchServe's inference listener: records each POST, answers `status`."""

    def __init__(self, status: int = 200):
        self.posts = []
        self.status = status

        class Handle(http.server.BaseHTTPRequestHandler):
            def do_POST(handler):  # noqa: N805 - the request handler's own self
                body = handler.rfile.read(int(handler.headers["Content-Length"]))
                self.posts.append((handler.path, dict(handler.headers), body))
                handler.send_response(self.status)
                handler.send_header("Content-Length", "2")
                handler.end_headers()
                handler.wfile.write(b"{}")

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handle)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.mark.parametrize("status", [200, 400])
def test_the_worker_posts_its_requests_one_after_another_and_logs_the_answers_whatever_they_are(status, caplog):
    frontend = Frontend(status)
    try:
        with caplog.at_level(logging.INFO, logger=frontend_warmup.__name__):
            frontend_warmup.send(frontend.address, "my model").join(30)
    finally:
        frontend.shutdown()
    assert len(frontend.posts) == frontend_warmup.REQUESTS
    for path, headers, body in frontend.posts:
        assert path == "/predictions/my%20model"
        assert json.loads(body) == {"text": "tsbatch warmup"}
    assert f"answered {[status] * frontend_warmup.REQUESTS}" in caplog.text


def test_nothing_listening_is_a_warning_not_an_error(caplog):
    [port] = free_ports(1)
    with caplog.at_level(logging.WARNING, logger=frontend_warmup.__name__):
        frontend_warmup.send(f"http://127.0.0.1:{port}", "m", timeout=5).join(30)
    assert "no answer from" in caplog.text and "first client's request pays" in caplog.text


def test_the_address_must_be_loopback_http_with_a_port():
    assert HandlerConfig.from_yaml({"frontend_warmup": "http://127.0.0.1:8080/"}).frontend_warmup == \
        "http://127.0.0.1:8080"
    assert HandlerConfig.from_yaml({}).frontend_warmup is None
    for bad in ("http://10.0.0.1:8080", "https://127.0.0.1:8080", "127.0.0.1:8080", "http://127.0.0.1"):
        with pytest.raises(ConfigError, match="handler.frontend_warmup must be"):
            HandlerConfig.from_yaml({"frontend_warmup": bad})


def test_tsbatch_archive_points_it_at_the_inference_port_unless_told_otherwise():
    request = Request("/models/m", "m", {"task": "embedding"}, 500.0)
    assert warming_the_frontend(request, {"inference_port": 9123}).section == \
        {"task": "embedding", "frontend_warmup": "http://127.0.0.1:9123"}
    assert warming_the_frontend(request, {}).section["frontend_warmup"] == "http://127.0.0.1:8080"
    # with token authorization the worker holds no key; a value the user gave (null: off) stays
    assert "frontend_warmup" not in warming_the_frontend(request, {"token_auth": True}).section
    own = Request("/models/m", "m", {"frontend_warmup": None}, 500.0)
    assert warming_the_frontend(own, {"inference_port": 9123}).section == {"frontend_warmup": None}
