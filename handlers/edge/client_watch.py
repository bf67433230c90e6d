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

How it looks: the kernel's sock_diag netlink interface, asked for listening and for established
TCP sockets only. /proc/net/tcp prints every bucket of the connection table: 6.6 ms a look (both
tables) on the test VM idle, 7.3 ms under load, whose table has 262,144 buckets; the handler used
to take one on the worker's event loop at every arrival and every 0.2 s (docs/experiments.md,
12-05 00:00). sock_diag filters by state in the kernel (about 1 ms for established sockets of one
address family, 0.02 ms for listening ones), and the handler now looks on a thread. Where netlink
is refused, /proc is read instead; one watch keeps one way of looking, so looks compare like with
like (the two write addresses differently).
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

ESTABLISHED, LISTEN = "01", "0A"  # states in /proc/net/tcp (include/net/tcp_states.h)
TABLES = {socket.AF_INET: "/proc/net/tcp", socket.AF_INET6: "/proc/net/tcp6"}
# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20
NLM_F_REQUEST, NLM_F_DUMP, NLMSG_ERROR, NLMSG_DONE = 0x1, 0x300, 0x2, 0x3
NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
DIAG_REQUEST = struct.Struct("=BBBBI48x")  # inet_diag_req_v2: family, protocol, ext, pad, states, an empty sockid

Row = tuple  # (local port, remote address as hex, remote port, state as /proc writes it, inode)

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


def proc_rows(family: int, state: str) -> list[Row]:
    """The family's TCP sockets in `state`, read from /proc/net/tcp or tcp6 (none where it is missing)."""
    try:
        with open(TABLES[family]) as f:
            return [row for row in parse_table(f.read()) if row[3] == state]
    except FileNotFoundError:
        return []


def diag_rows(family: int, state: str) -> list[Row]:
    """The family's TCP sockets in `state`, as proc_rows gives them, asked of the kernel over netlink
    (sock_diag) so it walks only the sockets in that state; OSError where netlink is refused."""
    request = DIAG_REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << int(state, 16))
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as sock:
        sock.sendto(NLMSG_HEADER.pack(NLMSG_HEADER.size + len(request), SOCK_DIAG_BY_FAMILY,
                                      NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + request, (0, 0))
        rows: list[Row] = []
        address_bytes = 4 if family == socket.AF_INET else 16
        while True:
            data, at = sock.recv(65536), 0
            if not data:
                raise OSError("sock_diag: the dump ended without NLMSG_DONE")
            while at + NLMSG_HEADER.size <= len(data):
                length, kind = NLMSG_HEADER.unpack_from(data, at)[:2]
                if kind == NLMSG_DONE:
                    return rows
                if kind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", data, at + NLMSG_HEADER.size)[0]
                    raise OSError(code, f"sock_diag: {os.strerror(code)}")
                msg = at + NLMSG_HEADER.size  # inet_diag_msg: family, state, timer, retrans, then the sockid
                local, remote = struct.unpack_from(">HH", data, msg + 4)
                address = data[msg + 24:msg + 24 + address_bytes].hex()
                inode = struct.unpack_from("=I", data, msg + 68)[0]
                rows.append((local, address, remote, f"{data[msg + 1]:02X}", inode))
                at += max(NLMSG_HEADER.size, (length + 3) & ~3)


def client_connections(pid: int, rows: Callable[[int, str], list[Row]] = diag_rows) -> frozenset:
    """The open client connections of process `pid`'s listening TCP ports, as `rows` (diag_rows or
    proc_rows: one watch uses one, their addresses are written differently) shows the sockets."""
    inodes = socket_inodes(pid)
    found = set()
    for family in TABLES:
        ports = {row[0] for row in rows(family, LISTEN) if row[4] in inodes}
        if ports:  # established sockets of a family where the process listens
            found.update((local, address, port) for local, address, port, _, inode in rows(family, ESTABLISHED)
                         if local in ports and inode in inodes)
    return frozenset(found)


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
        for rows in (diag_rows, proc_rows):
            try:
                seen = client_connections(pid, rows)
            except OSError as error:
                logger.info("tsbatch generation: %s cannot see the frontend's connections: %s", rows.__name__, error)
                continue
            logger.info("tsbatch generation: watching the frontend's client connections with %s (pid %d, %d open)",
                        rows.__name__, pid, len(seen))
            return cls(lambda: client_connections(pid, rows))
        logger.warning("tsbatch generation: cannot see the frontend's connections: a client that disconnects keeps "
                       "its sequence until it ends")
        return cls(None)

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
