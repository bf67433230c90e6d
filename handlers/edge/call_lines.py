"""What TorchServe 0.12's worker prints on every call, cut to what anyone reads.

In continuous mode the frontend calls a worker again as soon as it returns while it holds a
request, and tsbatch's worker returns every `poll_ms` to take new arrivals in: hundreds of calls a
second. On each, TorchServe's worker prints two lines to its stdout, and the frontend reads,
parses and logs each one:
- INFO "Backend received inference at: <time>" (ts/protocol/otf_message_handler.py), which
  tsbatch's log4j2.xml leaves out of every log anyway;
- the PredictionTime metric (ts/service.py), a gauge of how long the call took, its line carrying
  the id of every request the worker holds (a held request is re-sent with each call).
That work runs beside the passes; while a pass runs on every core (`borrow_cores`) it takes a core
from the pass's team on each call (docs/experiments.md, 12-06 20:15 and 20:34). `quiet_calls`
drops the first and emits the second at most once a second: the gauge a scrape reads stays
current to the second.
"""
from __future__ import annotations

import logging
import time

RECEIVED = "Backend received inference at: %d"  # TorchServe's per-call INFO line, format as logged
PREDICTION_TIME = "PredictionTime"
EVERY_S = 1.0  # PredictionTime is emitted at most this often


class _DropReceived(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != RECEIVED


def quiet_calls(metrics, clock=time.monotonic) -> None:
    """Drop TorchServe's per-call INFO line (root logger, this process) and emit PredictionTime
    through `metrics` (the context's metrics cache) at most every EVERY_S; other metrics pass."""
    root = logging.getLogger()
    if not any(isinstance(f, _DropReceived) for f in root.filters):
        root.addFilter(_DropReceived())
    add_time = getattr(metrics, "add_time", None)
    if add_time is None or getattr(add_time, "_tsbatch_throttled", False):
        return
    last = [float("-inf")]

    def throttled(name, value, *args, **kwargs):
        if name == PREDICTION_TIME:
            now = clock()
            if now - last[0] < EVERY_S:
                return None
            last[0] = now
        return add_time(name, value, *args, **kwargs)

    throttled._tsbatch_throttled = True
    metrics.add_time = throttled
