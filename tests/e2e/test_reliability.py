"""Reliability through a real torchserve: overload, a worker killed mid-batch, a bad archive.

Every request gets an answer — a result or a clear error — and none hangs; a killed worker is
replaced, warms up again and serves. The long versions (3x capacity for a minute, kill drills on
the shipped configuration) are in bench/chaos.py; these are short, bounded ones.

The session's models: "minilm" (TorchServe batching, warmup on), "minilm_cont" (tsbatch's
scheduler in continuous mode, as shipped: queue_cap 64, warmup on), "minilm_async" (the scheduler
in async mode, warmup off). Tests that change a model's workers restore them.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest

from tsbatch.archiver import server
from tsbatch.archiver.package import ArchiveSpec, build_archive
from tsbatch.archiver.properties import ServerSettings, model_config, render_properties
from tsbatch.archiver.server import free_ports
from bench.drills.overload import answer_problems, measure_capacity
from bench.loadtest.client import shoot
from bench.loadtest.load import Load, burst, open_loop
from bench.loadtest.proc import MemorySampler
from bench.loadtest.stats import by_status, percentile
from bench.loadtest.torchserve import reap_workers, restore_workers, wait_busy, wait_until, warmups, worker_pids
from tsbatch.handlers.edge.stages import WORKER_HEADER
from tests.e2e.conftest import ASYNC_FRONTEND, CONTINUOUS_FRONTEND, TEST_FRONTEND

DEADLINE_MS = 1500
MB = 1024
# An accepted request's answer must be back within its deadline plus this: the deadline counts from
# when the handler first sees the request, so the frontend and HTTP add a little on top.
DEADLINE_SLACK = 0.5


def texts(count: int, words: int = 30) -> list[bytes]:
    return [(f"request {i}: " + " ".join(["overload"] * words)).encode() for i in range(count)]


def huge(i: int) -> bytes:
    """~900 KB of text, under max_request_size: tokenized from a prefix (whole words) in milliseconds."""
    return (f"huge request {i} " + "word " * 180_000).encode()


def slow(i: int) -> bytes:
    """A request whose pass keeps the worker's CPU busy for 3 s (fault injection's slow_substring)."""
    return f"SLOW request {i}".encode()


def unbroken(i: int) -> bytes:
    """~900 KB without whitespace: cut mid-word (tokenized whole, it took about a second each)."""
    return (f"unbroken-request-{i}," + "word," * 180_000).encode()


def scale(management: str, model: str, low: int, high: int) -> None:
    server.scale(management, model, low, high, timeout=300)


def one_worker(management: str, model: str) -> int:
    """The pid of the model's only worker, once it is READY."""
    def single():
        found = server.workers(management, model)
        return found if len(found) == 1 and found[0]["status"] == "READY" else None

    return int(wait_until(single, 300, what=f"{model} with exactly one READY worker")[0]["pid"])


# -- overload: 3x capacity, bounded ------------------------------------------------------------

def test_overload_answers_everyone_promptly_within_deadlines_and_memory_stays_bounded(torchserve):
    """3x what 16 closed-loop clients get, for ~4 s, against a queue_cap of 64 (the shipped mode)."""
    url = f"{torchserve.inference}/predictions/minilm_cont"
    bodies = texts(200)
    capacity = measure_capacity(url, bodies, clients=16, seconds=3, timeout=30)["capacity_rps"]
    assert capacity > 0, "minilm_cont answered nothing"
    rate = 3 * capacity
    count = min(1500, max(300, int(rate * 4)))
    arrivals = [i / rate for i in range(count)]
    java = server.running_pid(torchserve.paths)
    with MemorySampler(java, lambda: worker_pids(torchserve.management, "minilm_cont")) as memory:
        shots = open_loop(url, [bodies[i % len(bodies)] for i in range(count)], arrivals,
                          {"X-Deadline-Ms": str(DEADLINE_MS)}, timeout=30)
    statuses = by_status(shots)
    accepted = [s.latency for s in shots if s.status == 200]
    print(f"\ncapacity {capacity:.1f} req/s, offered {rate:.1f} req/s x {count}: {statuses}; accepted p50 "
          f"{percentile(accepted, 50)}s p99 {percentile(accepted, 99)}s; memory {memory.summary()}")

    assert answer_problems(shots) == []  # answered, 200/503/504, 503 with Retry-After, JSON errors
    # shed what it could not serve: 503 once the queue is full, 504 for requests that could not meet
    # their deadline (with a 1.5 s deadline these come first: the queue never holds more than that).
    # How many were served (200) rests on a 3-second capacity figure taken on a shared 2-core
    # machine, so it is reported, not asserted; `make chaos` measures goodput under overload.
    assert statuses.get("503", 0) + statuses.get("504", 0) > 0, statuses
    deadline = DEADLINE_MS / 1000
    late = [round(s.latency, 2) for s in shots if s.status == 200 and s.latency > deadline + DEADLINE_SLACK]
    assert not late, f"{len(late)} accepted requests answered past their deadline: {sorted(late)[-10:]}"
    for shot in shots:
        bound = {200: deadline + DEADLINE_SLACK, 503: 5.0, 504: deadline + 5.0}[shot.status]
        assert shot.latency <= bound, f"{shot.status} after {shot.latency:.2f}s (bound {bound}s)"
    after = asyncio.run(shoot(url, b"after the overload", timeout=10))
    assert after.status == 200
    mem = memory.summary()
    for key in ("jvm_rss_kb", "worker_rss_kb"):
        assert mem[key]["end"] - mem[key]["start"] < 200 * MB, (key, mem[key])


def test_a_burst_is_shed_with_retry_after(torchserve):
    shots = burst(f"{torchserve.inference}/predictions/minilm_cont", texts(300, words=10),
                  {"X-Deadline-Ms": str(DEADLINE_MS)}, timeout=30)
    assert all(s.answered for s in shots), by_status(shots)
    assert answer_problems(shots) == []


@pytest.mark.parametrize("model", ["minilm_cont", "minilm_async"])
@pytest.mark.parametrize("make_big", [huge, unbroken])
def test_a_request_is_answered_within_its_deadline_even_behind_huge_ones(torchserve, model, make_big):
    url = f"{torchserve.inference}/predictions/{model}"
    load = Load()
    try:
        victim = one_worker(torchserve.management, model)
        big = [load.send(url, make_big(i), timeout=90) for i in range(8)]
        wait_busy([victim], cpu=0.2, timeout=60)
        small = load.send(url, b"a short request in a hurry", headers={"X-Deadline-Ms": "300"}, timeout=60).result(60)
        assert all(f.result(90).status == 200 for f in big)
        # answered in time, or 504 on time, or refused at once (503 with Retry-After) when its lane is
        # running a long pass it helps with (the long lane fell behind) that outlasts the deadline
        assert small.status in (200, 503, 504), small.body[:200]
        if small.status == 503:
            assert small.headers.get("retry-after") and "deadline" in small.body.decode(), small.body[:200]
        assert small.latency <= 0.3 + 0.5, f"{small.status} after {small.latency:.2f}s with X-Deadline-Ms 300"
    finally:
        load.close(5)


# -- a worker killed mid-batch ------------------------------------------------------------------

@pytest.mark.parametrize("model, frontend", [("minilm", TEST_FRONTEND), ("minilm_cont", CONTINUOUS_FRONTEND)],
                         ids=["default-batching", "continuous"])
def test_a_worker_killed_mid_batch_fails_its_batch_promptly_and_comes_back_warm(torchserve, model, frontend):
    url = f"{torchserve.inference}/predictions/{model}"
    scale(torchserve.management, model, 1, 1)  # one worker: the batch cannot be split between two
    load = Load()
    try:
        victim = one_worker(torchserve.management, model)
        batch = [load.send(url, slow(i), timeout=120) for i in range(8)]  # a pass of 3 s (fault injection)
        wait_busy([victim], cpu=0.5, timeout=60)
        if any(f.done() for f in batch):
            pytest.fail(f"the batch was answered before the kill: {by_status(f.result() for f in batch if f.done())}")
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        during = [load.send(url, f"sent while the worker restarts {i}".encode(), timeout=300) for i in range(2)]

        ready = wait_until(lambda: [w for w in server.workers(torchserve.management, model)
                                    if w["status"] == "READY" and int(w["pid"]) != victim], 300,
                           what="a new READY worker")
        recovered = time.monotonic() - killed
        new_pid = int(ready[0]["pid"])
        # Requests the dead worker held fail at once; in continuous mode the worker may not have
        # taken every request in yet: those wait in TorchServe's queue for the new worker.
        failed = 0
        for shot in (f.result(timeout=300) for f in batch):
            assert shot.answered, f"an in-flight request got no answer: {shot.error}"
            if shot.status == 200:
                assert int(shot.headers[WORKER_HEADER]) == new_pid, "a 200 from the killed worker after the kill"
                continue
            failed += 1
            assert shot.done_at - killed <= 15, f"failed {shot.done_at - killed:.1f}s after the kill"
            body = shot.json()
            assert shot.status >= 500 and isinstance(body, dict) and body.get("code") == shot.status, shot.body[:200]
        assert failed >= 1, "the kill hit no request the worker held"
        if model == "minilm":
            assert failed == len(batch)  # default batching: all eight were one batch in the worker
        warmed = warmups(torchserve.log())
        assert new_pid in warmed, f"no 'tsbatch warmup done ... by worker pid {new_pid}' line in the model log"
        for shot in (f.result(timeout=300) for f in during):  # queued in the frontend meanwhile: not lost
            assert shot.status == 200 and int(shot.headers[WORKER_HEADER]) == new_pid, (shot.status, shot.body[:200])
        after = asyncio.run(shoot(url, b"after recovery", timeout=30))
        assert after.status == 200 and int(after.headers[WORKER_HEADER]) == new_pid
        print(f"\nworker {victim} killed; {len(batch)} in-flight requests answered "
              f"{by_status(f.result() for f in batch)}; worker {new_pid} READY after {recovered:.1f}s "
              f"(warmup {warmed[new_pid]:.1f}s)")
    finally:
        load.close(5)
        scale(torchserve.management, model, frontend["minWorkers"], frontend["maxWorkers"])


HANG_BOUND = 10.0


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="TorchServe 0.12 async mode: a dead worker's in-flight jobs are never answered "
                          "(AsyncWorkerThread sends 'Worker died.' only for req, which is null after the flush)")
def test_an_async_worker_killed_mid_batch_answers_its_clients(torchserve, request):
    url = f"{torchserve.inference}/predictions/minilm_async"
    load = Load()
    try:
        victim = one_worker(torchserve.management, "minilm_async")
        in_flight = [load.send(url, slow(i), timeout=HANG_BOUND) for i in range(4)]
        wait_busy([victim], cpu=0.5, timeout=60)
        if any(f.done() for f in in_flight):
            pytest.fail("the requests were answered before the kill")
        os.kill(victim, signal.SIGKILL)
        shots = [f.result(timeout=HANG_BOUND + 10) for f in in_flight]
        hung = [s for s in shots if not s.answered]
        assert not hung, f"{len(hung)} of {len(shots)} in-flight requests got no answer within {HANG_BOUND:.0f}s"
    finally:
        load.close(1)
        restore_workers(torchserve.management, "minilm_async", ASYNC_FRONTEND["minWorkers"], 300)
        # the restarted worker's process outlives the scale-down and `torchserve --stop`: end it
        # once the session's server is stopped (config cleanup runs after session teardown)
        request.config.add_cleanup(lambda: reap_workers(torchserve.paths.tmpdir))


# -- a bad archive: the worker never serves, the model log says why --------------------------------

def test_an_archive_with_a_bad_handler_section_never_serves_and_logs_the_field(tmp_path, tiny_models):
    store = str(tmp_path / "store")
    handler = {"task": "sequence_classification", "buckets": [64, 32], "warmup": False}
    build_archive(ArchiveSpec(tiny_models["sequence_classification"], "bad", model_config(
        handler, {"minWorkers": 1, "maxWorkers": 1, "asyncCommunication": False, "continuousBatching": False,
                  "batchSize": 1}), store))
    ports = free_ports(5)
    settings = ServerSettings(store, ("bad.mar",), inference_port=ports[0], management_port=ports[1],
                              metrics_port=ports[2], grpc_inference_port=ports[3], grpc_management_port=ports[4])
    props = str(tmp_path / "config.properties")
    with open(props, "w") as f:
        f.write(render_properties(settings))
    paths = server.ServerPaths(str(tmp_path / "tmp"), str(tmp_path / "logs"))
    log = os.path.join(paths.logs, "model_log.log")
    message = "ConfigError: handler.buckets must be strictly increasing, got [64, 32]"
    server.start(props, store, paths)
    try:
        wait_until(lambda: message in open(log, errors="replace").read(), 120, every=0.5,
                   what=f"{message!r} in the model log")
        lines = [line for line in open(log, errors="replace") if "handler.buckets" in line and "ConfigError" in line]
        assert lines and all(line.rstrip().endswith(message) for line in lines), lines  # one whole line per load
        statuses = [w.get("status") for w in server.workers(f"http://127.0.0.1:{ports[1]}", "bad")]
        assert "READY" not in statuses, statuses
        assert not re.search(r"tsbatch loaded", open(log, errors="replace").read())
    finally:
        server.stop(paths)
