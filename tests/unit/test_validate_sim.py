"""bench/validate_sim.py serves a live run's arms in the simulator with the overheads it is given."""
import os
from dataclasses import replace

from bench.loadtest.report import RESULTS
from bench.validate_sim import compare
from tsbatch.archiver import pipeline
from tsbatch.archiver.simulate import Overheads
from tsbatch.handlers.core.cost import profile_threads


def live_first_come() -> dict:
    """A make bench report with only first-come's arm, as run.py writes its keys."""
    at = {"offered_rate": 6.0, "short": {"p99": 100.0}}
    sweep = [{"offered_rate": 6.0, "short": {"p99": 100.0}, "long": {"p99": 200.0}}]
    return {"workload": "long", "when": "now", "command": "make bench", "latency_target_ms": 500.0,
            "arms": {"b": {"capacity": 10.0, "at_70pct_b": at, "sweep": sweep}}}


def test_the_overheads_given_are_the_ones_simulated():
    control = pipeline.load_profile(os.path.join(RESULTS, "control-profile.json"))
    served = {profile_threads(control): control}
    default = compare(live_first_come(), served, "", served)["arms"]["b"]
    # the frontend taking most of a core at every rate leaves the passes less
    busy = replace(Overheads(), outside_first_come=((1.0, 0.9), (200.0, 0.9)))
    heavy = compare(live_first_come(), served, "", served, overheads=busy)["arms"]["b"]
    assert heavy["capacity"]["simulated"] < default["capacity"]["simulated"]
    assert heavy["sweep"][0]["simulated"]["long"] > default["sweep"][0]["simulated"]["long"]
