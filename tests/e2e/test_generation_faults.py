"""The generation handler through a real torchserve, archived as `tsbatch archive --task generation`
builds it plus a test-only --handler-config (added to the shipped handler section, which it does
not replace): max_running 4, max_new_tokens 1600, the out-of-memory fault on. In order: the generation metrics on
the Prometheus endpoint after known asks; a client that disconnects mid-stream frees its seat; a
step that runs out of memory preempts and recovers, every ask still answered as alone, the worker
the same process (the learned, lower KV bound stays for the server's life, so that test is last)."""
from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import pytest
import requests

from tests.e2e.client import post
from tests.e2e.test_generation_served import NAME, TEXTS, ask, headers, make_lm, serving, worker_pids

OOM = "oomnow"  # handler.fault_oom_substring below: a request holding it makes its first step run out of memory
SEATS = 4
HANDLER_CONFIG = f"max_running: {SEATS}\nmax_new_tokens: 1600\nfault_oom_substring: {OOM}\n"
POSITIONS = 2048  # the test model's: room for streams that hold their seat for seconds
LONG = 1500  # new tokens of a stream that would hold its seat for over a thousand steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_lm(str(tmp_path_factory.mktemp("lm_faults") / "model"), positions=POSITIONS)


@pytest.fixture(scope="module")
def lm(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("generation_faults")
    config = root / "handler.yaml"
    config.write_text(HANDLER_CONFIG)
    yield from serving(root, model_dir, "--handler-config", str(config))


def url(served) -> str:
    return f"{served.inference}/predictions/{NAME}"


def scrape(served) -> str:
    return requests.get(f"{served.metrics}/metrics", timeout=30).text


def value(text: str, name: str) -> float:
    """Sum of the samples of `name` for this model (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and f'ModelName="{NAME}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def has(text: str, name: str) -> bool:
    return any(line.startswith(name + "{") and f'ModelName="{NAME}"' in line for line in text.splitlines())


def settled(served, before: str, name: str, at_least: float, timeout: float = 30) -> str:
    """A scrape where `name` grew by at least `at_least` since `before` (the frontend reads worker
    metrics from its log: allow it a moment), or the last scrape when it never did."""
    deadline = time.monotonic() + timeout
    while True:
        after = scrape(served)
        if value(after, name) - value(before, name) >= at_least or time.monotonic() > deadline:
            return after
        time.sleep(0.3)


class Stream:
    """A streamed ask read on its own thread: its lines as they arrive, `first` set at the first."""

    def __init__(self, served, text: str, new: int):
        self.lines: list[dict] = []
        self.first = threading.Event()
        self.response = None
        self.error = None
        self.thread = threading.Thread(target=self._read, args=(served, text, new), daemon=True)
        self.thread.start()

    def _read(self, served, text, new):
        try:
            with requests.post(url(served), json=ask(text, new, stream=True)[0], stream=True, timeout=120) as response:
                self.response = response
                pending = b""
                for chunk in response.iter_content(chunk_size=None):
                    pending += chunk
                    *complete, pending = pending.split(b"\n")
                    self.lines += [json.loads(line) for line in complete if line.strip()]
                    if self.lines:
                        self.first.set()
        except Exception as error:  # noqa: BLE001 - recorded, then failed on by the test
            self.error = error
        finally:
            self.first.set()

    def join(self):
        self.thread.join(120)
        assert not self.thread.is_alive() and self.error is None, self.error
        return self.lines


def test_the_generation_metrics_reach_the_prometheus_endpoint_with_plausible_values(lm):
    before = scrape(lm)
    asks = [(TEXTS[0], 8), (TEXTS[1], 12), (TEXTS[2], 5)]
    answers = [post(url(lm), *ask(text, new)) for text, new in asks]
    assert [a.status for a in answers] == [200] * 3
    made = sum(new for _, new in asks)
    after = settled(lm, before, "tsbatch_generation_time_to_first_token_seconds_count", 3)

    def delta(name):
        return value(after, name) - value(before, name)

    assert delta("tsbatch_generation_time_to_first_token_seconds_count") == 3
    assert 0 < delta("tsbatch_generation_time_to_first_token_seconds_sum") < 3 * 10
    assert delta("tsbatch_generation_time_per_output_token_seconds_count") == 3  # every ask made more than one token
    assert 0 < delta("tsbatch_generation_time_per_output_token_seconds_sum") < 3 * 1.0
    assert delta("tsbatch_generation_output_tokens_total") == made
    assert value(after, "tsbatch_generation_kv_cache_bound_tokens") == 16384  # the shipped default
    assert value(after, "tsbatch_generation_token_budget_tokens") == 512
    for idle in ("tsbatch_generation_running_sequences", "tsbatch_generation_waiting_sequences",
                 "tsbatch_generation_kv_cache_tokens"):
        assert has(after, idle) and value(after, idle) == 0, idle  # all answered: the worker is idle
    for name in ("tsbatch_generation_preemptions_total", "tsbatch_generation_out_of_memory_steps_total",
                 "tsbatch_generation_cancelled_total"):
        assert delta(name) == 0, name  # none happened (a counter shows once it first grows)
    # while streams run (twice the seats: half of them wait), the gauges say so
    streams = [Stream(lm, TEXTS[i % len(TEXTS)], 480) for i in range(2 * SEATS)]
    running, kv = [], []
    while any(stream.thread.is_alive() for stream in streams):
        text = scrape(lm)
        running.append(value(text, "tsbatch_generation_running_sequences"))
        kv.append(value(text, "tsbatch_generation_kv_cache_tokens"))
        time.sleep(0.1)
    assert all(len(stream.join()) == 481 for stream in streams)
    assert 2 <= max(running) <= SEATS and 0 < max(kv) <= SEATS * 512, (running, kv)
    final = settled(lm, after, "tsbatch_generation_output_tokens_total", 2 * SEATS * 480)
    assert value(final, "tsbatch_generation_output_tokens_total") - value(after, "tsbatch_generation_output_tokens_total") \
        == 2 * SEATS * 480
    assert value(final, "tsbatch_generation_running_sequences") == 0  # idle again, and said so


def open_stream_and_leave(served, text: str, new: int, lines_before_leaving: int = 3) -> int:
    """A raw HTTP/1.1 client: asks for a stream, reads until it has `lines_before_leaving` lines,
    then closes its socket mid-stream. Returns the lines it read."""
    address = urlparse(served.inference)
    body = json.dumps(ask(text, new, stream=True)[0]).encode()
    sock = socket.create_connection((address.hostname, address.port), timeout=60)
    try:
        sock.sendall(f"POST /predictions/{NAME} HTTP/1.1\r\nHost: {address.hostname}\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while received.count(b'{"token"') < lines_before_leaving:
            chunk = sock.recv(4096)
            assert chunk, f"the server closed the stream first: {received[:300]!r}"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200"), received[:200]
        return received.count(b'{"token"')
    finally:
        sock.close()


def test_a_client_that_disconnects_mid_stream_frees_its_seat(lm):
    """Every seat is taken by a stream of LONG tokens; one client leaves after its first lines.
    The proof is in the counters, not a clock: the engine cancelled exactly one sequence, and made
    far fewer tokens than the four streams would have made had the left one run to its end; and an
    ask sent after the leaving, which needs a seat, is answered as alone."""
    alone = post(url(lm), *ask(TEXTS[2], 3)).body
    before = scrape(lm)
    left = open_stream_and_leave(lm, TEXTS[5], LONG)  # first, alone on the server: its connection is the only one seen
    kept = [Stream(lm, text, LONG) for text in (TEXTS[1], TEXTS[3], TEXTS[4])]
    assert all(stream.first.wait(60) for stream in kept)
    follow_up = post(url(lm), *ask(TEXTS[2], 3))  # a fifth sequence: it runs only in a seat the left one freed
    kept_lines = [stream.join() for stream in kept]
    assert follow_up.status == 200 and follow_up.body == alone
    assert [len(lines) for lines in kept_lines] == [LONG + 1] * 3  # the others streamed to their end
    after = settled(lm, before, "tsbatch_generation_cancelled_total", 1)
    assert value(after, "tsbatch_generation_cancelled_total") - value(before, "tsbatch_generation_cancelled_total") == 1
    made = value(after, "tsbatch_generation_output_tokens_total") - value(before, "tsbatch_generation_output_tokens_total")
    assert made - (3 * LONG + 3) < LONG // 2, (made, left)  # the left stream stopped well short of its LONG tokens
    assert made >= 3 * LONG + 3 + left
    assert value(after, "tsbatch_generation_running_sequences") == 0


def greedy_alone(model_dir: str, text: str, new: int) -> str:
    """The text transformers' own greedy generate() makes of `text` (the served model, in this process)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def test_a_step_out_of_memory_preempts_and_recovers_and_the_worker_stays_up(lm, model_dir):
    """Three long-prompt streams decode; then an ask holding OOM joins, and that step runs out of
    memory: nobody advances, the KV bound is learned lower than the decoders hold, so the youngest
    are preempted and recomputed later. Every ask gets its answer alone, from the same worker."""
    long_prompts = [" ".join([word] * 60) for word in ("sea", "ship", "park")]
    new = 30
    faulty = f"{OOM} a b"
    pids = worker_pids(lm)
    # alone, the faulty ask's own step would run out of memory (and teach the server a bound it cannot
    # fit in): its answer alone is transformers' greedy generate() of the same model
    alone = [post(url(lm), *ask(text, new)) for text in long_prompts]
    assert [a.status for a in alone] == [200] * 3, [a.body for a in alone]
    before = scrape(lm)
    streams = [Stream(lm, text, new) for text in long_prompts]
    assert all(stream.first.wait(60) for stream in streams)
    answer = post(url(lm), *ask(faulty, 8))
    got = [stream.join() for stream in streams]
    assert answer.status == 200, answer.body
    assert answer.body == {"generated_text": greedy_alone(model_dir, faulty, 8), "new_tokens": 8, "finish_reason": "length"}
    assert [lines[-1] for lines in got] == [a.body for a in alone[:3]]
    assert all(len(lines) == new + 1 for lines in got)
    after = settled(lm, before, "tsbatch_generation_preemptions_total", 1)
    assert value(after, "tsbatch_generation_out_of_memory_steps_total") - \
        value(before, "tsbatch_generation_out_of_memory_steps_total") == 1
    assert value(after, "tsbatch_generation_preemptions_total") - value(before, "tsbatch_generation_preemptions_total") >= 1
    assert value(after, "tsbatch_generation_kv_cache_bound_tokens") < 16384  # learned lower
    assert {headers(a)["x-tsbatch-worker"] for a in alone + [answer]} == {str(p) for p in pids}
    assert worker_pids(lm) == pids  # the same process: no worker died or restarted
