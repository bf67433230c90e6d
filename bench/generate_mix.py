"""bench/generate.py's pure parts: the mix of asks, what one answer was, what a window's figures are
(#37). No torch, no sockets, no clock: unit-tested.

The mix: prompts of 8-400 tokens, log-uniform (most prompts are short, a few fill the range); most
asks want 8-32 new tokens (uniform), a `long_share` of them 256. Prompts are random common words, one
token each with the benchmark's tokenizer, so a prompt of n words is n tokens. Asks come from a fixed
pool, so every answer of every window can be checked against the pool's answers computed alone.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field

from bench.loadtest.stats import percentile
from bench.loadtest.sweep import capacity, passes, saturated, saturation_row  # noqa: F401 - the project's rules, re-exported
from bench.loadtest.workload import WORDS

PROMPT_TOKENS = (8, 400)
SHORT_NEW = (8, 32)
LONG_NEW = 256


@dataclass(frozen=True)
class Ask:
    """One request of the mix: its prompt (`prompt_tokens` words, one token each) and how many new tokens."""

    index: int  # position in the pool: the key of its answer alone
    text: str
    prompt_tokens: int
    new_tokens: int

    @property
    def kind(self) -> str:
        return "long" if self.new_tokens == LONG_NEW else "short"

    def body(self, stream: bool) -> bytes:
        return json.dumps({"text": self.text, "max_new_tokens": self.new_tokens, "stream": stream}).encode()


def make_pool(size: int, long_share: float, seed: int = 0) -> list[Ask]:
    """`size` asks of the mix, in a fixed order for a seed."""
    rng = random.Random(seed)
    low, high = PROMPT_TOKENS
    pool = []
    for index in range(size):
        tokens = int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))
        tokens = max(low, min(high, tokens))
        new = LONG_NEW if rng.random() < long_share else rng.randint(*SHORT_NEW)
        pool.append(Ask(index, " ".join(rng.choice(WORDS) for _ in range(tokens)), tokens, new))
    return pool


def draw(pool: list[Ask], count: int, seed: int) -> list[Ask]:
    """`count` asks drawn from the pool with replacement (a window's requests)."""
    rng = random.Random(seed + 7919)
    return [rng.choice(pool) for _ in range(count)]


@dataclass
class Answer:
    """What one request got, as the client saw it. Times are seconds from its scheduled arrival
    (so the client's own lag counts: no coordinated omission); None where it never happened."""

    ask: Ask
    stream: bool
    status: int | None = None
    first_chunk: float | None = None  # the first non-empty piece of the body
    done: float | None = None  # the whole answer in
    body: bytes = b""
    error: str = ""


@dataclass(frozen=True)
class Reading:
    """An answer's body read: its text and token count, the token ids its stream named (empty when
    not streamed or unnamed), and what was wrong with it (empty: nothing)."""

    text: str | None = None
    new_tokens: int | None = None
    token_ids: tuple[int, ...] = ()
    lines: int = 0
    problem: str = ""


def read_body(body: bytes) -> Reading:
    """A whole JSON answer {"generated_text", "new_tokens"}, or an NDJSON stream: token lines
    {"token": id, ...} then the whole answer as its last line (or an error line)."""
    text = body.decode("utf-8", errors="replace").strip()
    if not text:
        return Reading(problem="empty body")
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            return Reading(problem=f"not JSON: {line[:80]!r}")
    last = rows[-1]
    if not isinstance(last, dict) or "generated_text" not in last or "new_tokens" not in last:
        return Reading(problem=f"no answer in the last line: {json.dumps(last)[:120]}")
    tokens = tuple(row["token"] for row in rows[:-1] if isinstance(row, dict) and "token" in row)
    reading = Reading(last["generated_text"], last["new_tokens"], tokens, len(rows) - 1)
    if len(rows) > 1 and reading.lines != reading.new_tokens:
        return Reading(reading.text, reading.new_tokens, tokens, reading.lines,
                       problem=f"{reading.lines} stream lines for {reading.new_tokens} tokens")
    return reading


@dataclass(frozen=True)
class Alone:
    """An ask's greedy answer computed alone in process: its token ids and their text."""

    token_ids: tuple[int, ...]
    text: str


def verdict(answer: Answer, alone: Alone | None) -> str:
    """'' when the answer is complete and identical to its answer alone; else what went wrong:
    'lost' (no answer, a cut-off body), 'status N', 'bad: ...' or 'differs: ...'."""
    if answer.status is None or answer.done is None:
        return "lost"
    if answer.status != 200:
        return f"status {answer.status}"
    reading = read_body(answer.body)
    if reading.problem:
        return "bad: " + reading.problem
    if alone is None:
        return ""
    if reading.new_tokens != len(alone.token_ids) or reading.text != alone.text:
        return f"differs: {reading.new_tokens} tokens {reading.text[:40]!r} vs {len(alone.token_ids)} {alone.text[:40]!r}"
    if reading.token_ids and reading.token_ids != alone.token_ids:
        return "differs: streamed token ids"
    return ""


def served_tokens(answer: Answer) -> int:
    """New tokens of a complete 200 answer (0 otherwise)."""
    if answer.status != 200 or answer.done is None:
        return 0
    return read_body(answer.body).new_tokens or 0


def _ms(values: list[float], q: float) -> float | None:
    return round(percentile(values, q) * 1000, 1) if values else None


def summarize(answers: list[Answer], rate: float, duration: float, references: dict | None = None) -> dict:
    """One window's figures, in the keys bench/loadtest/sweep.py's rules read (offered_rate, sent,
    ok, lost, all.p99, throughput, sent_rate) and generation's own: time to first chunk (TTFT) and
    to the whole answer per kind, output tokens/s, refusals, and answers that differ from alone.

    lost: no complete answer (no reply, a reply cut off, an empty or unreadable body); refused: a
    non-200 status. Output tokens/s is the served tokens over the busy period, from the window's
    start to its last answer (under overload the arm is busy throughout)."""
    references = references or {}
    verdicts = [verdict(a, references.get(a.ask.index)) for a in answers]
    ok = [a for a, v in zip(answers, verdicts) if v == "" or v.startswith("differs")]
    lost = sum(1 for v in verdicts if v == "lost" or v.startswith("bad"))
    refused = sum(1 for v in verdicts if v.startswith("status"))
    differs = [v for v in verdicts if v.startswith("differs")]
    ends = [a.done for a in answers if a.done is not None]
    busy = max([duration] + ends) if answers else duration
    tokens = sum(served_tokens(a) for a in ok)
    out = {
        "offered_rate": rate, "duration_s": duration, "sent": len(answers), "ok": len(ok), "lost": lost,
        "refused": refused, "status": _counts(str(a.status) for a in answers if a.status is not None),
        "differ": len(differs), "differ_first": differs[:3], "compared": sum(1 for a in ok if a.ask.index in references),
        "throughput": round(len(ok) / busy, 2) if busy else 0.0,
        "sent_rate": round(len(answers) / duration, 2) if duration else 0.0,
        "output_tokens": tokens, "busy_s": round(busy, 2),
        "output_tokens_per_s": round(tokens / busy, 1) if busy else 0.0,
        "all": {"p50": _ms([a.done for a in ok], 50), "p99": _ms([a.done for a in ok], 99), "n": len(ok)},
    }
    for kind in ("short", "long"):
        mine = [a for a in ok if a.ask.kind == kind]
        first = [a.first_chunk for a in mine if a.first_chunk is not None]
        out[kind] = {"n": len(mine), "sent": sum(1 for a in answers if a.ask.kind == kind),
                     "ttft_p50": _ms(first, 50), "ttft_p99": _ms(first, 99),
                     "total_p50": _ms([a.done for a in mine], 50), "total_p99": _ms([a.done for a in mine], 99)}
    return out


def floor(answers: list[Answer]) -> dict:
    """What no scheduler can beat: each short ask's time to first token with no company (answers of
    one request in flight; an ask sent more than once counts its best), over the asks of the pool."""
    best: dict[int, Answer] = {}
    for a in answers:
        if a.ask.kind == "short" and a.status == 200 and a.first_chunk is not None:
            if a.ask.index not in best or a.first_chunk < best[a.ask.index].first_chunk:
                best[a.ask.index] = a
    first = [a.first_chunk for a in best.values()]
    slowest = max(best.values(), key=lambda a: a.first_chunk, default=None)
    return {"asks": len(best), "ttft_p50": _ms(first, 50), "ttft_p99": _ms(first, 99),
            "slowest_prompt_tokens": slowest.ask.prompt_tokens if slowest else None}


def _counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def pooled_answers(windows: list[list[Answer]]) -> list[Answer]:
    return [a for w in windows for a in w]


def next_rates(start: float, factor: float, count: int) -> list[float]:
    """A geometric sweep: `count` rates from `start`, each `factor` times the last (rounded to 0.1)."""
    return [round(start * factor ** i, 1) for i in range(count)]


def bisect_rate(points: list[dict], target_ms: float) -> float | None:
    """The rate halfway between the capacity and the first miss above it (None: no miss, or no pass to start from)."""
    best = capacity(points, target_ms)
    above = sorted(p["offered_rate"] for p in points if p["offered_rate"] > best)
    if not above or best <= 0:
        return None
    return round((best + above[0]) / 2, 2)


@dataclass
class Tally:
    """Equality and loss counts of one arm over every window."""

    compared: int = 0
    differ: int = 0
    stream_compared: int = 0
    whole_compared: int = 0
    lost: int = 0
    refused: int = 0
    first_differ: list = field(default_factory=list)

    def add(self, answers: list[Answer], references: dict) -> None:
        for answer in answers:
            v = verdict(answer, references.get(answer.ask.index))
            if v == "lost" or v.startswith("bad"):
                self.lost += 1
                continue
            if v.startswith("status"):
                self.refused += 1
                continue
            if answer.ask.index not in references:
                continue
            self.compared += 1
            if answer.stream:
                self.stream_compared += 1
            else:
                self.whole_compared += 1
            if v:
                self.differ += 1
                if len(self.first_differ) < 3:
                    self.first_differ.append(v)

    def as_dict(self) -> dict:
        return dict(vars(self))
