"""bench/loadtest, the library under the bench scripts: percentiles, arrivals, the HTTP client's
parsing, /proc readings and report writing; and the layout rules that keep it the one home."""
from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

from bench.loadtest import report
from bench.loadtest.arrivals import at_arrivals, poisson_arrivals
from bench.loadtest.client import Shot, read_response, request_head, shoot, split_url
from bench.loadtest.load import Result, RunResult, as_result
from bench.loadtest.proc import MemorySampler, alive, cpu_seconds, machine_cpu, pids_with, rss_kb, threads_cpu
from bench.loadtest.stats import CLIENT_BEHIND_MS, by_status, client_behind, client_lag, percentile, rounded, summarize
from bench.loadtest.sweep import brief
from bench.loadtest.workload import Request

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


# -- percentile ---------------------------------------------------------------------------------

def test_percentile_takes_the_sample_at_the_rounded_rank():
    values = list(range(10, 0, -1))  # 10..1, unsorted on purpose
    assert percentile(values, 0) == 1
    assert percentile(values, 50) == 5  # rank round(4.5) = 4 (half to even)
    assert percentile(values, 90) == 9  # rank round(8.1) = 8
    assert percentile(values, 99) == 10
    assert percentile(values, 100) == 10


def test_percentile_is_not_nearest_rank():
    """The definition every published report used: on 1..100 the median is 51, where the
    nearest-rank method (ceil(q n) - 1) would give 50."""
    assert percentile(list(range(1, 101)), 50) == 51
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([1, 2, 3, 4], 50) == 3  # round(1.5) = 2
    assert percentile([1, 2, 3, 4, 5, 6], 50) == 3  # round(2.5) = 2: half to even


def test_percentile_of_nothing_is_missing_and_one_value_is_itself():
    assert percentile([], 50) is None
    assert percentile([0.25], 99) == 0.25
    assert rounded(None) is None and rounded(0.123456) == 0.123


def test_by_status_counts_answers_and_why_others_had_none():
    shots = [Shot(0, status=200), Shot(0, status=503), Shot(0, status=200), Shot(0, error="TimeoutError"), Shot(0)]
    assert by_status(shots) == {"200": 2, "503": 1, "unanswered:TimeoutError": 1, "unanswered:none": 1}


# -- arrivals -----------------------------------------------------------------------------------

def test_poisson_arrivals_are_reproducible_inside_the_window_and_at_the_rate():
    times = poisson_arrivals(50, 100, seed=3)
    assert times == poisson_arrivals(50, 100, seed=3)
    assert times != poisson_arrivals(50, 100, seed=4)
    assert times == sorted(times) and 0 < times[0] and times[-1] < 100
    assert 4750 < len(times) < 5250  # 5,000 expected; sd ~71
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert abs(statistics.mean(gaps) - 0.02) < 0.002
    assert statistics.stdev(gaps) > 0.015  # exponential gaps (sd = mean), not a fixed rate


def test_at_arrivals_sends_nothing_early_and_keeps_item_order():
    started_at, events = {}, []

    async def send(item, at):
        started_at[item] = time.perf_counter()
        events.append(("start", item))
        await asyncio.sleep(0.05 if item == "a" else 0)
        events.append(("end", item))
        return item.upper()

    async def run(one_in_flight):
        started_at.clear()
        events.clear()
        start = time.perf_counter()
        got = await at_arrivals(["a", "b", "c"], [0.0, 0.02, 0.04], send, one_in_flight)
        return got, {k: v - start for k, v in started_at.items()}

    got, offsets = asyncio.run(run(False))
    assert got == ["A", "B", "C"]
    assert offsets["b"] >= 0.02 and offsets["c"] >= 0.04
    # open loop: "b" left while "a" was still out (by order, not by a timing a busy machine moves:
    # "b"'s send is due before "a"'s answer, so it goes first even after a stall)
    assert events.index(("start", "b")) < events.index(("end", "a"))
    got, offsets = asyncio.run(run(True))
    assert got == ["A", "B", "C"] and offsets["b"] >= 0.05  # one in flight: "b" waited for "a"
    assert events.index(("end", "a")) < events.index(("start", "b"))


def test_at_arrivals_reports_how_late_the_client_sent_each_item():
    async def send(item, at):
        if item == "a":
            time.sleep(0.06)  # a client busy on its own loop: "b" cannot leave on time
        return item

    lags = []
    assert asyncio.run(at_arrivals(["a", "b", "c"], [0.0, 0.01, 0.2], send, lags=lags)) == ["a", "b", "c"]
    assert len(lags) == 3 and all(lag >= 0 for lag in lags)
    assert lags[1] >= 0.04  # due at 10 ms, sent after "a"'s 60 ms
    assert lags[2] < 0.04  # "c" was due long after: on time again


def test_a_window_whose_client_fell_behind_says_so_and_its_lag_is_reported():
    def run(lag_ms):
        return RunResult(10, 1.0, [Result("short", i / 10, 0.02, 200, lag=lag_ms / 1000) for i in range(10)], 1.0)

    assert not client_behind(client_lag(run(1.0))) and client_behind(client_lag(run(CLIENT_BEHIND_MS + 5)))
    point = summarize(run(CLIENT_BEHIND_MS + 5))
    assert point["client_behind"] and point["client_lag_ms"]["p99"] == CLIENT_BEHIND_MS + 5


# -- the HTTP client ----------------------------------------------------------------------------

def _parse(raw: bytes):
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        return await read_response(reader)

    return asyncio.run(run())


def test_read_response_by_content_length_and_by_chunks():
    status, headers, body = _parse(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 5\r\n\r\nbusy!extra")
    assert (status, headers[b"retry-after"], body) == (503, b"1", b"busy!")
    status, headers, body = _parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                   b"4\r\n{\"a\"\r\n3;ext=1\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n")
    assert (status, body) == (200, b'{"a": 1}')
    assert _parse(b"HTTP/1.1 200 OK\r\nX-Tsbatch-Worker: 7\r\n\r\nto the end")[1:] == ({b"x-tsbatch-worker": b"7"},
                                                                                         b"to the end")


def test_request_head_and_split_url():
    assert split_url("http://127.0.0.1:8080/predictions/m") == ("127.0.0.1", 8080, "/predictions/m")
    assert split_url("http://host") == ("host", 80, "/")
    assert request_head("h:1", "/p", "text/plain", 3, {"X-Deadline-Ms": "50"}) == (
        b"POST /p HTTP/1.1\r\nHost: h:1\r\nContent-Type: text/plain\r\nX-Deadline-Ms: 50\r\n"
        b"Content-Length: 3\r\nConnection: close\r\n\r\n")
    assert request_head("h", "/p", "a/b", 0, close=False).endswith(b"Content-Length: 0\r\n\r\n")


def test_shoot_records_an_answer_and_a_silent_server_as_unanswered():
    async def run():
        async def answer(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nX-Tsbatch-Worker: 42\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            writer.close()

        async def silent(reader, writer):
            await asyncio.sleep(5)

        answering = await asyncio.start_server(answer, "127.0.0.1", 0)
        quiet = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = lambda s: s.sockets[0].getsockname()[1]  # noqa: E731
        async with answering, quiet:
            good = await shoot(f"http://127.0.0.1:{port(answering)}/p", b"hi", tag="t")
            lost = await shoot(f"http://127.0.0.1:{port(quiet)}/p", b"hi", timeout=0.2)
        return good, lost

    good, lost = asyncio.run(run())
    assert (good.status, good.body, good.headers["x-tsbatch-worker"], good.tag) == (200, b"ok", "42", "t")
    assert good.answered and good.done_at == good.sent + good.latency
    assert not lost.answered and lost.error == "TimeoutError" and lost.latency is None


def test_a_shot_counts_for_the_benchmark_with_its_tokens_and_padding():
    request = Request("a few words", "short")
    shot = Shot(5.0, status=200, latency=0.02, body=b'{"embedding": [0.1], "tokens": 7}',
                headers={"x-tsbatch-padded-to": "16", "x-tsbatch-batch-size": "3"})
    assert as_result(request, 1.5, shot) == Result("short", 1.5, 0.02, 200, tokens=7, padded_to=16, batch_size=3)
    empty = as_result(request, 1.5, Shot(5.0, status=200, latency=0.02, body=b" "))
    assert (empty.latency, empty.status, empty.error) == (None, 200, "empty body")  # lost, though 200
    lost = as_result(request, 1.5, Shot(5.0, error="TimeoutError"))
    assert (lost.latency, lost.status, lost.error) == (None, None, "TimeoutError")
    error = as_result(request, 1.5, Shot(5.0, status=503, latency=0.01, body=b'{"error": "busy", "code": 503}'))
    assert (error.status, error.latency, error.tokens, error.padded_to, error.error) == (503, 0.01, 0, 0, "busy")
    odd = as_result(request, 1.5, Shot(5.0, status=502, latency=0.01, body=b"<html>bad gateway</html>"))
    assert (odd.status, odd.error) == (502, "<html>bad gateway</html>")


def test_a_window_keeps_a_few_messages_of_each_refusal_status():
    results = [Result("short", 0.0, 0.01, 200)] + [Result("long", i, 0.01, 503, error=f"{i} ms of work ahead")
                                                    for i in range(5)] + [Result("short", 9, 0.01, 504, error="late")]
    point = summarize(RunResult(10, 1.0, results, 1.0))
    assert point["refusals"] == {"503": ["0 ms of work ahead", "1 ms of work ahead", "2 ms of work ahead"],
                                 "504": ["late"]}
    assert summarize(RunResult(10, 1.0, results[:1], 1.0))["refusals"] == {}
    line = brief(point)
    assert "(first 503: 0 ms of work ahead; 504: late)" in line and "(first" not in brief(summarize(RunResult(10, 1.0, results[:1], 1.0)))


# -- /proc --------------------------------------------------------------------------------------

def test_proc_readings_of_a_live_a_zombie_and_a_missing_process():
    assert rss_kb(os.getpid()) > 1000 and cpu_seconds(os.getpid()) > 0
    per_thread = threads_cpu(os.getpid())
    assert threading.get_native_id() in per_thread and sum(per_thread.values()) <= cpu_seconds(os.getpid()) + 0.05
    machine = machine_cpu()
    assert set(machine) >= {"user", "nice", "system", "idle", "steal"} and min(machine.values()) >= 0
    assert machine["user"] + machine["system"] >= cpu_seconds(os.getpid()) - 0.05  # this process is part of it
    marker = f"tsbatch-pids-with-{os.getpid()}"
    child = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(30)", marker])
    try:
        deadline = time.monotonic() + 10
        while not pids_with(marker) and time.monotonic() < deadline:  # until the child has exec'd
            time.sleep(0.01)
        assert alive(child.pid) and pids_with(marker) == [child.pid]
        child.kill()
        while alive(child.pid) and time.monotonic() < deadline:  # a zombie until reaped: not alive
            time.sleep(0.01)
        assert not alive(child.pid) and pids_with(marker) == []
    finally:
        child.kill()
        child.wait()
    assert rss_kb(child.pid) is None and cpu_seconds(child.pid) is None and rss_kb(None) is None


def test_memory_sampler_reports_start_end_and_peak():
    with MemorySampler(os.getpid(), lambda: [os.getpid()], every=0.01) as sampler:
        while not sampler.samples:  # the start sample comes before the growth
            time.sleep(0.005)
        grown = bytearray(64 << 20)  # 64 MB touched while sampling
        grown[::4096] = b"x" * len(grown[::4096])
        time.sleep(0.1)
    summary = sampler.summary()
    assert set(summary) == {"jvm_rss_kb", "worker_rss_kb"}
    jvm = summary["jvm_rss_kb"]
    assert jvm["peak"] >= max(jvm["start"], jvm["end"]) and jvm["peak"] - jvm["start"] > 32 * 1024
    del grown


# -- reports ------------------------------------------------------------------------------------

def test_report_write_puts_json_and_markdown_side_by_side(tmp_path):
    stem = str(tmp_path / "deep" / "chaos")
    report.write(stem, {"p99_s": 0.8, "n": [1, 2]}, "# chaos\n")
    assert json.loads((tmp_path / "deep" / "chaos.json").read_text()) == {"p99_s": 0.8, "n": [1, 2]}
    assert (tmp_path / "deep" / "chaos.json").read_text().startswith('{\n "p99_s"')  # indent 1
    assert (tmp_path / "deep" / "chaos.md").read_text() == "# chaos\n"
    report.write(str(tmp_path / "idle"), {"a": 1}, indent=2)
    assert not (tmp_path / "idle.md").exists()
    assert (tmp_path / "idle.json").read_text() == '{\n  "a": 1\n}'
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", report.utc_now(seconds=True))
    assert report.machine(with_platform=False).endswith(f", {os.cpu_count()} cores")


# -- one home for each rule ---------------------------------------------------------------------

def _bench_sources() -> dict[str, str]:
    out = {}
    for root, _dirs, files in os.walk(BENCH):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    out[os.path.relpath(path, BENCH)] = f.read()
    return out


def test_each_rule_has_one_home_in_bench():
    sources = _bench_sources()
    homes = {
        r"/proc/": "loadtest/proc.py",
        r"readuntil\(b\"\\r\\n\\r\\n\"\)": "loadtest/client.py",
        r"def poisson_arrivals\(": "loadtest/arrivals.py",
    }
    for pattern, home in homes.items():
        assert [p for p, text in sources.items() if re.search(pattern, text)] == [home], pattern
    # one client opens connections; soak.py's keep-alive clients (reconnecting after errors) are the exception
    assert sorted(p for p, text in sources.items() if "open_connection(" in text) == ["loadtest/client.py", "soak.py"]


def test_the_project_has_one_percentile():
    """warmup's p90 and every bench figure use one definition (warmup/profile.py)."""
    repo = os.path.dirname(BENCH)
    found = []
    for folder in ("handlers", "warmup", "archiver", "bench"):
        for root, _dirs, files in os.walk(os.path.join(repo, folder)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(root, name)) as f:
                        if re.search(r"def percentile\(|quantiles\(|np\.percentile", f.read()):
                            found.append(os.path.relpath(os.path.join(root, name), repo))
    assert found == [os.path.join("warmup", "profile.py")]


def test_no_bench_file_is_over_300_lines():
    assert {p: n for p, text in _bench_sources().items() if (n := text.count("\n")) > 300} == {}


def test_the_library_loads_neither_torch_nor_torchserve():
    """A load generator must not take the cores or memory of the server it measures."""
    from tests.unit.test_pure_imports import imported_heavy_modules

    modules = [f"bench.loadtest.{m[:-3]}" for m in os.listdir(os.path.join(BENCH, "loadtest")) if m.endswith(".py")]
    assert len(modules) >= 10
    assert imported_heavy_modules(*modules, "bench.drills.overload", "bench.drills.kill") == []


def test_the_timing_header_becomes_a_breakdown_of_where_time_went():
    from bench.loadtest.load import Result, timing_of
    from bench.loadtest.stats import breakdown

    assert timing_of("wait=1.5; pass=11.0; handler=14.0") == {"wait": 1.5, "pass": 11.0, "handler": 14.0}
    assert timing_of("") == {} and timing_of("wait=soon") == {}
    results = [Result("short", 0.0, 0.020 + i / 1000, 200, timing={"wait": 1.0, "pass": 10.0, "handler": 12.0})
               for i in range(3)] + [Result("short", 0.0, 0.5, 200)]  # untimed: left out
    assert breakdown(results) == {"n": 3, "wait": 1.0, "pass": 10.0, "handler": 12.0, "outside_handler": 9.0,
                                  "p99": {"wait": 1.0, "pass": 10.0, "handler": 12.0, "outside_handler": 10.0}}
    assert breakdown([Result("short", 0.0, 0.5, 200)]) == {}
