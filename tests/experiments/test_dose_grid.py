"""experiments.dose_grid: arm definitions that supersede stored runs, claims, and several processes
writing one grid file (driven by stand-in run functions, as test_replay_dose.py)."""

import json
import subprocess
import sys

import pytest

from experiments import dose_grid as dg
from experiments import replay_dose as rd

from tests.experiments.test_replay_dose import FIXED, SETTINGS, fake_run

DEFS = {"TIS": {"tis_ratio": "pre-update"}}


def test_runs_of_an_earlier_arm_definition_are_dropped_and_rerun(tmp_path):
    path = tmp_path / "dose.json"
    first = []
    dg.run_grid(path, FIXED, SETTINGS, ["none", "TIS"], 2, fake_run(first), command="t")  # no definition yet
    assert len(first) == 8
    second = []
    result = dg.run_grid(path, FIXED, SETTINGS, ["none", "TIS"], 2, fake_run(second), command="t", arm_defs=DEFS)
    # only the TIS runs were of another definition: exactly those ran again, and carry it now
    assert sorted(second) == sorted(c for c in first if c[1] == "TIS")
    assert all(p["tis_ratio"] == "pre-update" for p in result["run_provenance"]["bf16/TIS"].values())
    assert all("tis_ratio" not in p for p in result["run_provenance"]["bf16/none"].values())
    assert result["complete"] is True and sum(len(v) for v in result["runs"].values()) == 8
    third = []
    dg.run_grid(path, FIXED, SETTINGS, ["none", "TIS"], 2, fake_run(third), command="t", arm_defs=DEFS)
    assert third == []  # runs of the current definition stay


def test_a_live_claim_is_skipped_and_a_dead_ones_is_taken_over(tmp_path):
    path = tmp_path / "dose.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stored = {"fixed": FIXED, "settings": {}, "runs": {}, "run_provenance": {}, "claims": {
        "bf16/none#0": {"host": dg._me()["host"], "pid": dg.os.getppid()},  # our parent: alive
        "bf16/R3#0": {"host": dg._me()["host"], "pid": dead.pid}}}
    path.write_text(json.dumps(stored))
    calls = []
    result = dg.run_grid(path, FIXED, SETTINGS[:1], ["none", "R3"], 1, fake_run(calls), command="t")
    assert calls == [("bf16", "R3", 0)]  # the dead claim's run ran here, the live one's did not
    assert result["claims"] == {"bf16/none#0": stored["claims"]["bf16/none#0"]}
    assert result["complete"] is False and "bf16/none" not in result["runs"]


def test_an_interrupted_run_releases_its_claim(tmp_path):
    path = tmp_path / "dose.json"
    with pytest.raises(KeyboardInterrupt):
        dg.run_grid(path, FIXED, SETTINGS[:1], ["none"], 2, fake_run([], fail_at=1), command="t")
    stored = json.loads(path.read_text())
    assert stored["claims"] == {} and list(stored["runs"]["bf16/none"]) == ["0"]


def test_two_writers_of_one_grid_lose_nothing_and_run_nothing_twice(tmp_path):
    """A second grid process runs to completion *inside* the first one's run: both share the file."""
    path = tmp_path / "dose.json"
    inner_calls, outer_calls = [], []
    inner = fake_run(inner_calls)
    outer_fake = fake_run(outer_calls)

    def outer(st, arm, seed):
        if not inner_calls:  # while the outer process holds its first claim
            dg.run_grid(path, FIXED, SETTINGS, ["none", "R3"], 2, inner, command="inner")
        return outer_fake(st, arm, seed)

    result = dg.run_grid(path, FIXED, SETTINGS, ["none", "R3"], 2, outer, command="outer")
    assert outer_calls == [("bf16", "none", 0)]  # all the rest was done by the inner process
    assert len(inner_calls) == 7 and ("bf16", "none", 0) not in inner_calls
    assert result["complete"] is True and sum(len(v) for v in result["runs"].values()) == 8
    assert result["claims"] == {}
    assert json.loads(path.read_text())["cells"] == result["cells"]


def test_replay_dose_defines_the_tis_arms_by_their_ratio():
    assert set(rd.ARM_DEFS) == {"TIS", "R3+TIS"}
    assert all(d == {"tis_ratio": rd.TIS_RATIO} for d in rd.ARM_DEFS.values())
