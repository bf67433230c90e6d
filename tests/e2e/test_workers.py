"""Several workers of one model, served exactly as `tsbatch archive` builds it, through a real torchserve.

The archives come from the CLI a user runs (`tsbatch profile` once, then `tsbatch archive
--profile` for this 2-core machine and for an 8-core one with `--cores 8`), each served with its
own generated config.properties and model-config.yaml; only the ports are chosen free. Workers are
scaled the README's way, with the management API. A request must never wait for another request
to arrive (TorchServe 0.12's continuous batching re-polls a worker under the lock an idle sibling
holds): lone requests are sent with idle gaps, and each must be answered well inside its gap.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import statistics
import threading
import time

import pytest
import requests

from tsbatch.archiver import server
from bench.loadtest.load import Load
from bench.loadtest.stats import by_status
from bench.loadtest.torchserve import wait_until, worker_pids
from tsbatch.handlers.edge.stages import WORKER_HEADER
from tests.e2e.conftest import NAME, serve_built
from tests.support import cosine

SHORT = "How do I scale TorchServe workers without losing requests?"
LONG = " ".join(["A much longer passage about serving models, batching requests by length and warming"
                 " every shape before the worker reports that it is ready."] * 9)
GAPS = (0.2, 1.5, 3.0, 0.5, 1.0, 2.0)
# a lone request stranded by a sibling waits for the next arrival, i.e. its whole gap: answers must
# come well inside the shortest long gap (1 s)
STRANDED_S = 0.9


@pytest.fixture(scope="module")
def reference(minilm_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_dir, device="cpu")
    return {text: model.encode([text])[0].tolist() for text in (SHORT, LONG)}


def scale(served, workers: int) -> None:
    """The README's way: tsbatch scale (TorchServe's management API without its synchronous mode)."""
    server.scale(served.management, NAME, workers, timeout=900)


def lone_requests(served, reference) -> list[tuple[str, float, float]]:
    """Short and long requests one at a time, each after an idle gap: (kind, gap, seconds)."""
    url = f"{served.inference}/predictions/{NAME}"
    out = []
    for i, gap in enumerate(GAPS):
        time.sleep(gap)
        kind, text = ("short", SHORT) if i % 2 == 0 else ("long", LONG)
        started = time.monotonic()
        response = requests.post(url, data=text.encode(), headers={"Content-Type": "text/plain"}, timeout=30)
        took = time.monotonic() - started
        assert response.status_code == 200, response.text
        assert cosine(response.json()["embedding"], reference[text]) >= 0.999
        out.append((kind, gap, took))
    return out


def medians(results) -> dict[str, float]:
    return {kind: statistics.median(t for k, _, t in results if k == kind) for kind in ("short", "long")}


@pytest.fixture(scope="module")
def one_worker_latency(shipped, reference) -> dict[str, float]:
    scale(shipped, 1)
    return medians(lone_requests(shipped, reference))


def check_lone(results, baseline: dict[str, float]) -> None:
    for kind, gap, took in results:
        assert took < STRANDED_S, f"a lone {kind} request after a {gap} s gap took {took:.2f} s: it waited for a sibling"
    for kind, median in medians(results).items():
        # medians of 3, against 3x the one-worker median: the check is about waiting, not noise
        assert median <= 3 * baseline[kind] + 0.05, f"{kind}: median {median:.3f} s vs one worker {baseline[kind]:.3f} s"


@pytest.mark.parametrize("workers", [2, 3])
def test_lone_requests_are_answered_without_waiting_for_another(shipped, reference, one_worker_latency, workers):
    scale(shipped, workers)
    check_lone(lone_requests(shipped, reference), one_worker_latency)


def burst_texts(count: int) -> list[bytes]:
    texts = [(LONG + f" {i}" if i % 4 == 0 else f"burst request {i} about scaling").encode() for i in range(count)]
    texts[5] = b'{"text": "unterminated'
    return texts


def check_burst(served) -> None:
    """24 mixed requests at once, one malformed: it alone fails with 400; every other one is
    answered, 200 unless the archive's deadline (twice its p99 target) cannot be kept on this
    shared machine, which refuses it at once (503) or answers 504 saying so, never late."""
    url = f"{served.inference}/predictions/{NAME}"
    load = Load()
    try:
        futures = [load.send(url, body, "application/json" if i == 5 else "text/plain", timeout=120)
                   for i, body in enumerate(burst_texts(24))]
        shots = [f.result(timeout=180) for f in futures]
    finally:
        load.close(1)
    assert all(s.answered for s in shots), [s.error for s in shots]
    assert shots[5].status == 400
    others = shots[:5] + shots[6:]
    past_deadline = [s for s in others if s.status in (503, 504) and b"deadline" in s.body]
    assert all(s.status == 200 for s in others if s not in past_deadline), [(s.status, s.body[:80]) for s in others]
    assert len(past_deadline) <= len(others) // 4, f"{len(past_deadline)} of {len(others)} past their deadline"


def test_a_mixed_burst_over_three_workers_is_answered_in_full(shipped):
    scale(shipped, 3)
    check_burst(shipped)


@contextlib.contextmanager
def under_load(url: str, rate: float = 6.0):
    """Requests at `rate` per second (every fifth one long) from a thread while the body runs;
    yields the list that receives every request's answer (a Shot) once the body is done."""
    load, stop, shots = Load(), threading.Event(), []

    def send() -> None:
        started, i = time.monotonic(), 0
        while not stop.is_set():
            load.send(url, (SHORT if i % 5 else LONG).encode(), timeout=120, tag=str(i))
            i += 1
            time.sleep(max(0.0, started + i / rate - time.monotonic()))

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        yield shots
    finally:
        stop.set()
        sender.join(10)
        shots.extend(f.result(timeout=180) for f in list(load._futures))
        load.close(1)


def test_scaling_one_to_three_to_one_under_load_answers_every_request(shipped):
    scale(shipped, 1)
    with under_load(f"{shipped.inference}/predictions/{NAME}") as shots:
        up = time.monotonic()
        scale(shipped, 3)
        up_done = time.monotonic()
        time.sleep(3)
        down = time.monotonic()
        scale(shipped, 1)
        down_done = time.monotonic()
        time.sleep(3)
    assert len(shots) > 30
    # TorchServe 0.12's synchronous scale call holds a Netty thread until the new workers are warm, and
    # the inference connections on that thread wait unread (every fourth here): scaled the README's
    # way, none waits for the scale-up (seconds of warmup) while the archive's deadline is about 1 s
    stalled = [s for s in shots if up <= s.sent < up_done and (s.latency or 0) > 10]
    assert not stalled, (f"{len(stalled)} requests sent during a {up_done - up:.0f} s scale-up waited > 10 s "
                         f"(tag, seconds): {[(s.tag, round(s.latency, 1)) for s in stalled]}")
    # TorchServe 0.12's scale-down races with a stopping worker's thread: WorkerThread.shutdown()
    # re-queues the jobs it holds while the interrupted thread fails or clears the same unsynchronised
    # map, so a request that reached a stopping worker in that instant can get no answer at all (seen
    # once in a fresh-clone run: the request sent at the scale-down call, not in the access log, no
    # "Worker died."). It never reached tsbatch; at most one, and only then.
    unanswered = [s for s in shots if not s.answered]
    assert all(down - 1 <= s.sent <= down_done + 1 for s in unanswered), \
        f"{len(unanswered)} of {len(shots)} requests got no answer: {unanswered[:3]}"
    assert len(unanswered) <= 1, f"{len(unanswered)} of {len(shots)} requests got no answer: {unanswered[:3]}"
    # TorchServe 0.12 stops a scaled-down worker by closing its socket and interrupting its thread,
    # which may answer the requests it held with 500 "Worker died." (a race in WorkerThread.shutdown)
    # instead of handing them to a sibling: those may fail, only at the scale-down. And while new
    # workers warm (or stop) on the same 2 cores, the serving ones slow and a backlog builds in
    # TorchServe's queue: they shed what their calls cannot take with 503 and Retry-After.
    died = [s for s in shots if s.status == 500]
    assert all(b"Worker" in s.body and down - 5 <= s.sent <= down_done for s in died), [s.body[:80] for s in died]
    assert len(died) <= 5, f"{len(died)} of {len(shots)} failed at the scale-down"
    shed = [s for s in shots if s.status == 503]
    assert all(s.headers.get("retry-after") and b"retry" in s.body for s in shed), [s.body[:80] for s in shed]
    # the archive as built answers within its deadline (twice the p99 target) or says 504: a request
    # caught behind the warming workers' CPU is answered 504 at its deadline, not late
    late = [s for s in shots if s.status == 504]
    assert all(b"deadline" in s.body for s in late), [s.body[:80] for s in late]
    assert {s.status for s in shots} <= {200, 500, 503, 504}
    assert sum(s.status == 200 for s in shots) >= len(shots) // 2, by_status(shots)
    assert len({s.headers.get(WORKER_HEADER) for s in shots}) >= 2, "one worker served everything"


def test_a_worker_killed_while_its_siblings_serve(shipped):
    """SIGKILL one of three workers under load: its siblings go on serving, no request goes
    unanswered, only requests the dead worker held may fail (TorchServe's 'Worker died.'), and the
    worker comes back warm."""
    scale(shipped, 3)
    victim = worker_pids(shipped.management, NAME)[0]
    with under_load(f"{shipped.inference}/predictions/{NAME}") as shots:
        time.sleep(3)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        time.sleep(5)
    assert not [s for s in shots if not s.answered], "a request got no answer"
    # while the replacement warms on the same two cores the siblings slow down: a request that
    # could not be answered within the archive's deadline gets 504 saying so, never a late answer
    late = [s for s in shots if s.status == 504 and b"deadline" in s.body]
    after = [s for s in shots if s.sent > killed + 1.0 and s not in late]
    assert after and all(s.status == 200 for s in after), sorted({s.status for s in after})
    assert len(late) <= len(shots) // 4, f"{len(late)} of {len(shots)} past their deadline"
    failed = [s for s in shots if s.status != 200 and s not in late]
    assert all(s.status >= 500 and s.sent < killed + 1.0 for s in failed), [(s.status, s.body[:80]) for s in failed]
    wait_until(lambda: len([w for w in server.workers(shipped.management, NAME) if w["status"] == "READY"]) == 3
               and victim not in worker_pids(shipped.management, NAME), 600, what="the killed worker replaced")


@pytest.fixture(scope="module")
def eight_core(tmp_path_factory, built_profile):
    """The archive `tsbatch archive --cores 8` plans for an 8-core machine, served here as built:
    2 workers x 4 threads, which each worker fits to its share of these 2 cores."""
    served = serve_built(tmp_path_factory.mktemp("eight"), built_profile, "--cores", "8")
    try:
        server.wait_ready(served.management, NAME, 600, min_workers=2)
        yield served
    finally:
        server.stop(served.paths)


def test_the_archive_tuned_for_eight_cores_plans_two_workers_of_four_threads(eight_core):
    import zipfile

    import yaml

    with zipfile.ZipFile(os.path.join(eight_core.store, f"{NAME}.mar")) as mar:
        config = yaml.safe_load(mar.read("model-config.yaml"))
    assert (config["minWorkers"], config["handler"]["torch_threads"]) == (2, 4)
    assert config["continuousBatching"] is True and config["maxWorkers"] == 2
    with open(eight_core.properties) as f:
        assert re.search(r"^default_workers_per_model=2$", f.read(), re.M)
    with open(os.path.join(eight_core.paths.logs, "model_log.log")) as f:
        assert "each (the archive was tuned for a bigger machine" in f.read()  # fitted to 2 cores, said so


@pytest.mark.parametrize("workers", [2, 3])
def test_the_eight_core_archive_answers_lone_requests_and_a_burst(eight_core, reference, one_worker_latency, workers):
    scale(eight_core, workers)
    check_lone(lone_requests(eight_core, reference), one_worker_latency)
    check_burst(eight_core)
