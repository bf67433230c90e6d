"""tsbatch.handlers.edge.backend_socket: TorchServe's own reader decodes the same calls with
`buffer_reads` installed, however the frontend's bytes arrive, and an empty read still ends the worker."""
from __future__ import annotations

import socket
import struct
import threading

import pytest

from tsbatch.handlers.edge import backend_socket

otf = pytest.importorskip("ts.protocol.otf_message_handler")

pytestmark = pytest.mark.unit


def field(value: bytes) -> bytes:
    return struct.pack("!i", len(value)) + value


END = struct.pack("!i", -1)
TIMEOUT_S = 10.0  # a reader that lost its place waits for bytes that never come: fail, do not hang


def pair() -> tuple[socket.socket, socket.socket]:
    reader, writer = socket.socketpair()
    reader.settimeout(TIMEOUT_S)
    return reader, writer


def call(requests: list[tuple[bytes, list[tuple[bytes, bytes]], bytes | None]]) -> bytes:
    """A predict call as the frontend encodes it: per request its id, its headers, and its input
    (None: a request the worker already holds, re-sent with no input, as continuous mode does)."""
    out = b"I"
    for rid, headers, body in requests:
        out += field(rid) + b"".join(field(k) + field(v) for k, v in headers) + END
        if body is not None:
            out += field(b"body") + field(b"text/plain") + field(body)
        out += END
    return out + END


CALLS = [
    call([(b"a" * 36, [(b"host", b"127.0.0.1"), (b"x-deadline-ms", b"800")], b"a short text")]),
    call([(b"b" * 36, [(b"content-type", b"text/plain"), (b"empty", b"")], "é long ".encode() * 500),
          (b"a" * 36, [(b"host", b"127.0.0.1")], None)]),
    call([]),
]


def decoded(messages: bytes, chunk: int) -> list:
    """retrieve_msg over a socket pair while another thread sends `messages` `chunk` bytes at a time."""
    reader, writer = pair()

    def send() -> None:
        try:
            for start in range(0, len(messages), chunk):
                writer.sendall(messages[start:start + chunk])
        except OSError:
            pass  # the reader gave up (its test fails there)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        return [otf.retrieve_msg(reader) for _ in CALLS]
    finally:
        reader.close()  # a reader that failed early: the sender's next write fails, it ends
        sender.join(TIMEOUT_S)
        writer.close()


def install_buffered_reads(monkeypatch) -> None:
    """`buffer_reads` as a worker installs it, on fresh state; TorchServe's reader is put back
    after the test."""
    monkeypatch.setattr(otf, "_retrieve_buffer", otf._retrieve_buffer)
    monkeypatch.setattr(backend_socket, "_INSTALLED", set())
    monkeypatch.setattr(backend_socket, "_BUFFERS", {})
    assert backend_socket.buffer_reads()
    assert otf._retrieve_buffer.__module__ == backend_socket.__name__


@pytest.fixture
def buffered(monkeypatch):
    install_buffered_reads(monkeypatch)


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])  # a byte at a time, fields split anywhere, every call at once
def test_buffered_reads_decode_every_call_as_torchserves_own_reader_does(chunk, monkeypatch):
    messages = b"".join(CALLS)
    expected = decoded(messages, chunk)
    assert [cmd for cmd, _ in expected] == [b"I"] * 3 and len(expected[1][1]) == 2
    install_buffered_reads(monkeypatch)  # after TorchServe's own reader has decoded them
    assert decoded(messages, chunk) == expected


def test_an_empty_read_ends_the_worker_as_torchserve_does(buffered):
    reader, writer = pair()
    writer.sendall(CALLS[0][:10])  # a call cut short, then the frontend gone
    writer.close()
    with pytest.raises(SystemExit):
        otf.retrieve_msg(reader)
    reader.close()


def test_reads_ahead_wait_for_the_next_message(buffered):
    reader, writer = pair()
    writer.sendall(CALLS[0] + CALLS[1])  # one read takes both
    first = otf.retrieve_msg(reader)
    second = otf.retrieve_msg(reader)
    assert first[1][0]["requestId"] == b"a" * 36
    assert [r["requestId"] for r in second[1]] == [b"b" * 36, b"a" * 36]
    assert second[1][0]["parameters"][0]["value"] == "é long " * 500
    reader.close()
    writer.close()


class Counted:
    """A socket that counts the reads asked of it."""

    def __init__(self, sock):
        self.sock, self.reads = sock, 0

    def recv(self, size):
        self.reads += 1
        return self.sock.recv(size)


def test_a_call_already_there_takes_one_read_and_nothing_read_stays_behind(buffered):
    reader, writer = pair()
    counted = Counted(reader)
    for _ in range(50):
        writer.sendall(CALLS[1])
        assert otf.retrieve_msg(counted)[1][0]["requestId"] == b"b" * 36
    assert counted.reads == 50  # TorchServe's own reader: 27 reads for this call
    held = backend_socket._BUFFERS[id(counted)]
    assert len(held.data) - held.start == 0 and len(held.data) <= len(CALLS[1])  # the buffer does not grow
    reader.close()
    writer.close()
