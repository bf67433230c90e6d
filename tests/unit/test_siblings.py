"""The sibling registry: live workers of one model seen through lock files, dead ones forgotten."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tsbatch.handlers.edge.siblings import FOLDER, Siblings, fit_threads, usable_cores

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOIN_AND_WAIT = """
import sys, time
from tsbatch.handlers.edge.siblings import Siblings
Siblings(sys.argv[1]).join()
print("joined", flush=True)
time.sleep(600)
"""


def test_workers_of_one_model_see_each_other_and_not_other_models(tmp_path):
    a = Siblings(str(tmp_path / "model-a"), ttl=0).join()
    assert a.alone()
    b = Siblings(str(tmp_path / "model-a"), ttl=0).join()
    other = Siblings(str(tmp_path / "model-b"), ttl=0).join()
    assert a.others() == 1 and b.others() == 1 and other.alone()
    b.leave()
    assert a.alone()


def test_a_killed_worker_stops_counting_and_its_file_is_removed(tmp_path):
    me = Siblings(str(tmp_path), ttl=0).join()
    child = subprocess.Popen([sys.executable, "-c", JOIN_AND_WAIT, str(tmp_path)], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "joined"
        assert me.others() == 1
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        assert me.others() == 0
        assert os.listdir(tmp_path / FOLDER) == [me.name]
    finally:
        if child.poll() is None:
            child.kill()


def test_the_count_is_cached_for_ttl_seconds(tmp_path):
    now = [0.0]
    me = Siblings(str(tmp_path), ttl=0.2, clock=lambda: now[0]).join()
    assert me.others() == 0
    sibling = Siblings(str(tmp_path)).join()
    now[0] = 0.1
    assert me.others() == 0  # still the cached count
    now[0] = 0.3
    assert me.others() == 1
    sibling.leave()


def test_a_file_that_is_not_locked_is_a_dead_workers(tmp_path):
    me = Siblings(str(tmp_path), ttl=0).join()
    stale = tmp_path / FOLDER / "12345-deadbeef.lock"
    stale.write_text("")
    assert me.others() == 0 and not stale.exists()


@pytest.mark.parametrize("asked, cores, workers, expected", [
    (4, 8, 2, 4),  # as tuned: 2 x 4 on 8 cores
    (4, 2, 2, 1),  # the 8-core archive on 2 cores: each worker's share
    (2, 2, 1, 2),
    (4, 2, 1, 2),
    (1, 2, 3, 1),  # never below one thread
    (None, 2, 1, None),  # a lone worker keeps torch's default
    (None, 8, 3, 2),
])
def test_fit_threads_never_oversubscribes_the_cores(asked, cores, workers, expected):
    threads, why = fit_threads(asked, cores, workers)
    assert threads == expected
    assert bool(why) == (threads != asked)


def test_usable_cores_counts_this_process_affinity():
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


def test_a_sibling_outside_a_call_is_idle_and_a_warming_one_is_not(tmp_path):
    first = Siblings(str(tmp_path)).join()
    assert not first.any_idle()  # alone: no sibling at all
    second = Siblings(str(tmp_path)).join()
    assert not first.any_idle()  # joined: loading and warming, not polling yet
    second.ready()  # READY, waiting for requests
    assert first.any_idle()
    second.in_call(True)
    assert not first.any_idle()
    second.leave()
    assert not first.any_idle()


def test_a_loading_sibling_shares_the_cores_but_cannot_strand_requests(tmp_path):
    """A sibling that is still loading cannot hold TorchServe's poll lock: this worker still
    answers as the model's only worker (alone), while the cores are already shared (others)."""
    me = Siblings(str(tmp_path), ttl=0).join()
    sibling = Siblings(str(tmp_path), ttl=0).join()
    assert me.others() == 1 and me.others(fresh=True) == 1
    assert me.alone() and not me.any_idle()
    sibling.ready()
    assert not me.alone() and me.any_idle()
    sibling.in_call(True)
    assert not me.alone() and not me.any_idle()
    sibling.leave()
    assert me.alone()


def test_alone_is_cached_with_the_count(tmp_path):
    now = [0.0]
    me = Siblings(str(tmp_path), ttl=0.2, clock=lambda: now[0]).join()
    sibling = Siblings(str(tmp_path)).join()
    assert me.alone()  # loading
    sibling.ready()
    now[0] = 0.1
    assert me.alone()  # the cached view: why a ready worker waits READY_MARGIN_S before it polls
    now[0] = 0.3
    assert not me.alone()
    sibling.leave()
