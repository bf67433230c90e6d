"""Intra-op threads set on one thread stay set whatever other threads set later."""
from __future__ import annotations

import threading

import pytest
import torch

from tsbatch.handlers.models.threads import use_intra_op_threads

pytestmark = pytest.mark.integration


def _first_pass_threads(set_threads) -> int:
    """A lane sets 1 thread; another lane then sets 2; the first lane's first parallel op runs:
    how many threads it runs on."""
    seen: list[int] = []
    lane_set, other_set = threading.Event(), threading.Event()

    def lane() -> None:
        set_threads(1)
        lane_set.set()
        other_set.wait()
        x = torch.ones(256, 256)
        (x @ x).sum()
        seen.append(torch.get_num_threads())

    def other() -> None:
        lane_set.wait()
        set_threads(2)
        other_set.set()

    threads = [threading.Thread(target=lane), threading.Thread(target=other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return seen[0]


def test_a_lanes_thread_count_survives_another_lane_setting_its_own():
    main = torch.get_num_threads()
    try:
        assert _first_pass_threads(use_intra_op_threads) == 1
    finally:
        torch.set_num_threads(main)


def test_a_bare_set_num_threads_is_overridden_on_the_lanes_first_pass():
    """What use_intra_op_threads works around (PyTorch's lazy per-thread setting): if this ever
    passes, PyTorch changed and the workaround may go."""
    main = torch.get_num_threads()
    try:
        assert _first_pass_threads(torch.set_num_threads) == 2
    finally:
        torch.set_num_threads(main)
