"""Percentiles and summaries: the one definition every bench report's figures come from.

percentile() is warmup.profile's, the project's only one: two definitions side by side would
make a p99 in one report mean something else than in the next (or than warmup's p90).
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Iterable, Sequence

from tsbatch.warmup.profile import percentile  # noqa: F401 - the project's one percentile (pure, no torch)

# a window whose client sent its p99 request this late (ms) after its scheduled time fell behind: the
# client, not the server, set part of its latency (the sweep runs it again)
CLIENT_BEHIND_MS = 20.0

if TYPE_CHECKING:
    from bench.loadtest.load import RunResult


def rounded(value: float | None, digits: int = 3) -> float | None:
    """round() that lets a missing figure stay missing."""
    return None if value is None else round(value, digits)


def by_status(shots: Iterable) -> dict[str, int]:
    """How many Shots got each status, and how many none (by why): the one-line story of a run."""
    counts: dict[str, int] = {}
    for shot in shots:
        key = str(shot.status) if shot.answered else f"unanswered:{shot.error or 'none'}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def refusals(results, keep: int = 3) -> dict[str, list[str]]:
    """The first `keep` messages of each status other than 200 (a 503 says how much work the worker
    saw ahead), so a window that missed only by a refusal shows why."""
    out: dict[str, list[str]] = {}
    for r in results:
        if r.status is None or r.status == 200:
            continue
        messages = out.setdefault(str(r.status), [])
        if len(messages) < keep:
            messages.append(r.error)
    return out


def summarize(run: RunResult) -> dict:
    """One window's figures: answered, lost, throughput, served tokens/s, padding waste, and
    latency p50/p95/p99 (ms) of the 200s, overall and per request kind."""
    ok = [r for r in run.results if r.status == 200]
    lost = [r for r in run.results if r.latency is None]
    out = {
        "offered_rate": run.rate, "sent": len(run.results), "ok": len(ok), "lost": len(lost),
        "status": dict(Counter(str(r.status) for r in run.results if r.status is not None)),
        "lost_errors": dict(Counter(r.error for r in lost)),
        "refusals": refusals(run.results),
        "throughput": round(len(ok) / run.wall, 2) if run.wall else 0.0,
        "sent_rate": round(len(run.results) / run.duration, 2) if run.duration else 0.0,
        "served_tokens_per_s": round(sum(r.tokens for r in ok) / run.wall, 1) if run.wall else 0.0,
    }
    real = sum(r.tokens for r in ok if r.padded_to)
    padded = sum(r.padded_to for r in ok if r.padded_to)
    out["padding_waste"] = round(1 - real / padded, 4) if padded else None
    for kind in ("all", "short", "long"):
        lat = [r.latency * 1000 for r in ok if kind == "all" or r.kind == kind]
        out[kind] = {f"p{q}": (round(percentile(lat, q), 1) if lat else None) for q in (50, 95, 99)}
        out[kind]["n"] = len(lat)
    out["short_breakdown_ms"] = breakdown([r for r in ok if r.kind == "short"])
    out["long_breakdown_ms"] = breakdown([r for r in ok if r.kind == "long"])
    out["client_lag_ms"] = client_lag(run)
    out["client_behind"] = client_behind(out["client_lag_ms"])
    return out


def client_lag(run: RunResult) -> dict:
    """How late the client sent this window's requests after their scheduled times, ms: p50, p99,
    max ({} for an empty window)."""
    lags = [r.lag * 1000 for r in run.results]
    return {"p50": round(percentile(lags, 50), 1), "p99": round(percentile(lags, 99), 1),
            "max": round(max(lags), 1)} if lags else {}


def client_behind(lag: dict) -> bool:
    """Did the client fall behind its schedule in a window (client_lag's p99 over CLIENT_BEHIND_MS)?"""
    return lag.get("p99", 0.0) > CLIENT_BEHIND_MS


def breakdown(results: Sequence) -> dict:
    """Medians of where answered requests' time went (x-tsbatch-timing): in tsbatch's queue, the
    pass, the handler in all, and the rest of what the client measured (TorchServe's frontend,
    the socket to the worker, the reply); and each part's p99 under "p99", since a latency tail
    may come from any one of them, which medians cannot tell. {} when the server sends no timing."""
    timed = [r for r in results if r.timing.keys() >= {"wait", "pass", "handler"}]
    if not timed:
        return {}
    parts = {"wait": [r.timing["wait"] for r in timed], "pass": [r.timing["pass"] for r in timed],
             "handler": [r.timing["handler"] for r in timed],
             "outside_handler": [r.latency * 1000 - r.timing["handler"] for r in timed]}
    return {"n": len(timed), **{k: round(percentile(v, 50), 1) for k, v in parts.items()},
            "p99": {k: round(percentile(v, 99), 1) for k, v in parts.items()}}
