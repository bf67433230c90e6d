"""The intra-op threads of the calling thread, set so that they stay set."""
from __future__ import annotations

import torch


def use_intra_op_threads(count: int) -> None:
    """Give the calling thread `count` intra-op threads for its passes. PyTorch fixes a thread's
    OpenMP count lazily, at its first parallel op, to whatever the last `torch.set_num_threads` of
    *any* thread left process-wide, overriding what this thread set before. A short lane that set 1
    while the borrowing lane warmed on 2 ran every pass on 2: a second OpenMP team, three threads
    on two cores, and the borrowed passes at their one-thread speed (scratch 12-06 17:30). Asking
    for the count first runs that lazy setting now, so the one set after it stays."""
    torch.get_num_threads()
    torch.set_num_threads(max(1, count))
