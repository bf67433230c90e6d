"""bench/intake_fit.py: one slope of pass slowdown per request/s, each live run at its own level."""
import json

import pytest

from bench.intake_fit import fit, main, points

pytestmark = pytest.mark.unit


def sweep_report(levels: dict[str, float], slope: float, capacity: float = 300.0, intake: float = 0.0) -> dict:
    """A validate_sim report whose live short passes are `level` x (1 + slope x rate) the simulated ones."""
    arms = {}
    for arm, level in levels.items():
        sweep = [{"rate": rate, "short_pass_ms": {"live": 10.0 * level * (1 + slope * rate), "simulated": 10.0}}
                 for rate in (32.0, 64.0, 128.0, 192.0)]
        sweep.append({"rate": 256.0, "short_pass_ms": {"live": 80.0, "simulated": 10.0}})  # past 75%: not read
        arms[arm] = {"capacity": {"live": capacity}, "sweep": sweep}
    arms["b"] = {"capacity": {"live": 100.0}, "sweep": [{"rate": 32.0, "short_pass_ms": {"live": None,
                                                                                       "simulated": None}}]}
    return {"intake": intake, "workloads": [{"workload": "short", "arms": arms}]}


def test_the_slope_is_found_whatever_level_each_run_sits_at():
    groups = points(sweep_report({"t": 0.86, "d": 1.14}, 0.001))
    assert sorted(groups) == ["short d", "short t"] and all(len(v) == 4 for v in groups.values())
    found = fit(groups)
    assert found["intake"] == pytest.approx(0.001) and found["misfit"] < 1e-9 < found["misfit_without"]
    assert fit(points(sweep_report({"t": 1.0}, 0.0)))["intake"] == 0.0


def test_one_rate_says_nothing_about_a_slope():
    with pytest.raises(ValueError, match="two rates"):
        fit({"short t": [(64.0, 1.2)]})


def test_the_fit_goes_into_a_copy_of_the_overheads_report_and_a_report_simulated_with_intake_is_refused(tmp_path):
    live = tmp_path / "vs.json"
    live.write_text(json.dumps(sweep_report({"t": 1.0, "d": 0.9}, 0.0005)))
    source = tmp_path / "overheads.json"
    source.write_text(json.dumps({"when": "then", "machine": "here", "command": "measured", "workload": "short",
                                  "duration": 15, "arms": {},
                                  "fit": {"outside": [[1.0, 0.1]], "outside_first_come": [[1.0, 0.1]], "latency": 0.006}}))
    before = source.read_text()
    assert main([str(live), "--overheads", str(source), "--out", str(tmp_path / "fitted")]) == 0
    assert source.read_text() == before  # what was simulated with it can be simulated again
    target = tmp_path / "fitted.json"
    written = json.loads(target.read_text())
    assert written["fit"]["intake"] == pytest.approx(0.0005) and written["intake"]["points"] == 8
    assert "`intake` 0.0005" in (tmp_path / "fitted.md").read_text()

    from tsbatch.archiver.simulate import Overheads

    assert Overheads.from_report(str(target)).intake == pytest.approx(0.0005)
    again = tmp_path / "again.json"
    again.write_text(json.dumps(sweep_report({"t": 1.0}, 0.0005, intake=0.0005)))
    with pytest.raises(SystemExit):
        main([str(again), "--overheads", str(source), "--out", str(tmp_path / "twice")])
