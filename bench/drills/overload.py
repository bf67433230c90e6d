"""The overload drill: capacity measured closed-loop, then a multiple of it offered open-loop with
a deadline on every request. Every request must be answered (200, 503 with Retry-After, or 504,
each error as tsbatch's JSON), and accepted ones should meet their deadline."""
from __future__ import annotations

import asyncio
import time
from typing import Iterable, Sequence

from bench.loadtest.arrivals import poisson_arrivals
from bench.loadtest.client import Shot, shoot
from bench.loadtest.load import Load, open_loop
from bench.loadtest.proc import MemorySampler
from bench.loadtest.stats import by_status, percentile, rounded
from bench.loadtest.torchserve import worker_pids


def answer_problems(shots: Iterable[Shot], allowed=(200, 503, 504)) -> list[str]:
    """What is wrong with an overload run's answers: unanswered, unexpected status, a 503 without
    Retry-After, an error body that is not {"error", "code"}."""
    problems = []
    for shot in shots:
        if not shot.answered:
            problems.append(f"unanswered ({shot.error}) after {time.monotonic() - shot.sent:.1f}s")
            continue
        if shot.status not in allowed:
            problems.append(f"status {shot.status}: {shot.body[:120]!r}")
        if shot.status == 503 and "retry-after" not in shot.headers:
            problems.append(f"503 without Retry-After: {shot.body[:120]!r}")
        if shot.status != 200:
            body = shot.json()
            if not (isinstance(body, dict) and set(body) == {"error", "code"} and body["code"] == shot.status):
                problems.append(f"{shot.status} body is not tsbatch's JSON error: {shot.body[:120]!r}")
    return problems


def measure_capacity(url: str, bodies: Sequence[bytes], clients: int, seconds: float, timeout: float = 60) -> dict:
    """Closed loop: `clients` clients for `seconds`; capacity = 200 answers per second."""
    load = Load()
    started = time.monotonic()
    load.clients(url, bodies, clients, timeout)
    time.sleep(seconds)  # the measurement window itself, not a wait for a condition
    load.stop()
    elapsed = time.monotonic() - started
    load.close(timeout + 5)
    ok = [s for s in load.shots if s.status == 200 and s.done_at is not None and s.done_at <= started + elapsed]
    return {"clients": clients, "seconds": round(elapsed, 1), "answered_200": len(ok),
            "capacity_rps": round(len(ok) / elapsed, 2), "by_status": by_status(load.shots),
            "p50_s": rounded(percentile([s.latency for s in ok], 50))}


def overload_drill(inference: str, management: str, model: str, java_pid: int | None, bodies: Sequence[bytes],
                   capacity_rps: float, factor: float, seconds: float, deadline_ms: int,
                   client_timeout: float, max_requests: int = 20000, seed: int = 0) -> dict:
    """Open loop at factor x capacity: every answer 200/503/504, accepted within their deadline."""
    url = f"{inference}/predictions/{model}"
    rate = factor * capacity_rps
    arrivals = poisson_arrivals(rate, seconds, seed)[:max_requests]
    chosen = [bodies[i % len(bodies)] for i in range(len(arrivals))]
    headers = {"X-Deadline-Ms": str(deadline_ms)}
    with MemorySampler(java_pid, lambda: worker_pids(management, model)) as memory:
        started = time.monotonic()
        shots = open_loop(url, chosen, arrivals, headers, client_timeout)
        elapsed = time.monotonic() - started
    after = asyncio.run(shoot(url, b"after the overload", timeout=30))
    accepted = [s.latency for s in shots if s.status == 200]
    timed_out = [s.latency for s in shots if s.status == 504]
    rejected = [s.latency for s in shots if s.status == 503]
    deadline = deadline_ms / 1000
    problems = answer_problems(shots)
    return {
        "model": model, "offered_rps": round(rate, 2), "factor": factor, "seconds": seconds,
        "wall_seconds": round(elapsed, 1), "requests": len(shots), "deadline_ms": deadline_ms,
        "answered": sum(s.answered for s in shots), "unanswered": sum(not s.answered for s in shots),
        "by_status": by_status(shots),
        "accepted": len(accepted),
        "accepted_p50_s": rounded(percentile(accepted, 50)), "accepted_p99_s": rounded(percentile(accepted, 99)),
        "accepted_max_s": rounded(max(accepted, default=None)),
        "deadline_misses_among_accepted": sum(lat > deadline for lat in accepted),
        "accepted_over_deadline_by_s": {"p50": rounded(percentile([max(0.0, l - deadline) for l in accepted], 50)),
                                        "max": rounded(max((l - deadline for l in accepted), default=None))},
        "504_latency_s": {"p50": rounded(percentile(timed_out, 50)), "max": rounded(max(timed_out, default=None))},
        "503_latency_s": {"p50": rounded(percentile(rejected, 50)), "max": rounded(max(rejected, default=None))},
        "frontend_503s": sum(s.status == 503 and b"ServiceUnavailableException" in s.body for s in shots),
        "rejected_503_with_retry_after": sum(s.status == 503 and "retry-after" in s.headers for s in shots),
        "problems": problems[:20], "problem_count": len(problems),
        "memory": memory.summary(),
        "served_after": after.status,
    }
