"""A deterministic discrete-event simulator of a TorchServe worker, running the policy itself.

`tsbatch tune` asks it which configuration to ship and `tsbatch simulate` answers "what would this
archive do under that traffic" in seconds. A tsbatch arm runs the very Policy the lane threads run
(handlers/core/policy.py), with pass times drawn from the latency profile with its spread (lognormal
through the shape's median and p90, or the profile's median times a ratio drawn from the host's
spread measured over hundreds of passes, Overheads' spread), on cores shared as Linux's fair
scheduler shares them: every running pass's threads and the work outside passes (TorchServe's
frontend, its protocol, parsing and JSON: per request, and per continuous-mode call) claim cores,
the long lane's nice-10 threads yield to the rest, and a team of intra-op threads waits for its
slowest thread. The continuous
mode's call cycle is modelled as TorchServe drives it: a worker holding requests takes new ones in
only when its call returns (a request done, or its `poll_ms` hold, replies paced as
handlers/edge/modes/continuous_mode.reply_pace says); a worker with siblings answers each call whole and
the frontend queues what arrives while every worker is inside a call. First-come arms model
TorchServe's own batching (batchSize, maxBatchDelay, a batch padded to its longest input or to
max_length), the controls of `make bench`.

Pure and deterministic: no torch, no clock, no threads; the same inputs and seed give the same
figures. Measured and modelled as factors, not mechanisms: a pass that runs beside a long one runs
slower (Overheads' beside, fitted live: in process two lanes run within 3% of alone, make
bench-beside, so it most likely stands for the worker's and the frontend's other work), and a team of threads that waited pays
more for its next pass the longer it waited (Overheads' cold: caches and sleeping threads, from
make bench-idle), and a tsbatch pass runs slower the more requests per second the worker takes in
(Overheads' intake: its intake thread holds the interpreter between the lane's operators; fitted
to live runs, bench/intake_fit.py), and each return of a continuous-mode call holds the worker's
passes up for a moment (Overheads' call, make bench-poll). Not at all: a machine whose speed drifts.
"""
from __future__ import annotations

import heapq
import itertools
import json
import math
import os
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from tsbatch.handlers.core.buckets import Item, bucket_for, bucket_tokens
from tsbatch.handlers.edge.config import HandlerConfig
from tsbatch.handlers.core.cost import CostModel
from tsbatch.handlers.core.errors import Overloaded
from tsbatch.handlers.edge.modes.continuous_mode import reply_pace
from tsbatch.handlers.core.policy import (Plan, Policy, PolicySettings, Ticket, call_hold, deadline_at, fits_call, lane_threads,
                                         split_lanes)
from tsbatch.warmup.profile import percentile

WORKLOADS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "workloads.json")
Z90 = 1.2815515655446004  # the standard normal's 90th percentile
SHORT_TOKENS = 64  # a request of at most this many tokens is "short" (as make bench counts)
NICE_WEIGHT = 110 / 1024  # Linux's scheduler weight of a nice-10 thread (the long lane's) against nice 0


@dataclass(frozen=True)
class Overheads:
    """What requests cost outside the passes: cores taken from the passes, and time. Defaults
    measured by bench/overheads.py (bench/results/overheads.md): the cores the frontend, the load
    generator and the worker's main thread use at each rate answered, under first-come batching and
    in continuous mode (TorchServe calls a worker that holds requests back to back; per request it
    costs less the more requests a call carries, so the measured curve, not a constant), a short
    request's time outside the handler at light load, and how much slower a pass runs beside another
    (from a make bench run's x-tsbatch-timing)."""

    # (requests/s, cores) measured (see outside_cores)
    outside: tuple[tuple[float, float], ...] = ((3.75, 0.0516), (8.38, 0.0958), (13.46, 0.1047), (15.19, 0.1167),
        (15.25, 0.1058), (32.56, 0.1706), (65.01, 0.3042), (128.5, 0.4755))
    outside_first_come: tuple[tuple[float, float], ...] = ((3.75, 0.0188), (8.37, 0.0279), (13.46, 0.0388),
        (15.21, 0.0412), (15.24, 0.0613), (32.56, 0.07), (64.88, 0.1051), (117.16, 0.1547))
    latency: float = 0.006  # seconds a request spends outside the handler at light load
    # a pass runs this many times slower while a long pass (more than SHORT_TOKENS) runs beside
    # it (fitted to a make bench search run's x-tsbatch-timing; two short passes side by side ran
    # as fast as alone in the short-only run). Not the lanes' memory traffic: in process they run
    # within 3% of alone (make bench-beside); most likely the worker's and the frontend's other work
    beside: float = 1.211
    # a long pass beside another long one (the short lane helping the long lane) runs this many
    # times slower (measured in process by make bench-beside); None: not measured, `beside` stands
    beside_long: float | None = None
    # a team of threads that has not run a pass for a while pays this much more for its next
    # one: (threads, padded tokens, seconds) after a long pause, and it approaches that as
    # 1 - exp(-pause / cold_tau) (fitted to make bench-idle's passes after pauses; none: not measured)
    cold: tuple[tuple[int, int, float], ...] = ()
    cold_tau: float = 0.03
    window: float = 1.0  # seconds over which the frontend's recent load is counted
    # a tsbatch pass runs (1 + intake x requests/s taken in) times slower: the worker's thread that
    # takes requests in (TorchServe's protocol, parsing, tokenizing, replies) holds the interpreter
    # between the lane's operators. Fitted to live runs' short passes against the simulated ones
    # (bench/intake_fit.py); first-come runs its passes on that same thread, so never beside it
    intake: float = 0.0
    # how much a pass varies on the host: (quantile, pass over its shape's median), measured over
    # hundreds of passes (bench/spread_bench.py); each pass is drawn as the profile's median times a
    # ratio from it. None measured (()): the profile's own spread, lognormal through median and p90
    spread: tuple[tuple[float, float], ...] = ()
    # seconds each continuous-mode return to the frontend holds up the worker's running passes (its
    # interpreter answers, then reads the next call, between the lanes' operators), so a pass during
    # which the call returns every poll_ms runs longer (make bench-poll; 0: not measured)
    call: float = 0.0

    @classmethod
    def from_report(cls, path: str) -> "Overheads":
        """The overheads a bench/overheads.py report measured (its `fit`, and `passes` when it fitted
        `beside`): a machine other than the one the defaults come from brings its own."""
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: not a bench/overheads.py report with a fit "
                             f"(outside, outside_first_come): {error}") from None
        return cls.of(report, path)

    @classmethod
    def of(cls, report: dict, source: str = "overheads") -> "Overheads":
        """The overheads of a bench/overheads.py report already read (`source` names it in errors)."""
        try:
            fit = report["fit"]
            curves = {name: tuple((float(rate), float(cores)) for rate, cores in fit[name])
                      for name in ("outside", "outside_first_come")}
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{source}: not a bench/overheads.py report with a fit "
                             f"(outside, outside_first_come): {error}") from None
        if not all(curves.values()) or any(c < 0 or r <= 0 for curve in curves.values() for r, c in curve):
            raise ValueError(f"{source}: each curve needs points of (requests/s > 0, cores >= 0)")
        extra = {}
        if fit.get("latency") is not None:
            extra["latency"] = float(fit["latency"])
        beside = (report.get("passes") or {}).get("beside")
        if beside is not None:
            extra["beside"] = float(beside)
        if fit.get("beside_long") is not None:
            extra["beside_long"] = float(fit["beside_long"])
        if fit.get("intake") is not None:
            extra["intake"] = float(fit["intake"])
        if fit.get("spread"):
            extra["spread"] = _spread(fit["spread"], source)
        if fit.get("cold"):
            extra["cold"] = tuple((int(t), int(n), float(s)) for t, n, s in fit["cold"])
            extra["cold_tau"] = float(fit["cold_tau"])
        if fit.get("call") is not None:
            extra["call"] = float(fit["call"])
        return cls(**curves, **extra)

    def beside_factor(self, *, long: bool) -> float:
        """How many times slower a pass (a long one: `long`) runs while a long pass runs beside it."""
        return self.beside_long if long and self.beside_long is not None else self.beside

    def cold_after(self, pause: float, *, threads: int, length: int) -> float:
        """Seconds a pass of `threads` threads over `length` tokens pays beyond the profile's
        (timed back to back) when its team last ran `pause` seconds ago: the measured points of the
        nearest thread count, interpolated in length."""
        if not self.cold or pause <= 0:
            return 0.0
        nearest = min({t for t, _, _ in self.cold}, key=lambda t: (abs(t - threads), t))
        points = {n: (s,) for t, n, s in self.cold if t == nearest}
        ends = min(points), max(points)
        full = _along(points, min(max(length, ends[0]), ends[1]))[0]
        return full * (1.0 - math.exp(-pause / self.cold_tau))


def _spread(points, source: str) -> tuple[tuple[float, float], ...]:
    """A measured spread, checked: quantiles from 0 to 1 in order, ratios positive and not falling."""
    try:
        spread = tuple((float(q), float(r)) for q, r in points)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: spread must be (quantile, ratio) pairs: {error}") from None
    quantiles, ratios = [q for q, _ in spread], [r for _, r in spread]
    if (len(spread) < 2 or quantiles[0] != 0.0 or quantiles[-1] != 1.0 or quantiles != sorted(quantiles)
            or ratios != sorted(ratios) or ratios[0] <= 0):
        raise ValueError(f"{source}: spread must run from quantile 0 to 1 in order, with positive ratios that do "
                         f"not fall, got {points}")
    return spread


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds from the start
    tokens: int  # the request's length, as the model's tokenizer counts it (before truncation)


@dataclass(frozen=True)
class Arm:
    """One way of serving: tsbatch (the archive's handler config and frontend keys) or first-come."""

    name: str
    kind: str = "tsbatch"  # "tsbatch" (continuous mode) or "first-come"
    config: HandlerConfig = field(default_factory=HandlerConfig)
    workers: int = 1
    batch_size: int = 8  # first-come: TorchServe's batchSize; tsbatch: the frontend's call size
    max_batch_delay_ms: int = 10  # first-come only
    pad: str = "longest"  # first-come: "longest" or "max" (every request padded to max_length)
    threads: int | None = None  # intra-op threads per worker (None: the config's, else cores / workers)


@dataclass
class Outcome:
    arrival: float
    tokens: int
    status: int = 0  # 0: not answered when the simulation ended
    answered: float = 0.0
    padded_to: int = 0
    pass_seconds: float = 0.0  # how long its pass took, served (slowed by what ran beside it)

    @property
    def kind(self) -> str:
        return "short" if self.tokens <= SHORT_TOKENS else "long"


def workload_tokens(name: str) -> list[int]:
    """Token lengths of a named workload (search, short, long, two-cluster: make bench's, from
    configs/workloads.json) or of a file: JSON, a list of lengths or {"tokens": [...]}, or plain
    text with one length per line."""
    with open(WORKLOADS_FILE) as f:
        named = json.load(f)["workloads"]
    if name in named:
        return list(named[name]["tokens"])
    if not os.path.isfile(name):
        raise ValueError(f"unknown workload {name!r}: one of {', '.join(named)}, or a file of token lengths")
    with open(name) as f:
        text = f.read()
    try:
        data = json.loads(text)
        values = data["tokens"] if isinstance(data, dict) else data
    except (json.JSONDecodeError, KeyError, TypeError):
        values = text.split()
    try:
        tokens = [int(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected token lengths (whole numbers), one per line or as a JSON list") from None
    if not tokens or min(tokens) < 1:
        raise ValueError(f"{name}: expected at least one token length, each at least 1")
    return tokens


def poisson(rate: float, duration: float, tokens: Sequence[int], seed: int = 0) -> list[Arrival]:
    """Open-loop Poisson arrivals at `rate` for `duration` seconds, lengths drawn from `tokens`."""
    rng = random.Random(seed)
    out, now = [], 0.0
    while True:
        now += rng.expovariate(rate)
        if now >= duration:
            return out
        out.append(Arrival(now, rng.choice(tokens)))


# -- pass times ---------------------------------------------------------------------------------------

class PassTimes:
    """Seconds of a pass alone, from the profile: exact for a measured shape, interpolated in
    length and size otherwise (first-come pads to any length and any batch size); drawn with the
    shape's spread. Threads: a profile per thread count; a count none was measured at is the
    nearest profile scaled as if threads divided the time (optimistic for that arm)."""

    def __init__(self, profiles: dict[int, object], seed: int = 0, spread: tuple[tuple[float, float], ...] = ()):
        if not profiles:
            raise ValueError("the simulator needs a latency profile")
        self.tables: dict[int, dict] = {}
        for t, p in profiles.items():  # a profile's own shapes, and any it timed on other threads (borrow_cores)
            self.tables[t] = _table(p.own_shapes())
            for wide in {s.threads for s in p.shapes if s.threads} - set(profiles):
                self.tables[wide] = _table([s for s in p.shapes if s.threads == wide])
        self.cost = {t: CostModel.from_profile(p) for t, p in profiles.items()}
        for t, model in self.cost.items():  # each arm's policy knows every thread count measured
            model.wider = {**{u: m for u, m in self.cost.items() if u != t}, **model.wider}
        self.rng = random.Random(seed)
        self.spread = spread  # Overheads' spread: the host's, in place of the profile's p90

    def cost_for(self, threads: int) -> CostModel:
        """What the policy of an arm whose passes run on `threads` threads is told."""
        return self.cost.get(threads) or self.cost[min(self.cost, key=lambda t: abs(t - threads))]

    def median_p90(self, *, length: int, size: int, threads: int) -> tuple[float, float]:
        measured = min(self.tables, key=lambda t: (abs(t - threads), -t))
        median, p90 = _interpolate(self.tables[measured], length, size)
        scale = measured / threads if threads > measured else 1.0
        return median * scale, p90 * scale

    def draw(self, *, length: int, size: int, threads: int) -> float:
        median, p90 = self.median_p90(length=length, size=size, threads=threads)
        if self.spread:  # the host's, measured over hundreds of passes
            return median * spread_ratio(self.spread, self.rng.random())
        sigma = math.log(p90 / median) / Z90 if p90 > median > 0 else 0.0
        return median * math.exp(sigma * self.rng.gauss(0.0, 1.0)) if sigma else median


def spread_ratio(spread: tuple[tuple[float, float], ...], u: float) -> float:
    """The pass-over-median ratio at quantile `u` of a measured spread (linear between its points,
    which run from quantile 0 to 1)."""
    return _along({q: (r,) for q, r in spread}, u)[0]


def _table(shapes) -> dict[int, dict[int, tuple[float, float]]]:
    """bucket edge -> {batch size: (median s, p90 s)} of timings on one thread count, single-size buckets only."""
    table: dict[int, dict[int, tuple[float, float]]] = {}
    for shape in shapes:
        if isinstance(shape.bucket, int):
            table.setdefault(shape.bucket, {}).setdefault(shape.batch, (shape.median_ms / 1000, shape.p90_ms / 1000))
    if not table:
        raise ValueError("the latency profile has no single-length shapes to simulate")
    return table


def _along(points: dict[int, tuple[float, float]], x: float) -> tuple[float, float]:
    """Linear interpolation over sorted keys; past the ends, proportional to x from the nearest."""
    keys = sorted(points)
    if x <= keys[0]:
        return tuple(v * x / keys[0] for v in points[keys[0]]) if x < keys[0] and len(keys) == 1 else points[keys[0]]
    if x >= keys[-1]:
        return tuple(v * x / keys[-1] for v in points[keys[-1]])
    hi = next(k for k in keys if k >= x)
    lo = max(k for k in keys if k <= x)
    if hi == lo:
        return points[lo]
    w = (x - lo) / (hi - lo)
    return tuple(a + w * (b - a) for a, b in zip(points[lo], points[hi]))


def _interpolate(table, length: int, size: int) -> tuple[float, float]:
    by_length = {edge: _along(sizes, size) for edge, sizes in table.items()}
    return _along(by_length, max(1, length))


# -- the machine ---------------------------------------------------------------------------------------

def outside_cores(curve: Sequence[tuple[float, float]], rate: float) -> float:
    """Cores busy outside the passes at `rate` requests/s, by a measured curve: interpolated between
    its points, proportional below the first, and along its last segment's slope past the last (a
    request costs less the more requests share a call)."""
    points = sorted(curve)
    if rate <= 0:
        return 0.0
    if rate <= points[0][0]:
        return points[0][1] * rate / points[0][0]
    if rate >= points[-1][0]:
        if len(points) == 1:
            return points[0][1] * rate / points[0][0]
        (x0, y0), (x1, y1) = points[-2], points[-1]
        slope = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 else 0.0
        return y1 + slope * (rate - x1)
    return _along({x: (y,) for x, y in points}, rate)[0]


def shares_of(demands: Sequence[tuple[float, float]], cores: int) -> list[float]:
    """Each claimant's share of a core per thread, as Linux's fair scheduler divides `cores`:
    (threads, weight per thread) each; a thread gets at most one core, and cores left over by
    those capped go to the rest in proportion to weight."""
    if sum(d for d, _ in demands) <= cores:
        return [1.0] * len(demands)
    capped: set[int] = set()
    while True:
        free = cores - sum(demands[i][0] for i in capped)
        weight = sum(d * w for i, (d, w) in enumerate(demands) if i not in capped)
        scale = free / weight if weight > 0 else 0.0
        newly = {i for i, (d, w) in enumerate(demands) if i not in capped and d > 0 and scale * w >= 1.0}
        if not newly:
            return [1.0 if i in capped else min(1.0, scale * w) for i, (_, w) in enumerate(demands)]
        capped |= newly


class Simulation:
    """Events on one clock; passes share the cores with the per-request work outside them."""

    def __init__(self, cores: int, overheads: Overheads):
        self.cores = cores
        self.overheads = overheads
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()
        # pass id -> [alone seconds left, threads, version, done, weight per thread, progress per second, long]
        self.running: dict[int, list] = {}
        self.seen = 0.0  # when `running` was last brought up to date
        self.recent: list[float] = []  # arrivals within the window
        self.curve = overheads.outside  # the measured curve of the arm's kind: simulate() sets first-come's
        self.intake = overheads.intake  # per request/s taken in, how much slower a pass runs (0 for first-come)
        self.last_ran: dict[object, float] = {}  # a team of threads -> when its last pass ended

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (when, next(self.seq), action))

    def run(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            when, _, action = heapq.heappop(self.events)
            self.now = max(self.now, when)
            action()

    def arrived(self) -> None:
        """A request reached the frontend: the work outside the passes follows the rate of the
        last window (the measured curve of its kind)."""
        self.recent.append(self.now)
        self._reflow()
        self.at(self.now + self.overheads.window * (1 + 1e-9), self._reflow)  # when it leaves the window

    def start(self, alone: float, threads: int, done: Callable[[], None], background: bool = False,
              length: int = 0, team: object = None) -> int:
        """Run a pass of `alone` seconds on `threads` threads over inputs of `length` tokens;
        `done()` when it ends. A background pass (a long lane's: its threads run at nice 10)
        yields the cores to everything else; a long one slows the passes beside it. `team`: whose
        threads run it (a lane, a worker): they pay the cold cost of the pause since their last."""
        self._advance()
        pause = self.now - self.last_ran.get(team, -math.inf)
        alone += self.overheads.cold_after(pause, threads=threads, length=length)

        def ended() -> None:
            self.last_ran[team] = self.now
            done()

        pid = next(self.seq)
        self.running[pid] = [alone, threads, 0, ended, NICE_WEIGHT if background else 1.0, 1.0, length > SHORT_TOKENS]
        self._reflow(advanced=True)
        return pid

    def stall(self, pids, seconds: float) -> None:
        """The passes `pids` (those still running) make no progress for `seconds` from now."""
        held = [self.running[pid] for pid in pids if pid in self.running]
        if seconds <= 0 or not held:
            return
        self._advance()
        for entry in held:
            entry[0] += seconds * entry[5]
        self._reflow(advanced=True)

    def _advance(self) -> None:
        elapsed = self.now - self.seen
        if elapsed > 0:
            for entry in self.running.values():
                entry[0] -= elapsed * entry[5]
        self.seen = self.now

    def _reflow(self, advanced: bool = False) -> None:
        if not advanced:
            self._advance()
        window = self.overheads.window
        while self.recent and self.recent[0] < self.now - window:
            self.recent.pop(0)
        rate = len(self.recent) / window
        outside = outside_cores(self.curve, rate)
        demands = [(outside, 1.0)] + [(entry[1], entry[4]) for entry in self.running.values()]
        shares = shares_of(demands, self.cores)[1:]
        longs = sum(entry[6] for entry in self.running.values())
        for (pid, entry), share in zip(self.running.items(), shares):
            entry[5] = share ** entry[1] / (1 + self.intake * rate)  # a team waits at every op for its slowest thread
            if longs - entry[6] > 0:  # a long pass runs beside this one
                entry[5] /= self.overheads.beside_factor(long=entry[6])
            entry[2] += 1
            version = entry[2]
            self.at(self.now + max(0.0, entry[0]) / entry[5], lambda pid=pid, version=version: self._end(pid, version))

    def _end(self, pid: int, version: int) -> None:
        entry = self.running.get(pid)
        if entry is None or entry[2] != version:
            return  # rescheduled since
        self._advance()
        del self.running[pid]
        self._reflow(advanced=True)
        entry[3]()


# -- tsbatch in continuous mode ------------------------------------------------------------------------

class TsbatchWorker:
    """One worker: the Policy, its lanes as simulated passes, and the continuous mode's calls."""

    def __init__(self, sim: Simulation, fleet: "Fleet", arm: Arm, times: PassTimes, max_length: int, alone: bool):
        self.sim, self.fleet, self.arm, self.times = sim, fleet, arm, times
        cfg = arm.config
        self.edges = cfg.edges_for(max_length)
        self.max_length = max_length
        threads = arm.threads or cfg.torch_threads or max(1, sim.cores // arm.workers)
        lanes = split_lanes(self.edges, cfg.long_lane_from)
        self.lane_threads = lane_threads(threads, len(lanes))
        self.policy = Policy(PolicySettings.of(cfg, self.edges), cfg.batch_limit, times.cost_for(self.lane_threads), lanes,
                             [self.lane_threads] * len(lanes))
        self.alone = alone
        self.held: dict[int, Ticket] = {}  # request index -> its ticket while in this worker
        self.done: dict[int, tuple[int, float | None]] = {}  # request index -> (status, deadline), answered at the next return
        self.in_call = False
        self.call = 0  # the call's number: a hold timeout of an earlier call is stale
        self.returning = False  # a return is scheduled
        self.replied = -math.inf
        self.wakes = [0] * len(lanes)  # each lane's wake-up's number: a wake of an earlier wait is stale
        self.watches = 0  # the deadline watcher's wake-up's number, alike
        self.passes: set[int] = set()  # the simulation's ids of this worker's running passes

    # the frontend's side
    @property
    def idle(self) -> bool:
        return not self.in_call

    def take(self, requests: list[int]) -> None:
        """A call brings `requests` (indexes into the fleet's outcomes); it starts now."""
        now = self.sim.now
        if not self.alone and len(requests) >= max(2, self.arm.batch_size // 4) and not self.fleet.any_idle(self):
            requests = self._fit_call(requests)
        for index in requests:
            outcome = self.fleet.outcomes[index]
            length = min(outcome.tokens, self.max_length)
            bucket = bucket_for(length, self.edges)
            deadline = deadline_at(now, self.arm.config.deadline_ms, self.arm.config.deadline_margin_ms)
            ticket = Ticket(Item(index=index, text="", length=length, bucket=bucket), now, deadline=deadline,
                            may_wait=self.alone)
            try:
                self.policy.admit([ticket], now)
            except Overloaded:
                self.fleet.answer(index, 503, now)
                continue
            self.held[index] = ticket
        self.in_call = True
        self.call += 1
        self.returning = False
        if self.alone:
            call = self.call
            self.sim.at(now + self._hold(), lambda: self._hold_over(call))
        self._kick()
        self._maybe_return()

    def _fit_call(self, requests: list[int]) -> list[int]:
        buckets = [bucket_for(min(self.fleet.outcomes[i].tokens, self.max_length), self.edges) for i in requests]
        fits = fits_call(buckets, self.policy, self.arm.config.max_call_ms / 1000)
        for index, ok in zip(requests, fits):
            if not ok:
                self.fleet.answer(index, 503, self.sim.now)
        return [index for index, ok in zip(requests, fits) if ok]

    def _hold(self) -> float:
        poll = self.arm.config.poll_ms / 1000
        return call_hold(poll, self.policy.free_in(self.sim.now))

    def _hold_over(self, call: int) -> None:
        if call == self.call and self.in_call and not self.returning:
            self._schedule_return()

    def _maybe_return(self) -> None:
        """When the call may go back: alone, once one of its requests is done; with siblings, once
        every request it holds is."""
        if not self.in_call or self.returning:
            return
        if self.alone and self.done:
            self._schedule_return()
        elif not self.alone and not self.held:
            self._schedule_return()

    def _schedule_return(self) -> None:
        self.returning = True
        when = self.sim.now
        if self.alone:
            pace = self.replied + reply_pace(len(self.held))
            deadlines = [deadline for _, deadline in self.done.values() if deadline is not None]
            when = max(when, min([pace] + deadlines))  # never past a done request's own deadline
        self.sim.at(when, self._return)

    def _return(self) -> None:
        now = self.sim.now
        for index, (status, _) in self.done.items():
            self.fleet.answer(index, status, now)
        self.done = {}
        self.replied = now
        self.sim.stall(self.passes, self.sim.overheads.call)  # the return and the next call, between operators
        self.in_call = False
        self.returning = False
        self.fleet.returned(self)
        if not self.in_call and self.held:  # nothing new, but requests in flight: the frontend calls again
            self.take([])

    # the lanes
    def _kick(self) -> None:
        for lane, state in enumerate(self.policy.lanes):
            if state.running is None:
                self._step(lane)
        self._watch()

    def _watch(self) -> None:
        """Lanes' deadline watcher: while every lane is inside a pass, expire tickets when due."""
        self.watches += 1
        due = self.policy.until_expiry(self.sim.now) if all(self.policy.busy) else None
        if due is not None:
            watch = self.watches
            when = max(self.sim.now + due, math.nextafter(self.sim.now, math.inf))
            self.sim.at(when, lambda: self._watched(watch))

    def _watched(self, watch: int) -> None:
        if watch != self.watches or not all(self.policy.busy):
            return
        for ticket in self.policy.expire(self.sim.now):
            self._finish(ticket, 504)
        self._watch()

    def _step(self, lane: int) -> None:
        while True:
            plan = self.policy.schedule(lane, self.sim.now)
            for ticket in plan.expired:
                self._finish(ticket, 504)
            if plan.batch is not None:
                self._run(plan)
                return
            if not plan.expired:
                if plan.wait is not None:
                    self.wakes[lane] += 1
                    wake = self.wakes[lane]
                    # the clock must move: a wait of 0 would ask again at this instant forever
                    when = max(self.sim.now + plan.wait, math.nextafter(self.sim.now, math.inf))
                    self.sim.at(when, lambda: self._wake(lane, wake))
                return
            self.policy.finished(plan, self.sim.now)  # only 504s: the lane asks again

    def _wake(self, lane: int, wake: int) -> None:
        if wake == self.wakes[lane] and self.policy.lanes[lane].running is None:
            self._step(lane)
            self._watch()

    def _run(self, plan: Plan) -> None:
        batch = plan.batch
        alone = self.times.draw(length=bucket_tokens(batch.bucket), size=batch.size, threads=plan.threads)
        started = self.sim.now

        def done() -> None:
            now = self.sim.now
            self.passes.discard(pid)
            self.policy.finished(plan, now)
            for ticket in plan.tickets:
                late = ticket.deadline is not None and now > ticket.deadline
                outcome = self.fleet.outcomes[ticket.item.index]
                outcome.padded_to, outcome.pass_seconds = bucket_tokens(batch.bucket), now - started
                self._finish(ticket, 504 if late else 200)
            self._kick()
            self._maybe_return()

        pid = self.sim.start(alone, plan.threads, done, background=plan.lane > 0,  # as scheduled.py lowers lane 1+
                             length=bucket_tokens(batch.bucket), team=(self, plan.lane))
        self.passes.add(pid)

    def _finish(self, ticket: Ticket, status: int) -> None:
        index = ticket.item.index
        self.held.pop(index, None)
        self.done[index] = (status, ticket.deadline)
        self._maybe_return()


# -- first-come: TorchServe's own batching -------------------------------------------------------------

class FirstComeWorker:
    """TorchServe's frontend batching: the first waiting request, then up to batchSize - 1 more
    within maxBatchDelay of taking it; one pass padded to the batch's longest input (or max_length)."""

    def __init__(self, sim: Simulation, fleet: "Fleet", arm: Arm, times: PassTimes, max_length: int):
        self.sim, self.fleet, self.arm, self.times = sim, fleet, arm, times
        self.max_length = max_length
        self.threads = arm.threads or max(1, sim.cores // arm.workers)
        self.busy = False
        self.batch: list[int] | None = None  # being gathered
        self.closes = 0

    @property
    def idle(self) -> bool:
        return not self.busy and self.batch is None

    def begin(self, first: int) -> None:
        self.batch = [first]
        self.closes += 1
        closes = self.closes
        self.sim.at(self.sim.now + self.arm.max_batch_delay_ms / 1000, lambda: self._close(closes))
        self.fleet.fill(self)

    def offer(self, index: int) -> bool:
        """Take a waiting request into the batch being gathered, if there is room."""
        if self.batch is None or len(self.batch) >= self.arm.batch_size:
            return False
        self.batch.append(index)
        if len(self.batch) >= self.arm.batch_size:
            self._close(self.closes)
        return True

    def _close(self, closes: int) -> None:
        if closes != self.closes or self.batch is None:
            return
        batch, self.batch = self.batch, None
        self.busy = True
        lengths = [min(self.fleet.outcomes[i].tokens, self.max_length) for i in batch]
        padded = self.max_length if self.arm.pad == "max" else max(lengths)
        alone = self.times.draw(length=padded, size=len(batch), threads=self.threads)
        started = self.sim.now

        def done() -> None:
            for index in batch:
                outcome = self.fleet.outcomes[index]
                outcome.padded_to, outcome.pass_seconds = padded, self.sim.now - started
                self.fleet.answer(index, 200, self.sim.now)
            self.busy = False
            self.fleet.returned(self)

        self.sim.start(alone, self.threads, done, length=padded, team=self)


# -- the frontend in front of the workers ------------------------------------------------------------------

class Fleet:
    """TorchServe's queue for one model and its workers."""

    def __init__(self, sim: Simulation, arm: Arm, times: PassTimes, max_length: int, arrivals: Sequence[Arrival]):
        self.sim, self.arm = sim, arm
        self.outcomes = [Outcome(a.at, a.tokens) for a in arrivals]
        self.queue: list[int] = []
        alone = arm.workers == 1
        if arm.kind == "first-come":
            self.workers = [FirstComeWorker(sim, self, arm, times, max_length) for _ in range(arm.workers)]
        else:
            self.workers = [TsbatchWorker(sim, self, arm, times, max_length, alone) for _ in range(arm.workers)]
        self.turn = 0
        half = sim.overheads.latency / 2
        for index, arrival in enumerate(arrivals):
            sim.at(arrival.at + half, lambda index=index: self.arrive(index))

    def any_idle(self, besides) -> bool:
        return any(w.idle for w in self.workers if w is not besides)

    def arrive(self, index: int) -> None:
        self.sim.arrived()
        if self.arm.kind == "first-come":
            gathering = next((w for w in self.workers if w.batch is not None), None)
            if gathering is not None and gathering.offer(index):
                return
            idle = self._idle()
            if idle is not None:
                idle.begin(index)
            else:
                self.queue.append(index)
            return
        idle = self._idle()
        if idle is not None:
            idle.take([index])
        else:
            self.queue.append(index)

    def _idle(self):
        for k in range(len(self.workers)):
            worker = self.workers[(self.turn + k) % len(self.workers)]
            if worker.idle:
                self.turn = (self.turn + k + 1) % len(self.workers)
                return worker
        return None

    def fill(self, worker: FirstComeWorker) -> None:
        while self.queue and worker.offer(self.queue[0]):
            self.queue.pop(0)

    def returned(self, worker) -> None:
        """A worker is back at the frontend: it takes what waits (a tsbatch worker, a call of at
        most batchSize; a first-come worker, the next batch)."""
        if not self.queue:
            return
        if self.arm.kind == "first-come":
            worker.begin(self.queue.pop(0))
            return
        room = max(1, self.arm.batch_size - len(worker.held))
        taken, self.queue = self.queue[:room], self.queue[room:]
        worker.take(taken)

    def answer(self, index: int, status: int, now: float) -> None:
        outcome = self.outcomes[index]
        if not outcome.status:
            outcome.status = status
            outcome.answered = now + self.sim.overheads.latency / 2


# -- running arms ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    """One simulated window, in the figures make bench reports (bench/loadtest/stats.summarize)."""

    rate: float
    sent: int
    ok: int
    status: dict
    throughput: float
    padding_waste: float | None
    latency: dict  # "all" | "short" | "long" -> {"p50", "p95", "p99", "n", "pass_p50", "pass_p99"} in ms (pass_: its passes')
    late: int = 0  # of the 504s, those whose pass ran (lanes.late): work done, then thrown away

    def passes(self, target_ms: float) -> bool:
        """Served within the target: every request answered 200 and p99 under it."""
        p99 = self.latency["all"]["p99"]
        return self.ok == self.sent and p99 is not None and p99 <= target_ms


def simulate(arm: Arm, arrivals: Sequence[Arrival], profiles: dict[int, object], max_length: int, cores: int = 2,
             overheads: Overheads = Overheads(), seed: int = 0, rate: float = 0.0) -> Point:
    """Serve `arrivals` with `arm` and report it. `profiles`: latency profiles by intra-op threads."""
    sim = Simulation(cores, overheads)
    if arm.kind == "first-come":
        sim.curve, sim.intake = overheads.outside_first_come, 0.0
    fleet = Fleet(sim, arm, PassTimes(profiles, seed, overheads.spread), max_length, arrivals)
    end = (arrivals[-1].at if arrivals else 0.0) + 60.0  # a drain after the last arrival
    sim.run(end)
    outcomes = fleet.outcomes
    ok = [o for o in outcomes if o.status == 200]
    status: dict[str, int] = {}
    for o in outcomes:
        key = str(o.status) if o.status else "lost"
        status[key] = status.get(key, 0) + 1
    span = max((o.answered for o in outcomes if o.status), default=0.0) - (arrivals[0].at if arrivals else 0.0)
    real = sum(min(o.tokens, max_length) for o in ok if o.padded_to)
    padded = sum(o.padded_to for o in ok if o.padded_to)
    latency = {}
    for kind in ("all", "short", "long"):
        ms = [(o.answered - o.arrival) * 1000 for o in ok if kind == "all" or o.kind == kind]
        latency[kind] = {f"p{q}": (round(percentile(ms, q), 1) if ms else None) for q in (50, 95, 99)}
        latency[kind]["n"] = len(ms)
        passes = [o.pass_seconds * 1000 for o in ok if (kind == "all" or o.kind == kind) and o.pass_seconds]
        latency[kind]["pass_p50"] = round(percentile(passes, 50), 1) if passes else None
        latency[kind]["pass_p99"] = round(percentile(passes, 99), 1) if passes else None
    late = sum(1 for o in outcomes if o.status == 504 and o.pass_seconds)
    return Point(rate, len(outcomes), len(ok), status, round(len(ok) / span, 2) if span > 0 else 0.0,
                 round(1 - real / padded, 4) if padded else None, latency, late)


def at_rate(arm: Arm, rate: float, tokens: Sequence[int], profiles, max_length: int, duration: float = 60.0,
            seed: int = 0, **kw) -> Point:
    return simulate(arm, poisson(rate, duration, tokens, seed), profiles, max_length, seed=seed, rate=rate, **kw)


def capacity(arm: Arm, tokens: Sequence[int], profiles, max_length: int, target_ms: float,
             duration: float = 60.0, seed: int = 0, resolution: float = 1.0, **kw) -> float:
    """The highest rate (to `resolution` req/s) served within the target, searched upward then
    bisected: like make bench's rule, the rate below the first one that misses."""
    def ok(rate: float) -> bool:
        return at_rate(arm, rate, tokens, profiles, max_length, duration, seed, **kw).passes(target_ms)

    low, high = 0.0, 4.0
    while ok(high):
        low, high = high, high * 2
        if high > 10_000:
            return low
    while high - low > resolution:
        middle = (low + high) / 2
        if ok(middle):
            low = middle
        else:
            high = middle
    return round(low, 1)
