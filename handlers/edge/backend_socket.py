"""The worker's one socket to TorchServe's frontend: two fixes to how TorchServe 0.12 uses it.

- Writes, serialised (async mode): the final replies are written by one thread (AsyncService's
  send_responses) and intermediate replies by whoever calls send_intermediate_predict_response,
  with no lock between them. `sendall` may write a large message in several chunks, so two
  writers can interleave bytes and corrupt the stream. tsbatch answers through intermediate
  replies, so `lock_writes` puts one process-wide lock around `socket.socket.sendall`.
- Reads, buffered (every mode): TorchServe's worker decodes each call field by field with one
  `recv` per field (ts/protocol/otf_message_handler.py, `_retrieve_buffer`): 27 system calls for
  a request with a few headers, and in continuous mode every call re-sends each request the
  worker holds, so on a saturated worker those reads took most of the thread that takes requests
  in, cores the passes lack (bench/results/fc-v1272/buffered-reads/saturation-before.md).
  `buffer_reads` makes `_retrieve_buffer` serve fields from a buffer filled by large reads. Only
  `retrieve_msg` reads that socket, so bytes read ahead wait in the buffer for the next message;
  an empty read (the frontend gone) still ends the worker.
"""
from __future__ import annotations

import logging
import socket
import sys
import threading

_LOCK = threading.Lock()
_INSTALLED: set[str] = set()
_BUFFERS: dict[int, "_Buffered"] = {}  # id of a connection -> what was read from it ahead
READ_AHEAD = 1 << 16  # bytes asked of the socket per read; a recv returns what is there, never waits for more


def lock_writes() -> None:
    """One lock around every `sendall` in this process (the worker has one socket)."""
    if "writes" in _INSTALLED:
        return
    unlocked = socket.socket.sendall

    def sendall(self, data, *args):
        with _LOCK:
            return unlocked(self, data, *args)

    socket.socket.sendall = sendall
    _INSTALLED.add("writes")


class _Buffered:
    """Bytes read from one connection ahead of the field that asked."""

    def __init__(self):
        self.data = bytearray()
        self.start = 0  # where the unread bytes begin

    def take(self, conn, length: int) -> bytearray:
        while len(self.data) - self.start < length:
            chunk = conn.recv(max(READ_AHEAD, length - (len(self.data) - self.start)))
            if not chunk:
                logging.info("Frontend disconnected.")
                sys.exit(0)  # as TorchServe's own reader does
            if self.start:
                del self.data[:self.start]
                self.start = 0
            self.data += chunk
        field = self.data[self.start:self.start + length]
        self.start += length
        return field


def buffer_reads() -> bool:
    """Serve TorchServe's field reads from a buffer per connection. False (and nothing changed)
    where TorchServe's protocol module is not the one this was written for."""
    if "reads" in _INSTALLED:
        return True
    try:
        from ts.protocol import otf_message_handler as otf
    except ImportError:
        return False
    if not callable(getattr(otf, "_retrieve_buffer", None)):
        return False

    def _retrieve_buffer(conn, length):
        buffered = _BUFFERS.get(id(conn))
        if buffered is None:
            buffered = _BUFFERS[id(conn)] = _Buffered()
        return buffered.take(conn, length)

    otf._retrieve_buffer = _retrieve_buffer
    _INSTALLED.add("reads")
    return True
