"""Which workers of this model are alive: a lock file per worker in the model's shared directory.

Continuous mode needs it. TorchServe 0.12's continuous-batching frontend re-polls a worker that
still holds requests under the model-wide lock, and an idle sibling blocks inside that same lock
until a new request arrives (wlm/Model.pollInferJob). So a worker that returns with requests
unfinished while a sibling exists can strand them until the next arrival. A worker therefore
asks, before every partial return, whether it is alone.

Every worker of one model shares the extracted archive directory. Each one holds an exclusive
`flock` on its own file there for as long as it lives; the kernel drops the lock when the process
exits, however it dies (SIGKILL, OOM killer, scale-down), so a file whose lock can be taken is a
dead worker's and is removed. No pids are trusted, so pid reuse cannot fake a sibling.

A new worker joins at the start of initialize() marked as loading, and says it is ready at the
end, `READY_MARGIN_S` before initialize() returns and it can first poll. A loading sibling cannot
hold the lock, so until then the serving workers go on answering as the model's only worker: a
scale-up or a restart does not turn them into workers that answer each call whole, held to its
slowest request, while TorchServe's queue grows unseen behind them (12-07 19:28, docs/experiments.md).
Pure: no torch, no TorchServe; the clock is injected for tests.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
import uuid
from typing import Callable

logger = logging.getLogger(__name__)

FOLDER = ".tsbatch-workers"
# the first byte of a worker's file: loading (joined, not polling yet), inside a call, polling
LOADING, IN_CALL, POLLING = b"L", b"1", b"0"
# a ready worker's siblings see it within their cache's ttl: it waits this long before it can poll
READY_MARGIN_S = 1.0  # ample on an overcommitted host, where a call's return can lag its decision


class Siblings:
    """This worker's entry in the model's registry, and a cached count of the other live ones."""

    def __init__(self, model_dir: str, ttl: float = 0.2, clock: Callable[[], float] = time.monotonic):
        self.folder = os.path.join(model_dir, FOLDER)
        self.ttl = ttl  # a joining worker needs seconds before it can poll, so a short cache is safe
        self.clock = clock
        self.name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}.lock"
        self._fd: int | None = None
        self._count = 0
        self._serving = 0  # of those, the ones past loading (they poll between calls)
        self._checked = float("-inf")

    def join(self) -> "Siblings":
        os.makedirs(self.folder, exist_ok=True)
        # locked under a temporary name, then renamed: no sibling ever sees this file unlocked
        # (and takes it for a dead worker's)
        staging = os.path.join(self.folder, self.name + ".new")
        fd = os.open(staging, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, LOADING, 0)  # loading and warming: not polling, as busy as a call (ready() once done)
        os.rename(staging, os.path.join(self.folder, self.name))
        self._fd = fd
        self._checked = float("-inf")
        return self

    def leave(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(os.path.join(self.folder, self.name))
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def others(self, fresh: bool = False) -> int:
        """Live workers of this model besides this one (0 when the registry cannot be read:
        a worker that cannot see siblings behaves as it did before this registry existed).
        Counted at most every `ttl` seconds unless `fresh`."""
        now = self.clock()
        if not fresh and now - self._checked < self.ttl:
            return self._count
        paths = (os.path.join(self.folder, name) for name in self._others_files())
        states = [state for state in map(_live_state, paths) if state is not None]
        count = len(states)
        if not fresh:  # a fresh count is for a one-off decision; the cache keeps its own schedule
            self._count, self._serving, self._checked = count, sum(s != LOADING for s in states), now
        return count

    def alone(self) -> bool:
        """No sibling can poll TorchServe's queue: none, or only ones still loading (they share
        the cores, `others`, but cannot strand this worker's requests)."""
        self.others()
        return self._serving == 0

    def ready(self) -> None:
        """Loaded and warm: from the next call on this worker polls between calls. Its siblings
        read that within their ttl; the caller waits `READY_MARGIN_S` before it may poll."""
        self.in_call(False)

    def _others_files(self) -> list[str]:
        """The other workers' registry files (none when the registry cannot be read)."""
        try:
            return [n for n in os.listdir(self.folder) if n.endswith(".lock") and n != self.name]
        except OSError:
            return []

    def in_call(self, busy: bool) -> None:
        """Say whether this worker is inside a call (one byte at the start of its file). A sibling
        that is not is polling TorchServe's queue, so that queue holds no backlog."""
        if self._fd is not None:
            try:
                os.pwrite(self._fd, IN_CALL if busy else POLLING, 0)
            except OSError:
                pass

    def any_idle(self) -> bool:
        """Whether some live sibling is outside a call (waiting for the next request)."""
        return any(_state(os.path.join(self.folder, name)) == POLLING for name in self._others_files())


def _state(path: str) -> bytes | None:
    """A worker file's first byte (LOADING, IN_CALL, POLLING), None when it is gone."""
    try:
        with open(path, "rb") as f:
            return f.read(1)
    except OSError:
        return None


def _live_state(path: str) -> bytes | None:
    """The state byte of a live worker's file (it holds the file's lock), read through the same
    open; None when that worker is gone, and a dead worker's file is removed."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None  # removed meanwhile: its worker left
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            return os.pread(fd, 1, 0)
        except OSError:
            return b""  # alive, state unreadable: counted as serving, as a sibling always was
    except OSError:
        return None
    else:
        try:
            os.unlink(path)
        except OSError:
            pass
        logger.info("tsbatch: removed %s, left by a worker that is gone", os.path.basename(path))
        return None
    finally:
        os.close(fd)


def fit_threads(asked: int | None, cores: int, workers: int) -> tuple[int | None, str]:
    """Intra-op threads for one of `workers` workers on `cores` cores, and why, if not as asked.

    An archive tuned for a bigger machine (`tsbatch archive --cores 8`) asks for more threads
    than a smaller one has: OpenMP teams that outnumber the cores spin against each other (warmup
    of 2 workers x 4 threads on 2 cores outran startupTimeout), so each worker
    takes its share of the cores instead. None (torch's default) stays for a lone worker."""
    share = max(1, cores // max(1, workers))
    if asked is None:
        return (None, "") if workers <= 1 else (share, f"{workers} workers share {cores} cores: {share} each")
    if asked <= share:
        return asked, ""
    return share, (f"handler.torch_threads={asked}, but {workers} worker(s) share {cores} cores here: {share} "
                   f"each (the archive was tuned for a bigger machine; `tsbatch archive` here tunes for this one)")


def usable_cores() -> int:
    """Cores this process may run on (its affinity), or every core the OS reports."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
