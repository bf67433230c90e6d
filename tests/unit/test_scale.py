"""tsbatch scale (archiver/server.scale): never TorchServe's synchronous scale call, retries what
TorchServe 0.12 answers 500 under load, and returns only once exactly the asked workers are READY.

The management API here is a loopback HTTP server that behaves like TorchServe's where it matters:
a scale call is answered at once (202) and the workers change state afterwards, one poll at a time.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from tsbatch.archiver import server


class FakeManagement:
    """Workers as TorchServe lists them; a scale call takes effect over the next `polls` GETs."""

    def __init__(self, workers: int, refusals: list[str] = (), polls: int = 3):
        self.states = ["READY"] * workers
        self.refusals = list(refusals)  # bodies of 500s to answer before accepting a PUT
        self.polls = polls
        self.puts: list[dict] = []
        self._target: int | None = None
        self._left = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self):
                query = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
                with fake.lock:
                    fake.puts.append(query)
                    if fake.refusals:
                        return self._send(500, {"code": 500, "message": fake.refusals.pop(0)})
                    low, high = int(query["min_worker"]), int(query["max_worker"])
                    # TorchServe adds up to min_worker, stops down to max_worker, keeps a count in
                    # between, and with min_worker=0 drops every worker from the list
                    fake._target = 0 if low == 0 else min(max(len(fake.states), low), high)
                    fake._left = fake.polls
                    # a new worker is listed at once, loading; a stopped one is gone after the polls
                    fake.states += ["UNLOADING"] * max(0, fake._target - len(fake.states))
                self._send(202, {"status": "Processing worker updates..."})

            def do_GET(self):
                with fake.lock:
                    if fake._target is not None:
                        fake._left -= 1
                        if fake._left <= 0:
                            fake.states = ["READY"] * fake._target
                            fake._target = None
                    body = [{"modelName": "m", "workers": [{"id": str(9000 + i), "status": s, "pid": 100 + i}
                                                           for i, s in enumerate(fake.states)]}]
                self._send(200, body)

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def management(request):
    fakes = []

    def make(*args, **kwargs):
        fakes.append(FakeManagement(*args, **kwargs))
        return fakes[-1]

    yield make
    for fake in fakes:
        fake.close()


def test_scale_up_is_asynchronous_and_waits_for_every_new_worker(management):
    fake = management(1)
    found = server.scale(fake.url, "m", 3, timeout=30)
    assert [p["synchronous"] for p in fake.puts] == ["false"]
    assert fake.puts[0]["min_worker"] == "3" and fake.puts[0]["max_worker"] == "3"
    assert len(found) == 3 and {w["status"] for w in found} == {"READY"}


def test_scale_down_waits_until_the_stopped_workers_are_gone(management):
    fake = management(3)
    found = server.scale(fake.url, "m", 1, timeout=30)
    assert fake.puts[0]["max_worker"] == "1"
    assert len(found) == 1  # not the three READY ones listed before the scale-down took effect


def test_scale_to_zero_waits_until_none_is_listed(management):
    fake = management(2)
    assert server.scale(fake.url, "m", 0, timeout=30) == []
    assert fake.puts[0]["min_worker"] == "0"


def test_scale_retries_what_torchserve_refuses_under_load(management, monkeypatch):
    monkeypatch.setattr(server.time, "sleep", lambda s: None)
    fake = management(1, refusals=["java.util.ConcurrentModificationException", "IllegalStateException: Deque full"])
    assert len(server.scale(fake.url, "m", 2, timeout=30)) == 2
    assert len(fake.puts) == 3


def test_scale_reports_any_other_refusal(management):
    fake = management(1, refusals=["Model not found: m"])
    with pytest.raises(server.ServerError, match="HTTP 500 .*Model not found"):
        server.scale(fake.url, "m", 2, timeout=30)
    assert len(fake.puts) == 1


def test_scale_within_a_range_keeps_the_workers_already_in_it(management):
    """min_worker=1&max_worker=2 with two workers: TorchServe keeps both, and scale returns."""
    fake = management(2)
    assert len(server.scale(fake.url, "m", 1, max_workers=2, timeout=30)) == 2
