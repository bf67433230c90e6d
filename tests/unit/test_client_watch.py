"""The generation handler's disconnect rule (handlers/edge/client_watch.py) and its metrics, with
fakes: /proc text as Linux writes it, a fake clock, a fake TorchServe metrics store."""
from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest

from tsbatch.handlers.edge.client_watch import ClientWatch, client_connections, diag_rows, parse_table, proc_rows
from tsbatch.handlers.edge.metrics import Metrics

pytestmark = pytest.mark.unit

TABLE = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 111 1 0 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000  1000        0 222 1 0 20 4 30 10 -1
   2: 0100007F:D431 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 333 1 0 20 4 30 10 -1
   3: 0100007F:1F90 0100007F:D432 08 00000000:00000000 00:00000000 00000000  1000        0 444 1 0 20 4 30 10 -1
"""


def test_a_proc_table_row_gives_ports_state_and_inode():
    rows = parse_table(TABLE)
    assert rows[0] == (8080, "00000000", 0, "0A", 111)
    assert rows[1] == (8080, "0100007F", 54321, "01", 222)
    assert rows[3][3] == "08"  # CLOSE_WAIT: the client closed


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_client_counts_as_gone_only_once_every_connection_open_at_its_arrival_closed():
    clock = FakeClock()
    open_now = {frozenset({("a",), ("b",)})}
    looks = []

    def look():
        looks.append(clock.now)
        return next(iter(open_now))

    watch = ClientWatch(look, every=0.2, clock=clock)
    seen = watch.open_now(since=0.0)
    assert seen == {("a",), ("b",)} and looks == [0.0]
    assert watch.open_now(since=0.0) == seen and looks == [0.0]  # a look after the arrival serves it again
    open_now.clear()
    open_now.add(frozenset({("b",), ("c",)}))  # "a" closed, but "b" may be this request's own
    clock.now = 0.1
    assert not watch.gone(seen) and looks == [0.0]  # looked at most every 0.2 s
    clock.now = 0.3
    assert not watch.gone(seen) and looks == [0.0, 0.3]
    open_now.clear()
    open_now.add(frozenset({("c",)}))
    clock.now = 0.6
    assert watch.gone(seen)
    assert not watch.gone(frozenset())  # nothing seen at arrival: never gone (the rule errs late, not early)


def test_a_watch_that_cannot_look_never_calls_anyone_gone():
    def look():
        raise PermissionError("no /proc here")

    watch = ClientWatch(look, clock=FakeClock())
    assert watch.open_now(since=0.0) == frozenset()
    assert watch.look is None and not watch.gone(frozenset({("a",)}))
    assert not ClientWatch(None).gone(frozenset({("a",)}))


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="Linux /proc only")
@pytest.mark.parametrize("rows", [diag_rows, proc_rows], ids=["sock_diag", "proc"])
@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")], ids=["ipv4", "ipv6"])
def test_this_process_sees_its_own_listening_port_connections_open_and_then_closed(rows, family, host):
    server = socket.socket(family)
    try:
        server.bind((host, 0))
    except OSError:
        server.close()
        pytest.skip(f"no {host} here")
    server.listen()
    port = server.getsockname()[1]
    others = [socket.create_connection((host, port)) for _ in range(2)]  # two more clients, one stays
    client = socket.create_connection((host, port))
    accepted = [server.accept()[0] for _ in range(3)]
    try:
        seen = client_connections(os.getpid(), rows)
        mine = {c for c in seen if c[0] == port}
        assert len(mine) == 3 and {c[2] for c in mine} == {s.getsockname()[1] for s in others + [client]}
        assert not any(c[0] == client.getsockname()[1] for c in seen)  # the client's end is no listening port
        watch = ClientWatch(lambda: client_connections(os.getpid(), rows), every=0.0)
        own = frozenset(c for c in mine if c[2] == client.getsockname()[1])
        assert not watch.gone(own)
        client.close()
        accepted[-1].close()  # the server closes its end once the client's end-of-file arrives, as Netty does
        after = {c for c in client_connections(os.getpid(), rows) if c[0] == port}
        assert after == mine - own and watch.gone(own) and not watch.gone(frozenset(mine))
    finally:
        for s in others + accepted:
            s.close()
        server.close()


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="Linux /proc only")
def test_sock_diag_and_proc_see_the_same_sockets():
    """One look each way, here and now: the same listening and established sockets (ports, state, inode)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        for state in ("0A", "01"):
            diag = {(r[0], r[2], r[3], r[4]) for r in diag_rows(socket.AF_INET, state)}
            proc = {(r[0], r[2], r[3], r[4]) for r in proc_rows(socket.AF_INET, state)}
            mine = {r for r in proc if server.getsockname()[1] in (r[0], r[1])}
            assert mine and mine <= diag
    finally:
        client.close()
        accepted.close()
        server.close()


class FakeStore:
    def __init__(self):
        self.lines = []

    def add_metric(self, name, value, unit, _idx, dims, kind):
        self.lines.append((name, value))


def seq(arrived, first, end, tokens, status="finished"):
    return SimpleNamespace(request=SimpleNamespace(arrived=arrived), first_token_at=first, ended_at=end,
                           tokens=[0] * tokens, status=SimpleNamespace(value=status))


def stats(**kw):
    base = {"running": 0, "waiting": 0, "kv_tokens": 0, "kv_bound": 100, "tokens": 0, "preemptions": 0,
            "out_of_memory_steps": 0, "cancelled": 0}
    return {**base, **kw}


def test_generation_metrics_report_each_finished_request_and_the_counters_growth_at_most_twice_a_second():
    pytest.importorskip("ts")
    clock = FakeClock()
    store = FakeStore()
    metrics = Metrics(store, "lm", clock=clock)
    metrics.generation_step(stats(running=2, kv_tokens=40, tokens=2), [])
    assert dict(store.lines)["tsbatch_generation_output_tokens_total"] == 2
    assert dict(store.lines)["tsbatch_generation_running_sequences"] == 2
    store.lines.clear()
    clock.now = 0.1
    metrics.generation_step(stats(running=2, kv_tokens=42, tokens=4), [])
    assert store.lines == []  # busy and emitted 0.1 s ago: nothing yet
    clock.now = 0.2
    metrics.generation_step(stats(tokens=9, preemptions=1), [seq(0.0, 0.05, 0.25, 6), seq(0.0, None, 0.2, 0, "failed")])
    got = dict(store.lines)
    assert got["tsbatch_generation_time_to_first_token_seconds"] == pytest.approx(0.05)
    assert got["tsbatch_generation_time_per_output_token_seconds"] == pytest.approx(0.04)
    assert got["tsbatch_generation_output_tokens_total"] == 7  # growth since the last emit
    assert got["tsbatch_generation_preemptions_total"] == 1 and got["tsbatch_generation_running_sequences"] == 0
    assert "tsbatch_generation_cancelled_total" not in got  # no growth, no line
    assert [name for name, _ in store.lines].count("tsbatch_generation_time_to_first_token_seconds") == 1
