"""Serialise writes to the worker's backend socket in async mode.

In TorchServe 0.12's async mode the final replies are written by one thread (AsyncService's
send_responses) and intermediate replies by whoever calls send_intermediate_predict_response,
with no lock between them. `sendall` may write a large message in several chunks, so two writers
can interleave bytes and corrupt the stream. tsbatch answers through intermediate replies, so it
puts one process-wide lock around `socket.socket.sendall` in the worker (the worker has one
socket: its connection to the frontend).
"""
from __future__ import annotations

import socket
import threading

_LOCK = threading.Lock()
_INSTALLED = False


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    unlocked = socket.socket.sendall

    def sendall(self, data, *args):
        with _LOCK:
            return unlocked(self, data, *args)

    socket.socket.sendall = sendall
    _INSTALLED = True
