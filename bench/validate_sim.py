"""The simulator against live `make bench` runs: for each workload's report, every arm it measured
served again in the simulator (archiver/simulate.py) with the profile the run was tuned from, and
the agreement in one table: capacity at the target, and short p99 at the rate make bench measured
it (70% of first-come's capacity). Writes bench/results/simulator-vs-live.{json,md}. A second
reading asks the same agreement against what one live run cannot tell apart (its capacity lies
below the next rate it tried; its p99 pools rounds that differ from each other), beside the verdict.

    python bench/validate_sim.py --profile P.json --profile-2t P2.json LIVE/bench-search.json ...
    python bench/validate_sim.py --own-profiles W1/bench-search.json W2/bench-long.json ...

`--profile`: the profile the tsbatch arms serve with (taken with their lanes' threads, as
`tsbatch profile` does); `--profile-2t`: one taken with a single lane on every thread (handler
long_lane_from: null), for first-come's two-thread passes, unless `--profile-first-come` gives the
control's own (bench/control_profile.py: its eager model, tokenizing inside the pass); `--overheads`
what bench/overheads.py measured on the live runs' machine. `--own-profiles`: each report with the
profiles in its own folder, taken just before it (make bench-window, bench/same_window.py), since the host's speed moves by
tens of percent between hours and a profile of another hour judges the simulator by that. Arm t is served
as the live run served it (the model-config.yaml make bench records), or, for a report without it,
tuned again from --profile exactly as `make bench` tunes it (tsbatch archive's default workload).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tsbatch.archiver import pipeline  # noqa: E402
from tsbatch.archiver.simulate import Arm, Overheads, at_rate, capacity, workload_tokens  # noqa: E402
from tsbatch.archiver.tune import continuous_batch_size  # noqa: E402
from tsbatch.archiver.tune_sim import DEFAULT_WORKLOAD  # noqa: E402
from tsbatch.handlers.core.cost import profile_threads  # noqa: E402
from tsbatch.handlers.edge.config import HandlerConfig  # noqa: E402
from bench.loadtest import report as reports  # noqa: E402

CAPACITY_WITHIN = 0.15
P99_WITHIN = 0.25
SIMULATED_AT_70 = 300.0  # seconds simulated at the 70% rate: its p99 the model's, not one draw's (live pools 2-4 windows)


def tuned_arm(profile_path: str, target_ms: float) -> Arm:
    """Arm t as make bench builds it: tsbatch archive --profile, continuous mode, default workload."""
    request = pipeline.Request("", "minilm", {"task": "embedding"}, target_ms, workload=DEFAULT_WORKLOAD)
    tuning, _ = pipeline.tune_for(request, pipeline.load_profile(profile_path))
    handler = {"task": "embedding", **tuning.handler_values()}
    frontend = tuning.frontend_values()
    return Arm("t", config=HandlerConfig.from_yaml(handler), workers=int(frontend["minWorkers"]),
               batch_size=int(frontend["batchSize"]))


def arms_for(live: dict, profile_path: str) -> dict[str, Arm]:
    template = HandlerConfig.from_yaml({"task": "embedding"})
    known = {
        "a": Arm("a", kind="first-come", pad="max", threads=2),
        "b": Arm("b", kind="first-come", threads=2),
        "d": Arm("d", config=template, batch_size=continuous_batch_size(template)),
        "d2": Arm("d2", config=HandlerConfig.from_yaml({"task": "embedding", "torch_threads": 1}), workers=2,
                  batch_size=continuous_batch_size(template)),
        "b2": Arm("b2", kind="first-come", workers=2, threads=1),
    }
    out = {name: known[name] for name in live["arms"] if name in known}
    if "t" in live["arms"]:
        served = live.get("tuned_model_config")
        out["t"] = served_arm(served) if served else tuned_arm(profile_path, live["latency_target_ms"])
    return out


def served_arm(model_config: dict) -> Arm:
    """Arm t as the live run served it: the model-config.yaml its .mar held."""
    handler = {k: v for k, v in model_config["handler"].items() if k != "model_dir"}
    return Arm("t", config=HandlerConfig.from_yaml(handler), workers=int(model_config.get("minWorkers", 1)),
               batch_size=int(model_config.get("batchSize", 8)))


def within(predicted, measured, share: float) -> bool | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return abs(predicted - measured) / measured <= share


def within_span(predicted, low, high, share: float) -> bool | None:
    """Within `share` of some value the live run could not tell apart from its figure: between
    `low` and `high` (a capacity and the rate above it that missed; a p99's rounds)."""
    if predicted is None or low is None or high is None:
        return None
    return low * (1 - share) <= predicted <= high * (1 + share)


def live_span(measured: dict) -> dict:
    """What one live run leaves open. Its capacity is the rate below the first miss, so the arm's
    knee lies between that rate and the next one tried; its short p99 at 70% pools rounds of
    15 s that can differ by half from each other at one rate and one arm on a shared host."""
    above = sorted(p["offered_rate"] for p in measured["sweep"] if p["offered_rate"] > measured["capacity"])
    rounds = measured["at_70pct_b"].get("rounds_short_p99") or []
    return {"capacity_next": above[0] if above else None,
            "p99_rounds": rounds, "p99_spread": round(max(rounds) / min(rounds) - 1, 3) if len(rounds) > 1 and min(rounds) else None}


def pass_times(breakdown: dict | None, simulated: dict) -> dict:
    """A class's passes, live (make bench's breakdown of x-tsbatch-timing) and simulated: the median,
    and the p99, where a host's tail shows that an in-process profile does not carry."""
    breakdown = breakdown or {}
    return {"live": breakdown.get("pass"), "simulated": simulated["pass_p50"],
            "live_p99": (breakdown.get("p99") or {}).get("pass"), "simulated_p99": simulated.get("pass_p99")}


def compare(live: dict, profiles: dict, profile_path: str, first_come: dict | None = None,
            overheads: Overheads = Overheads(), after: tuple[dict, dict | None] | None = None) -> dict:
    """Each arm of a live run in the simulator. `after`: profiles (tsbatch's, first-come's) taken
    right after the run, where its 70% point was measured last: that point is simulated with them,
    the host's speed of its own minutes (fc-v1252 once ran 30% slower a quarter hour after a profile,
    and a p99 near half a lane's load moves about three times as much as the pass), the earlier
    profiles' figure kept beside."""
    tokens = workload_tokens(live["workload"])
    max_length = max(s.bucket for s in next(iter(profiles.values())).shapes if isinstance(s.bucket, int))
    target = live["latency_target_ms"]
    rows = {}
    for name, arm in arms_for(live, profile_path).items():
        measured = live["arms"][name]
        served = first_come if arm.kind == "first-come" and first_come else profiles
        rate = measured["at_70pct_b"]["offered_rate"]
        predicted_capacity = capacity(arm, tokens, served, max_length, target, 30.0, 0, 1.0, overheads=overheads)
        point = at_rate(arm, rate, tokens, served, max_length, SIMULATED_AT_70, 0, overheads=overheads)
        before_p99 = None
        if after is not None:
            later = after[1] if arm.kind == "first-come" and after[1] else after[0]
            before_p99 = point.latency["short"]["p99"]
            point = at_rate(arm, rate, tokens, later, max_length, SIMULATED_AT_70, 0, overheads=overheads)
        live_p99 = measured["at_70pct_b"]["short"]["p99"]
        sweep = []
        for live_point in sorted(measured["sweep"], key=lambda p: p["offered_rate"]):
            simulated = at_rate(arm, live_point["offered_rate"], tokens, served, max_length, 30.0, 0,
                                overheads=overheads).latency
            again = live_point.get("again")  # measured again (make bench's confirm): its second window
            sweep.append({"rate": live_point["offered_rate"], "live": {k: live_point[k]["p99"] for k in ("short", "long")},
                          "live_again": {k: again[k]["p99"] for k in ("short", "long")} if again else None,
                          "simulated": {k: simulated[k]["p99"] for k in ("short", "long")},
                          # each class's pass served, median and p99: tsbatch's x-tsbatch-timing, and the simulator's
                          **{f"{k}_pass_ms": pass_times(live_point.get(f"{k}_breakdown_ms"), simulated[k])
                             for k in ("short", "long")}})
        span, simulated_p99 = live_span(measured), point.latency["short"]["p99"]
        rounds = span["p99_rounds"] or [live_p99]
        rows[name] = {"sweep": sweep, "capacity": {"live": measured["capacity"], "simulated": predicted_capacity,
                                   "agrees": within(predicted_capacity, measured["capacity"], CAPACITY_WITHIN),
                                   "live_next": span["capacity_next"],
                                   "within_span": within_span(predicted_capacity, measured["capacity"],
                                                              span["capacity_next"] or measured["capacity"], CAPACITY_WITHIN)},
                      "short_p99_at_70pct_b": {"rate": rate, "live": live_p99, "simulated": simulated_p99,
                                               "agrees": within(simulated_p99, live_p99, P99_WITHIN),
                                               "simulated_profile_before": before_p99,
                                               "pass_ms": pass_times(measured["at_70pct_b"].get("short_breakdown_ms"),
                                                                 point.latency["short"]),
                                               "live_rounds": span["p99_rounds"], "live_spread": span["p99_spread"],
                                               "within_span": within_span(simulated_p99, min(rounds), max(rounds), P99_WITHIN)}}
    return {"workload": live["workload"], "live_when": live["when"], "live_command": live["command"], "arms": rows}


def markdown(report: dict) -> str:
    lines = [f"# The simulator against live make bench ({report['when']})", "",
             f"Machine: {report['machine']}. Command: `{report['command']}`.",
             f"Agreement asked: capacity within {CAPACITY_WITHIN:.0%} of live, short p99 at 70% of first-come's "
             f"capacity within {P99_WITHIN:.0%}. Simulated: 30 s per rate for capacity (1 req/s resolution), "
             f"{SIMULATED_AT_70:g} s at the 70% rate, seed 0; the live runs' own settings are in their reports."
             + (f" tsbatch's passes run 1 + {report['intake']} x requests/s slower (the overheads' `intake`, "
                "fitted by bench/intake_fit.py)." if report.get("intake") else ""), ""]
    yes = lambda v: {True: "yes", False: "**no**", None: "-"}[v]  # noqa: E731
    rows = [(result["workload"], name, row) for result in report["workloads"] for name, row in result["arms"].items()]
    agreed = [row for _, _, row in rows if row["capacity"]["agrees"] and row["short_p99_at_70pct_b"]["agrees"]]
    lines += [f"**{len(agreed)} of {len(rows)}** arms agree on both figures.", "",
              "| workload | arm | capacity live / simulated (req/s) | within 15% | short p99 @70% b live / simulated (ms) | within 25% |",
              "|---|---|---|---|---|---|"]
    for workload, name, row in rows:
        c, p = row["capacity"], row["short_p99_at_70pct_b"]
        before = p.get("simulated_profile_before")
        lines.append(f"| {workload} | {name} | {c['live']} / {c['simulated']} | {yes(c['agrees'])} | "
                     f"{p['live']} / {p['simulated']} (at {p['rate']} req/s"
                     + (f"; {before} with the profile before the run" if before is not None else "") + f") | {yes(p['agrees'])} |")
    if any(row["short_p99_at_70pct_b"].get("simulated_profile_before") is not None for _, _, row in rows):
        lines += ["", "Where a run has profiles taken right after it, its 70% point (measured last) is simulated "
                  "with them, the host's speed of that point's minutes; capacity with the ones taken before."]
    lines += ["", "What one live run cannot tell apart: its capacity lies between the rate it reports and the "
              "next rate it tried (which missed); its p99 pools its rounds (windows of 15 s), each a p99 of its own. "
              "The same agreement asked of the simulator against any value in those spans (a second reading; "
              "the table above is the verdict):", ""]
    spread = sorted(row["short_p99_at_70pct_b"]["live_spread"] for _, _, row in rows
                    if row["short_p99_at_70pct_b"].get("live_spread") is not None)
    if spread:
        lines += [f"The rounds' p99s of one arm at one rate differ by {spread[len(spread) // 2]:.0%} in the median "
                  f"over these arms, by up to {spread[-1]:.0%}.", ""]
    lines += ["| workload | arm | live capacity, next rate tried / simulated | within 15% of the span | "
              "live p99 rounds / simulated | within 25% of the span |", "|---|---|---|---|---|---|"]
    for workload, name, row in rows:
        c, p = row["capacity"], row["short_p99_at_70pct_b"]
        rounds = ", ".join(f"{r:g}" for r in p.get("live_rounds") or []) or "-"
        lines.append(f"| {workload} | {name} | {c['live']:g}, {'-' if c['live_next'] is None else format(c['live_next'], 'g')} "
                     f"/ {c['simulated']} | {yes(c['within_span'])} | {rounds} / {p['simulated']} | "
                     f"{yes(p['within_span'])} |")
    both = [row for _, _, row in rows if row["capacity"]["within_span"] and row["short_p99_at_70pct_b"]["within_span"]]
    lines += ["", f"{len(both)} of {len(rows)} arms within both spans.", ""]
    for result in report["workloads"]:
        lines += [f"## {result['workload']} (live: {result['live_when']}, `{result['live_command']}`)"]
        if result.get("profiles"):
            lines += ["", f"Simulated with the profiles taken just before it"
                      + (" (its 70% point with the ones taken just after it)" if result["profiles"].get("after") else "")
                      + f", in `{result['profiles']['from']}`."]
        timed = {name: row["short_p99_at_70pct_b"].get("pass_ms") or {} for name, row in result["arms"].items()}
        timed = {name: p for name, p in timed.items() if p.get("live_p99")}
        if timed:
            lines += ["", "The short passes at the 70% rate, median and p99 in ms, live / simulated: " + ", ".join(
                f"{name} {p['live']} / {p['simulated']} and {p['live_p99']} / {p['simulated_p99']}"
                for name, p in timed.items()) + "."]
        lines += ["", "Each rate of the live sweep, p99 in ms, live / simulated (short; long), and for tsbatch's "
                  "arms the pass served, median (and p99 where the run timed it), live / simulated (short; long, "
                  "where the run timed long passes):", ""]
        for name, row in result["arms"].items():
            cells = []
            for pt in row["sweep"]:
                again = pt.get("live_again")
                timed = (pt.get(f"{kind}_pass_ms", {}) for kind in ("short", "long"))
                passes = [f"{p['live']} / {p['simulated']}" + (f", p99 {p['live_p99']} / {p['simulated_p99']}"
                                                               if p.get("live_p99") else "") for p in timed if p.get("live")]
                cells.append(f"{pt['rate']:g}: {pt['live']['short']} / {pt['simulated']['short']}; "
                             f"{pt['live']['long']} / {pt['simulated']['long']}"
                             + (f" (again: {again['short']}; {again['long']})" if again else "")
                             + (f" (pass {'; '.join(passes)})" if passes else ""))
            lines.append(f"- {name}: " + " · ".join(cells))
        lines.append("")
    return "\n".join(lines)


def load_profiles(profile: str, profile_2t: str | None, first_come_path: str | None) -> tuple[dict, dict | None]:
    """The tsbatch arms' profiles by thread count, and first-come's own (None: it is served with those)."""
    lanes = pipeline.load_profile(profile)
    profiles = {profile_threads(lanes): lanes}
    if profile_2t:
        two = pipeline.load_profile(profile_2t)
        profiles[profile_threads(two)] = two
    if not first_come_path:
        return profiles, None
    control = pipeline.load_profile(first_come_path)
    return profiles, {profile_threads(control): control}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("live", nargs="+", help="make bench reports (bench-WORKLOAD.json)")
    parser.add_argument("--profile", help="the profile the tsbatch arms serve with (one for every live report)")
    parser.add_argument("--profile-2t", help="a profile taken on one lane with every thread (first-come's passes)")
    parser.add_argument("--profile-first-come", help="the first-come control's own passes (bench/control_profile.py)")
    parser.add_argument("--own-profiles", action="store_true",
                        help="each live report served with the profile.json and control-profile.json in its own folder "
                             "(its 70%% point with profile-after.json and control-profile-after.json, where present) "
                             "(taken minutes before it: the host's speed of that window, not of another hour)")
    parser.add_argument("--overheads", metavar="JSON", help="a bench/overheads.py report measured on the live runs' "
                                                             "machine (default: the simulator's, fitted 12-02)")
    parser.add_argument("--out", default=os.path.join(reports.RESULTS, "simulator-vs-live"))
    args = parser.parse_args(argv)
    if bool(args.profile) == args.own_profiles:
        parser.error("give --profile, or --own-profiles (not both)")
    overheads = Overheads.from_report(args.overheads) if args.overheads else Overheads()
    report = {"when": reports.utc_now(), "machine": reports.machine(),
              "command": "python bench/validate_sim.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "intake": overheads.intake, "profiles": {}, "workloads": []}
    for path in args.live:
        profile, first_come_path = args.profile, args.profile_first_come
        if args.own_profiles:
            folder = os.path.dirname(os.path.abspath(path))
            profile, first_come_path = os.path.join(folder, "profile.json"), os.path.join(folder, "control-profile.json")
        profiles, first_come = load_profiles(profile, args.profile_2t, first_come_path)
        after = None
        if args.own_profiles and os.path.exists(os.path.join(folder, "profile-after.json")):
            control_after = os.path.join(folder, "control-profile-after.json")
            after = load_profiles(os.path.join(folder, "profile-after.json"), None,
                                  control_after if os.path.exists(control_after) else None)
        with open(path) as f:
            result = compare(json.load(f), profiles, profile, first_come, overheads, after)
        environments = {**{str(t): p.environment for t, p in profiles.items()},
                        **({"first-come": next(iter(first_come.values())).environment} if first_come else {})}
        if args.own_profiles:
            result["profiles"] = {"from": os.path.relpath(os.path.dirname(profile)), **environments,
                                  **({"after": {str(t): p.environment for t, p in after[0].items()}} if after else {})}
        else:
            report["profiles"] = environments
        report["workloads"].append(result)
    text = markdown(report)
    reports.write(args.out, report, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
