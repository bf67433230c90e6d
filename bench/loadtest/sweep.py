"""Offered-rate sweeps and the rules that read them: when a rate passes, when an arm is saturated,
what its capacity is. Arms take turns (rotated) so on a shared machine every ratio compares arms
measured in the same minutes. Used by `make bench` (bench/run.py) and bench/tune_bench.py.
"""
from __future__ import annotations

from typing import Callable

from bench.loadtest.arrivals import poisson_arrivals
from bench.loadtest.load import RunResult, run_one_in_flight, run_open_loop
from bench.loadtest.stats import client_behind, client_lag, summarize
from bench.loadtest.workload import Maker, two_cluster


def brief(point: dict) -> str:
    """One progress line for a measured rate."""
    said = [f"{status}: {messages[0][:100]}" for status, messages in point.get("refusals", {}).items() if messages]
    return (f"rate {point['offered_rate']:>5}: thr {point['throughput']:>6} p99 {point['all']['p99']} "
            f"short p99 {point['short']['p99']} lost {point['lost']} status {point['status']}"
            + (f" (first {'; '.join(said)})" if said else ""))


def passes(point: dict, target_ms: float) -> bool:
    """A rate is served within the target: p99 under it, every request answered 200, in its window
    or in the window that measured it again (`again`: see confirm)."""
    once = (point["all"]["p99"] is not None and point["all"]["p99"] <= target_ms and point["lost"] == 0
            and point["ok"] == point["sent"])
    return once or ("again" in point and passes(point["again"], target_ms))


def saturated(point: dict, target_ms: float) -> bool:
    """Past what the arm can serve: higher rates would only lengthen its queue."""
    p99 = point["all"]["p99"]
    return (point["lost"] > 0 or p99 is None or p99 > 4 * target_ms
            or point["throughput"] < 0.85 * point["sent_rate"])


def saturation_row(tried: list[dict], target_ms: float) -> dict:
    """An arm's saturation windows (rates rising) as the report's row: its best output tokens/s, and
    whether any window saturated it. The best window is often an earlier, lighter one, so its own
    state says nothing about whether the sweep reached the arm's limit."""
    best = max(tried, key=lambda p: p["output_tokens_per_s"])
    return {"output_tokens_per_s": best["output_tokens_per_s"],
            "saturated": any(saturated(p, target_ms) for p in tried),
            "offered_rates": [p["offered_rate"] for p in tried]}


def capacity(points: list[dict], target_ms: float) -> float:
    """The highest offered rate below the first one that misses the target (points in rising order;
    a missed rate measured again passes if its second window does: see confirm). Not the highest
    passing rate anywhere: one lucky window past the knee would count."""
    best = 0.0
    for point in sorted(points, key=lambda p: p["offered_rate"]):
        if not passes(point, target_ms):
            break
        best = point["offered_rate"]
    return best


def knee(points: list[dict], target_ms: float) -> tuple[float, float] | None:
    """The capacity and the first rate above it, which missed the target (None: none missed)."""
    best = capacity(points, target_ms)
    above = sorted(p["offered_rate"] for p in points if p["offered_rate"] > best)
    return (best, above[0]) if above else None


def confirm(urls: dict[str, str], sweeps: dict[str, list[dict]], duration: float, target_ms: float,
            requests: Maker = two_cluster) -> None:
    """Measure an arm's first miss again when a higher rate passed: a rate misses only when two
    windows at it do. One stall of the shared machine (a p99 is its slowest 1%) otherwise ends an
    arm's capacity at a rate it serves (seen: the template missing 16 req/s and passing 24 and 40).
    The second window rides on the point as `again`; arms take turns, each retry once per rate."""
    for turn in range(len(max(sweeps.values(), key=len, default=[]))):
        retried = False
        for arm in rotated(list(urls), turn):
            points = sorted(sweeps[arm], key=lambda p: p["offered_rate"])
            first = next((p for p in points if not passes(p, target_ms)), None)
            if first is None or "again" in first or not any(
                    passes(p, target_ms) for p in points if p["offered_rate"] > first["offered_rate"]):
                continue
            first["again"] = summarize(window(urls[arm], first["offered_rate"], duration, seed=500 + turn,
                                              requests=requests))
            retried = True
            print(f"arm {arm} (missed {first['offered_rate']:g}, passed above it) again: {brief(first['again'])}",
                  flush=True)
        if not retried:
            return


def refine(urls: dict[str, str], sweeps: dict[str, list[dict]], duration: float, target_ms: float,
           steps: int = 2, requests: Maker = two_cluster) -> None:
    """Bisect each arm's knee `steps` times, one more window per arm and step (arms in turns), so
    that a capacity is known to a quarter of the sweep's step: with rates 8 req/s apart one noisy
    window either side of the target moves a ratio by a whole step. Adds the points to `sweeps`."""
    for step in range(steps):
        for arm in rotated(list(urls), step):
            found = knee(sweeps[arm], target_ms)
            if found is None:
                continue
            rate = round(sum(found) / 2, 1)
            point = summarize(window(urls[arm], rate, duration, seed=300 + step, requests=requests))
            sweeps[arm] = sorted(sweeps[arm] + [point], key=lambda p: p["offered_rate"])
            print(f"arm {arm} (knee {found[0]:g}-{found[1]:g}) {brief(point)}", flush=True)


def window(url: str, rate: float, duration: float, seed: int, load=run_open_loop, requests: Maker = two_cluster):
    """One window: Poisson arrivals at `rate` of the workload `requests` makes (open loop unless
    `load` says).
    A window whose client fell behind its schedule is discarded and run once more (the report's
    client_lag_ms says how far behind the kept one was)."""
    arrivals = poisson_arrivals(rate, duration, seed)
    sent = requests(len(arrivals), seed)
    run = load(url, sent, arrivals, rate, duration)
    if load is run_open_loop and client_behind(client_lag(run)):
        print(f"the client fell behind at {rate} req/s: window run again", flush=True)
        run = load(url, sent, arrivals, rate, duration)
    return run


def measure(url: str, rate: float, duration: float, seed: int, requests: Maker = two_cluster) -> dict:
    return summarize(window(url, rate, duration, seed, requests=requests))


def pooled(runs: list[RunResult]) -> RunResult:
    """Several windows at one rate as one sample (more requests behind each percentile)."""
    return RunResult(runs[0].rate, sum(r.duration for r in runs), [x for r in runs for x in r.results],
                     sum(r.wall for r in runs))


def rotated(items: list, turn: int) -> list:
    """`items` starting at position `turn`: interleaved arms take turns going first, so a slow
    minute on a shared machine does not always land on the same arm."""
    turn %= len(items) or 1
    return items[turn:] + items[:turn]


def sweep_interleaved(urls: dict[str, str], rates: list[float], duration: float, target_ms: float,
                      rounds: int = 1, leaves: Callable[[dict, float], bool] | None = None,
                      label: str = "arm", requests: Maker = two_cluster) -> dict:
    """Every arm at each offered rate in turn (arms interleaved, the first one rotating), so the
    arms of one run see the same machine; with `rounds` > 1 each arm gets that many windows per
    rate, in turns, pooled. An arm leaves the sweep when `leaves(point, target_ms)` says so: by
    default once saturated (it loses requests, its p99 passes 4x the target or it answers under
    85% of what was sent), so the sweep shows its most throughput; its capacity is the rate before
    the first one that misses the target."""
    leaves = leaves or saturated
    sweeps: dict[str, list[dict]] = {arm: [] for arm in urls}
    active = list(urls)
    for turn, rate in enumerate(rates):
        runs: dict[str, list[RunResult]] = {arm: [] for arm in active}
        for round_ in range(rounds):
            for arm in rotated(active, turn + round_):
                runs[arm].append(window(urls[arm], rate, duration, seed=100 * round_ + int(rate), requests=requests))
        for arm, arm_runs in runs.items():
            point = summarize(pooled(arm_runs))
            sweeps[arm].append(point)
            print(f"{label} {arm} {brief(point)}", flush=True)
            if leaves(point, target_ms):
                active.remove(arm)
        if not active:
            break
    return sweeps


def at_rate_interleaved(urls: dict[str, str], rate: float, duration: float, rounds: int,
                        requests: Maker = two_cluster) -> dict:
    """All arms at one rate for `rounds` interleaved windows each, pooled; each round's short p99
    is kept too, so the report shows how much one window's tail moves."""
    runs: dict[str, list[RunResult]] = {arm: [] for arm in urls}
    rounds_short_p99: dict[str, list] = {arm: [] for arm in urls}
    for turn in range(rounds):
        for arm in rotated(list(urls), turn):
            run = window(urls[arm], rate, duration, seed=7 + turn, requests=requests)
            runs[arm].append(run)
            rounds_short_p99[arm].append(summarize(run)["short"]["p99"])
            print(f"arm {arm} at {rate}/s, round {turn + 1}: short p99 {rounds_short_p99[arm][-1]}", flush=True)
    out = {}
    for arm, arm_runs in runs.items():
        point = summarize(pooled(arm_runs))
        point["rounds_short_p99"] = rounds_short_p99[arm]
        point["short_latencies_ms"] = [r.latency * 1000 for run in arm_runs for r in run.results
                                       if r.status == 200 and r.kind == "short"]
        out[arm] = point
        print(f"arm {arm} at {rate}/s pooled: short p99 {point['short']['p99']} (rounds "
              f"{point['rounds_short_p99']}) waste {point['padding_waste']} lost {point['lost']}", flush=True)
    return out


def floor(urls: dict[str, str], rate: float, duration: float, requests: Maker = two_cluster) -> dict:
    """Each arm at the first window's arrivals and requests at `rate`, but one request in flight at
    a time: what a short request costs when it never waits behind another, after the idle gaps this
    rate leaves (on a shared machine the caches go cold in them: `make bench-idle`). Scheduling can
    only add to it, so its p99 / a control's short p99 is about the best ratio this machine allows."""
    out = {}
    for arm, url in urls.items():
        point = summarize(window(url, rate, duration, seed=7, load=run_one_in_flight, requests=requests))
        out[arm] = {"short": point["short"], "ok": point["ok"], "sent": point["sent"]}
        print(f"arm {arm} at {rate}/s, one request in flight, short requests: {point['short']}", flush=True)
    return out
