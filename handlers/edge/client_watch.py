"""Whether a request's client is still connected, seen from a TorchServe worker (Linux /proc).

Found in TorchServe 0.12.0's sources (frontend/server/src/main/java/org/pytorch/serve/): nothing
tells an async-mode worker that a client went away. AsyncBatchAggregator keeps the job in
`jobs_in_backend` until a reply marked ts_stream_next=false and never looks at the client's
channel; RestJob.responseInference writes each streamed chunk with `ctx.writeAndFlush` to the
closed channel, whose failed future nobody reads; `Job.isOpen()` exists but only
ContinuousBatching.sendResponse calls it (to stop re-sending the job), and no message goes to the
backend either way. So a disconnected stream would keep its seat until its max_new_tokens or
its deadline.

What the worker can see: the frontend is its parent process on the same host, and a client's
TCP connection is a socket of that process in ESTABLISHED state on one of its listening ports.
Netty closes a connection whose client closed (it reads end-of-file), so the socket leaves
/proc/net/tcp. The frontend does not say which connection carried which request, so the rule is
one that can only err late, never early: a request remembers the client connections open when it
reached the handler (its own is one of them) and its client counts as gone once none of those is
open any more. A client alone on the server is seen gone within a check; under load with
long-lived keep-alive connections it may be seen late or never (its deadline still bounds it).
Where /proc cannot be read (not Linux, or the parent is not the frontend) nothing is ever gone.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

ESTABLISHED, LISTEN = "01", "0A"  # states in /proc/net/tcp (include/net/tcp_states.h)
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")

Connection = tuple  # (local port, remote address as hex, remote port)


def parse_table(text: str) -> list[tuple[int, str, int, str, int]]:
    """(local port, remote address, remote port, state, inode) of each row of a /proc/net/tcp table."""
    rows = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        local, remote, state, inode = parts[1], parts[2], parts[3], parts[9]
        address, _, port = remote.rpartition(":")
        rows.append((int(local.rpartition(":")[2], 16), address, int(port, 16), state, int(inode)))
    return rows


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds open."""
    inodes = set()
    folder = f"/proc/{pid}/fd"
    for name in os.listdir(folder):
        try:
            target = os.readlink(os.path.join(folder, name))
        except OSError:
            continue  # closed while listed
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def client_connections(pid: int, tables: tuple[str, ...] = TABLES) -> frozenset:
    """The open client connections of process `pid`'s listening TCP ports."""
    inodes = socket_inodes(pid)
    rows = []
    for table in tables:
        try:
            with open(table) as f:
                rows += parse_table(f.read())
        except FileNotFoundError:
            continue
    ports = {row[0] for row in rows if row[3] == LISTEN and row[4] in inodes}
    return frozenset((local, address, port) for local, address, port, state, inode in rows
                     if state == ESTABLISHED and local in ports and inode in inodes)


class ClientWatch:
    """`open_now()` when a request arrives; `gone(seen)` later: True once none of `seen` is open.
    One look at /proc serves every request for `every` seconds."""

    def __init__(self, look: Callable[[], frozenset] | None, every: float = 0.2,
                 clock: Callable[[], float] = time.monotonic):
        self.look = look  # None: watching is off, nothing is ever gone
        self.every = every
        self.clock = clock
        self.lock = threading.Lock()
        self.last: frozenset = frozenset()
        self.at = float("-inf")

    @classmethod
    def of_frontend(cls) -> "ClientWatch":
        """Watching the parent process (TorchServe's frontend starts its workers), if /proc shows it."""
        pid = os.getppid()
        try:
            seen = client_connections(pid)
        except OSError as error:
            logger.warning("tsbatch generation: cannot see the frontend's connections (%s): a client that "
                           "disconnects keeps its sequence until it ends", error)
            return cls(None)
        logger.info("tsbatch generation: watching the frontend's client connections (pid %d, %d open)", pid, len(seen))
        return cls(lambda: client_connections(pid))

    def open_now(self, since: float | None = None) -> frozenset:
        """The open connections, as seen at `since` (monotonic) or later; None: any look from the last
        `every` seconds. A request's own connection is in a look taken after it arrived, not before."""
        if self.look is None:
            return frozenset()
        with self.lock:
            now = self.clock()
            if (self.at < since) if since is not None else (now - self.at >= self.every):
                try:
                    self.last, self.at = self.look(), now
                except OSError:
                    self.look = None  # the frontend is gone or hidden: stop looking, never cancel
                    return frozenset()
            return self.last

    def gone(self, seen: frozenset) -> bool:
        """True when none of the connections open at the request's arrival is open now (never when
        none was seen)."""
        if not seen or self.look is None:
            return False
        return not (seen & self.open_now())
